"""Devices + config -> the resources and device IDs to advertise.

Pure functions over frozen values: the daemon calls `build_resources` on every inventory,
health or config change and diffs the result against what is being served.

The steps, in order:
1. MIG strategy picks the units: whole GPUs (`none`), all MIG slices as `nvidia.com/gpu`
   (`single`), or whole GPUs plus one resource per MIG profile (`mixed`).
2. `resources.gpus` / `resources.mig` patterns rename units (first match wins; `*` is
   the only wildcard, as in NVIDIA's config).
3. `sharing.timeSlicing` / `sharing.mps` replicate the selected units of a resource
   (`devices`: all, a count, or a list) as `<UUID>::<n>`, optionally under a new name.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from functools import cached_property

from kubegpu.config import (
    AmdNamingStrategy,
    Config,
    MigStrategy,
    ReplicatedResource,
    SharingStrategy,
)
from kubegpu.config.names import pattern_matches
from kubegpu.devices import DeviceID, Gpu, Health, Inventory, MigDevice, ResourceName, Vendor
from kubegpu.errors import ConfigError
from kubegpu.placement import Fabric

DEFAULT_NVIDIA = ResourceName("nvidia.com/gpu")
DEFAULT_AMD = ResourceName("amd.com/gpu")
#: A compute-memory partition mode as it may name a resource (`cpx_nps4`).
_PARTITION_MODE = re.compile(r"[a-z0-9]+_[a-z0-9]+")
#: MPS supports at most 48 clients per GPU, 16 on GPUs below compute capability 7.5.
MPS_MAX_REPLICAS = 48
MPS_MAX_REPLICAS_BEFORE_CC75 = 16
REPLICA_SEPARATOR = "::"
#: The kubelet reads at most 4 MiB per gRPC message; one ListAndWatch answer holds every
#: device of a resource, so a resource must fit in it (or the node shows 0 of it).
KUBELET_MAX_MESSAGE_BYTES = 4 * 1024 * 1024
#: An upper bound on one device's bytes in that message beyond its ID: the Device framing
#: and length (4), health "Unhealthy" (11), a NUMA topology entry (16), the ID's tag (3).
DEVICE_OVERHEAD_BYTES = 34


class SharingKind(StrEnum):
    NONE = "none"
    TIME_SLICING = "time-slicing"
    MPS = "mps"


@dataclass(frozen=True)
class Unit:
    """One allocatable piece of hardware: a whole GPU or one MIG slice."""

    #: What the container is given: the GPU UUID or the MIG UUID.
    uuid: str
    #: NVIDIA index notation: `3` for a GPU, `3:1` for a MIG slice.
    index: str
    gpu: Gpu
    mig: MigDevice | None = None

    @property
    def health(self) -> Health:
        return self.mig.health if self.mig is not None else self.gpu.health

    @property
    def device_paths(self) -> tuple[str, ...]:
        own = self.mig.device_paths if self.mig is not None else ()
        return self.gpu.device_paths + own

    @property
    def profile(self) -> str | None:
        return self.mig.profile if self.mig is not None else None


@dataclass(frozen=True)
class AdvertisedDevice:
    """One device ID as the kubelet sees it."""

    id: DeviceID
    unit: Unit
    #: Replica number for shared devices; None for a whole unit.
    replica: int | None = None

    @property
    def health(self) -> Health:
        return self.unit.health

    @property
    def numa_node(self) -> int | None:
        return self.unit.gpu.numa_node


@dataclass(frozen=True)
class ResourceSpec:
    """Everything the plugin server for one resource name needs."""

    name: ResourceName
    devices: tuple[AdvertisedDevice, ...]
    sharing: SharingKind = SharingKind.NONE
    replicas: int = 1
    fail_requests_greater_than_one: bool = False
    #: The sharing config entry this resource came from (MPS limits), if shared.
    shared_by: ReplicatedResource | None = None
    #: Device nodes every container of this vendor needs (nvidiactl, uvm, kfd).
    control_device_paths: tuple[str, ...] = ()
    vendor: Vendor = Vendor.NVIDIA
    #: The devices are simulated ones (`Inventory.simulated`): no device node is real.
    simulated: bool = False
    #: What GetPreferredAllocation reads of these devices (pair weights, ranks, replicas),
    #: built here with the spec so that no request pays for it.
    placement: Fabric = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        fabric = Fabric.build(
            self.name,
            self.by_id,
            replicas=self.replicas if self.sharing is not SharingKind.NONE else None,
            amd=self.vendor is Vendor.AMD,
        )
        object.__setattr__(self, "placement", fabric)  # frozen: set once, here

    @cached_property
    def by_id(self) -> Mapping[str, AdvertisedDevice]:
        return {d.id: d for d in self.devices}

    @property
    def healthy_count(self) -> int:
        return sum(1 for d in self.devices if d.health is Health.HEALTHY)

    @property
    def socket_name(self) -> str:
        return socket_name(self.name)


def socket_name(resource: str) -> str:
    """`nvidia.com/gpu` -> `kubegpu-nvidia.com-gpu.sock`: the `/` becomes `-`, and a `-` of
    the name is doubled, so that no two resource names share a socket (`x.io-a/b` and
    `x.io/a-b` would both be `x.io-a-b` otherwise). A valid resource name has one `/`,
    between two letters or digits, so a lone `-` in the file name can only be the `/`."""
    return f"kubegpu-{resource.replace('-', '--').replace('/', '-')}.sock"


def replica_id(uuid: str, n: int) -> DeviceID:
    return DeviceID(f"{uuid}{REPLICA_SEPARATOR}{n}")


def mig_resource_name(profile: str) -> ResourceName:
    """`1g.10gb+me` -> `nvidia.com/mig-1g.10gb.me` (NVIDIA's mixed-strategy names)."""
    return ResourceName(f"nvidia.com/mig-{profile.replace('+', '.')}")


def build_resources(inventory: Inventory, config: Config) -> tuple[ResourceSpec, ...]:
    """The resources to advertise, sorted by name. Raises `ConfigError` when the config
    cannot apply to these devices (e.g. MIG single on mismatched slices)."""
    groups = _group_units(inventory, config)
    shared = _apply_sharing(groups, config)
    specs = []
    for name in sorted(shared):
        devices, sharing, entry, strategy = shared[name]
        vendor = devices[0].unit.gpu.vendor if devices else Vendor.NVIDIA
        specs.append(
            ResourceSpec(
                name=name,
                devices=tuple(devices),
                sharing=sharing,
                replicas=entry.replicas if entry is not None else 1,
                fail_requests_greater_than_one=(
                    strategy.fail_requests_greater_than_one if strategy is not None else False
                ),
                shared_by=entry,
                control_device_paths=inventory.control_device_paths,
                vendor=vendor,
                simulated=inventory.simulated,
            )
        )
    return tuple(specs)


# -- step 1 and 2: units per resource name -------------------------------------------------


def _group_units(inventory: Inventory, config: Config) -> dict[ResourceName, list[Unit]]:
    strategy = config.flags.mig_strategy
    groups: dict[ResourceName, list[Unit]] = {}

    def add(name: ResourceName, unit: Unit) -> None:
        groups.setdefault(name, []).append(unit)

    mig_gpus = [g for g in inventory.gpus if g.mig_enabled]
    if strategy is MigStrategy.SINGLE and mig_gpus:
        _check_single(inventory.gpus)
    for gpu in inventory.gpus:
        whole = Unit(uuid=gpu.uuid, index=str(gpu.index), gpu=gpu)
        if strategy is MigStrategy.NONE or not gpu.mig_enabled:
            add(_gpu_name(gpu, config), whole)
            continue
        for mig in sorted(gpu.mig_devices, key=lambda m: (m.gi_id, m.ci_id)):
            unit = Unit(uuid=mig.uuid, index=mig.index, gpu=gpu, mig=mig)
            if strategy is MigStrategy.SINGLE:
                add(_gpu_name(gpu, config), unit)
            else:
                add(_mig_name(mig, config), unit)
    if config.flags.plugin.amd_resource_naming_strategy is AmdNamingStrategy.MIXED:
        _name_amd_by_partition(groups)
    return groups


def _amd_partition_mode(gpu: Gpu) -> str | None:
    """ROCm's partition type of an AMD device, `<compute>_<memory>` (`cpx_nps4`); None
    when the GPU does not say both (no partitioning: an MI210, a Radeon)."""
    amd = gpu.amd
    if amd is None or not amd.compute_partition or not amd.memory_partition:
        return None
    mode = f"{amd.compute_partition}_{amd.memory_partition}"
    # sysfs says `CPX`, `NPS4`; anything else could not name a resource the kubelet takes.
    return mode if _PARTITION_MODE.fullmatch(mode) else None


def _name_amd_by_partition(groups: dict[ResourceName, list[Unit]]) -> None:
    """ROCm's `mixed` naming, in place: `amd.com/gpu` devices are advertised under their
    partition mode, `amd.com/<compute>_<memory>`.

    As ROCm's plugin: a node whose devices are all in one mode advertises all of them
    under that name, one in several modes a resource per mode, and a node without
    partitioning keeps `amd.com/gpu`. A device without a mode beside partitioned ones
    (which ROCm leaves unadvertised) stays `amd.com/gpu`, as ROCm names GPUs that cannot
    be partitioned. Devices renamed by `resources.gpus` keep their names.
    """
    units = groups.get(DEFAULT_AMD, [])
    modes = {u.uuid: _amd_partition_mode(u.gpu) for u in units}
    distinct = set(modes.values()) - {None}
    if not distinct:
        return
    del groups[DEFAULT_AMD]
    only = next(iter(distinct)) if len(distinct) == 1 else None
    for unit in units:
        mode = only or modes[unit.uuid]
        name = DEFAULT_AMD if mode is None else ResourceName(f"amd.com/{mode}")
        groups.setdefault(name, []).append(unit)


def _check_single(gpus: Sequence[Gpu]) -> None:
    disabled = [str(g.index) for g in gpus if not g.mig_enabled]
    if disabled:
        raise ConfigError(
            f"flags.migStrategy: 'single' needs MIG enabled on every GPU, but GPU(s) "
            f"{', '.join(disabled)} have it off; enable MIG on all GPUs or use 'mixed'"
        )
    profiles = {m.profile for g in gpus for m in g.mig_devices}
    if len(profiles) != 1:
        found = ", ".join(sorted(profiles)) or "no slices"
        raise ConfigError(
            f"flags.migStrategy: 'single' needs one MIG profile on every GPU, found {found}; "
            f"repartition identically or use 'mixed'"
        )


def _gpu_name(gpu: Gpu, config: Config) -> ResourceName:
    for rule in config.resources.gpus:
        if pattern_matches(rule.pattern, gpu.product):
            return _qualify(rule.name, gpu.vendor)
    return DEFAULT_AMD if gpu.vendor is Vendor.AMD else DEFAULT_NVIDIA


def _mig_name(mig: MigDevice, config: Config) -> ResourceName:
    for rule in config.resources.mig:
        if pattern_matches(rule.pattern, mig.profile):
            return _qualify(rule.name, Vendor.NVIDIA)
    return mig_resource_name(mig.profile)


def _qualify(name: str, vendor: Vendor) -> ResourceName:
    """Short names get the vendor's domain, as NVIDIA's config does for `gpu`."""
    if "/" in name:
        return ResourceName(name)
    return ResourceName(f"{'amd.com' if vendor is Vendor.AMD else 'nvidia.com'}/{name}")


# -- step 3: sharing ------------------------------------------------------------------------

_Group = tuple[
    list[AdvertisedDevice], SharingKind, ReplicatedResource | None, SharingStrategy | None
]


def _apply_sharing(
    groups: Mapping[ResourceName, list[Unit]], config: Config
) -> dict[ResourceName, _Group]:
    out: dict[ResourceName, _Group] = {}
    claimed: dict[ResourceName, set[str]] = {}
    strategies = (
        (SharingKind.TIME_SLICING, "timeSlicing", config.sharing.time_slicing),
        (SharingKind.MPS, "mps", config.sharing.mps),
    )
    for kind, section, strategy in strategies:
        if strategy is None:
            continue
        for i, entry in enumerate(strategy.resources):
            key = f"sharing.{section}.resources[{i}]"
            base = _qualify(entry.name, Vendor.NVIDIA)
            units = groups.get(base, [])
            if not units:
                # One cluster-wide config meets nodes without this resource: nothing to share.
                continue
            selected = _select(units, entry, key)
            if kind is SharingKind.MPS:
                _check_mps(selected, entry, key)
            _check_sizing(selected, entry, key)
            taken = claimed.setdefault(base, set())
            for unit in selected:
                if unit.uuid in taken:
                    raise ConfigError(
                        f"{key}.devices: GPU {unit.index} is shared twice; list it once"
                    )
                taken.add(unit.uuid)
            if entry.rename is not None:
                name = _qualify(entry.rename, Vendor.NVIDIA)
            elif strategy.rename_by_default:
                name = ResourceName(f"{base}.shared")
            else:
                name = base
            if name == base and len(selected) != len(units):
                raise ConfigError(
                    f"{key}.devices: shares only some {base} devices but keeps the name {base} "
                    f"for both shared and whole GPUs; set 'rename' or 'renameByDefault: true'"
                )
            if name in out:
                raise ConfigError(
                    f"{key}.name: resource {name} is produced twice; rename one of them"
                )
            _check_fits(name, selected, entry.replicas, key)
            devices = [
                AdvertisedDevice(id=replica_id(u.uuid, n), unit=u, replica=n)
                for u in selected
                for n in range(entry.replicas)
            ]
            out[name] = (devices, kind, entry, strategy)
    for name, units in groups.items():
        rest = [u for u in units if u.uuid not in claimed.get(name, set())]
        if not rest:
            continue
        if name in out:
            raise ConfigError(
                f"resources: {name} is both a shared (renamed) resource and a plain one; "
                f"choose another rename"
            )
        out[name] = (
            [AdvertisedDevice(id=DeviceID(u.uuid), unit=u) for u in rest],
            SharingKind.NONE,
            None,
            None,
        )
    return out


def list_message_bytes(ids: Sequence[str]) -> int:
    """An upper bound on the ListAndWatch message size for devices with these IDs."""
    return sum(len(i.encode()) + DEVICE_OVERHEAD_BYTES for i in ids)


def _check_fits(name: ResourceName, units: Sequence[Unit], replicas: int, key: str) -> None:
    """Refuse replicas whose device list the kubelet could not read, before building it.

    Computed from the sizes alone, so `replicas: 1000000000` fails at once instead of
    building a billion IDs.
    """
    suffix = len(REPLICA_SEPARATOR) + len(str(max(replicas - 1, 0)))
    per_replica = sum(len(u.uuid.encode()) + suffix + DEVICE_OVERHEAD_BYTES for u in units)
    if per_replica * replicas > KUBELET_MAX_MESSAGE_BYTES:
        most = KUBELET_MAX_MESSAGE_BYTES // max(per_replica, 1)
        raise ConfigError(
            f"{key}.replicas: {replicas} replicas of {len(units)} device(s) would make "
            f"{name}'s device list larger than the kubelet's 4 MiB message limit "
            f"(got {replicas}); use at most {most} replicas here"
        )


def _select(units: Sequence[Unit], entry: ReplicatedResource, key: str) -> list[Unit]:
    """The units picked by `devices`: all, the first N GPUs by index, or a list."""
    spec = entry.devices
    if spec == "all":
        return list(units)
    if isinstance(spec, int):
        if spec > len(units):
            raise ConfigError(
                f"{key}.devices: asks to share {spec} devices but {entry.name} has {len(units)}; "
                f"lower the count or use 'all'"
            )
        return list(units[:spec])
    picked: list[Unit] = []
    for raw in spec:
        ref = str(raw)
        # A GPU reference selects the GPU, or all its slices when it is MIG-partitioned.
        match = [u for u in units if ref in (u.uuid, u.index, u.gpu.uuid, str(u.gpu.index))]
        if not match:
            raise ConfigError(
                f"{key}.devices: {ref!r} matches no {entry.name} device on this node; "
                f"use a GPU index, GPU/MIG UUID or MIG 'i:j' index that exists"
            )
        picked.extend(u for u in match if u not in picked)
    return picked


def _check_sizing(units: Sequence[Unit], entry: ReplicatedResource, key: str) -> None:
    """A memory-sized GPU must hold its default claim and, as the API requires of a
    capacity whose smallest request is one step, two steps."""
    sizing = entry.sizing
    if sizing is None:
        return
    step = sizing.step_bytes()
    for unit in units:
        memory = unit_memory_bytes(unit)
        if 2 * step > memory:
            raise ConfigError(
                f"{key}.sizing.memoryStep: {sizing.memory_step} is more than half of the "
                f"{memory >> 20}Mi of GPU {unit.index}; the smallest claim is one step and the "
                f"API needs room for two: use a smaller step"
            )
        default = sizing.default_bytes(memory, entry.replicas)
        if default > memory // step * step:
            raise ConfigError(
                f"{key}.sizing.defaultMemory: {sizing.default_memory} does not fit in the "
                f"{memory >> 20}Mi of GPU {unit.index}; give at most what one GPU holds"
            )


def unit_memory_bytes(unit: Unit) -> int:
    """The memory a unit gives its containers: its MIG slice's, else its GPU's."""
    return (unit.mig.memory_mib if unit.mig is not None else unit.gpu.memory_mib) << 20


# -- memory-sized shared GPUs: how their limits are held ------------------------------


class MemoryLimit(StrEnum):
    """What holds a sized claim's memory limit (`kubegpu.dra.sizing` says what each does),
    published on the device (DRA) and as a node label (`kubegpu.labels`)."""

    NVML_CGROUP = "nvml-cgroup"
    MPS_PINNED = "mps-pinned-memory"
    NONE = "none"


class ComputeLimit(StrEnum):
    """What holds a sized claim's compute share, published as `MemoryLimit` is."""

    MPS_THREADS = "mps-active-threads"
    NONE = "none"


def sized(resource: ResourceSpec) -> bool:
    """Whether claims on this resource's devices are sized by memory (and limited)."""
    entry = resource.shared_by
    return (
        resource.sharing is not SharingKind.NONE and entry is not None and entry.sizing is not None
    )


def mechanisms(
    resource: ResourceSpec, unit: Unit, kernel: bool
) -> tuple[MemoryLimit, ComputeLimit]:
    """How a claim's memory and compute limits are held on this unit. `kernel`: the node
    offers per-cgroup memory limits (`Inventory.memory_limits`); MIG slices have none."""
    mps = resource.sharing is SharingKind.MPS
    if kernel and unit.mig is None:
        memory = MemoryLimit.NVML_CGROUP
    else:
        memory = MemoryLimit.MPS_PINNED if mps else MemoryLimit.NONE
    return memory, ComputeLimit.MPS_THREADS if mps else ComputeLimit.NONE


def _check_mps(units: Sequence[Unit], entry: ReplicatedResource, key: str) -> None:
    for unit in units:
        if unit.mig is not None:
            raise ConfigError(
                f"{key}.devices: MPS cannot share MIG device {unit.index}; "
                f"share whole GPUs or use timeSlicing"
            )
        limit = (
            MPS_MAX_REPLICAS
            if unit.gpu.compute_capability >= (7, 5)
            else MPS_MAX_REPLICAS_BEFORE_CC75
        )
        if entry.replicas > limit:
            cc = ".".join(map(str, unit.gpu.compute_capability))
            raise ConfigError(
                f"{key}.replicas: {entry.replicas} exceeds MPS's limit of {limit} clients "
                f"on GPU {unit.index} (compute capability {cc}); use at most {limit}"
            )
