"""Replicas of shared GPUs (time-slicing, MPS) by `sharedDevicesAllocationPolicy`.

NVIDIA's meaning: `distributed` spreads a request over the least-used units (fewest of its
own replicas first, then fewest used), `packed` fills the most-used unit first. Among
equally used units the healthy ones go first, then the unit that talks best (summed link
weight) with those already in the request, then the lowest (GPU, GPU instance, compute
instance); each unit hands out its lowest free replica number.
"""

from __future__ import annotations

from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

from kubegpu.config import AllocationPolicy
from kubegpu.devices import DeviceID


@dataclass(frozen=True)
class ReplicaIndex:
    """A shared resource's replica IDs by unit, so that a request over thousands of IDs
    costs a few set operations per unit, not Python work per ID."""

    #: Per unit, its replica IDs by replica number (the order they are handed out in).
    ids: tuple[tuple[DeviceID, ...], ...]
    #: Per unit, the same IDs as a set (free replicas are counted by intersection).
    id_sets: tuple[frozenset[str], ...]
    #: Per unit, 1 when unhealthy: taken only after every healthy unit.
    sick: tuple[int, ...]
    #: Per unit, its place in (GPU index, GPU instance, compute instance) order.
    rank: tuple[int, ...]


def pick_replicas(
    index: ReplicaIndex,
    link: Sequence[Sequence[int]],
    replicas: int,
    chosen_rows: Sequence[int],
    taken: AbstractSet[str],
    pool: AbstractSet[str],
    need: int,
    policy: AllocationPolicy,
) -> list[DeviceID]:
    """`need` more replica IDs from `pool` by `policy`, joining the must-include replicas
    (`taken`, on units `chosen_rows`); `link` holds the units' pair weights."""
    rows = range(len(index.ids))
    in_request = [0] * len(rows)
    loss = [0] * len(rows)  # minus the gain: summed link weight with the request's units
    for r in chosen_rows:  # each must-include replica adds its pair weights
        in_request[r] += 1
        loss = [g - w for g, w in zip(loss, link[r], strict=True)]
    # Free: offered and not already in the request (`taken` lies inside `pool`).
    free = [len(ids & pool) - in_request[r] for r, ids in enumerate(index.id_sets)]
    used = [replicas - free[r] + in_request[r] for r in rows]
    packed = policy is AllocationPolicy.PACKED
    cursor = [0] * len(rows)  # where each unit's scan for its next free replica resumes
    picked: list[DeviceID] = []
    for _ in range(need):
        # The policy's key per unit, compared as tuples in one C-level min; a unit with no
        # free replica left leads with a value above any live one.
        if packed:
            lead = [-u if f > 0 else _GONE for u, f in zip(used, free, strict=True)]
            target = min(zip(lead, index.sick, loss, index.rank, rows, strict=True))[-1]
        else:
            lead = [q if f > 0 else _GONE for q, f in zip(in_request, free, strict=True)]
            target = min(zip(lead, used, index.sick, loss, index.rank, rows, strict=True))[-1]
        ids, j = index.ids[target], cursor[target]
        while ids[j] not in pool or ids[j] in taken:
            j += 1
        cursor[target] = j + 1
        picked.append(ids[j])
        # One fewer free and one more in the request: both count as used.
        free[target] -= 1
        used[target] += 2
        in_request[target] += 1
        if in_request[target] == 1:  # a unit joins: everyone's gain with it changes
            loss = [g - w for g, w in zip(loss, link[target], strict=True)]
    return picked


#: Above any live key's first field (replica counts and their negatives).
_GONE = 1 << 62
