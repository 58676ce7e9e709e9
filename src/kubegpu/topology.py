"""`GetPreferredAllocation`: which of the available devices a container should get.

Whole GPUs are chosen to maximise how well they talk to each other: NVLink first (more
lanes better), then PCIe distance, then a shared NUMA node. Small candidate sets are
searched exhaustively (8 GPUs choose 4 is 70 sets); large ones greedily. Replicas of
shared GPUs follow `sharedDevicesAllocationPolicy`: `distributed` spreads a request over
the least-used GPUs, `packed` fills one GPU before the next.

AMD GPUs are weighed as ROCm's best-effort allocator weighs them (see `amd_pair_weight`), so
`amd.com/gpu` gets the devices ROCm's plugin would pick: partitions of one GPU together, on
the GPU with the fewest free partitions (so whole GPUs stay whole), xGMI peers before PCIe.

The answer is a hint to the kubelet, but it must be a valid one: only IDs it offered,
every `must_include` ID, exactly `allocation_size` of them.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

from kubegpu.config import AllocationPolicy
from kubegpu.devices import DeviceID, Gpu, Health, LinkKind, Vendor
from kubegpu.errors import AllocationError
from kubegpu.resources import AdvertisedDevice, ResourceSpec, SharingKind, Unit

#: Above this many candidate sets the search turns greedy (keeps p99 well under 1 ms).
EXHAUSTIVE_LIMIT = 2000

_LINK_SCORE = {
    LinkKind.SINGLE_SWITCH: 50,
    LinkKind.MULTI_SWITCH: 40,
    LinkKind.HOST_BRIDGE: 30,
    LinkKind.SAME_NUMA: 20,
    LinkKind.CROSS_NUMA: 0,
}


def preferred_allocation(
    spec: ResourceSpec,
    available: Sequence[str],
    must_include: Sequence[str],
    size: int,
    policy: AllocationPolicy = AllocationPolicy.DISTRIBUTED,
) -> list[DeviceID]:
    """The preferred `size` IDs out of `available` ∪ `must_include`."""
    pool_ids = list(dict.fromkeys([*must_include, *available]))
    unknown = [i for i in pool_ids if i not in spec.by_id]
    if unknown:
        raise AllocationError(
            f"{spec.name}: unknown device ID(s) {', '.join(map(repr, unknown[:5]))} in the "
            f"preferred-allocation request"
        )
    if size <= 0:
        raise AllocationError(f"{spec.name}: allocation_size must be at least 1, got {size}")
    required = list(dict.fromkeys(must_include))
    if len(required) > size:
        raise AllocationError(
            f"{spec.name}: {len(required)} must-include devices exceed allocation_size {size}"
        )
    if size > len(pool_ids):
        raise AllocationError(
            f"{spec.name}: allocation_size {size} exceeds the {len(pool_ids)} devices offered"
        )
    chosen = [spec.by_id[i] for i in required]
    # Healthy devices first: the kubelet offers only healthy ones, but be safe.
    pool = sorted(
        (spec.by_id[i] for i in pool_ids if i not in required),
        key=lambda d: (d.health is not Health.HEALTHY, _order(d)),
    )
    need = size - len(chosen)
    if need:
        if spec.sharing is SharingKind.NONE and spec.vendor is Vendor.AMD:
            chosen += _best_amd(chosen, pool, need)
        elif spec.sharing is SharingKind.NONE:
            chosen += _best_units(chosen, pool, need)
        else:
            chosen += _replicas(spec, chosen, pool, need, policy)
    return [d.id for d in chosen]


def _order(d: AdvertisedDevice) -> tuple[int, int, int, int]:
    mig = d.unit.mig
    return (
        d.unit.gpu.index,
        mig.gi_id if mig else -1,
        mig.ci_id if mig else -1,
        d.replica if d.replica is not None else -1,
    )


def pair_score(a: Unit, b: Unit) -> int:
    """How well two units communicate; higher is better."""
    if a.gpu.uuid == b.gpu.uuid:
        return 200  # two MIG slices of one GPU share its memory system
    link = a.gpu.link_to(b.gpu.uuid)
    numa = 15 if a.gpu.numa_node is not None and a.gpu.numa_node == b.gpu.numa_node else 0
    if link is None:
        return numa
    if link.kind is LinkKind.NVLINK:
        return 100 + 10 * link.count + numa
    return _LINK_SCORE[link.kind] + numa


def _set_score(units: Sequence[Unit]) -> int:
    return sum(pair_score(a, b) for a, b in itertools.combinations(units, 2))


def _best_units(
    chosen: list[AdvertisedDevice], pool: list[AdvertisedDevice], need: int
) -> list[AdvertisedDevice]:
    if math.comb(len(pool), need) <= EXHAUSTIVE_LIMIT:
        fixed = [d.unit for d in chosen]
        best: tuple[AdvertisedDevice, ...] = ()
        best_score = -1
        # combinations() runs in pool order, so ties keep the lowest indices.
        for combo in itertools.combinations(pool, need):
            score = _set_score(fixed + [d.unit for d in combo])
            if score > best_score:
                best, best_score = combo, score
        return list(best)
    picked: list[AdvertisedDevice] = []
    rest = list(pool)
    for _ in range(need):
        current = [d.unit for d in chosen + picked]
        if not current:
            # Seed with the device whose neighbourhood is strongest.
            nxt = max(rest, key=lambda d: sum(pair_score(d.unit, o.unit) for o in rest))
        else:
            nxt = max(rest, key=lambda d: sum(pair_score(d.unit, u) for u in current))
        picked.append(nxt)
        rest.remove(nxt)
    return picked


# ROCm's best-effort weights (lower is closer); a pair's weight is one term of each kind.
_AMD_SAME_GPU, _AMD_OTHER_GPU = 10, 20
_AMD_XGMI, _AMD_PCIE, _AMD_OTHER_LINK = 10, 40, 50
_AMD_SAME_NUMA, _AMD_OTHER_NUMA = 10, 20
#: KFD io_link types.
_IOLINK_XGMI, _IOLINK_PCIE = 11, 2


def amd_pair_weight(a: Gpu, b: Gpu) -> int:
    """How far apart two AMD devices (GPUs or partitions) are; lower is better.

    Same physical GPU, the KFD link type between them (xGMI, PCIe, other) and the NUMA
    node each add a term, with ROCm's values. Where KFD lists no link ROCm's allocator
    counts nothing for the pair; we count an "other" link instead, so an unlisted pair is
    never preferred over a listed one (real KFD trees list every GPU pair).
    """
    same_gpu = a.amd is not None and b.amd is not None and a.amd.pci_group == b.amd.pci_group
    link = a.link_to(b.uuid)
    kind = link.iolink_type if link is not None else None
    return (
        (_AMD_SAME_GPU if same_gpu else _AMD_OTHER_GPU)
        + {_IOLINK_XGMI: _AMD_XGMI, _IOLINK_PCIE: _AMD_PCIE}.get(kind or -1, _AMD_OTHER_LINK)
        + (_AMD_SAME_NUMA if a.numa_node == b.numa_node else _AMD_OTHER_NUMA)
    )


def _best_amd(
    chosen: list[AdvertisedDevice], pool: list[AdvertisedDevice], need: int
) -> list[AdvertisedDevice]:
    """The `need` devices that, with `chosen`, have the lowest total ROCm weight.

    Devices are tried GPU by GPU, the GPU with the fewest free devices first: among equal
    totals that keeps whole GPUs free for bigger requests, the tie-break ROCm uses. Small
    searches are exhaustive; larger ones start once from each GPU (take its free devices,
    then add the closest device until full) and keep the lowest total.
    """
    groups: dict[str, list[AdvertisedDevice]] = {}
    for d in pool:
        key = d.unit.gpu.amd.pci_group if d.unit.gpu.amd is not None else d.unit.uuid
        groups.setdefault(key, []).append(d)
    ordered = sorted(groups.values(), key=lambda g: (len(g), _order(g[0])))
    pool = [d for group in ordered for d in group]
    every = [d.unit.gpu for d in chosen + pool]
    weight = {
        (a.uuid, b.uuid): amd_pair_weight(a, b) for a in every for b in every if a.uuid != b.uuid
    }
    fixed = [d.unit.gpu.uuid for d in chosen]

    def total(devices: Sequence[AdvertisedDevice]) -> int:
        uuids = fixed + [d.unit.gpu.uuid for d in devices]
        return sum(weight[a, b] for a, b in itertools.combinations(uuids, 2))

    best: list[AdvertisedDevice] = []
    best_total: float = math.inf
    if math.comb(len(pool), need) <= EXHAUSTIVE_LIMIT:
        for combo in itertools.combinations(pool, need):  # first of equal totals wins
            score = total(combo)
            if score < best_total:
                best, best_total = list(combo), score
        return best
    for group in ordered:
        picked = group[:need]
        taken = {d.id for d in picked}
        rest = [d for d in pool if d.id not in taken]
        members = fixed + [d.unit.gpu.uuid for d in picked]
        cost = {d.id: sum(weight[d.unit.gpu.uuid, m] for m in members) for d in rest}
        while len(picked) < need:
            nxt = min(rest, key=lambda d: cost[d.id])  # min() keeps the first of ties
            rest.remove(nxt)
            picked.append(nxt)
            for d in rest:
                cost[d.id] += weight[d.unit.gpu.uuid, nxt.unit.gpu.uuid]
        score = total(picked)
        if score < best_total:
            best, best_total = picked, score
    return best


def _replicas(
    spec: ResourceSpec,
    chosen: list[AdvertisedDevice],
    pool: list[AdvertisedDevice],
    need: int,
    policy: AllocationPolicy,
) -> list[AdvertisedDevice]:
    free: dict[str, list[AdvertisedDevice]] = {}
    for d in pool:
        free.setdefault(d.unit.uuid, []).append(d)
    in_request: dict[str, int] = {}
    for d in chosen:
        in_request[d.unit.uuid] = in_request.get(d.unit.uuid, 0) + 1
    index = {u: lst[0].unit.gpu.index for u, lst in free.items()}

    picked: list[AdvertisedDevice] = []
    for _ in range(need):
        candidates = [u for u, lst in free.items() if lst]

        def used(uuid: str) -> int:
            # Replicas of this unit already taken by other containers, plus by this request.
            return spec.replicas - len(free[uuid]) + in_request.get(uuid, 0)

        if policy is AllocationPolicy.PACKED:
            target = min(candidates, key=lambda u: (-used(u), index[u]))
        else:
            target = min(candidates, key=lambda u: (in_request.get(u, 0), used(u), index[u]))
        picked.append(free[target].pop(0))
        in_request[target] = in_request.get(target, 0) + 1
    return picked
