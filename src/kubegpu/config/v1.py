"""The `v1` config schema: the keys and meanings of NVIDIA's device plugin config file.

The same YAML that configures NVIDIA's plugin (`version: v1`, `flags`, `resources`,
`sharing`, `imex`) configures kubegpu. Unlike NVIDIA's loader, unknown keys are refused
(with a suggestion for typos) rather than silently ignored, and `resources` renaming and
`sharing.*.resources[].devices` subsets take effect instead of being parsed and dropped.

The models are pydantic (v2) dataclasses, frozen: a `Config` is a value, a reload builds a
new one, and `dataclasses.replace` works on it. pydantic adds nothing to the image (the
`kubernetes` client already depends on it) and generates the JSON Schema that `kubegpu
config schema` prints (`json_schema`). File keys are NVIDIA's camelCase spellings; Python
code constructs models by field name (`Flags(mig_strategy=MigStrategy.MIXED)`).

Checks raise `invalid(...)`, carrying a hint (what to do) and an optional sub-path, which
`kubegpu.config.loader` turns into one line; pydantic's own errors (types, enums, unknown
keys) are worded there too, in one place.
"""

from __future__ import annotations

import re
from dataclasses import field
from enum import StrEnum
from typing import Annotated, Any, ClassVar, Final, Literal

from pydantic import (
    AfterValidator,
    ConfigDict,
    Field,
    Strict,
    TypeAdapter,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic.alias_generators import to_camel
from pydantic.dataclasses import dataclass, is_pydantic_dataclass
from pydantic.json_schema import GenerateJsonSchema
from pydantic_core import PydanticCustomError, core_schema

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

#: Marks "no `got` in the error context" apart from a real `None` value.
_NO_VALUE: Final = "\x00no-value"


def invalid(message: str, hint: str, *, at: str = "", got: Any = _NO_VALUE) -> PydanticCustomError:
    """A validation error the loader prints as `<path><at>: <message> (got <got>); <hint>`."""
    ctx: dict[str, Any] = {"message": message, "hint": hint, "at": at}
    if not (isinstance(got, str) and got == _NO_VALUE):
        ctx["got"] = got
    return PydanticCustomError("kubegpu", "{message}", ctx)


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


# NVIDIA's config is JSON-decoded by Go, which takes no `"true"` for a bool nor `2.0` or
# `"2"` for an int; pydantic's lax coercion would, so NVIDIA's keys are strict. kubegpu's
# own numeric keys (health) take the lax forms, as they always have.
_Bool = Annotated[bool, Strict()]
_Int = Annotated[int, Strict()]

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
    return _FILE_KEYS.get(name) or to_camel(name)


def _schema_extra(schema: dict[str, Any], cls: type) -> None:
    """The JSON Schema of a model as the loader reads it: `key: null` means "not set"
    (except for the `_null_is_error` keys, which never take the null of an optional
    field), plus what the model's `_schema` adds to a property or to the model."""
    extra: dict[str, Any] = dict(getattr(cls, "_schema", {}))
    never_null = {*getattr(cls, "_null_is_error", ()), *extra.get("required", ())}
    properties: dict[str, Any] = schema.get("properties", {})
    for key, added in extra.pop("properties", {}).items():
        properties.setdefault(key, {}).update(added)
    schema.update(extra)
    for key, prop in properties.items():
        prop.pop("title", None)  # pydantic's title is the field name, not the file key
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


_CONFIG: Final = ConfigDict(
    extra="forbid",
    # Each model's validator and serializer are built on its first use, not at import
    # (pydantic's own deferral): importing the schema for its enums or types builds
    # nothing, and validating a `Config` builds its tree once. The nested models' defaults
    # are factories for the same reason: a default instance would be validated, and its
    # model built, as the class is defined; a factory builds it when a default is needed.
    defer_build=True,
    alias_generator=file_key,
    validate_by_name=True,
    validate_by_alias=True,
    json_schema_extra=_schema_extra,
)


class _Model:
    """What every model shares: how `null` reads, and the JSON Schema tweaks."""

    #: Keys whose explicit `null` is an error rather than "not set" (see `_nulls_unset`).
    _null_is_error: ClassVar[frozenset[str]] = frozenset()
    #: Added to the model's JSON Schema (what the before-validators accept beyond the
    #: field types, or require beyond them).
    _schema: ClassVar[dict[str, Any]] = {}

    @model_validator(mode="before")
    @classmethod
    def _nulls_unset(cls, data: Any) -> Any:
        """`key: null` (or `key:` with no value) means "not set", as in NVIDIA's Go decoder,
        where a null leaves a pointer nil and a value untouched: the default applies."""
        if not isinstance(data, dict):
            return data
        return {k: v for k, v in data.items() if v is not None or k in cls._null_is_error}


def _one_of(enum: type[StrEnum]) -> str:
    return ", ".join(m.value for m in enum)


def _schema_of(schema: dict[str, Any]) -> Any:
    """A type whose JSON Schema is `schema` (for inputs a before-validator accepts)."""
    return Annotated[Any, WithJsonSchema(schema)]


def _enum_values(enum: type[StrEnum]) -> dict[str, Any]:
    return {"type": "string", "enum": [m.value for m in enum]}


@dataclass(frozen=True, kw_only=True, config=_CONFIG)
class PluginFlags(_Model):
    pass_device_specs: _Bool = False
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

    @field_validator(
        "device_list_strategy",
        mode="before",
        json_schema_input_type=_schema_of(
            {
                "anyOf": [
                    _enum_values(DeviceListStrategy),
                    {"type": "array", "minItems": 1, "items": _enum_values(DeviceListStrategy)},
                ]
            }
        ),
    )
    @classmethod
    def _strategies(cls, value: Any) -> Any:
        """NVIDIA reads one string or a list; a strategy listed twice is simply enabled."""
        items = (value,) if isinstance(value, str) else value
        if not isinstance(items, list | tuple):
            return value  # pydantic reports the type
        hint = f"use one or more of: {_one_of(DeviceListStrategy)}"
        if not items:
            raise invalid("needs at least one strategy", hint, got=[])
        valid = {m.value for m in DeviceListStrategy}
        for i, item in enumerate(items):
            if not isinstance(item, str) or item not in valid:  # a list item is unhashable
                at = f"[{i}]" if not isinstance(value, str) else ""
                if isinstance(item, str) and "," in item:
                    hint += " (write several as a YAML list, not a comma string)"
                raise invalid("unknown device list strategy", hint, at=at, got=item)
        return tuple(dict.fromkeys(items))


def _sleep_interval(value: Any) -> Any:
    """NVIDIA's `Duration`: a Go duration string, `infinite`, or a number of nanoseconds.

    A negative interval relabels without pause, as Go's timer does; it reads as `0s`.
    """
    if not isinstance(value, str | int | float) or isinstance(value, bool):
        return value  # pydantic reports the type
    try:
        ns = parse_go_duration(value)
    except ValueError as exc:
        raise invalid(
            str(exc),
            "write a duration like 60s, 5m or 1h30m, 'infinite', or a number of nanoseconds",
            got=value,
        ) from None
    return format_go_duration(ns)


@dataclass(frozen=True, kw_only=True, config=_CONFIG)
class GfdFlags(_Model):
    """GPU Feature Discovery flags, shared with `kubegpu labels`."""

    oneshot: _Bool = False
    no_timestamp: _Bool = False
    #: Time between labelling passes, normalised to e.g. `1m30s`, `0s` or `infinite`.
    sleep_interval: str = _sleep_interval("60s")
    output_file: str = "/etc/kubernetes/node-feature-discovery/features.d/gfd"
    machine_type_file: str = "/sys/class/dmi/id/product_name"
    use_node_feature_api: _Bool = False

    @field_validator(
        "sleep_interval",
        mode="before",
        json_schema_input_type=_schema_of({"type": ["string", "number"]}),
    )
    @classmethod
    def _sleep_interval(cls, value: Any) -> Any:
        return _sleep_interval(value)


_Xid = Annotated[int, Field(ge=0)]


class _XidMap(dict[int, XidOutcome]):
    """A dict that hashes by its items, so that the models stay hashable frozen values."""

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(frozenset(self.items()))


#: Validated as a mapping (errors name the Xid), held as a hashable one.
_XidOverrides = Annotated[dict[_Xid, XidOutcome], AfterValidator(_XidMap)]


@dataclass(frozen=True, kw_only=True, config=_CONFIG)
class HealthFlags(_Model):
    """kubegpu's health settings (NVIDIA has env vars only; we accept both)."""

    #: Xids that never mark a GPU unhealthy (application errors by default).
    ignored_xids: tuple[_Xid, ...] = (13, 31, 43, 45, 68, 109)
    #: Xids to treat as critical even if listed in `ignored_xids`.
    critical_xids: tuple[_Xid, ...] = ()
    #: Turn health checks off entirely (DP_DISABLE_HEALTHCHECKS=all).
    disabled: bool = False
    #: A GPU whose probes pass this long after its last error is healthy again; 0 never heals.
    recovery_seconds: Annotated[float, Field(ge=0.0)] = 60.0
    #: How often unhealthy GPUs are probed for recovery.
    probe_interval_seconds: Annotated[float, Field(gt=0.0)] = 5.0
    #: What an Xid does, per Xid, over NVIDIA's catalog and `ignoredXids` (not over
    #: `criticalXids`): `ignore`, `unhealthy`, or `unhealthy-until-reset`.
    xid_overrides: _XidOverrides = field(default_factory=_XidMap)


@dataclass(frozen=True, kw_only=True, config=_CONFIG)
class Flags(_Model):
    # NVIDIA keeps `useNodeFeatureAPI` here; `_node_feature_api` moves it to `gfd`.
    _schema: ClassVar[dict[str, Any]] = {
        "properties": {"useNodeFeatureAPI": {"type": ["boolean", "null"]}}
    }

    mig_strategy: MigStrategy = MigStrategy.NONE
    fail_on_init_error: _Bool = True
    nvidia_driver_root: str = "/"
    nvidia_dev_root: str | None = None
    #: Where the MPS control daemons keep pipes and logs; required when `sharing.mps` is set.
    mps_root: str | None = None
    gds_enabled: _Bool = False
    mofed_enabled: _Bool = False
    gdrcopy_enabled: _Bool = False
    #: NVIDIA's plugin and GFD accept exactly these.
    device_discovery_strategy: DeviceDiscoveryStrategy = "auto"
    plugin: PluginFlags = field(default_factory=PluginFlags)
    gfd: GfdFlags = field(default_factory=GfdFlags)
    health: HealthFlags = field(default_factory=HealthFlags)

    @model_validator(mode="before")
    @classmethod
    def _node_feature_api(cls, data: Any) -> Any:
        """NVIDIA keeps `useNodeFeatureAPI` in `flags` itself; kubegpu reads it from
        `flags.gfd`, where the labeller's flag sets it. A `flags.gfd` value wins."""
        if not isinstance(data, dict):
            return data
        keys = ("useNodeFeatureAPI", "use_node_feature_api")
        value = next((data[k] for k in keys if data.get(k) is not None), None)
        data = {k: v for k, v in data.items() if k not in keys}
        if value is None:
            return data
        gfd = data.get("gfd")
        if gfd is None:
            gfd = {}
        if isinstance(gfd, dict) and all(gfd.get(k) is None for k in keys):
            data["gfd"] = {**gfd, "useNodeFeatureAPI": value}
        return data

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


def _check_resource_name(value: Any) -> Any:
    """Validate (not rewrite) a resource name: consumers qualify short names per vendor."""
    if not isinstance(value, str):
        return value  # pydantic reports the type
    try:
        full = value if "/" in value else f"{DEFAULT_RESOURCE_PREFIX}/{value}"
        if full.startswith(f"{DEFAULT_RESOURCE_PREFIX}/") and full.count("/") == 1:
            _check_nvidia_name(full)  # first: its rules are the stricter ones
        qualify_resource_name(value)
    except ValueError as exc:
        raise invalid(
            f"not a valid extended resource name: {exc}",
            "use '<domain>/<name>' like 'nvidia.com/gpu.shared', or a bare name like 'gpu'",
            got=value,
        ) from None
    return value


@dataclass(frozen=True, kw_only=True, config=_CONFIG)
class ResourcePattern(_Model):
    """Advertise devices whose product name matches `pattern` (glob) as `name`."""

    # NVIDIA reads a null pattern as "" (matching no device) and refuses a null name.
    _null_is_error: ClassVar[frozenset[str]] = frozenset({"pattern", "name"})

    pattern: str
    name: str

    @field_validator(
        "pattern", mode="before", json_schema_input_type=_schema_of({"type": ["string", "null"]})
    )
    @classmethod
    def _pattern(cls, value: Any) -> Any:
        return "" if value is None else value

    @field_validator("name", mode="before")
    @classmethod
    def _name(cls, value: Any) -> Any:
        return _check_resource_name(value)


@dataclass(frozen=True, kw_only=True, config=_CONFIG)
class Resources(_Model):
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


_MIB: Final = 1 << 20
_QUANTITY_HINT = "write bytes or a quantity like '10Gi' or '512Mi'"


def _memory_quantity(value: Any) -> Any:
    """A memory quantity key: a positive quantity, kept as written (a string)."""
    if value is None:
        return None
    if not isinstance(value, str | int) or isinstance(value, bool):
        raise invalid("is not a Kubernetes quantity", _QUANTITY_HINT, got=value)
    try:
        parse_quantity(value)
    except ValueError as exc:
        raise invalid(str(exc), _QUANTITY_HINT, got=value) from None
    return str(value)


@dataclass(frozen=True, kw_only=True, config=_CONFIG)
class ClaimSizing(_Model):
    """kubegpu extension, DRA mode: claims on these GPUs are sized by memory.

    The GPU is published with a `memory` capacity whose request policy sizes a claim that
    names no memory (`defaultMemory`) and rounds every request up to `memoryStep`, and a
    `shares` capacity of `replicas` of which an unsized claim takes `defaultShares`. On an
    MPS-shared GPU each prepared claim gets the memory it consumed and its shares of the
    SMs as limits it cannot lift (its own MPS control daemon). The device plugin mode
    ignores the key: its replicas keep NVIDIA's fixed limits.
    """

    _schema: ClassVar[dict[str, Any]] = {"properties": {"defaultShares": {"minimum": 1}}}

    #: What a claim that asks for no memory takes; default the GPU's memory / replicas,
    #: rounded down to `memoryStep`.
    default_memory: str | None = None
    #: Memory requests round up to a multiple of this, and no claim takes less.
    memory_step: str = "1Mi"
    #: Shares (of the GPU's `replicas`) a claim that asks for none takes.
    default_shares: _Int = 1

    @field_validator(
        "default_memory",
        "memory_step",
        mode="before",
        json_schema_input_type=_schema_of({"type": ["string", "integer"]}),
    )
    @classmethod
    def _quantities(cls, value: Any) -> Any:
        return _memory_quantity(value)

    @field_validator("memory_step")
    @classmethod
    def _whole_mib(cls, value: str) -> str:
        if parse_quantity(value) % _MIB:
            raise invalid(
                "must be whole MiB",
                "MPS takes its memory limits in MiB: use a multiple of 1Mi, like '256Mi' or '1Gi'",
                got=value,
            )
        return value

    @field_validator("default_shares")
    @classmethod
    def _shares(cls, value: int) -> int:
        if value < 1:
            raise invalid("must be at least 1", "give the shares an unsized claim takes", got=value)
        return value

    @model_validator(mode="after")
    def _default_on_step(self) -> ClaimSizing:
        if self.default_memory is not None:
            memory, step = parse_quantity(self.default_memory), parse_quantity(self.memory_step)
            if memory % step:
                raise invalid(
                    f"is not a multiple of memoryStep ({self.memory_step})",
                    "make it one: the scheduler only hands out whole steps",
                    at="defaultMemory",
                    got=self.default_memory,
                )
        return self

    def step_bytes(self) -> int:
        return parse_quantity(self.memory_step)

    def default_bytes(self, gpu_memory: int, replicas: int) -> int:
        """The memory an unsized claim takes on a GPU of `gpu_memory` bytes."""
        if self.default_memory is not None:
            return parse_quantity(self.default_memory)
        step = self.step_bytes()
        return max(step, gpu_memory // replicas // step * step)


@dataclass(frozen=True, kw_only=True, config=_CONFIG)
class ReplicatedResource(_Model):
    # NVIDIA rejects a null in any of these keys (an empty name, no device list, 0 replicas).
    _null_is_error: ClassVar[frozenset[str]] = frozenset({"name", "replicas", "rename", "devices"})
    _schema: ClassVar[dict[str, Any]] = {
        "properties": {
            "replicas": {"minimum": 2},
            "activeThreadPercentage": {"minimum": 1, "maximum": 100},
        }
    }

    #: The resource to share; a bare name means `nvidia.com/<name>`.
    name: str
    replicas: _Int
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

    @field_validator(
        "name", "rename", mode="before", json_schema_input_type=_schema_of({"type": "string"})
    )
    @classmethod
    def _names(cls, value: Any) -> Any:
        if value is None:  # NVIDIA reads a null name or rename as "" and refuses it
            raise invalid("is empty", "give a resource name, or remove the key", got=None)
        return _check_resource_name(value)

    @field_validator("replicas")
    @classmethod
    def _replicas(cls, value: int) -> int:
        if value < 2:
            raise invalid(
                "must be at least 2",
                "sharing needs 2 or more replicas per GPU; remove the entry to not share",
                got=value,
            )
        return value

    @field_validator("devices", mode="before", json_schema_input_type=_schema_of(_DEVICES_SCHEMA))
    @classmethod
    def _devices(cls, value: Any) -> Any:
        """`all`, a positive count, or a list of distinct GPU/MIG indices and UUIDs."""
        if value == "all":
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            if value < 1:
                raise invalid("must be a positive count of GPUs", _DEVICES_HINT, got=value)
            return value
        if not isinstance(value, list | tuple):
            raise invalid("is not a device selector", _DEVICES_HINT, got=value)
        if not value:
            raise invalid("lists no devices", _DEVICES_HINT, got=[])
        seen: set[object] = set()  # a set, not value[:i]: linear in a long list
        for i, entry in enumerate(value):
            try:
                device_entry_kind(entry)
            except ValueError as exc:
                raise invalid(f"entry {exc}", _DEVICES_HINT, at=f"[{i}]", got=entry) from None
            if entry in seen:
                raise invalid(
                    "lists a device twice", "list each device once", at=f"[{i}]", got=entry
                )
            seen.add(entry)
        return tuple(value)

    @field_validator(
        "memory_limit",
        mode="before",
        json_schema_input_type=_schema_of({"type": ["string", "integer", "null"]}),
    )
    @classmethod
    def _memory_limit(cls, value: Any) -> Any:
        if value is None:
            return None
        if not isinstance(value, str | int) or isinstance(value, bool):
            raise invalid("is not a Kubernetes quantity", "write bytes or e.g. '10Gi'", got=value)
        try:
            parse_quantity(value)
        except ValueError as exc:
            raise invalid(
                f"memory limit {exc}", "write bytes or a quantity like '10Gi' or '512Mi'", got=value
            ) from None
        return str(value)

    @field_validator("active_thread_percentage")
    @classmethod
    def _percentage(cls, value: int | None) -> int | None:
        if value is not None and not 1 <= value <= 100:
            raise invalid("must be between 1 and 100", "give a percentage of SMs", got=value)
        return value

    @model_validator(mode="after")
    def _sizing_shares(self) -> ReplicatedResource:
        if self.sizing is not None and self.sizing.default_shares > self.replicas:
            raise invalid(
                f"is more than the {self.replicas} replicas (shares) of each GPU",
                f"give at most {self.replicas}",
                at="sizing.defaultShares",
                got=self.sizing.default_shares,
            )
        return self


@dataclass(frozen=True, kw_only=True, config=_CONFIG)
class SharingStrategy(_Model):
    _schema: ClassVar[dict[str, Any]] = {
        "required": ["resources"],
        "properties": {"resources": {"minItems": 1}},
    }

    rename_by_default: _Bool = False
    #: Refuse requests for more than one replica. Defaults to true under `sharing.mps`
    #: (NVIDIA's MPS always refused them before the key existed), false for timeSlicing.
    fail_requests_greater_than_one: _Bool = False
    resources: tuple[ReplicatedResource, ...] = ()

    @model_validator(mode="after")
    def _resources(self) -> SharingStrategy:
        if not self.resources:
            raise invalid(
                "lists no resources to share",
                "add an entry like {name: nvidia.com/gpu, replicas: 4}, or remove the strategy",
                at="resources",
                got=[],
            )
        seen: set[str] = set()
        for i, entry in enumerate(self.resources):
            full = qualify_resource_name(entry.name)
            if full in seen:
                raise invalid(
                    "is listed twice in this strategy",
                    "give each resource one entry (use 'devices' to pick GPUs)",
                    at=f"resources[{i}].name",
                    got=entry.name,
                )
            seen.add(full)
        return self


@dataclass(frozen=True, kw_only=True, config=_CONFIG)
class Sharing(_Model):
    # NVIDIA decodes `timeSlicing: null` as a strategy with no resources, an error; a
    # null `mps` is "no MPS".
    _null_is_error: ClassVar[frozenset[str]] = frozenset({"timeSlicing", "time_slicing"})

    time_slicing: SharingStrategy | None = None
    mps: SharingStrategy | None = None

    @field_validator("time_slicing", mode="before")
    @classmethod
    def _time_slicing(cls, value: Any) -> Any:
        if value is None:
            raise invalid(
                "lists no resources to share",
                "add resources like [{name: nvidia.com/gpu, replicas: 4}], or remove the key",
                got=None,
            )
        return value

    @field_validator("mps", mode="before")
    @classmethod
    def _mps_defaults(cls, value: Any) -> Any:
        keys = ("failRequestsGreaterThanOne", "fail_requests_greater_than_one")
        if isinstance(value, dict) and all(value.get(k) is None for k in keys):
            return {**{k: v for k, v in value.items() if k not in keys}, keys[0]: True}
        return value

    @model_validator(mode="after")
    def _cross_checks(self) -> Sharing:
        if self.time_slicing is not None:
            for i, entry in enumerate(self.time_slicing.resources):
                for key, val in (
                    ("memoryLimit", entry.memory_limit),
                    ("activeThreadPercentage", entry.active_thread_percentage),
                ):
                    if val is not None:
                        raise invalid(
                            "applies to MPS only",
                            "move the entry under sharing.mps or remove the key",
                            at=f"timeSlicing.resources[{i}].{key}",
                            got=val,
                        )
        if self.mps is None:
            return self
        sliced = {
            qualify_resource_name(r.name)
            for r in (self.time_slicing.resources if self.time_slicing else ())
        }
        for i, entry in enumerate(self.mps.resources):
            at = f"mps.resources[{i}]"
            if entry.replicas > MPS_MAX_REPLICAS:
                raise invalid(
                    f"exceeds the MPS limit of {MPS_MAX_REPLICAS} clients per GPU",
                    f"use at most {MPS_MAX_REPLICAS} replicas",
                    at=f"{at}.replicas",
                    got=entry.replicas,
                )
            if isinstance(entry.devices, tuple):
                for j, dev in enumerate(entry.devices):
                    if device_entry_kind(dev) in ("mig-index", "mig-uuid"):
                        raise invalid(
                            "names a MIG device; MPS sharing of MIG devices is not supported",
                            "list whole GPUs only, or share MIG devices with timeSlicing",
                            at=f"{at}.devices[{j}]",
                            got=dev,
                        )
            if qualify_resource_name(entry.name) in sliced:
                raise invalid(
                    "is shared by both timeSlicing and mps",
                    "share each resource with one strategy only",
                    at=f"{at}.name",
                    got=entry.name,
                )
        return self


@dataclass(frozen=True, kw_only=True, config=_CONFIG)
class Imex(_Model):
    """IMEX channels to inject into every container (NVIDIA compatibility)."""

    # NVIDIA supports no channel but channel 0: `[]` or `[0]`.
    _schema: ClassVar[dict[str, Any]] = {
        "properties": {"channelIDs": {"maxItems": 1, "items": {"const": 0}}}
    }

    channel_ids: tuple[_Int, ...] = ()
    required: _Bool = False

    @field_validator("channel_ids")
    @classmethod
    def _channels(cls, value: tuple[int, ...]) -> tuple[int, ...]:
        if value not in ((), (0,)):
            raise invalid(
                "must be [] or [0]", "only IMEX channel 0 is supported; use [0]", got=list(value)
            )
        return value


@dataclass(frozen=True, kw_only=True, config=_CONFIG)
class Config(_Model):
    """A kubegpu (and NVIDIA device plugin) config file, version v1."""

    # NVIDIA reads an empty version as v1.
    _schema: ClassVar[dict[str, Any]] = {"properties": {"version": {"enum": [VERSION, ""]}}}

    version: str = VERSION
    flags: Flags = field(default_factory=Flags)
    resources: Resources = field(default_factory=Resources)
    sharing: Sharing = field(default_factory=Sharing)
    imex: Imex = field(default_factory=Imex)

    @field_validator("version", mode="before")
    @classmethod
    def _version_unset(cls, value: Any) -> Any:
        return VERSION if value == "" else value

    @field_validator("version")
    @classmethod
    def _version(cls, value: str) -> str:
        if value not in SUPPORTED_VERSIONS:
            raise invalid(
                "unsupported config version",
                f"this kubegpu reads version {', '.join(SUPPORTED_VERSIONS)}; set 'version: v1'",
                got=value,
            )
        return value

    @model_validator(mode="after")
    def _mps_needs(self) -> Config:
        if self.sharing.mps is None:
            return self
        if self.flags.mig_strategy is MigStrategy.MIXED:
            raise invalid(
                "MPS sharing (sharing.mps) cannot be used with MIG strategy 'mixed'",
                "use migStrategy 'none' or 'single', or remove sharing.mps",
                at="flags.migStrategy",
                got="mixed",
            )
        if not self.flags.mps_root:
            raise invalid(
                "is required when sharing.mps is configured",
                "set flags.mpsRoot or --mps-root/MPS_ROOT (e.g. /run/nvidia/mps)",
                at="flags.mpsRoot",
                got=None,
            )
        return self


#: Validates and dumps `Config` (and builds its JSON Schema); built on first use, as the
#: models are, reusing `Config`'s own validator when that is built first.
CONFIG_ADAPTER: Final = TypeAdapter(Config)


class _ModelDefaults(GenerateJsonSchema):
    """Shows a nested model's default, which a factory makes, as the object it is
    (pydantic leaves factories out unless this method is overridden to call them)."""

    def get_default_value(self, schema: core_schema.WithDefaultSchema) -> Any:
        factory = schema.get("default_factory")
        if isinstance(factory, type) and is_pydantic_dataclass(factory):
            return factory()
        return super().get_default_value(schema)


def json_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of a v1 config file, as `kubegpu config schema`
    prints it: for editors and CI checks of a ConfigMap before it reaches a node."""
    schema = CONFIG_ADAPTER.json_schema(by_alias=True, schema_generator=_ModelDefaults)
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **schema}
