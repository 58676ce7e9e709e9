"""Strings from outside kubegpu: escaped for one log line, checked as Kubernetes names.

What the kubelet, the API server or a request sends is data. `escape` renders any such
string as one bounded line with its control characters escaped, for logs and gRPC
statuses; it is the one helper every outside string goes through on its way there.

A DRA claim's namespace, name and UID go further: into a URL (the claim's read from the
API, sent with the plugin's ServiceAccount token), into file names (the claim's CDI spec)
and into the checkpoint. They are checked first against what Kubernetes itself allows, so
none can carry a path, a line break or an escape sequence:

- namespace: a DNS-1123 label, at most 63 characters (`ValidateNamespaceName`, which is
  apimachinery's `NameIsDNSLabel`);
- a ResourceClaim's name: a DNS-1123 subdomain, at most 253 characters
  (`ValidateResourceClaimName`, apimachinery's `NameIsDNSSubdomain`);
- UID: a UUID in its 36-character text form. Kubernetes does not check a UID's form, but
  the API server sets every object's UID itself on create (`uuid.NewUUID()`, a random
  UUID in lowercase), so a claim the API holds has no other; either case is taken.

The patterns are Kubernetes' own, from k8s.io/apimachinery/pkg/util/validation
(`dns1123LabelFmt`, `dns1123SubdomainFmt` and the two maximum lengths). Written out here:
no maintained Python package publishes them (lightkube sends names unchecked).
"""

from __future__ import annotations

import re
from typing import Final

#: An outside string is cut to this many characters in a message unless told otherwise.
ECHO_CHARS: Final = 80

#: apimachinery's `dns1123LabelFmt` and `DNS1123LabelMaxLength`.
DNS_LABEL: Final = "[a-z0-9]([-a-z0-9]*[a-z0-9])?"
DNS_LABEL_MAX: Final = 63
#: apimachinery's `dns1123SubdomainFmt` and `DNS1123SubdomainMaxLength`.
DNS_SUBDOMAIN: Final = re.compile(rf"{DNS_LABEL}(\.{DNS_LABEL})*")
DNS_SUBDOMAIN_MAX: Final = 253

_DNS_LABEL = re.compile(DNS_LABEL)
_HEX = "[0-9a-fA-F]"
_UID = re.compile(rf"{_HEX}{{8}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{12}}")


def escape(text: str, limit: int = ECHO_CHARS) -> str:
    """`text` cut to `limit` characters with control characters escaped (one log line)."""
    cut = text if len(text) <= limit else text[:limit] + "..."
    # repr() escapes \n, \r, \x1b, bidi overrides and other non-printables; strip its quotes.
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in cut)


def is_dns_label(text: str) -> bool:
    """A DNS-1123 label: a namespace's name, or a claim's name in its pod."""
    # Length first: no pattern runs over a hostile megabyte.
    return len(text) <= DNS_LABEL_MAX and _DNS_LABEL.fullmatch(text) is not None


def is_dns_subdomain(text: str) -> bool:
    """A DNS-1123 subdomain: the name of a ResourceClaim (and of most objects)."""
    return len(text) <= DNS_SUBDOMAIN_MAX and DNS_SUBDOMAIN.fullmatch(text) is not None


def is_uid(text: str) -> bool:
    """An object UID as the API server issues them (`4f8a...-...`, 36 characters)."""
    return len(text) == 36 and _UID.fullmatch(text) is not None


def object_problem(namespace: str, name: str, uid: str | None = None) -> str | None:
    """What is wrong with a namespaced object's namespace, name and UID (None: nothing),
    the value escaped and bounded: fit for an error message as it is."""
    if not is_dns_label(namespace):
        return (
            f"namespace '{escape(namespace)}' is not a Kubernetes namespace name (at most "
            f"{DNS_LABEL_MAX} lowercase letters, digits and '-', starting and ending with a "
            f"letter or digit)"
        )
    if not is_dns_subdomain(name):
        return (
            f"name '{escape(name)}' is not a Kubernetes object name (at most "
            f"{DNS_SUBDOMAIN_MAX} lowercase letters, digits, '-' and '.', starting and "
            f"ending with a letter or digit)"
        )
    if uid is not None and not is_uid(uid):
        return (
            f"UID '{escape(uid)}' is not a Kubernetes object UID (the 36-character UUID "
            f"the API server sets in metadata.uid)"
        )
    return None


__all__ = [
    "DNS_LABEL",
    "DNS_LABEL_MAX",
    "DNS_SUBDOMAIN",
    "DNS_SUBDOMAIN_MAX",
    "ECHO_CHARS",
    "escape",
    "is_dns_label",
    "is_dns_subdomain",
    "is_uid",
    "object_problem",
]
