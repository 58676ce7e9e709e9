"""Processes -> the containers kubegpu gave their devices to, with each allocation's limit.

Pure functions over values. An `Allocation` is one holder (a container, or a DRA claim when
the kubelet does not say which containers use it) given one unit (a GPU or a MIG slice,
replicas folded into the unit they share), with the memory it may use. A process is
attributed in two steps:

1. the device it runs on names the candidates: the allocations of that unit;
2. its cgroup's pod UID picks among them. Where no candidate's UID is known (a DRA claim;
   the kubelet's device checkpoint unreadable), a unit held by one holder alone is still
   that holder's, since only its containers were given the device; a unit shared by
   several such holders is not guessed at.

A process outside every pod (the MPS server, a host process), in a pod that holds no part
of the device, or not decidable, counts under the device's unattributed row: one per device
at most, so cardinality is bounded by the allocations and devices, never by processes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from kubegpu.config.names import parse_quantity
from kubegpu.devices import Health, Inventory, ProcessTable, Vendor
from kubegpu.metrics import UNATTRIBUTED, DeviceHealthRow, UsageRow
from kubegpu.resources import ResourceSpec, SharingKind, Unit
from kubegpu.usage.cgroup import PodCgroup
from kubegpu.usage.kubelet import ContainerClaimDevice, ContainerDevices, PodUids

MIB = 1024 * 1024


@dataclass(frozen=True)
class Holder:
    """Who was given a device: a container, or a DRA claim whose users are not known."""

    namespace: str
    pod: str = ""
    container: str = ""
    #: The DRA claim's name (in `namespace`); empty for device plugin resources.
    claim: str = ""
    #: The pod's UID where the kubelet's records give it; empty when not known.
    pod_uid: str = ""


@dataclass(frozen=True)
class Allocation:
    holder: Holder
    unit: Unit
    #: Device memory the holder may use on the unit; None when not known.
    limit_bytes: int | None


@dataclass(frozen=True)
class ClaimDevices:
    """A prepared DRA claim (from the driver's checkpoint): its devices by published name."""

    namespace: str
    name: str
    devices: tuple[str, ...]
    #: A claim sized in memory: the device memory it consumed, by device name, which its
    #: limits hold it to (the checkpoint records them); other claims' limits are the unit's.
    limit_bytes: Mapping[str, int] = field(default_factory=dict)
    #: The UIDs of the pods the claim is reserved for, as recorded at its prepare.
    pods: tuple[str, ...] = ()

    @property
    def pod_uid(self) -> str:
        """Its one pod's UID; empty when it is shared by several pods (which of them a
        container is in cannot be said from the claim) or not known."""
        return self.pods[0] if len(self.pods) == 1 else ""


def memory_limit(unit: Unit, spec: ResourceSpec) -> int:
    """The device memory one allocation of `unit` under `spec` may use, in bytes.

    A whole GPU or MIG slice: all of its memory. An MPS replica: the pinned-memory limit the
    MPS control daemon sets for each client (`sharing.mps` `memoryLimit`, else an equal share
    of the GPU, as NVIDIA's plugin sets it; `kubegpu.mps`). A time-sliced replica: the whole
    device, time-slicing does not partition memory. A DRA claim sized in memory is held to
    what it consumed instead (`ClaimDevices.limit_bytes`).
    """
    if unit.mig is not None:
        return unit.mig.memory_mib * MIB
    if spec.sharing is SharingKind.MPS:
        entry = spec.shared_by
        if entry is not None and entry.memory_limit:
            return (parse_quantity(entry.memory_limit) // MIB) * MIB
        return max(1, unit.gpu.memory_mib // max(1, spec.replicas)) * MIB
    return unit.gpu.memory_mib * MIB


def plugin_allocations(
    held: Iterable[ContainerDevices], specs: Iterable[ResourceSpec], uids: PodUids
) -> tuple[Allocation, ...]:
    """The allocations of kubegpu's device plugin resources among `held` (other plugins'
    resources are left out); pod UIDs from the kubelet's checkpoint where it has them."""
    by_name = {str(s.name): s for s in specs}
    found: dict[tuple[Holder, str], Allocation] = {}
    for entry in held:
        spec = by_name.get(entry.resource)
        if spec is None:
            continue
        uid = uids.get((entry.container, entry.resource, frozenset(entry.device_ids)), "")
        holder = Holder(entry.namespace, entry.pod, entry.container, pod_uid=uid)
        for device_id in entry.device_ids:
            device = spec.by_id.get(device_id)
            if device is not None:
                unit = device.unit
                found.setdefault(
                    (holder, unit.uuid), Allocation(holder, unit, memory_limit(unit, spec))
                )
    return tuple(found.values())


def dra_allocations(
    claims: Iterable[ClaimDevices],
    used_by: Iterable[ContainerClaimDevice],
    devices: Mapping[str, tuple[Unit, ResourceSpec]],
    *,
    driver: str,
    pool: str = "",
) -> tuple[Allocation, ...]:
    """The allocations of the driver's prepared claims: to the containers the kubelet says
    use each claim device, else to the claim itself (its pod not known from the claim)."""
    users: dict[tuple[str, str, str], list[ContainerClaimDevice]] = {}
    for use in used_by:
        if use.driver == driver and (not pool or use.pool == pool):
            users.setdefault((use.namespace, use.claim, use.device), []).append(use)
    found: dict[tuple[Holder, str], Allocation] = {}

    def add(holder: Holder, device: str, sized: int | None = None) -> None:
        known = devices.get(device)
        if known is not None:
            unit, spec = known
            limit = memory_limit(unit, spec) if sized is None else sized
            found.setdefault((holder, unit.uuid), Allocation(holder, unit, limit))

    for claim in claims:
        for device in claim.devices:
            sized = claim.limit_bytes.get(device)
            containers = users.pop((claim.namespace, claim.name, device), [])
            uid = claim.pod_uid
            for use in containers:
                holder = Holder(use.namespace, use.pod, use.container, claim.name, uid)
                add(holder, device, sized)
            if not containers:
                add(Holder(claim.namespace, claim=claim.name, pod_uid=uid), device, sized)
    # Claims the kubelet reports that the checkpoint did not (it could not be read).
    for uses in users.values():
        for use in uses:
            add(Holder(use.namespace, use.pod, use.container, use.claim), use.device)
    return tuple(found.values())


def attribute(
    owner: PodCgroup | None, candidates: Sequence[Allocation]
) -> tuple[Holder, int | None] | None:
    """The holder (and its limit) a process in `owner`'s pod on a unit with these
    allocations is attributed to; None when it cannot be said."""
    if owner is None or not candidates:
        return None
    mine = [a for a in candidates if a.holder.pod_uid == owner.pod_uid]
    if mine:
        return _common(mine, pod_level=True)
    if any(a.holder.pod_uid for a in candidates):
        # Some holders' pods are known and this is none of them: only the unknown ones remain.
        candidates = [a for a in candidates if not a.holder.pod_uid]
    if not candidates:
        return None
    holders = {a.holder for a in candidates}
    if len(holders) == 1:
        return candidates[0].holder, candidates[0].limit_bytes
    # Several containers of one claim: the claim is known, the container is not.
    claims = {(h.namespace, h.claim) for h in holders}
    if len(claims) == 1 and candidates[0].holder.claim:
        return _common(candidates, pod_level=False)
    return None


def _common(allocations: Sequence[Allocation], *, pod_level: bool) -> tuple[Holder, int | None]:
    """One holder for several allocations of a unit: the one, or what they share (the pod
    with its container unknown, or the claim) with their limit when they agree."""
    holders = {a.holder for a in allocations}
    limits = {a.limit_bytes for a in allocations}
    limit = limits.pop() if len(limits) == 1 else None
    if len(holders) == 1:
        return allocations[0].holder, allocations[0].limit_bytes
    first = allocations[0].holder
    if pod_level:
        claim = first.claim if all(h.claim == first.claim for h in holders) else ""
        return Holder(first.namespace, first.pod, "", claim, first.pod_uid), limit
    return Holder(first.namespace, claim=first.claim), limit


@dataclass(frozen=True)
class _Device:
    """The dcgm-exporter labels of one GPU or MIG slice."""

    gpu: str
    uuid: str
    pci_bus_id: str
    device: str
    model: str
    gi_profile: str = ""
    gi_id: str = ""
    mig: bool = False

    def labels(self, hostname: str) -> tuple[str, str, str, str, str, str, str, str]:
        """Its `DeviceLabels` values, in their order, on the node `hostname`."""
        return (
            self.gpu,
            self.uuid,
            self.pci_bus_id,
            self.device,
            self.model,
            hostname,
            self.gi_profile,
            self.gi_id,
        )


def _devices(inventory: Inventory) -> dict[str, _Device]:
    """GPU or MIG UUID -> its labels (a slice carries its parent's, as dcgm-exporter's do)."""
    found: dict[str, _Device] = {}
    for gpu in inventory.gpus:
        node = f"nvidia{gpu.minor}" if gpu.vendor is Vendor.NVIDIA else ""
        base = _Device(str(gpu.index), gpu.uuid, gpu.pci_bus_id, node, gpu.product)
        found[gpu.uuid] = base
        for mig in gpu.mig_devices:
            found[mig.uuid] = _Device(
                base.gpu,
                gpu.uuid,
                gpu.pci_bus_id,
                node,
                gpu.product,
                mig.profile,
                str(mig.gi_id),
                mig=True,
            )
    return found


@dataclass
class _Sum:
    limit: int | None
    used: int = 0
    sm: int | None = None
    processes: int = 0


def usage_rows(
    table: ProcessTable,
    owners: Mapping[int, PodCgroup | None],
    allocations: Iterable[Allocation],
    inventory: Inventory,
    hostname: str = "",
) -> list[UsageRow]:
    """One row per (device, holder) with an allocation or a process, plus one unattributed
    row per device that has processes no holder is known for."""
    devices = _devices(inventory)
    by_unit: dict[str, list[Allocation]] = {}
    sums: dict[tuple[str, Holder | None], _Sum] = {}
    for a in allocations:
        by_unit.setdefault(a.unit.uuid, []).append(a)
        # Every allocation has a row, so its limit always has a use beside it.
        sm = None if a.unit.mig is not None else 0
        sums.setdefault((a.unit.uuid, a.holder), _Sum(a.limit_bytes, sm=sm))
    for process in table.processes:
        found = attribute(owners.get(process.pid), by_unit.get(process.uuid, ()))
        holder, limit = found if found is not None else (None, None)
        total = sums.setdefault((process.uuid, holder), _Sum(limit))
        total.used += process.used_memory_bytes or 0
        total.processes += 1
        if process.sm_percent is not None:
            total.sm = min(100, (total.sm or 0) + process.sm_percent)
    rows = []
    for (uuid, holder), total in sums.items():
        device = devices.get(uuid) or _Device("", uuid, "", "", "")
        who = holder or Holder("", UNATTRIBUTED)
        rows.append(
            UsageRow(
                *device.labels(hostname),
                namespace=who.namespace,
                pod=who.pod,
                container=who.container,
                claim=who.claim,
                used_bytes=total.used,
                limit_bytes=total.limit,
                sm_percent=total.sm,
                processes=total.processes,
            )
        )
    return rows


def device_health(
    inventory: Inventory, health: Mapping[str, Health], hostname: str = ""
) -> tuple[DeviceHealthRow, ...]:
    """Each GPU and MIG slice of `inventory` with the health `health` gives it (a slice is
    unhealthy with its GPU), under the labels its usage rows carry."""
    devices = _devices(inventory)
    rows = []
    for gpu in inventory.with_health(health).gpus:
        for uuid, state in ((gpu.uuid, gpu.health), *((m.uuid, m.health) for m in gpu.mig_devices)):
            rows.append(
                DeviceHealthRow(*devices[uuid].labels(hostname), healthy=state is Health.HEALTHY)
            )
    return tuple(rows)


def capped(rows: Sequence[UsageRow], max_rows: int) -> tuple[tuple[UsageRow, ...], int]:
    """At most `max_rows` rows, those holding the most memory kept, in display order (GPU,
    slice, namespace, pod, container); and how many were left out."""
    kept = list(rows)
    if len(kept) > max_rows:
        kept = sorted(kept, key=lambda r: (-r.used_bytes, r.labels()))[:max_rows]
    kept.sort(key=_display_order)
    return tuple(kept), len(rows) - len(kept)


def _display_order(row: UsageRow) -> tuple[object, ...]:
    index = int(row.gpu) if row.gpu.isdigit() else 1 << 30
    gi = int(row.gi_id) if row.gi_id.isdigit() else -1
    # The unattributed row of a device after its holders'.
    return (index, row.uuid, gi, row.pod == UNATTRIBUTED and not row.namespace, row.labels())


__all__ = [
    "Allocation",
    "ClaimDevices",
    "Holder",
    "attribute",
    "capped",
    "device_health",
    "dra_allocations",
    "memory_limit",
    "plugin_allocations",
    "usage_rows",
]
