"""Admitting a container's device request, as the kubelet's `manager.go` and `topology_hints.go`.

`check` is the admission-time validation (devices to include, the node-resources fit);
`devices_to_allocate` picks the devices in the kubelet's order (reusable first, then
NUMA-aligned, the plugin's `GetPreferredAllocation` hint, the rest); `allocate` and
`pre_start` are the two calls to the plugin that follow, with the kubelet's error texts.
The topology manager is reduced to `narrowest_hint` unless the caller passes the merged hint.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass

import grpc

from kubegpu.api import pb
from kubegpu.kubelet.endpoint import Endpoint, Recorder, go_error
from kubegpu.kubelet.model import AdmissionError, Allocation, ContainerStartError, DeviceState

log = logging.getLogger("kubegpu.kubelet")

UNEXPECTED = "UnexpectedAdmissionError"

#: Asks the plugin for its preferred devices: (available, must include, size) -> its answer,
#: or None when the plugin does not offer GetPreferredAllocation.
Preferred = Callable[[list[str], list[str], int], Awaitable[tuple[str, ...] | None]]


@dataclass(frozen=True)
class Request:
    """One container's request for `count` devices of one resource."""

    resource: str
    count: int
    pod: str
    container: str
    #: Devices that must be part of the answer (de-duplicated, in the caller's order).
    must_include: tuple[str, ...] = ()
    #: The topology manager's merged hint; None: the narrowest NUMA node set that fits.
    numa_affinity: frozenset[int] | None = None

    def unexpected(self, why: str) -> AdmissionError:
        """The `UnexpectedAdmissionError` the kubelet writes when the device manager fails."""
        return AdmissionError(
            UNEXPECTED,
            f"Allocate failed due to {why}, which is unexpected",
            resource=self.resource,
            pod=self.pod,
            container=self.container,
        )


def check(
    req: Request,
    devices: dict[str, DeviceState],
    in_use: set[str],
    held_by_pod: set[str],
    allocatable: int,
) -> None:
    """Refuse what the kubelet refuses before choosing devices (raises `AdmissionError`)."""
    for dev in req.must_include:
        if dev not in devices:
            raise req.unexpected(f"device {dev} to include is not a device of {req.resource}")
        if dev in in_use and dev not in held_by_pod:
            raise req.unexpected(f"device {dev} to include is in use by another pod")
    if len(req.must_include) > req.count:
        raise req.unexpected(
            f"{len(req.must_include)} devices to include but only {req.count} requested"
        )

    # The node-resources fit check the kubelet repeats at admission.
    requested = req.count - len(held_by_pod.intersection(req.must_include))
    used = len(in_use)
    if requested > allocatable - used:
        raise AdmissionError(
            f"OutOf{req.resource}",
            f"Pod was rejected: Insufficient {req.resource}: Node didn't have enough resource: "
            f"{req.resource}, requested: {requested}, used: {used}, capacity: {allocatable}",
            resource=req.resource,
            pod=req.pod,
            container=req.container,
        )


async def devices_to_allocate(
    req: Request,
    devices: dict[str, DeviceState],
    in_use: set[str],
    *,
    topology_manager: bool,
    preferred: Preferred,
) -> tuple[list[str], tuple[str, ...] | None]:
    """The devices to give, and what GetPreferredAllocation answered (None: not asked).

    Reusable (must-include) devices first, then aligned, the plugin's hint, the rest.
    """
    allocated: list[str] = list(req.must_include)
    needed = req.count - len(allocated)
    hint: tuple[str, ...] | None = None
    if needed == 0:
        return allocated, hint
    available = sorted(
        d for d, s in devices.items() if s.healthy and d not in in_use and d not in allocated
    )
    if len(available) < needed:
        raise req.unexpected(
            f"requested number of devices unavailable for {req.resource}. "
            f"Requested: {needed}, Available: {len(available)}"
        )
    aligned, unaligned, no_affinity = filter_by_affinity(
        devices, available, allocated, req.count, req.numa_affinity, topology_manager
    )

    def take(candidates: Sequence[str], allowed: Collection[str]) -> None:
        nonlocal needed
        for dev in candidates:
            if needed == 0:
                return
            if dev in allowed and dev not in allocated:
                allocated.append(dev)
                needed -= 1

    if needed < len(aligned):
        # All of it fits in the aligned set: let the plugin choose within it.
        hint = await preferred(union(aligned, allocated), allocated, req.count)
        take(hint or (), set(aligned))
        take(aligned, aligned)
    else:
        # Honour alignment first, then let the plugin choose the remainder.
        take(aligned, aligned)
        if needed > 0:
            ordered = union(aligned, unaligned, no_affinity, allocated)
            hint = await preferred(ordered, allocated, req.count)
            take(hint or (), set(available))
            take(unaligned, unaligned)
            take(no_affinity, no_affinity)
    if needed > 0:
        raise req.unexpected(
            f"unexpectedly allocated less resources than required. "
            f"Requested: {req.count}, Got: {req.count - needed}"
        )
    return allocated, hint


def filter_by_affinity(
    devices: dict[str, DeviceState],
    available: list[str],
    must_include: list[str],
    count: int,
    numa_affinity: Collection[int] | None,
    topology_manager: bool,
) -> tuple[list[str], list[str], list[str]]:
    """Split available devices into NUMA-aligned, unaligned and without topology."""
    if not topology_manager or not any(d.numa_nodes for d in devices.values()):
        return [], [], list(available)
    mask = (
        set(numa_affinity)
        if numa_affinity is not None
        else narrowest_hint(devices, available, must_include, count)
    )
    aligned = [d for d in available if mask.intersection(devices[d].numa_nodes)]
    unaligned = [d for d in available if devices[d].numa_nodes and d not in aligned]
    no_affinity = [d for d in available if not devices[d].numa_nodes]
    return aligned, unaligned, no_affinity


def narrowest_hint(
    devices: dict[str, DeviceState], available: list[str], must_include: list[str], count: int
) -> set[int]:
    """The topology manager's preferred hint: fewest NUMA nodes holding enough devices.

    Masks are tried narrowest first, lowest node IDs first; they must cover the devices
    already chosen. When nothing fits, every node (no alignment possible).
    """
    nodes = sorted({n for d in devices.values() for n in d.numa_nodes})
    for size in range(1, len(nodes) + 1):
        for combo in itertools.combinations(nodes, size):
            mask = set(combo)
            if not all(
                mask.intersection(devices[d].numa_nodes) or not devices[d].numa_nodes
                for d in must_include
            ):
                continue
            fits = sum(
                1 for d in [*available, *must_include] if mask.intersection(devices[d].numa_nodes)
            )
            if fits >= count:
                return mask
    return set(nodes)


def union(*groups: Sequence[str]) -> list[str]:
    """The groups concatenated without repeats, first occurrence kept."""
    return list(dict.fromkeys(d for group in groups for d in group))


async def ask_preferred(
    ep: Endpoint | None,
    req: Request,
    available: list[str],
    must_include: list[str],
    size: int,
    record: Recorder,
) -> tuple[str, ...] | None:
    """GetPreferredAllocation when the plugin offers it; its answer is only a hint."""
    if ep is None or not ep.options.get_preferred_allocation_available:
        return None
    request = pb.PreferredAllocationRequest(
        container_requests=[
            pb.ContainerPreferredAllocationRequest(
                available_deviceIDs=available,
                must_include_deviceIDs=must_include,
                allocation_size=size,
            )
        ]
    )
    try:
        answer = await ep.client.preferred(request)
    except grpc.RpcError as exc:
        record(req.resource, ep.name, "GetPreferredAllocation", go_error(exc))
        raise AdmissionError(
            UNEXPECTED,
            f"Allocate failed due to device plugin GetPreferredAllocation rpc failed with "
            f"err: {go_error(exc)}, which is unexpected",
            resource=req.resource,
            pod=req.pod,
            container=req.container,
        ) from exc
    record(req.resource, ep.name, "GetPreferredAllocation", None)
    if not answer.container_responses:
        return ()
    return tuple(answer.container_responses[0].deviceIDs)


async def allocate(
    ep: Endpoint, req: Request, device_ids: list[str], record: Recorder
) -> pb.ContainerAllocateResponse:
    """Allocate on the plugin; its answer for the one container, or `AdmissionError`."""
    request = pb.AllocateRequest(
        container_requests=[pb.ContainerAllocateRequest(devices_ids=device_ids)]
    )
    log.info(
        "allocating %s devices %s for %s/%s through %s",
        req.resource,
        device_ids,
        req.pod,
        req.container,
        ep.name,
    )
    try:
        answer = await ep.client.allocate(request)
    except grpc.RpcError as exc:
        record(req.resource, ep.name, "Allocate", go_error(exc))
        raise req.unexpected(go_error(exc)) from exc
    record(req.resource, ep.name, "Allocate", None)
    if not answer.container_responses:
        raise req.unexpected(f"no containers return in allocation response {answer}")
    response = pb.ContainerAllocateResponse()
    response.CopyFrom(answer.container_responses[0])
    return response


async def pre_start(ep: Endpoint, allocation: Allocation, timeout: float, record: Recorder) -> None:
    """PreStartContainer when the plugin asked for it; `ContainerStartError` when it fails."""
    if not ep.options.pre_start_required:
        return
    prefix = "device plugin PreStartContainer rpc failed with err"
    if not ep.alive:
        raise ContainerStartError(f"{prefix}: endpoint {ep.name} has been stopped")
    request = pb.PreStartContainerRequest(devices_ids=allocation.device_ids)
    try:
        await ep.client.pre_start(request, timeout)
    except grpc.RpcError as exc:
        record(allocation.resource, ep.name, "PreStartContainer", go_error(exc))
        raise ContainerStartError(f"{prefix}: {go_error(exc)}") from exc
    record(allocation.resource, ep.name, "PreStartContainer", None)
