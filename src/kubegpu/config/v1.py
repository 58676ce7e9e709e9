"""The `v1` config schema: the keys and meanings of NVIDIA's device plugin config file.

The same YAML that configures NVIDIA's plugin (`version: v1`, `flags`, `resources`,
`sharing`) configures kubegpu. Unlike NVIDIA's loader, unknown keys are refused (with a
suggestion for typos) rather than silently ignored, and `resources` renaming and
`sharing.*.resources[].devices` subsets take effect instead of being parsed and dropped.

Models are frozen: a `Config` is a value, and a reload builds a new one.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic.alias_generators import to_camel

VERSION = "v1"


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


class _Model(BaseModel):
    model_config = ConfigDict(
        frozen=True, extra="forbid", alias_generator=to_camel, populate_by_name=True
    )


class PluginFlags(_Model):
    pass_device_specs: bool = False
    #: One strategy or several; a string in the file is read as a one-element list.
    device_list_strategy: tuple[DeviceListStrategy, ...] = (DeviceListStrategy.ENVVAR,)
    device_id_strategy: DeviceIDStrategy = DeviceIDStrategy.UUID
    cdi_annotation_prefix: str = "cdi.k8s.io/"
    nvidia_ctk_path: str = "/usr/bin/nvidia-ctk"
    container_driver_root: str = "/driver-root"
    shared_devices_allocation_policy: AllocationPolicy = AllocationPolicy.DISTRIBUTED

    @field_validator("device_list_strategy", mode="before")
    @classmethod
    def _one_or_many(cls, value: Any) -> Any:
        if isinstance(value, str):
            return (value,)
        return value

    @field_validator("device_list_strategy")
    @classmethod
    def _not_empty(cls, value: tuple[DeviceListStrategy, ...]) -> tuple[DeviceListStrategy, ...]:
        if not value:
            raise ValueError("needs at least one strategy: envvar, volume-mounts, cdi-annotations, cdi-cri")
        if len(set(value)) != len(value):
            raise ValueError("lists a strategy twice")
        return value


class GfdFlags(_Model):
    """GPU Feature Discovery flags, shared with `kubegpu labels`."""

    oneshot: bool = False
    no_timestamp: bool = False
    sleep_interval: str = "60s"
    output_file: str = "/etc/kubernetes/node-feature-discovery/features.d/gfd"
    machine_type_file: str = "/sys/class/dmi/id/product_name"
    use_node_feature_api: bool = False


class HealthFlags(_Model):
    """kubegpu's health settings (NVIDIA has env vars only; we accept both)."""

    #: Xids that never mark a GPU unhealthy (application errors by default).
    ignored_xids: tuple[int, ...] = (13, 31, 43, 45, 68, 109)
    #: Xids to treat as critical even if listed in `ignored_xids`.
    critical_xids: tuple[int, ...] = ()
    #: Turn health checks off entirely (DP_DISABLE_HEALTHCHECKS=all).
    disabled: bool = False
    #: A GPU whose probes pass this long after its last error is healthy again; 0 never heals.
    recovery_seconds: float = Field(default=60.0, ge=0)
    #: How often unhealthy GPUs are probed for recovery.
    probe_interval_seconds: float = Field(default=5.0, gt=0)


class Flags(_Model):
    mig_strategy: MigStrategy = MigStrategy.NONE
    fail_on_init_error: bool = True
    nvidia_driver_root: str = "/"
    nvidia_dev_root: str | None = None
    mps_root: str | None = None
    gds_enabled: bool = False
    mofed_enabled: bool = False
    gdrcopy_enabled: bool = False
    device_discovery_strategy: str = "auto"
    plugin: PluginFlags = PluginFlags()
    gfd: GfdFlags = GfdFlags()
    health: HealthFlags = HealthFlags()

    @property
    def dev_root(self) -> str:
        """Where /dev nodes live on the host: `nvidiaDevRoot`, else the driver root."""
        return self.nvidia_dev_root or self.nvidia_driver_root


class ResourcePattern(_Model):
    """Advertise devices whose product name matches `pattern` (glob) as `name`."""

    pattern: str
    name: str


class Resources(_Model):
    gpus: tuple[ResourcePattern, ...] = ()
    mig: tuple[ResourcePattern, ...] = ()


#: `devices`: "all", a count of GPUs, or a list of indices / UUIDs / MIG `i:j`.
DeviceSelector = Literal["all"] | int | tuple[str | int, ...]


class ReplicatedResource(_Model):
    name: str
    replicas: int
    rename: str | None = None
    devices: DeviceSelector = "all"
    #: MPS only: per-GPU pinned memory limit (e.g. `10Gi`); default total/replicas.
    memory_limit: str | None = None
    #: MPS only: active thread percentage; default 100/replicas.
    active_thread_percentage: int | None = None


class SharingStrategy(_Model):
    rename_by_default: bool = False
    fail_requests_greater_than_one: bool = False
    resources: tuple[ReplicatedResource, ...] = ()


class Sharing(_Model):
    time_slicing: SharingStrategy | None = None
    mps: SharingStrategy | None = None


class Config(_Model):
    version: Annotated[str, Field(default=VERSION)] = VERSION
    flags: Flags = Flags()
    resources: Resources = Resources()
    sharing: Sharing = Sharing()
