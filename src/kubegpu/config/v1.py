"""The `v1` config schema: the keys and meanings of NVIDIA's device plugin config file.

The same YAML that configures NVIDIA's plugin (`version: v1`, `flags`, `resources`,
`sharing`, `imex`) configures kubegpu. Unlike NVIDIA's loader, unknown keys are refused
(with a suggestion for typos) rather than silently ignored, and `resources` renaming and
`sharing.*.resources[].devices` subsets take effect instead of being parsed and dropped.

Models are frozen dataclasses: a `Config` is a value, and a reload builds a new one. File
keys are NVIDIA's camelCase spellings; Python code constructs models by field name. How a
file is read into them (hooks, kinds, the order of checks) is `kubegpu.config.schema`.

Checks raise `invalid(...)`, carrying a hint (what to do) and an optional sub-path, which
the loader turns into one line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, ClassVar, Final, Literal

from kubegpu.config.names import (
    DEFAULT_RESOURCE_PREFIX,
    device_entry_kind,
    format_go_duration,
    parse_go_duration,
    parse_quantity,
    qualify_resource_name,
)
from kubegpu.config.schema import (
    AS_IS,
    LAX_BOOL,
    LAX_FLOAT,
    LAX_INT,
    STR,
    STRICT_BOOL,
    STRICT_INT,
    ListOf,
    Model,
    Nested,
    Optional,
    at_least,
    invalid,
    key,
    literal,
    one_of,
    required,
)

VERSION: Final = "v1"
#: Every config version this build reads.
SUPPORTED_VERSIONS: Final = (VERSION,)
#: The CUDA MPS control daemon's hard limit on clients per GPU (16 on pre-Volta GPUs,
#: which needs the devices to check and is done where devices are known).
MPS_MAX_REPLICAS: Final = 48


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
# `"2"` for an int: NVIDIA's keys are STRICT_BOOL / STRICT_INT. kubegpu's own numeric
# keys (health) take the lax forms, as they always have.

DeviceDiscoveryStrategy = Literal["auto", "nvml", "tegra"]


def _one_of(enum: type[StrEnum]) -> str:
    return ", ".join(m.value for m in enum)


def _strategies(value: Any) -> Any:
    """NVIDIA reads one string or a list; a strategy listed twice is simply enabled."""
    items = (value,) if isinstance(value, str) else value
    if not isinstance(items, list | tuple):
        return value  # the list kind reports the type
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


@dataclass(frozen=True, kw_only=True)
class PluginFlags(Model):
    pass_device_specs: bool = key(False, STRICT_BOOL)
    #: One strategy or several; a string in the file is read as a one-element list.
    device_list_strategy: tuple[DeviceListStrategy, ...] = key(
        (DeviceListStrategy.ENVVAR,), ListOf(one_of(DeviceListStrategy)), before=_strategies
    )
    # NVIDIA spells these with capitals ("ID", "CTK") that camelCase would lower.
    device_id_strategy: DeviceIDStrategy = key(
        DeviceIDStrategy.UUID, one_of(DeviceIDStrategy), alias="deviceIDStrategy"
    )
    cdi_annotation_prefix: str = key("cdi.k8s.io/", STR)
    nvidia_ctk_path: str = key("/usr/bin/nvidia-ctk", STR, alias="nvidiaCTKPath")
    container_driver_root: str = key("/driver-root", STR)
    #: kubegpu extension: how replicas are picked for a multi-replica request.
    shared_devices_allocation_policy: AllocationPolicy = key(
        AllocationPolicy.DISTRIBUTED, one_of(AllocationPolicy)
    )
    #: kubegpu extension (ROCm's plugin flag): how AMD devices are named.
    amd_resource_naming_strategy: AmdNamingStrategy = key(
        AmdNamingStrategy.SINGLE, one_of(AmdNamingStrategy)
    )


def _sleep_interval(value: Any) -> Any:
    """NVIDIA's `Duration`: a Go duration string, `infinite`, or a number of nanoseconds.

    A negative interval relabels without pause, as Go's timer does; it reads as `0s`.
    """
    if not isinstance(value, str | int | float) or isinstance(value, bool):
        return value  # the string kind reports the type
    try:
        ns = parse_go_duration(value)
    except ValueError as exc:
        raise invalid(
            str(exc),
            "write a duration like 60s, 5m or 1h30m, 'infinite', or a number of nanoseconds",
            got=value,
        ) from None
    return format_go_duration(ns)


@dataclass(frozen=True, kw_only=True)
class GfdFlags(Model):
    """GPU Feature Discovery flags, shared with `kubegpu labels`."""

    oneshot: bool = key(False, STRICT_BOOL)
    no_timestamp: bool = key(False, STRICT_BOOL)
    #: Time between labelling passes, normalised to e.g. `1m30s`, `0s` or `infinite`.
    sleep_interval: str = key(_sleep_interval("60s"), STR, before=_sleep_interval)
    output_file: str = key("/etc/kubernetes/node-feature-discovery/features.d/gfd", STR)
    machine_type_file: str = key("/sys/class/dmi/id/product_name", STR)
    use_node_feature_api: bool = key(False, STRICT_BOOL, alias="useNodeFeatureAPI")


_XIDS: Final = ListOf(at_least(LAX_INT, 0))


@dataclass(frozen=True, kw_only=True)
class HealthFlags(Model):
    """kubegpu's health settings (NVIDIA has env vars only; we accept both)."""

    #: Xids that never mark a GPU unhealthy (application errors by default).
    ignored_xids: tuple[int, ...] = key((13, 31, 43, 45, 68, 109), _XIDS)
    #: Xids to treat as critical even if listed in `ignored_xids`.
    critical_xids: tuple[int, ...] = key((), _XIDS)
    #: Turn health checks off entirely (DP_DISABLE_HEALTHCHECKS=all).
    disabled: bool = key(False, LAX_BOOL)
    #: A GPU whose probes pass this long after its last error is healthy again; 0 never heals.
    recovery_seconds: float = key(60.0, at_least(LAX_FLOAT, 0.0))
    #: How often unhealthy GPUs are probed for recovery.
    probe_interval_seconds: float = key(5.0, at_least(LAX_FLOAT, 0.0, strictly=True))


@dataclass(frozen=True, kw_only=True)
class Flags(Model):
    mig_strategy: MigStrategy = key(MigStrategy.NONE, one_of(MigStrategy))
    fail_on_init_error: bool = key(True, STRICT_BOOL)
    nvidia_driver_root: str = key("/", STR)
    nvidia_dev_root: str | None = key(None, Optional(STR))
    #: Where the MPS control daemons keep pipes and logs; required when `sharing.mps` is set.
    mps_root: str | None = key(None, Optional(STR))
    gds_enabled: bool = key(False, STRICT_BOOL)
    mofed_enabled: bool = key(False, STRICT_BOOL)
    gdrcopy_enabled: bool = key(False, STRICT_BOOL)
    #: NVIDIA's plugin and GFD accept exactly these.
    device_discovery_strategy: DeviceDiscoveryStrategy = key(
        "auto", literal("auto", "nvml", "tegra")
    )
    plugin: PluginFlags = key(PluginFlags(), Nested(PluginFlags))
    gfd: GfdFlags = key(GfdFlags(), Nested(GfdFlags))
    health: HealthFlags = key(HealthFlags(), Nested(HealthFlags))

    @classmethod
    def _before(cls, data: dict[str, Any]) -> dict[str, Any]:
        """NVIDIA keeps `useNodeFeatureAPI` in `flags` itself; kubegpu reads it from
        `flags.gfd`, where the labeller's flag sets it. A `flags.gfd` value wins."""
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
        return value  # the string kind reports the type
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


@dataclass(frozen=True, kw_only=True)
class ResourcePattern(Model):
    """Advertise devices whose product name matches `pattern` (glob) as `name`."""

    # NVIDIA reads a null pattern as "" (matching no device) and refuses a null name.
    _null_is_error: ClassVar[frozenset[str]] = frozenset({"pattern", "name"})

    pattern: str = required(STR, before=lambda value: "" if value is None else value)
    name: str = required(STR, before=_check_resource_name)


@dataclass(frozen=True, kw_only=True)
class Resources(Model):
    gpus: tuple[ResourcePattern, ...] = key((), ListOf(Nested(ResourcePattern)))
    mig: tuple[ResourcePattern, ...] = key((), ListOf(Nested(ResourcePattern)))


#: `devices`: "all", a count of GPUs, or a list of indices / UUIDs / MIG `i:j`.
DeviceSelector = Literal["all"] | int | tuple[str | int, ...]

_DEVICES_HINT = (
    "use 'all', a count of GPUs, or a list of GPU indices (0), MIG indices (0:1) or UUIDs (GPU-…)"
)


def _names(value: Any) -> Any:
    if value is None:  # NVIDIA reads a null name or rename as "" and refuses it
        raise invalid("is empty", "give a resource name, or remove the key", got=None)
    return _check_resource_name(value)


def _replicas(value: int) -> int:
    if value < 2:
        raise invalid(
            "must be at least 2",
            "sharing needs 2 or more replicas per GPU; remove the entry to not share",
            got=value,
        )
    return value


def _devices(value: Any) -> Any:
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
            raise invalid("lists a device twice", "list each device once", at=f"[{i}]", got=entry)
        seen.add(entry)
    return tuple(value)


def _memory_limit(value: Any) -> Any:
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


def _percentage(value: int | None) -> int | None:
    if value is not None and not 1 <= value <= 100:
        raise invalid("must be between 1 and 100", "give a percentage of SMs", got=value)
    return value


@dataclass(frozen=True, kw_only=True)
class ReplicatedResource(Model):
    # NVIDIA rejects a null in any of these keys (an empty name, no device list, 0 replicas).
    _null_is_error: ClassVar[frozenset[str]] = frozenset({"name", "replicas", "rename", "devices"})

    #: The resource to share; a bare name means `nvidia.com/<name>`.
    name: str = required(STR, before=_names)
    replicas: int = required(STRICT_INT, after=_replicas)
    #: Advertise the replicas under this name instead (wins over `renameByDefault`).
    rename: str | None = key(None, Optional(STR), before=_names)
    devices: DeviceSelector = key("all", AS_IS, before=_devices)
    #: kubegpu extension, MPS only: per-GPU pinned memory limit (e.g. `10Gi`);
    #: default total/replicas.
    memory_limit: str | None = key(None, Optional(STR), before=_memory_limit)
    #: kubegpu extension, MPS only: active thread percentage; default 100/replicas.
    active_thread_percentage: int | None = key(None, Optional(LAX_INT), after=_percentage)


@dataclass(frozen=True, kw_only=True)
class SharingStrategy(Model):
    rename_by_default: bool = key(False, STRICT_BOOL)
    #: Refuse requests for more than one replica. Defaults to true under `sharing.mps`
    #: (NVIDIA's MPS always refused them before the key existed), false for timeSlicing.
    fail_requests_greater_than_one: bool = key(False, STRICT_BOOL)
    resources: tuple[ReplicatedResource, ...] = key((), ListOf(Nested(ReplicatedResource)))

    def _check(self) -> None:
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


def _time_slicing(value: Any) -> Any:
    # NVIDIA decodes `timeSlicing: null` as a strategy with no resources, an error.
    if value is None:
        raise invalid(
            "lists no resources to share",
            "add resources like [{name: nvidia.com/gpu, replicas: 4}], or remove the key",
            got=None,
        )
    return value


def _mps_defaults(value: Any) -> Any:
    keys = ("failRequestsGreaterThanOne", "fail_requests_greater_than_one")
    if isinstance(value, dict) and all(value.get(k) is None for k in keys):
        return {**{k: v for k, v in value.items() if k not in keys}, keys[0]: True}
    return value


@dataclass(frozen=True, kw_only=True)
class Sharing(Model):
    # A null `mps` is "no MPS"; a null `timeSlicing` is refused (see `_time_slicing`).
    _null_is_error: ClassVar[frozenset[str]] = frozenset({"timeSlicing", "time_slicing"})

    time_slicing: SharingStrategy | None = key(
        None, Optional(Nested(SharingStrategy)), before=_time_slicing
    )
    mps: SharingStrategy | None = key(None, Optional(Nested(SharingStrategy)), before=_mps_defaults)

    def _check(self) -> None:
        if self.time_slicing is not None:
            for i, entry in enumerate(self.time_slicing.resources):
                for name, val in (
                    ("memoryLimit", entry.memory_limit),
                    ("activeThreadPercentage", entry.active_thread_percentage),
                ):
                    if val is not None:
                        raise invalid(
                            "applies to MPS only",
                            "move the entry under sharing.mps or remove the key",
                            at=f"timeSlicing.resources[{i}].{name}",
                            got=val,
                        )
        if self.mps is None:
            return
        sliced = {
            qualify_resource_name(r.name) for r in (self.time_slicing or _NO_SHARING).resources
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


def _channels(value: tuple[int, ...]) -> tuple[int, ...]:
    if value not in ((), (0,)):
        raise invalid(
            "must be [] or [0]", "only IMEX channel 0 is supported; use [0]", got=list(value)
        )
    return value


@dataclass(frozen=True, kw_only=True)
class Imex(Model):
    """IMEX channels to inject into every container (NVIDIA compatibility)."""

    #: NVIDIA supports no channel but channel 0: `[]` or `[0]`.
    channel_ids: tuple[int, ...] = key((), ListOf(STRICT_INT), alias="channelIDs", after=_channels)
    required: bool = key(False, STRICT_BOOL)


def _version_unset(value: Any) -> Any:
    return VERSION if value == "" else value  # NVIDIA reads an empty version as v1


def _version(value: str) -> str:
    if value not in SUPPORTED_VERSIONS:
        raise invalid(
            "unsupported config version",
            f"this kubegpu reads version {', '.join(SUPPORTED_VERSIONS)}; set 'version: v1'",
            got=value,
        )
    return value


@dataclass(frozen=True, kw_only=True)
class Config(Model):
    version: str = key(VERSION, STR, before=_version_unset, after=_version)
    flags: Flags = key(Flags(), Nested(Flags))
    resources: Resources = key(Resources(), Nested(Resources))
    sharing: Sharing = key(Sharing(), Nested(Sharing))
    imex: Imex = key(Imex(), Nested(Imex))

    def _check(self) -> None:
        if self.sharing.mps is None:
            return
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


_NO_SHARING: Final = SharingStrategy()
