"""The `v1` config schema: the keys and meanings of NVIDIA's device plugin config file.

The same YAML that configures NVIDIA's plugin (`version: v1`, `flags`, `resources`,
`sharing`, `imex`) configures kubegpu. Unlike NVIDIA's loader, unknown keys are refused
(with a suggestion for typos) rather than silently ignored, and `resources` renaming and
`sharing.*.resources[].devices` subsets take effect instead of being parsed and dropped.

The models are frozen `msgspec.Struct`s: a `Config` is a hashable value, a reload builds a
new one, and `msgspec.structs.replace` derives one from another. msgspec is already loaded
by every process that talks to Kubernetes (lightkube is built on it) and costs a fraction
of the memory and import time of a validator that builds its models. File keys are
NVIDIA's camelCase spellings (`file_key`); Python code constructs models by field name
(`Flags(mig_strategy=MigStrategy.MIXED)`). kubegpu's rules on values run in
`__post_init__`, so a model built in code obeys them as one read from a file does; types,
enums and bounds are msgspec's, checked as the loader converts a file.

A file's mapping reaches a `Config` in two steps, both driven by the loader:
`read_file_keys` applies what msgspec's types do not say (unknown keys, `key: null` as
"not set", the before-readers of each model: one string for a list, NVIDIA's duration
syntax, the lax forms of kubegpu's own health keys), then `msgspec.convert(..., strict=True)`
checks the types, as Go's JSON decoder does for NVIDIA's keys, and runs the rules. Rules
raise `Invalid` (what was wrong, what to do, an optional sub-path), which
`kubegpu.config.loader` words as one line, as it does msgspec's own errors.
"""

from __future__ import annotations

import inspect
import json
import math
import re
from collections.abc import Callable, Mapping
from enum import StrEnum
from typing import Annotated, Any, ClassVar, Final, Literal, get_args

import msgspec
from msgspec import Meta, Struct, field

from kubegpu.config.names import (
    DEFAULT_RESOURCE_PREFIX,
    device_entry_kind,
    format_go_duration,
    parse_go_duration,
    parse_quantity,
    qualify_resource_name,
)
from kubegpu.xid_catalog import XidOutcome

VERSION: Final = "v1"
#: Every config version this build reads.
SUPPORTED_VERSIONS: Final = (VERSION,)
#: The CUDA MPS control daemon's hard limit on clients per GPU (16 on pre-Volta GPUs,
#: which needs the devices to check and is done where devices are known).
MPS_MAX_REPLICAS: Final = 48

#: Marks "no `got` in the error" apart from a real `None` value.
_NO_VALUE: Final = "\x00no-value"


class Invalid(ValueError):
    """A value the schema refuses, printed as `<path><at>: <message> (got <got>); <hint>`.

    A `ValueError`, so that msgspec, raising it from a model's `__post_init__`, wraps it in
    its `ValidationError` with the model's path and keeps it as the `__cause__`.
    """

    def __init__(self, message: str, hint: str, *, at: str = "", got: Any = _NO_VALUE) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint
        #: The key path below the model (or, from `read_file_keys`, from the file's top).
        self.at = at
        self.got = got

    @property
    def has_got(self) -> bool:
        return not (isinstance(self.got, str) and self.got == _NO_VALUE)


class UnknownKey(Exception):
    """A key no model has: `path` is the mapping's key path, `valid` the keys it takes."""

    def __init__(self, path: str, key: str, valid: tuple[str, ...]) -> None:
        super().__init__(f"unknown key {key!r}")
        self.path = path
        self.key = key
        self.valid = valid


class MigStrategy(StrEnum):
    NONE = "none"
    SINGLE = "single"
    MIXED = "mixed"


class DeviceListStrategy(StrEnum):
    ENVVAR = "envvar"
    VOLUME_MOUNTS = "volume-mounts"
    CDI_ANNOTATIONS = "cdi-annotations"
    CDI_CRI = "cdi-cri"


class DeviceIDStrategy(StrEnum):
    UUID = "uuid"
    INDEX = "index"


class AllocationPolicy(StrEnum):
    """How replicas of shared GPUs are chosen for a multi-replica request."""

    DISTRIBUTED = "distributed"
    PACKED = "packed"


class AmdNamingStrategy(StrEnum):
    """ROCm's `-resource_naming_strategy`: every AMD device as `amd.com/gpu`, or one
    resource per compute-memory partition mode (`amd.com/cpx_nps4`)."""

    SINGLE = "single"
    MIXED = "mixed"


DeviceDiscoveryStrategy = Literal["auto", "nvml", "tegra"]

#: File keys that are not the camelCase of the field name (NVIDIA's capitals).
_FILE_KEYS: Final = {
    "device_id_strategy": "deviceIDStrategy",
    "nvidia_ctk_path": "nvidiaCTKPath",
    "use_node_feature_api": "useNodeFeatureAPI",
    "channel_ids": "channelIDs",
}


def file_key(name: str) -> str:
    """A field's key in the file: NVIDIA's spelling, camelCase unless `_FILE_KEYS` says."""
    first, *rest = name.split("_")
    return _FILE_KEYS.get(name) or first + "".join(part.capitalize() for part in rest)


#: A before-reader: the file's value of one key as the field's type takes it, or the value
#: unchanged where its type is wrong (the type check then words the error).
Reader = Callable[[Any], Any]


class _Model(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, rename=file_key):
    """What every model shares: NVIDIA's keys, frozen values, and how a file is read.

    Types are checked strictly (the loader converts with `strict=True`): NVIDIA's config
    is JSON-decoded by Go, which takes no `"true"` for a bool nor `2.0` or `"2"` for an
    int. kubegpu's own numeric health keys take the lax forms they always took, through
    their readers. Each model repeats `frozen=True`: msgspec inherits it, but type
    checkers read it class by class.
    """

    #: File keys whose explicit `null` is an error rather than "not set" (`key: null`, or
    #: `key:` with no value, is "not set", as in NVIDIA's Go decoder, where a null leaves a
    #: pointer nil and a value untouched: the default applies).
    _null_is_error: ClassVar[frozenset[str]] = frozenset()
    #: Before-readers by file key, run on the file's value before the type check.
    _readers: ClassVar[Mapping[str, Reader]] = {}
    #: Keys the model reads and moves elsewhere (`_reshape`), beyond its own fields.
    _moved_keys: ClassVar[tuple[str, ...]] = ()
    #: The JSON Schema of what a key's reader accepts, in place of the field type's.
    _inputs: ClassVar[Mapping[str, dict[str, Any]]] = {}
    #: Added to the model's JSON Schema (what the rules require beyond the field types).
    _schema: ClassVar[Mapping[str, Any]] = {}

    @classmethod
    def _reshape(cls, data: dict[str, Any]) -> dict[str, Any]:
        """The file's mapping with keys moved where the model reads them (none by default)."""
        return data


def _one_of(enum: type[StrEnum]) -> str:
    return ", ".join(m.value for m in enum)


def _enum_values(enum: type[StrEnum]) -> dict[str, Any]:
    return {"type": "string", "enum": [m.value for m in enum]}


# -- lax forms of kubegpu's own health keys --------------------------------------------------
# Written out because they are kubegpu's own contract (what these keys have always read):
# msgspec's lax mode differs in details, and the strict mode NVIDIA's keys need would
# refuse them. A value of the wrong form comes back unchanged, for the type check to word.

_LAX_BOOLS: Final = {
    **dict.fromkeys(("0", "off", "f", "false", "n", "no"), False),
    **dict.fromkeys(("1", "on", "t", "true", "y", "yes"), True),
}
_LAX_INT = re.compile(r"\s*[+-]?[0-9]+(?:_[0-9]+)*(?:\.0*)?\s*")
_INT64: Final = 2**63


def _text(value: Any) -> str | None:
    if isinstance(value, bytes):
        try:
            return value.decode()
        except UnicodeDecodeError:
            return None
    return value if isinstance(value, str) else None


def _lax_bool(value: Any) -> Any:
    if isinstance(value, int | float) and not isinstance(value, bool) and value in (0, 1):
        return bool(value)
    text = _text(value)
    return value if text is None else _LAX_BOOLS.get(text.lower(), value)


def _lax_int(value: Any) -> Any:
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise Invalid("input should be a finite number", "write e.g. 4", got=value)
        return int(value) if value.is_integer() and abs(value) < _INT64 else value
    text = _text(value)
    if text is not None and text.isascii() and _LAX_INT.fullmatch(text):
        return int(text.strip().partition(".")[0])
    return value


def _lax_float(value: Any) -> Any:
    if isinstance(value, bool | int):
        try:
            return float(value)
        except OverflowError:
            return value
    text = _text(value)
    if text is not None and text.isascii():
        try:
            return float(text)
        except ValueError:
            return value
    return value


def _lax_ints(value: Any) -> Any:
    if not isinstance(value, list | tuple):
        return value
    out = []
    for i, item in enumerate(value):
        try:
            out.append(_lax_int(item))
        except Invalid as exc:
            exc.at = f"[{i}]"
            raise
    return out


def _xid_overrides(value: Any) -> Any:
    """Xids as whole numbers (a JSON file's keys are strings), outcomes by name."""
    if not isinstance(value, dict):
        return value
    out = {}
    for key, outcome in value.items():
        xid = _lax_int(key)
        if not isinstance(xid, int) or xid < 0:
            raise Invalid(
                "is not an Xid number", "use Xids like 48 or 79 as keys", at=f".{key}", got=key
            )
        if not isinstance(outcome, str) or outcome not in {m.value for m in XidOutcome}:
            raise Invalid(
                "unknown value", f"use one of: {_one_of(XidOutcome)}", at=f".{key}", got=outcome
            )
        out[xid] = outcome
    return out


# -- reading a file's mapping into what the types take ---------------------------------------


def read_file_keys(raw: Mapping[str, Any]) -> dict[str, Any]:
    """`raw` as `msgspec.convert(..., Config, strict=True)` takes it.

    Refuses the first unknown key (`UnknownKey`: looked for first, as a typo also makes
    the key it meant look missing), then drops each `key: null` (not set) and runs each
    model's `_reshape` and readers, which raise `Invalid` with the path from the top.
    """
    unknown = _first_unknown(Config, raw, "")
    if unknown is not None:
        raise unknown
    return _read(Config, raw, "")


def _join(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    if not path or key.startswith("["):
        return f"{path}{key}"
    return f"{path}.{key.removeprefix('.')}"


def _model_in(annotation: Any) -> type[_Model] | None:
    """The model inside `X`, `X | None` or `tuple[X, ...]`."""
    if isinstance(annotation, type) and issubclass(annotation, _Model):
        return annotation
    for arg in get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def _mappings(value: Any, path: str) -> list[tuple[str, Any]]:
    """The mappings a model field's value holds, by path: itself, or a list's items."""
    if isinstance(value, dict):
        return [(path, value)]
    if isinstance(value, list | tuple):
        return [(_join(path, i), v) for i, v in enumerate(value) if isinstance(v, dict)]
    return []


def _first_unknown(model: type[_Model], data: Mapping[str, Any], path: str) -> UnknownKey | None:
    """The first key no model takes: nested models' first, then this one's own."""
    keys = []
    for info in msgspec.structs.fields(model):
        keys.append(info.encode_name)
        inner = _model_in(info.type)
        if inner is None or info.encode_name not in data:
            continue
        for at, item in _mappings(data[info.encode_name], _join(path, info.encode_name)):
            found = _first_unknown(inner, item, at)
            if found is not None:
                return found
    allowed = {*keys, *model._moved_keys}
    extra = next((k for k in data if k not in allowed), None)
    if extra is None:
        return None
    return UnknownKey(_join(path, str(extra)), str(extra), tuple(keys))


def _read(model: type[_Model], data: Mapping[str, Any], path: str) -> dict[str, Any]:
    """`data` with nulls dropped, `_reshape` and the readers applied, nested models too."""
    kept = {k: v for k, v in data.items() if v is not None or k in model._null_is_error}
    out = model._reshape(kept)
    for info in msgspec.structs.fields(model):
        key = info.encode_name
        if key not in out:
            continue
        here = _join(path, key)
        reader = model._readers.get(key)
        if reader is not None:
            try:
                out[key] = reader(out[key])
            except Invalid as exc:
                exc.at = _join(here, exc.at) if exc.at else here
                raise
        inner = _model_in(info.type)
        if inner is None:
            continue
        value = out[key]
        if isinstance(value, dict):
            out[key] = _read(inner, value, here)
        elif isinstance(value, list | tuple):
            out[key] = [
                _read(inner, v, _join(here, i)) if isinstance(v, dict) else v
                for i, v in enumerate(value)
            ]
    return out


# -- the models ------------------------------------------------------------------------------


def _strategies(value: Any) -> Any:
    """NVIDIA reads one string or a list; a strategy listed twice is simply enabled."""
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list | tuple):
        return value  # the type check words it
    hint = f"use one or more of: {_one_of(DeviceListStrategy)}"
    if not items:
        raise Invalid("needs at least one strategy", hint, got=[])
    valid = {m.value for m in DeviceListStrategy}
    for i, item in enumerate(items):
        if not isinstance(item, str) or item not in valid:  # a list item is unhashable
            at = f"[{i}]" if not isinstance(value, str) else ""
            if isinstance(item, str) and "," in item:
                hint += " (write several as a YAML list, not a comma string)"
            raise Invalid("unknown device list strategy", hint, at=at, got=item)
    return list(dict.fromkeys(items))


class PluginFlags(_Model, frozen=True):
    _readers: ClassVar[Mapping[str, Reader]] = {"deviceListStrategy": _strategies}
    _inputs: ClassVar[Mapping[str, dict[str, Any]]] = {
        "deviceListStrategy": {
            "anyOf": [
                _enum_values(DeviceListStrategy),
                {"type": "array", "minItems": 1, "items": _enum_values(DeviceListStrategy)},
            ]
        }
    }

    pass_device_specs: bool = False
    #: One strategy or several; a string in the file is read as a one-element list.
    device_list_strategy: tuple[DeviceListStrategy, ...] = (DeviceListStrategy.ENVVAR,)
    device_id_strategy: DeviceIDStrategy = DeviceIDStrategy.UUID
    cdi_annotation_prefix: str = "cdi.k8s.io/"
    nvidia_ctk_path: str = "/usr/bin/nvidia-ctk"
    container_driver_root: str = "/driver-root"
    #: kubegpu extension: how replicas are picked for a multi-replica request.
    shared_devices_allocation_policy: AllocationPolicy = AllocationPolicy.DISTRIBUTED
    #: kubegpu extension (ROCm's plugin flag): how AMD devices are named.
    amd_resource_naming_strategy: AmdNamingStrategy = AmdNamingStrategy.SINGLE

    def __post_init__(self) -> None:
        _checked("deviceListStrategy", _strategies, self.device_list_strategy)


def _sleep_interval(value: Any) -> Any:
    """NVIDIA's `Duration`: a Go duration string, `infinite`, or a number of nanoseconds.

    A negative interval relabels without pause, as Go's timer does; it reads as `0s`.
    """
    if not isinstance(value, str | int | float) or isinstance(value, bool):
        return value  # the type check words it
    try:
        ns = parse_go_duration(value)
    except ValueError as exc:
        raise Invalid(
            str(exc),
            "write a duration like 60s, 5m or 1h30m, 'infinite', or a number of nanoseconds",
            got=value,
        ) from None
    return format_go_duration(ns)


class GfdFlags(_Model, frozen=True):
    """GPU Feature Discovery flags, shared with `kubegpu labels`."""

    _readers: ClassVar[Mapping[str, Reader]] = {"sleepInterval": _sleep_interval}
    _inputs: ClassVar[Mapping[str, dict[str, Any]]] = {
        "sleepInterval": {"type": ["string", "number"]}
    }

    oneshot: bool = False
    no_timestamp: bool = False
    #: Time between labelling passes, normalised to e.g. `1m30s`, `0s` or `infinite`.
    sleep_interval: str = _sleep_interval("60s")
    output_file: str = "/etc/kubernetes/node-feature-discovery/features.d/gfd"
    machine_type_file: str = "/sys/class/dmi/id/product_name"
    use_node_feature_api: bool = False

    def __post_init__(self) -> None:
        _checked("sleepInterval", _sleep_interval, self.sleep_interval)


_Xid = Annotated[int, Meta(ge=0)]


class _XidMap(dict[int, XidOutcome]):
    """A dict that hashes by its items, so that the models stay hashable frozen values."""

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(frozenset(self.items()))


class HealthFlags(_Model, frozen=True):
    """kubegpu's health settings (NVIDIA has env vars only; we accept both)."""

    _readers: ClassVar[Mapping[str, Reader]] = {
        "ignoredXids": _lax_ints,
        "criticalXids": _lax_ints,
        "disabled": _lax_bool,
        "recoverySeconds": _lax_float,
        "probeIntervalSeconds": _lax_float,
        "xidOverrides": _xid_overrides,
    }

    #: Xids that never mark a GPU unhealthy (application errors by default).
    ignored_xids: tuple[_Xid, ...] = (13, 31, 43, 45, 68, 109)
    #: Xids to treat as critical even if listed in `ignored_xids`.
    critical_xids: tuple[_Xid, ...] = ()
    #: Turn health checks off entirely (DP_DISABLE_HEALTHCHECKS=all).
    disabled: bool = False
    #: A GPU whose probes pass this long after its last error is healthy again; 0 never heals.
    recovery_seconds: Annotated[float, Meta(ge=0.0)] = 60.0
    #: How often unhealthy GPUs are probed for recovery.
    probe_interval_seconds: Annotated[float, Meta(gt=0.0)] = 5.0
    #: What an Xid does, per Xid, over NVIDIA's catalog and `ignoredXids` (not over
    #: `criticalXids`): `ignore`, `unhealthy`, or `unhealthy-until-reset`.
    xid_overrides: dict[_Xid, XidOutcome] = field(default_factory=_XidMap)

    def __post_init__(self) -> None:
        # Held as a hashable mapping, so that the model stays a hashable value.
        msgspec.structs.force_setattr(self, "xid_overrides", _XidMap(self.xid_overrides))


def _node_feature_api(data: dict[str, Any]) -> dict[str, Any]:
    """NVIDIA keeps `useNodeFeatureAPI` in `flags` itself; kubegpu reads it from
    `flags.gfd`, where the labeller's flag sets it. A `flags.gfd` value wins."""
    value = data.pop("useNodeFeatureAPI", None)
    if value is None:
        return data
    gfd = data.get("gfd")
    if gfd is None:
        gfd = {}
    if isinstance(gfd, dict) and gfd.get("useNodeFeatureAPI") is None:
        data["gfd"] = {**gfd, "useNodeFeatureAPI": value}
    return data


class Flags(_Model, frozen=True):
    # NVIDIA keeps `useNodeFeatureAPI` here; `_reshape` moves it to `gfd`.
    _moved_keys: ClassVar[tuple[str, ...]] = ("useNodeFeatureAPI",)
    _schema: ClassVar[Mapping[str, Any]] = {
        "properties": {"useNodeFeatureAPI": {"type": ["boolean", "null"]}}
    }

    mig_strategy: MigStrategy = MigStrategy.NONE
    fail_on_init_error: bool = True
    nvidia_driver_root: str = "/"
    nvidia_dev_root: str | None = None
    #: Where the MPS control daemons keep pipes and logs; required when `sharing.mps` is set.
    mps_root: str | None = None
    gds_enabled: bool = False
    mofed_enabled: bool = False
    gdrcopy_enabled: bool = False
    #: NVIDIA's plugin and GFD accept exactly these.
    device_discovery_strategy: DeviceDiscoveryStrategy = "auto"
    plugin: PluginFlags = field(default_factory=PluginFlags)
    gfd: GfdFlags = field(default_factory=GfdFlags)
    health: HealthFlags = field(default_factory=HealthFlags)

    @classmethod
    def _reshape(cls, data: dict[str, Any]) -> dict[str, Any]:
        return _node_feature_api(data)

    @property
    def dev_root(self) -> str:
        """Where /dev nodes live on the host: `nvidiaDevRoot`, else the driver root."""
        return self.nvidia_dev_root or self.nvidia_driver_root


_NVIDIA_NAME_MAX: Final = 63
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


def _check_nvidia_name(full: str) -> None:
    """NVIDIA's own rules for `nvidia.com/` names: at most 63 characters in all, and the
    part after the slash a lowercase DNS subdomain (no capitals, no `_`)."""
    if len(full) > _NVIDIA_NAME_MAX:
        raise ValueError(f"is {len(full)} characters with its domain; at most 63 are allowed")
    short = full.partition("/")[2]
    if any(len(label) > 63 for label in short.split(".")) or not _DNS_SUBDOMAIN.fullmatch(short):
        raise ValueError(
            f"name part {short!r} must be lowercase letters, digits, '-' and '.', "
            "starting and ending with a letter or digit"
        )


def _check_resource_name(value: str) -> None:
    """Validate (not rewrite) a resource name: consumers qualify short names per vendor."""
    try:
        full = value if "/" in value else f"{DEFAULT_RESOURCE_PREFIX}/{value}"
        if full.startswith(f"{DEFAULT_RESOURCE_PREFIX}/") and full.count("/") == 1:
            _check_nvidia_name(full)  # first: its rules are the stricter ones
        qualify_resource_name(value)
    except ValueError as exc:
        raise Invalid(
            f"not a valid extended resource name: {exc}",
            "use '<domain>/<name>' like 'nvidia.com/gpu.shared', or a bare name like 'gpu'",
            got=value,
        ) from None


def _checked(key: str, check: Callable[[Any], Any], value: Any) -> None:
    """Run a reader's or a check's rule on a field's value in `__post_init__`, so that a
    model built in code obeys what a file's value does; errors name the key."""
    try:
        check(value)
    except Invalid as exc:
        exc.at = _join(key, exc.at) if exc.at else key
        raise


def _pattern(value: Any) -> Any:
    return "" if value is None else value


class ResourcePattern(_Model, frozen=True):
    """Advertise devices whose product name matches `pattern` (glob) as `name`."""

    # NVIDIA reads a null pattern as "" (matching no device) and refuses a null name.
    _null_is_error: ClassVar[frozenset[str]] = frozenset({"pattern", "name"})
    _readers: ClassVar[Mapping[str, Reader]] = {"pattern": _pattern}
    _inputs: ClassVar[Mapping[str, dict[str, Any]]] = {"pattern": {"type": ["string", "null"]}}

    pattern: str
    name: str

    def __post_init__(self) -> None:
        _checked("name", _check_resource_name, self.name)


class Resources(_Model, frozen=True):
    gpus: tuple[ResourcePattern, ...] = ()
    mig: tuple[ResourcePattern, ...] = ()


#: `devices`: "all", a count of GPUs, or a list of indices / UUIDs / MIG `i:j`.
DeviceSelector = Literal["all"] | int | tuple[str | int, ...]

_DEVICES_HINT = (
    "use 'all', a count of GPUs, or a list of GPU indices (0), MIG indices (0:1) or UUIDs (GPU-…)"
)
_DEVICES_SCHEMA: Final = {
    "anyOf": [
        {"const": "all"},
        {"type": "integer", "minimum": 1},
        {
            "type": "array",
            "minItems": 1,
            "uniqueItems": True,
            "items": {"anyOf": [{"type": "string"}, {"type": "integer", "minimum": 0}]},
        },
    ]
}


def _devices(value: Any) -> Any:
    """`all`, a positive count, or a list of distinct GPU/MIG indices and UUIDs."""
    if value == "all":
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 1:
            raise Invalid("must be a positive count of GPUs", _DEVICES_HINT, got=value)
        return value
    if not isinstance(value, list | tuple):
        raise Invalid("is not a device selector", _DEVICES_HINT, got=value)
    if not value:
        raise Invalid("lists no devices", _DEVICES_HINT, got=[])
    seen: set[object] = set()  # a set, not value[:i]: linear in a long list
    for i, entry in enumerate(value):
        try:
            device_entry_kind(entry)
        except ValueError as exc:
            raise Invalid(f"entry {exc}", _DEVICES_HINT, at=f"[{i}]", got=entry) from None
        if entry in seen:
            raise Invalid("lists a device twice", "list each device once", at=f"[{i}]", got=entry)
        seen.add(entry)
    return value


_MIB: Final = 1 << 20
_QUANTITY_HINT = "write bytes or a quantity like '10Gi' or '512Mi'"


def _memory_quantity(value: Any) -> Any:
    """A memory quantity key: a positive quantity, kept as written (a string)."""
    if not isinstance(value, str | int) or isinstance(value, bool):
        raise Invalid("is not a Kubernetes quantity", _QUANTITY_HINT, got=value)
    try:
        parse_quantity(value)
    except ValueError as exc:
        raise Invalid(str(exc), _QUANTITY_HINT, got=value) from None
    return str(value)


def _memory_limit(value: Any) -> Any:
    if not isinstance(value, str | int) or isinstance(value, bool):
        raise Invalid("is not a Kubernetes quantity", "write bytes or e.g. '10Gi'", got=value)
    try:
        parse_quantity(value)
    except ValueError as exc:
        raise Invalid(f"memory limit {exc}", _QUANTITY_HINT, got=value) from None
    return str(value)


_QUANTITY_INPUT: Final = {"type": ["string", "integer"]}


class ClaimSizing(_Model, frozen=True):
    """kubegpu extension, DRA mode: claims on these GPUs are sized by memory.

    The GPU is published with a `memory` capacity whose request policy sizes a claim that
    names no memory (`defaultMemory`) and rounds every request up to `memoryStep`, and a
    `shares` capacity of `replicas` of which an unsized claim takes `defaultShares`. On an
    MPS-shared GPU each prepared claim gets the memory it consumed and its shares of the
    SMs as limits it cannot lift (its own MPS control daemon). The device plugin mode
    ignores the key: its replicas keep NVIDIA's fixed limits.
    """

    _readers: ClassVar[Mapping[str, Reader]] = {
        "defaultMemory": _memory_quantity,
        "memoryStep": _memory_quantity,
    }
    _inputs: ClassVar[Mapping[str, dict[str, Any]]] = {
        "defaultMemory": _QUANTITY_INPUT,
        "memoryStep": _QUANTITY_INPUT,
    }
    _schema: ClassVar[Mapping[str, Any]] = {"properties": {"defaultShares": {"minimum": 1}}}

    #: What a claim that asks for no memory takes; default the GPU's memory / replicas,
    #: rounded down to `memoryStep`.
    default_memory: str | None = None
    #: Memory requests round up to a multiple of this, and no claim takes less.
    memory_step: str = "1Mi"
    #: Shares (of the GPU's `replicas`) a claim that asks for none takes.
    default_shares: int = 1

    def __post_init__(self) -> None:
        if self.default_memory is not None:
            _checked("defaultMemory", _memory_quantity, self.default_memory)
        _checked("memoryStep", _memory_quantity, self.memory_step)
        if parse_quantity(self.memory_step) % _MIB:
            raise Invalid(
                "must be whole MiB",
                "MPS takes its memory limits in MiB: use a multiple of 1Mi, like '256Mi' or '1Gi'",
                at="memoryStep",
                got=self.memory_step,
            )
        if self.default_shares < 1:
            raise Invalid(
                "must be at least 1",
                "give the shares an unsized claim takes",
                at="defaultShares",
                got=self.default_shares,
            )
        if self.default_memory is not None:
            memory, step = parse_quantity(self.default_memory), parse_quantity(self.memory_step)
            if memory % step:
                raise Invalid(
                    f"is not a multiple of memoryStep ({self.memory_step})",
                    "make it one: the scheduler only hands out whole steps",
                    at="defaultMemory",
                    got=self.default_memory,
                )

    def step_bytes(self) -> int:
        return parse_quantity(self.memory_step)

    def default_bytes(self, gpu_memory: int, replicas: int) -> int:
        """The memory an unsized claim takes on a GPU of `gpu_memory` bytes."""
        if self.default_memory is not None:
            return parse_quantity(self.default_memory)
        step = self.step_bytes()
        return max(step, gpu_memory // replicas // step * step)


def _name(value: Any) -> Any:
    if value is None:  # NVIDIA reads a null name or rename as "" and refuses it
        raise Invalid("is empty", "give a resource name, or remove the key", got=None)
    return value


class ReplicatedResource(_Model, frozen=True):
    # NVIDIA rejects a null in any of these keys (an empty name, no device list, 0 replicas).
    _null_is_error: ClassVar[frozenset[str]] = frozenset({"name", "replicas", "rename", "devices"})
    _readers: ClassVar[Mapping[str, Reader]] = {
        "name": _name,
        "rename": _name,
        "devices": _devices,
        "memoryLimit": _memory_limit,
    }
    _inputs: ClassVar[Mapping[str, dict[str, Any]]] = {
        "devices": _DEVICES_SCHEMA,
        "memoryLimit": {"type": ["string", "integer", "null"]},
    }
    _schema: ClassVar[Mapping[str, Any]] = {
        "properties": {
            "replicas": {"minimum": 2},
            "activeThreadPercentage": {"minimum": 1, "maximum": 100},
        }
    }

    #: The resource to share; a bare name means `nvidia.com/<name>`.
    name: str
    replicas: int
    #: Advertise the replicas under this name instead (wins over `renameByDefault`).
    rename: str | None = None
    devices: DeviceSelector = "all"
    #: kubegpu extension, MPS only: per-GPU pinned memory limit (e.g. `10Gi`);
    #: default total/replicas.
    memory_limit: str | None = None
    #: kubegpu extension, MPS only: active thread percentage; default 100/replicas.
    active_thread_percentage: int | None = None
    #: kubegpu extension, DRA mode: claims on these GPUs are sized by memory.
    sizing: ClaimSizing | None = None

    def __post_init__(self) -> None:
        _checked("name", _check_resource_name, self.name)
        if self.replicas < 2:
            raise Invalid(
                "must be at least 2",
                "sharing needs 2 or more replicas per GPU; remove the entry to not share",
                at="replicas",
                got=self.replicas,
            )
        if self.rename is not None:
            _checked("rename", _check_resource_name, self.rename)
        _checked("devices", _devices, self.devices)
        if self.memory_limit is not None:
            _checked("memoryLimit", _memory_limit, self.memory_limit)
        percentage = self.active_thread_percentage
        if percentage is not None and not 1 <= percentage <= 100:
            raise Invalid(
                "must be between 1 and 100",
                "give a percentage of SMs",
                at="activeThreadPercentage",
                got=percentage,
            )
        if self.sizing is not None and self.sizing.default_shares > self.replicas:
            raise Invalid(
                f"is more than the {self.replicas} replicas (shares) of each GPU",
                f"give at most {self.replicas}",
                at="sizing.defaultShares",
                got=self.sizing.default_shares,
            )


class SharingStrategy(_Model, frozen=True):
    _schema: ClassVar[Mapping[str, Any]] = {
        "required": ["resources"],
        "properties": {"resources": {"minItems": 1}},
    }

    rename_by_default: bool = False
    #: Refuse requests for more than one replica. Defaults to true under `sharing.mps`
    #: (NVIDIA's MPS always refused them before the key existed), false for timeSlicing.
    fail_requests_greater_than_one: bool = False
    resources: tuple[ReplicatedResource, ...] = ()

    def __post_init__(self) -> None:
        if not self.resources:
            raise Invalid(
                "lists no resources to share",
                "add an entry like {name: nvidia.com/gpu, replicas: 4}, or remove the strategy",
                at="resources",
                got=[],
            )
        seen: set[str] = set()
        for i, entry in enumerate(self.resources):
            full = qualify_resource_name(entry.name)
            if full in seen:
                raise Invalid(
                    "is listed twice in this strategy",
                    "give each resource one entry (use 'devices' to pick GPUs)",
                    at=f"resources[{i}].name",
                    got=entry.name,
                )
            seen.add(full)


def _time_slicing(value: Any) -> Any:
    if value is None:
        raise Invalid(
            "lists no resources to share",
            "add resources like [{name: nvidia.com/gpu, replicas: 4}], or remove the key",
            got=None,
        )
    return value


def _mps_defaults(value: Any) -> Any:
    key = "failRequestsGreaterThanOne"
    if isinstance(value, dict) and value.get(key) is None:
        return {**value, key: True}
    return value


class Sharing(_Model, frozen=True):
    # NVIDIA decodes `timeSlicing: null` as a strategy with no resources, an error; a
    # null `mps` is "no MPS".
    _null_is_error: ClassVar[frozenset[str]] = frozenset({"timeSlicing"})
    _readers: ClassVar[Mapping[str, Reader]] = {
        "timeSlicing": _time_slicing,
        "mps": _mps_defaults,
    }

    time_slicing: SharingStrategy | None = None
    mps: SharingStrategy | None = None

    def __post_init__(self) -> None:
        if self.time_slicing is not None:
            for i, entry in enumerate(self.time_slicing.resources):
                for key, val in (
                    ("memoryLimit", entry.memory_limit),
                    ("activeThreadPercentage", entry.active_thread_percentage),
                ):
                    if val is not None:
                        raise Invalid(
                            "applies to MPS only",
                            "move the entry under sharing.mps or remove the key",
                            at=f"timeSlicing.resources[{i}].{key}",
                            got=val,
                        )
        if self.mps is None:
            return
        sliced = {
            qualify_resource_name(r.name)
            for r in (self.time_slicing.resources if self.time_slicing else ())
        }
        for i, entry in enumerate(self.mps.resources):
            at = f"mps.resources[{i}]"
            if entry.replicas > MPS_MAX_REPLICAS:
                raise Invalid(
                    f"exceeds the MPS limit of {MPS_MAX_REPLICAS} clients per GPU",
                    f"use at most {MPS_MAX_REPLICAS} replicas",
                    at=f"{at}.replicas",
                    got=entry.replicas,
                )
            if isinstance(entry.devices, tuple):
                for j, dev in enumerate(entry.devices):
                    if device_entry_kind(dev) in ("mig-index", "mig-uuid"):
                        raise Invalid(
                            "names a MIG device; MPS sharing of MIG devices is not supported",
                            "list whole GPUs only, or share MIG devices with timeSlicing",
                            at=f"{at}.devices[{j}]",
                            got=dev,
                        )
            if qualify_resource_name(entry.name) in sliced:
                raise Invalid(
                    "is shared by both timeSlicing and mps",
                    "share each resource with one strategy only",
                    at=f"{at}.name",
                    got=entry.name,
                )


class Imex(_Model, frozen=True):
    """IMEX channels to inject into every container (NVIDIA compatibility)."""

    # NVIDIA supports no channel but channel 0: `[]` or `[0]`.
    _schema: ClassVar[Mapping[str, Any]] = {
        "properties": {"channelIDs": {"maxItems": 1, "items": {"const": 0}}}
    }

    channel_ids: tuple[int, ...] = ()
    required: bool = False

    def __post_init__(self) -> None:
        if self.channel_ids not in ((), (0,)):
            raise Invalid(
                "must be [] or [0]",
                "only IMEX channel 0 is supported; use [0]",
                at="channelIDs",
                got=list(self.channel_ids),
            )


def _version(value: Any) -> Any:
    return VERSION if value == "" else value


class Config(_Model, frozen=True):
    """A kubegpu (and NVIDIA device plugin) config file, version v1."""

    _readers: ClassVar[Mapping[str, Reader]] = {"version": _version}
    # NVIDIA reads an empty version as v1.
    _schema: ClassVar[Mapping[str, Any]] = {"properties": {"version": {"enum": [VERSION, ""]}}}

    version: str = VERSION
    flags: Flags = field(default_factory=Flags)
    resources: Resources = field(default_factory=Resources)
    sharing: Sharing = field(default_factory=Sharing)
    imex: Imex = field(default_factory=Imex)

    def __post_init__(self) -> None:
        if self.version not in SUPPORTED_VERSIONS:
            raise Invalid(
                "unsupported config version",
                f"this kubegpu reads version {', '.join(SUPPORTED_VERSIONS)}; set 'version: v1'",
                at="version",
                got=self.version,
            )
        if self.sharing.mps is None:
            return
        if self.flags.mig_strategy is MigStrategy.MIXED:
            raise Invalid(
                "MPS sharing (sharing.mps) cannot be used with MIG strategy 'mixed'",
                "use migStrategy 'none' or 'single', or remove sharing.mps",
                at="flags.migStrategy",
                got="mixed",
            )
        if not self.flags.mps_root:
            raise Invalid(
                "is required when sharing.mps is configured",
                "set flags.mpsRoot or --mps-root/MPS_ROOT (e.g. /run/nvidia/mps)",
                at="flags.mpsRoot",
                got=None,
            )


# -- the JSON Schema -------------------------------------------------------------------------


def json_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of a v1 config file, as `kubegpu config schema`
    prints it: for editors and CI checks of a ConfigMap before it reaches a node.

    msgspec's schema of the models, with what the loader reads beyond the types: each
    reader's input (`_inputs`), each model's additions (`_schema`), `null` wherever the
    loader reads it as "not set", and nested models' defaults as the objects they are.
    """
    generated = msgspec.json.schema(Config)
    defs: dict[str, Any] = generated["$defs"]
    models: dict[str, type[_Model]] = {}
    enums: dict[str, type[StrEnum]] = {}
    _collect(Config, models, enums)
    for name, schema in defs.items():
        if "description" in schema:
            schema["description"] = inspect.cleandoc(schema["description"])
        if name in models:
            _model_schema(schema, models[name])
        elif name in enums:  # in the enum's order, as its `_one_of` hints list it
            schema.update(_enum_values(enums[name]))
    top = defs.pop(Config.__name__)
    text = json.dumps(defs) + json.dumps(top)
    used = {name: schema for name, schema in defs.items() if f'"#/$defs/{name}"' in text}
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "$defs": used, **top}


def _collect(
    annotation: Any, models: dict[str, type[_Model]], enums: dict[str, type[StrEnum]]
) -> None:
    """The models and enums a type holds, by name, as msgspec names their `$defs`."""
    if isinstance(annotation, type) and issubclass(annotation, StrEnum):
        enums[annotation.__name__] = annotation
    elif (
        isinstance(annotation, type)
        and issubclass(annotation, _Model)
        and annotation.__name__ not in models
    ):
        models[annotation.__name__] = annotation
        for info in msgspec.structs.fields(annotation):
            _collect(info.type, models, enums)
    for arg in get_args(annotation):
        _collect(arg, models, enums)


def _model_schema(schema: dict[str, Any], model: type[_Model]) -> None:
    extra = dict(model._schema)
    never_null = {*model._null_is_error, *extra.get("required", ())}
    properties: dict[str, Any] = schema.setdefault("properties", {})
    for info in msgspec.structs.fields(model):
        prop = properties[info.encode_name]
        if info.encode_name in model._inputs:
            kept = {k: prop[k] for k in ("description", "default") if k in prop}
            prop.clear()
            prop.update({**model._inputs[info.encode_name], **kept})
        if info.default_factory is not msgspec.NODEFAULT:
            prop["default"] = msgspec.to_builtins(info.default_factory(), str_keys=True)
    for key, added in extra.pop("properties", {}).items():
        properties.setdefault(key, {}).update(added)
    if not schema.get("required"):
        schema.pop("required", None)
    schema.update(extra)
    for key, prop in properties.items():
        if prop.get("enum") and "type" not in prop:  # a Literal's choices
            prop["type"] = "string"
        if key in never_null:
            if "anyOf" in prop:
                prop["anyOf"] = [p for p in prop["anyOf"] if p != {"type": "null"}]
                if len(prop["anyOf"]) == 1:
                    prop.update(prop.pop("anyOf")[0])
        elif not _allows_null(prop):
            outer = {k: prop.pop(k) for k in ("description", "default") if k in prop}
            properties[key] = {**outer, "anyOf": [prop, {"type": "null"}]}


def _allows_null(prop: dict[str, Any]) -> bool:
    types = prop.get("type")
    return (
        types == "null"
        or (isinstance(types, list) and "null" in types)
        or any(_allows_null(p) for p in prop.get("anyOf", ()))
    )
