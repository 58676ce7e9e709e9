"""`amd.com/gpu`: the devices ROCm's best-effort allocator would pick.

Partitions of one GPU go together, on the GPU with the fewest free partitions (so whole
GPUs stay whole), and xGMI peers before PCIe ones: ROCm's own weights, so that switching
from ROCm's plugin changes no pod's devices (docs/migrating-from-rocm.md).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

from kubegpu.devices import Gpu
from kubegpu.placement.objective import PlacedDevice, device_order

#: Candidate sets up to which the search is exhaustive; beyond, greedy from each GPU.
EXHAUSTIVE_LIMIT = 2000
# ROCm's best-effort weights (lower is closer); a pair's weight is one term of each kind.
_SAME_GPU, _OTHER_GPU = 10, 20
_XGMI, _PCIE, _OTHER_LINK = 10, 40, 50
_SAME_NUMA, _OTHER_NUMA = 10, 20
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
        (_SAME_GPU if same_gpu else _OTHER_GPU)
        + {_IOLINK_XGMI: _XGMI, _IOLINK_PCIE: _PCIE}.get(kind or -1, _OTHER_LINK)
        + (_SAME_NUMA if a.numa_node == b.numa_node else _OTHER_NUMA)
    )


def best_amd(
    chosen: Sequence[PlacedDevice], pool: Sequence[PlacedDevice], need: int
) -> list[PlacedDevice]:
    """The `need` devices that, with `chosen`, have the lowest total ROCm weight.

    Devices are tried GPU by GPU, the GPU with the fewest free devices first: among equal
    totals that keeps whole GPUs free for bigger requests, the tie-break ROCm uses. Small
    searches are exhaustive; larger ones start once from each GPU (take its free devices,
    then add the closest device until full) and keep the lowest total.
    """
    groups: dict[str, list[PlacedDevice]] = {}
    for d in pool:
        amd = d.unit.gpu.amd
        groups.setdefault(amd.pci_group if amd is not None else d.unit.uuid, []).append(d)
    ordered = sorted(groups.values(), key=lambda g: (len(g), device_order(g[0])))
    pool = [d for group in ordered for d in group]
    every = [d.unit.gpu for d in [*chosen, *pool]]
    weight = {
        (a.uuid, b.uuid): amd_pair_weight(a, b) for a in every for b in every if a.uuid != b.uuid
    }
    fixed = [d.unit.gpu.uuid for d in chosen]

    def total(devices: Sequence[PlacedDevice]) -> int:
        uuids = fixed + [d.unit.gpu.uuid for d in devices]
        return sum(weight[a, b] for a, b in itertools.combinations(uuids, 2))

    best: list[PlacedDevice] = []
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
