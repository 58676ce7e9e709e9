"""The checks the kubelet's device manager applies to a `RegisterRequest` and to device IDs.

Messages copy the kubelet's (`pkg/kubelet/cm/devicemanager/plugin/v1beta1/server.go` and
`k8s.io/apimachinery/pkg/util/validation`), so a plugin sees the same text it would see
from a real node.
"""

from __future__ import annotations

import re

from kubegpu.api import VERSION

#: `v1.DefaultResourceRequestsPrefix`: quota names for extended resources.
REQUESTS_PREFIX = "requests."
#: `v1.ResourceDefaultNamespacePrefix`: names containing it are native resources.
NATIVE_NAMESPACE = "kubernetes.io/"
#: Longest name part of a qualified name and longest device ID.
MAX_NAME_LENGTH = 63
MAX_DEVICE_ID_LENGTH = 63
MAX_DNS_SUBDOMAIN_LENGTH = 253

_QUALIFIED_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_DNS1123_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS1123_SUBDOMAIN = re.compile(rf"^{_DNS1123_LABEL}(\.{_DNS1123_LABEL})*$")


def _qualified_name_errors(value: str) -> list[str]:
    """`validation.IsQualifiedName`: an optional DNS-subdomain prefix, a slash, a name."""
    parts = value.split("/")
    if len(parts) == 1:
        name = parts[0]
        errors: list[str] = []
    elif len(parts) == 2:
        prefix, name = parts
        errors = []
        if not prefix:
            errors.append("prefix part must be non-empty")
        elif len(prefix) > MAX_DNS_SUBDOMAIN_LENGTH:
            errors.append(f"prefix part must be no more than {MAX_DNS_SUBDOMAIN_LENGTH} characters")
        elif not _DNS1123_SUBDOMAIN.match(prefix):
            errors.append("prefix part must be a lowercase RFC 1123 subdomain")
    else:
        return ["a qualified name must consist of an optional prefix, a '/' and a name"]
    if not name:
        errors.append("name part must be non-empty")
    elif len(name) > MAX_NAME_LENGTH:
        errors.append(f"name part must be no more than {MAX_NAME_LENGTH} characters")
    elif not _QUALIFIED_NAME.match(name):
        errors.append(
            "name part must consist of alphanumeric characters, '-', '_' or '.', and must "
            "start and end with an alphanumeric character"
        )
    return errors


def is_extended_resource_name(name: str) -> bool:
    """`v1helper.IsExtendedResourceName`: what the kubelet accepts as a plugin resource.

    Native resources (no `/`, or any `kubernetes.io/` namespace including subdomains such
    as `foo.kubernetes.io/`) and quota names (`requests.` prefix) are refused; the rest must
    be a qualified name once prefixed with `requests.`, as quota needs.
    """
    if "/" not in name or NATIVE_NAMESPACE in name:
        return False
    if name.startswith(REQUESTS_PREFIX):
        return False
    return not _qualified_name_errors(REQUESTS_PREFIX + name)


def resource_name_errors(name: str) -> list[str]:
    """Why `name` is not an extended resource name; empty when it is one."""
    if "/" not in name:
        return ["must contain '/' (a vendor domain, e.g. nvidia.com/gpu)"]
    if NATIVE_NAMESPACE in name:
        return ["must not be in the kubernetes.io namespace"]
    if name.startswith(REQUESTS_PREFIX):
        return [f"must not start with {REQUESTS_PREFIX!r}"]
    return _qualified_name_errors(REQUESTS_PREFIX + name)


def endpoint_error(endpoint: str) -> str | None:
    """The kubelet joins `endpoint` to its own directory: only a plain file name is sane."""
    if not endpoint or endpoint in (".", "..") or "/" in endpoint or "\x00" in endpoint:
        return (
            f"invalid endpoint {endpoint!r}: must be a socket file name inside the "
            "device plugin directory"
        )
    return None


def register_request_error(version: str, resource_name: str, endpoint: str) -> str | None:
    """The kubelet's refusal text for a `RegisterRequest`, or None when it is acceptable."""
    if version != VERSION:
        return (
            f'requested API version "{version}" is not supported by kubelet. '
            f'Supported versions are ["{VERSION}"]'
        )
    if not is_extended_resource_name(resource_name):
        return f'the ResourceName "{resource_name}" is invalid'
    return endpoint_error(endpoint)


def device_id_error(device_id: str) -> str | None:
    """Device IDs end up in checkpoints and pod annotations: non-empty, at most 63 chars."""
    if not device_id:
        return "device ID must be non-empty"
    if len(device_id) > MAX_DEVICE_ID_LENGTH:
        return (
            f"device ID {device_id!r} is {len(device_id)} characters long; "
            f"the limit is {MAX_DEVICE_ID_LENGTH}"
        )
    return None
