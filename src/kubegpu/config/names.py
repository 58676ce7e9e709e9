"""Syntax checks for values inside the config: resource names, quantities, device selectors.

Pure functions that raise `ValueError` with a short reason; the schema turns the reason
into a one-line config error that names the key. Kept apart from the schema so the
resource and allocation code can reuse the same rules (e.g. `qualify_resource_name`).
"""

from __future__ import annotations

import math
import re
from fractions import Fraction
from typing import Final

from kubegpu.untrusted import is_dns_subdomain

#: Names given without a domain belong to NVIDIA's, as in NVIDIA's plugin (`gpu`).
DEFAULT_RESOURCE_PREFIX: Final = "nvidia.com"
#: The node label NVIDIA's chart uses to pick a named config.
DEFAULT_NODE_LABEL: Final = "nvidia.com/device-plugin.config"

_NAME_PART = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")

# The spellings of a UUID that NVIDIA's config accepts after `GPU-` / `MIG-` (those of
# github.com/google/uuid's Parse): dashed, braced, `urn:uuid:`-prefixed, or bare hex.
_HEX = "[0-9A-Fa-f]"
_UUID_DASHED = rf"{_HEX}{{8}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{12}}"
_UUID = re.compile(
    rf"{_UUID_DASHED}|\{{{_UUID_DASHED}\}}|(?i:urn:uuid:){_UUID_DASHED}|{_HEX}{{32}}"
)
_UINT64_MAX: Final = 2**64 - 1

_QUANTITY = re.compile(
    r"(?P<num>[+-]?(\d+(\.\d*)?|\.\d+))"
    r"(?P<suffix>Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E|[eE][+-]?\d+)?"
)
#: No memory size needs more: 1e30 bytes is far beyond any GPU.
_MAX_EXPONENT = 30
_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {
    "n": Fraction(1, 10**9),
    "u": Fraction(1, 10**6),
    "m": Fraction(1, 10**3),
    "k": Fraction(10**3),
    "M": Fraction(10**6),
    "G": Fraction(10**9),
    "T": Fraction(10**12),
    "P": Fraction(10**15),
    "E": Fraction(10**18),
}


def qualify_resource_name(name: str) -> str:
    """`name` as a full extended resource name (`gpu` -> `nvidia.com/gpu`), or ValueError.

    The rules are the kubelet's: the kubelet rejects a device plugin registering a name
    that breaks them, so catching them at config time saves a crash loop.
    """
    full = name if "/" in name else f"{DEFAULT_RESOURCE_PREFIX}/{name}"
    prefix, _, short = full.partition("/")
    if "/" in short:
        raise ValueError("has more than one '/'")
    if not prefix:
        raise ValueError("has an empty domain before '/'")
    if not short:
        raise ValueError("has an empty name after '/'")
    if len(short) > 63:
        raise ValueError(f"name part is {len(short)} characters; at most 63 are allowed")
    if not _NAME_PART.fullmatch(short):
        raise ValueError(
            f"name part {short!r} must be letters, digits, '-', '_' or '.', "
            "starting and ending with a letter or digit"
        )
    if not is_dns_subdomain(prefix):
        raise ValueError(f"domain {prefix!r} is not a lowercase DNS subdomain")
    if prefix == "kubernetes.io" or prefix.endswith(".kubernetes.io"):
        raise ValueError("the kubernetes.io domain is reserved for Kubernetes' own resources")
    return full


_LABEL_VALUE = re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?")


def is_label_key(text: str) -> bool:
    """A Kubernetes label key: `[prefix/]name`, the prefix a DNS subdomain."""
    prefix, slash, name = text.rpartition("/")
    if slash and not is_dns_subdomain(prefix):
        return False
    return len(name) <= 63 and _NAME_PART.fullmatch(name) is not None


def is_label_value(text: str) -> bool:
    """A Kubernetes label value: empty, or up to 63 letters, digits, `-`, `_`, `.`."""
    return _LABEL_VALUE.fullmatch(text) is not None


def parse_quantity(value: str | int) -> int:
    """A Kubernetes quantity (`10Gi`, `512Mi`, `1e9`, `1073741824`) as whole bytes, > 0.

    Fractions of a byte round up, as the API server does for memory.
    """
    if isinstance(value, bool):
        raise ValueError("is not a quantity")
    if isinstance(value, int):
        amount = Fraction(value)
    else:
        match = _QUANTITY.fullmatch(value.strip())
        if match is None:
            raise ValueError("is not a Kubernetes quantity")
        amount = Fraction(match["num"])
        suffix = match["suffix"] or ""
        if suffix in _BINARY:
            amount *= _BINARY[suffix]
        elif suffix in _DECIMAL:
            amount *= _DECIMAL[suffix]
        elif suffix:
            exponent = int(suffix[1:])
            if abs(exponent) > _MAX_EXPONENT:  # 10**999999999 would take minutes to build
                raise ValueError(f"has an exponent beyond ±{_MAX_EXPONENT}")
            amount *= Fraction(10) ** exponent
    if amount <= 0:
        raise ValueError("must be more than 0 bytes")
    return math.ceil(amount)


def _is_uint(text: str) -> bool:
    """A decimal unsigned 64-bit integer, as Go's `strconv.ParseUint(text, 10, 0)` reads it."""
    return text.isascii() and text.isdigit() and int(text) <= _UINT64_MAX


def _is_gpu_uuid(text: str) -> bool:
    return text.startswith("GPU-") and _UUID.fullmatch(text[4:]) is not None


def _is_mig_uuid(text: str) -> bool:
    """`MIG-<uuid>`, or the older `MIG-GPU-<uuid>/<gi>/<ci>` (both parts required)."""
    if not text.startswith("MIG-"):
        return False
    rest = text[4:]
    if _UUID.fullmatch(rest):
        return True
    parts = rest.split("/", 2)
    return len(parts) == 3 and _is_gpu_uuid(parts[0]) and all(_is_uint(p) for p in parts[1:])


def device_entry_kind(entry: object) -> str:
    """Classify one `devices` list entry: `index`, `mig-index`, `uuid` or `mig-uuid`.

    The rules are NVIDIA's (`ReplicatedDeviceRef`): a UUID must be a well-formed UUID
    after its `GPU-`/`MIG-` prefix, so a truncated or placeholder UUID is refused at load
    time instead of silently matching no device.
    """
    if isinstance(entry, bool):
        raise ValueError("is not a GPU index, MIG index (i:j) or UUID")
    if isinstance(entry, int):
        if entry < 0:
            raise ValueError("is a negative GPU index")
        if entry > _UINT64_MAX:
            raise ValueError("is not a GPU index, MIG index (i:j) or UUID")
        return "index"
    if isinstance(entry, str):
        if _is_uint(entry):
            return "index"
        gpu, colon, mig = entry.partition(":")
        if colon and _is_uint(gpu) and _is_uint(mig):
            return "mig-index"
        if _is_mig_uuid(entry):
            return "mig-uuid"
        if _is_gpu_uuid(entry):
            return "uuid"
        if entry.startswith(("GPU-", "MIG-")):
            raise ValueError(
                "is not a well-formed UUID (GPU-<uuid>, MIG-<uuid> or MIG-GPU-<uuid>/<gi>/<ci>)"
            )
    raise ValueError("is not a GPU index, MIG index (i:j) or UUID")


#: Go's `time.ParseDuration` units, in nanoseconds (both micro signs are Go's).
_GO_UNITS: Final = {
    "ns": 1,
    "us": 10**3,
    "\u00b5s": 10**3,
    "\u03bcs": 10**3,
    "ms": 10**6,
    "s": 10**9,
    "m": 60 * 10**9,
    "h": 3600 * 10**9,
}
_GO_PART = re.compile(r"(\d*)(?:\.(\d*))?([^\d.]+)")
_INT64_MAX: Final = 2**63 - 1
#: NVIDIA's `Duration` for "infinite" (sleep forever after the first pass).
INFINITE_NS: Final = _INT64_MAX


def parse_go_duration(value: str | int | float) -> int:
    """A duration as NVIDIA's config reads it, in nanoseconds (`INFINITE_NS` for `infinite`).

    Strings are Go's `time.ParseDuration` (`60s`, `1h30m`, `.5s`, `0`, `-1s`) or
    `infinite`; JSON/YAML numbers are nanoseconds, truncated toward zero.
    """
    if isinstance(value, bool):
        raise ValueError("is not a duration")
    if isinstance(value, int | float):
        if not math.isfinite(value) or abs(value) > _INT64_MAX:
            raise ValueError("is out of range for a duration")
        return int(value)
    if value == "infinite":
        return INFINITE_NS
    text = value
    sign = 1
    if text[:1] in ("-", "+"):
        sign = -1 if text[0] == "-" else 1
        text = text[1:]
    if text == "0":
        return 0
    if not text:
        raise ValueError("is not a duration")
    total = Fraction(0)
    pos = 0
    while pos < len(text):
        match = _GO_PART.match(text, pos)
        whole, frac, unit = (match[1], match[2], match[3]) if match else ("", None, "")
        if match is None or (not whole and not frac) or unit not in _GO_UNITS:
            raise ValueError("is not a duration")
        number = Fraction(int(whole or "0"))
        if frac:
            number += Fraction(int(frac), 10 ** len(frac))
        total += number * _GO_UNITS[unit]
        pos = match.end()
    if total > _INT64_MAX + (1 if sign < 0 else 0):
        raise ValueError("is out of range for a duration")
    return sign * math.floor(total)


def format_go_duration(ns: int) -> str:
    """Nanoseconds as a duration string every kubegpu reader takes (`1m30s`, `0s`, `infinite`)."""
    if ns >= INFINITE_NS:
        return "infinite"
    if ns <= 0:
        return "0s"
    parts = []
    for unit, size in (
        ("h", 3600 * 10**9),
        ("m", 60 * 10**9),
        ("s", 10**9),
        ("ms", 10**6),
        ("us", 10**3),
        ("ns", 1),
    ):
        count, ns = divmod(ns, size)
        if count:
            parts.append(f"{count}{unit}")
    return "".join(parts)


def pattern_matches(pattern: str, text: str) -> bool:
    """NVIDIA's resource pattern match: the whole `text`, with `*` as the only wildcard."""
    regex = ".*".join(re.escape(literal) for literal in pattern.split("*"))
    return re.fullmatch(regex, text, flags=re.DOTALL) is not None
