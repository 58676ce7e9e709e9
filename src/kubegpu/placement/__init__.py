"""`GetPreferredAllocation`: which of the offered devices a container should get.

Whole GPUs and MIG slices maximise one objective (`objective`, docs/placement.md): summed
bandwidth-proportional pair weights, NUMA as the tie-break. Exact by branch and bound up to
`EXACT_LIMIT` candidates, bounded beyond (`search`). Replicas of shared GPUs follow
`sharedDevicesAllocationPolicy` (`replicas`); AMD devices ROCm's weights (`amd`).

Everything a request reads of the devices (pair weights, ranks, the replica index) is a
`Fabric`, built once when the resource's spec is built (`kubegpu.resources.ResourceSpec`),
so no request pays for it and nothing is cached beside the spec.

The answer is a hint to the kubelet, but a valid one: only IDs it offered, every
`must_include` ID, exactly `allocation_size` of them.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Protocol

from kubegpu.config import AllocationPolicy
from kubegpu.devices import DeviceID, Health
from kubegpu.errors import AllocationError
from kubegpu.placement.amd import amd_pair_weight, best_amd
from kubegpu.placement.objective import (
    DEFAULT_NVLINK_GBPS,
    NVLINK_GBPS,
    PCIE_WEIGHT,
    PlacedDevice,
    device_order,
    link_weight,
    numa_term,
    objective,
)
from kubegpu.placement.replicas import ReplicaIndex, pick_replicas
from kubegpu.placement.search import EXACT_LIMIT, Placement, best_subset, bounded

__all__ = [
    "DEFAULT_NVLINK_GBPS",
    "EXACT_LIMIT",
    "NVLINK_GBPS",
    "PCIE_WEIGHT",
    "Fabric",
    "Placement",
    "amd_pair_weight",
    "best_subset",
    "bounded",
    "link_weight",
    "numa_term",
    "objective",
    "preferred_allocation",
]

log = logging.getLogger(__name__)

Matrix = tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class Fabric:
    """What placement knows of one resource's devices, built once with its spec."""

    #: The resource name, for error messages.
    name: str
    by_id: Mapping[str, PlacedDevice]
    #: Device ID -> its unit's row in the matrices (units in device order, one per UUID).
    row: Mapping[str, int]
    #: `link_weight` and `numa_term` of every pair of units (the diagonal: a unit with
    #: itself, which is what a replica adds to the others of its GPU).
    link: Matrix
    numa: Matrix
    #: Per row, its class of twins: units that weigh the same to every other unit (the
    #: GPUs of one NVSwitch board on one NUMA node, the slices of one GPU); whole units only.
    twins: tuple[int, ...]
    #: Device ID -> its place in (healthy first, `device_order`) order; whole units only.
    rank: Mapping[str, int]
    #: The replica IDs per unit when the resource is shared, else None.
    replica_index: ReplicaIndex | None
    #: Replicas per unit (1 when not shared).
    replicas: int
    #: AMD devices: weighed as ROCm's allocator weighs them.
    amd: bool

    @classmethod
    def build(
        cls,
        name: str,
        by_id: Mapping[str, PlacedDevice],
        *,
        replicas: int | None = None,
        amd: bool = False,
    ) -> Fabric:
        """The fabric of `by_id`'s devices; `replicas` per unit when they are shared."""
        units = {d.unit.uuid: d.unit for d in by_id.values()}
        rows = list(units.values())
        index = {uuid: k for k, uuid in enumerate(units)}
        n = len(rows)
        link = [[0] * n for _ in range(n)]
        numa = [[0] * n for _ in range(n)]
        for i, a in enumerate(rows):
            for j in range(i, n):
                b = rows[j]
                link[i][j] = link[j][i] = link_weight(a, b)
                numa[i][j] = numa[j][i] = numa_term(a, b)
        lm = tuple(map(tuple, link))
        nm = tuple(map(tuple, numa))
        row = {i: index[d.unit.uuid] for i, d in by_id.items()}
        shared = replicas is not None
        return cls(
            name=name,
            by_id=by_id,
            row=row,
            link=lm,
            numa=nm,
            twins=() if shared else _twins(lm, nm),
            rank={} if shared else _rank(by_id.values()),
            replica_index=_replica_index(by_id.values(), row, n) if shared else None,
            replicas=replicas or 1,
            amd=amd,
        )


def _rank(devices: Iterable[PlacedDevice]) -> dict[str, int]:
    """Each device's place in (healthy first, `device_order`) order: one integer sort key."""
    ordered = sorted(devices, key=lambda d: (d.health is not Health.HEALTHY, device_order(d)))
    return {d.id: k for k, d in enumerate(ordered)}


def _replica_index(devices: Iterable[PlacedDevice], row: Mapping[str, int], n: int) -> ReplicaIndex:
    by_row: list[list[PlacedDevice]] = [[] for _ in range(n)]
    for d in devices:
        by_row[row[d.id]].append(d)
    for replicas in by_row:
        replicas.sort(key=lambda d: d.replica if d.replica is not None else -1)
    first = [replicas[0] for replicas in by_row]
    rank = [0] * n
    for place, r in enumerate(sorted(range(n), key=lambda r: device_order(first[r])[:3])):
        rank[r] = place
    return ReplicaIndex(
        ids=tuple(tuple(d.id for d in replicas) for replicas in by_row),
        id_sets=tuple(frozenset(d.id for d in replicas) for replicas in by_row),
        sick=tuple(int(d.health is not Health.HEALTHY) for d in first),
        rank=tuple(rank),
    )


def _twins(link: Matrix, numa: Matrix) -> tuple[int, ...]:
    """Per row, its class of twins. Being twins is transitive (equal weights to everyone
    else, so equal weights inside too): each row is compared with one row per class."""
    first: list[int] = []
    classes: list[int] = []
    for i in range(len(link)):
        for c, j in enumerate(first):  # j < i
            if all(
                m[i][:j] == m[j][:j]
                and m[i][j + 1 : i] == m[j][j + 1 : i]
                and m[i][i + 1 :] == m[j][i + 1 :]
                for m in (link, numa)
            ):
                classes.append(c)
                break
        else:
            classes.append(len(first))
            first.append(i)
    return tuple(classes)


class Placeable(Protocol):
    """A resource spec (`kubegpu.resources.ResourceSpec`): its devices' fabric."""

    @property
    def placement(self) -> Fabric: ...


def preferred_allocation(
    spec: Placeable,
    available: Iterable[str],
    must_include: Iterable[str],
    size: int,
    policy: AllocationPolicy = AllocationPolicy.DISTRIBUTED,
) -> list[DeviceID]:
    """The preferred `size` IDs out of `available` ∪ `must_include`, must-include first."""
    fabric = spec.placement
    name, by_id = fabric.name, fabric.by_id
    required = list(dict.fromkeys(must_include))
    pool: AbstractSet[str]
    if not required and isinstance(available, set | frozenset):
        pool = available  # the server's own set of offered IDs: hashed once
    else:
        pool = dict.fromkeys(itertools.chain(required, available)).keys()
    if not pool <= by_id.keys():
        unknown = [i for i in pool if i not in by_id]
        if isinstance(pool, set | frozenset):
            unknown.sort()  # a set has no order of its own; the message must not vary
        raise AllocationError(
            f"{name}: unknown device ID(s) {', '.join(map(repr, unknown[:5]))} in the "
            f"preferred-allocation request"
        )
    if size <= 0:
        raise AllocationError(f"{name}: allocation_size must be at least 1, got {size}")
    if len(required) > size:
        raise AllocationError(
            f"{name}: {len(required)} must-include devices exceed allocation_size {size}"
        )
    if size > len(pool):
        raise AllocationError(
            f"{name}: allocation_size {size} exceeds the {len(pool)} devices offered"
        )
    need = size - len(required)
    chosen = [by_id[i].id for i in required]
    if not need:
        return chosen
    taken = set(required)
    if fabric.replica_index is not None:
        free = pool if isinstance(pool, set | frozenset) else set(pool)
        rows = [fabric.row[i] for i in required]
        index, link = fabric.replica_index, fabric.link
        return chosen + pick_replicas(index, link, fabric.replicas, rows, taken, free, need, policy)
    offered = [by_id[i] for i in sorted(pool - taken, key=fabric.rank.__getitem__)]
    if fabric.amd:
        picks = best_amd([by_id[i] for i in required], offered, need)
    else:
        picks = _best_units(fabric, required, offered, need)
    return chosen + [d.id for d in picks]


def _best_units(
    fabric: Fabric, required: Sequence[str], offered: Sequence[PlacedDevice], need: int
) -> list[PlacedDevice]:
    """Whole GPUs or MIG slices: the best under `objective` (exact up to `EXACT_LIMIT`)."""
    # Unhealthy devices only when the healthy ones are too few (the kubelet offers healthy).
    healthy = [d for d in offered if d.health is Health.HEALTHY]
    candidates = healthy if len(healthy) >= need else list(offered)
    rows = [fabric.row[d.id] for d in candidates]
    fixed = [fabric.row[i] for i in required]
    k = len(fixed) + need
    # The objective in one integer: link x (pairs + 1) + NUMA. A set of k units has at most
    # k(k-1)/2 same-NUMA pairs, so all of them weigh less than one unit of link weight.
    scale = k * (k - 1) // 2 + 1
    link, numa = fabric.link, fabric.numa
    weights = []
    for i, a in enumerate(rows):
        la, na = link[a], numa[a]
        row = [la[b] * scale + na[b] for b in rows]
        row[i] = 0
        weights.append(row)
    base = [sum(link[a][f] * scale + numa[a][f] for f in fixed) for a in rows]
    fixed_score = sum(link[a][b] * scale + numa[a][b] for a, b in itertools.combinations(fixed, 2))
    twins = [fabric.twins[a] for a in rows]
    found = bounded(weights, base, need, fixed_score=fixed_score, twins=twins)
    if not found.optimal:
        log.debug(
            "%s: placement of %d from %d within %.1f%% of optimal (search budget reached)",
            fabric.name,
            need,
            len(candidates),
            100 * found.gap,
        )
    return [candidates[i] for i in found.picked]
