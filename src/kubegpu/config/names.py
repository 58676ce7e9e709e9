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

#: Names given without a domain belong to NVIDIA's, as in NVIDIA's plugin (`gpu`).
DEFAULT_RESOURCE_PREFIX: Final = "nvidia.com"

_NAME_PART = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
_DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS_SUBDOMAIN = re.compile(rf"{_DNS_LABEL}(\.{_DNS_LABEL})*")

_GPU_UUID = re.compile(r"GPU-[A-Za-z0-9][A-Za-z0-9-]*")
# New-style `MIG-<uuid>` and the older `MIG-GPU-<uuid>/<gi>/<ci>`.
_MIG_UUID = re.compile(r"MIG-[A-Za-z0-9][A-Za-z0-9/-]*")
_MIG_INDEX = re.compile(r"\d+:\d+")

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
    if len(prefix) > 253 or not _DNS_SUBDOMAIN.fullmatch(prefix):
        raise ValueError(f"domain {prefix!r} is not a lowercase DNS subdomain")
    if prefix == "kubernetes.io" or prefix.endswith(".kubernetes.io"):
        raise ValueError("the kubernetes.io domain is reserved for Kubernetes' own resources")
    return full


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


def device_entry_kind(entry: object) -> str:
    """Classify one `devices` list entry: `index`, `mig-index`, `uuid` or `mig-uuid`."""
    if isinstance(entry, bool):
        raise ValueError("is not a GPU index, MIG index (i:j) or UUID")
    if isinstance(entry, int):
        if entry < 0:
            raise ValueError("is a negative GPU index")
        return "index"
    if isinstance(entry, str):
        if entry.isdigit():
            return "index"
        if _MIG_INDEX.fullmatch(entry):
            return "mig-index"
        if _MIG_UUID.fullmatch(entry):
            return "mig-uuid"
        if _GPU_UUID.fullmatch(entry):
            return "uuid"
    raise ValueError("is not a GPU index, MIG index (i:j) or UUID")


def is_mig_entry(entry: object) -> bool:
    """Whether a (valid) `devices` entry names a MIG device rather than a full GPU."""
    return device_entry_kind(entry) in ("mig-index", "mig-uuid")
