"""The one objective GetPreferredAllocation maximises (docs/placement.md).

A set's score is the sum over its pairs of a bandwidth-proportional link weight, with the
number of same-NUMA pairs as a tie-break that never outweighs one unit of link weight.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Protocol

from kubegpu.devices import DeviceID, Gpu, Health, LinkKind, MigDevice

#: Per-link, per-direction NVLink bandwidth in GB/s by NVLink version (1: P100 ... 5: B200).
NVLINK_GBPS = {1: 20, 2: 25, 3: 25, 4: 25, 5: 50}
#: Per-link bandwidth when the version is unknown (NVLink 2 to 4 all carry 25 GB/s a link).
DEFAULT_NVLINK_GBPS = 25
#: Two units on one GPU (MIG slices, replicas) talk through its own memory: above any fabric.
SAME_GPU_GBPS = 2000
#: Pair weights are GB/s x 100, so that the PCIe levels below fit under one NVLink (2,000).
WEIGHT_PER_GBPS = 100
#: PCIe relations, closest first; the largest (50) is 1/40 of the slowest single NVLink.
PCIE_WEIGHT = {
    LinkKind.SINGLE_SWITCH: 50,
    LinkKind.MULTI_SWITCH: 40,
    LinkKind.HOST_BRIDGE: 30,
    LinkKind.SAME_NUMA: 20,
    LinkKind.CROSS_NUMA: 10,
}


class OnGpu(Protocol):
    """Anything placed on a GPU: a whole GPU or MIG slice (`kubegpu.resources.Unit`)."""

    @property
    def gpu(self) -> Gpu: ...


class PlacedUnit(OnGpu, Protocol):
    """What placement reads of a unit (`kubegpu.resources.Unit`, which builds on it)."""

    @property
    def uuid(self) -> str: ...
    @property
    def mig(self) -> MigDevice | None: ...
    @property
    def health(self) -> Health: ...


class PlacedDevice(Protocol):
    """What placement reads of an advertised device (`kubegpu.resources.AdvertisedDevice`)."""

    @property
    def id(self) -> DeviceID: ...
    @property
    def unit(self) -> PlacedUnit: ...
    @property
    def replica(self) -> int | None: ...
    @property
    def health(self) -> Health: ...


def device_order(d: PlacedDevice) -> tuple[int, int, int, int]:
    """NVIDIA's device order: GPU index, GPU instance, compute instance, replica."""
    mig = d.unit.mig
    return (
        d.unit.gpu.index,
        mig.gi_id if mig else -1,
        mig.ci_id if mig else -1,
        d.replica if d.replica is not None else -1,
    )


def link_weight(a: OnGpu, b: OnGpu) -> int:
    """The bandwidth term of the objective for one pair."""
    if a.gpu.uuid == b.gpu.uuid:
        return SAME_GPU_GBPS * WEIGHT_PER_GBPS
    link = a.gpu.link_to(b.gpu.uuid) or b.gpu.link_to(a.gpu.uuid)
    if link is None:
        return 0
    if link.kind is LinkKind.NVLINK:
        gbps = NVLINK_GBPS.get(link.nvlink_version, DEFAULT_NVLINK_GBPS)
        return link.count * gbps * WEIGHT_PER_GBPS
    return PCIE_WEIGHT[link.kind]


def numa_term(a: OnGpu, b: OnGpu) -> int:
    """1 when both sit on one known NUMA node: the tie-break between equal bandwidths."""
    na, nb = a.gpu.numa_node, b.gpu.numa_node
    return 1 if na is not None and na == nb else 0


def objective(units: Sequence[OnGpu]) -> tuple[int, int]:
    """(summed link weight, same-NUMA pairs) of a set, compared as a tuple."""
    link = numa = 0
    for a, b in itertools.combinations(units, 2):
        link += link_weight(a, b)
        numa += numa_term(a, b)
    return link, numa
