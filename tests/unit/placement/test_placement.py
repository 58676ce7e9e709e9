"""The placement objective and its exact optimum, checked against brute force.

Random small topologies (NVLink counts and versions, PCIe levels, NUMA nodes, MIG slices)
and random requests: kubegpu's pick must score exactly the best any subset scores under
`objective`, keep every must-include ID, and be the same on every call.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kubegpu.config import AllocationPolicy, parse_config
from kubegpu.devices import Inventory, Link, LinkKind
from kubegpu.devices.simulated import SimulatedBackend
from kubegpu.errors import AllocationError
from kubegpu.placement import (
    bounded,
    link_weight,
    numa_term,
    objective,
    preferred_allocation,
)
from kubegpu.resources import ResourceSpec, Unit, build_resources
from tests.builders import gpu, inventory
from tests.unit.placement.conftest import topologies


def whole_gpus(inv: Inventory) -> ResourceSpec:
    (spec,) = build_resources(inv, parse_config("version: v1"))
    return spec


def brute_force(fixed: list[Unit], pool: list[Unit], need: int) -> tuple[int, int]:
    return max(objective(fixed + list(combo)) for combo in itertools.combinations(pool, need))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(inv=topologies(), data=st.data())
def test_pick_scores_the_brute_force_optimum(inv: Inventory, data: st.DataObject) -> None:
    spec = whole_gpus(inv)
    ids = [d.id for d in spec.devices]
    available = data.draw(st.lists(st.sampled_from(ids), min_size=1, unique=True))
    must = data.draw(st.lists(st.sampled_from(available), max_size=len(available), unique=True))
    size = data.draw(st.integers(max(1, len(must)), len(available)))
    got = preferred_allocation(spec, available, must, size)
    assert len(got) == len(set(got)) == size
    assert set(must) <= set(got) and set(got) <= set(available)
    fixed = [spec.by_id[i].unit for i in must]
    pool = [spec.by_id[i].unit for i in available if i not in must]
    assert objective([spec.by_id[i].unit for i in got]) == brute_force(
        fixed, pool, size - len(must)
    )
    assert preferred_allocation(spec, available, must, size) == got


@settings(max_examples=60, deadline=None)
@given(inv=topologies(max_gpus=5), data=st.data())
def test_mig_slices_use_the_same_objective(inv: Inventory, data: st.DataObject) -> None:
    """Whole GPUs made MIG: slices of one GPU weigh above any fabric, the rest as the GPUs."""
    migged = Inventory(
        gpus=tuple(
            gpu(g.index, numa=g.numa_node, links=g.links, migs=["1g.10gb"] * 2) for g in inv.gpus
        )
    )
    specs = build_resources(migged, parse_config("version: v1\nflags:\n  migStrategy: mixed"))
    spec = next(s for s in specs if s.name.startswith("nvidia.com/mig"))
    ids = [d.id for d in spec.devices]
    size = data.draw(st.integers(1, len(ids)))
    got = preferred_allocation(spec, ids, [], size)
    units = [spec.by_id[i].unit for i in got]
    assert objective(units) == brute_force([], [d.unit for d in spec.devices], size)


def test_two_nvlinks_weigh_twice_one_and_numa_never_outweighs_a_link() -> None:
    u = [gpu(i).uuid for i in range(4)]
    # 0-1: one NVLink across sockets; 2-3: PCIe switch on one socket.
    inv = inventory(
        gpu(0, numa=0, links=[Link(u[1], LinkKind.NVLINK, 1)]),
        gpu(1, numa=1, links=[Link(u[0], LinkKind.NVLINK, 1)]),
        gpu(2, numa=0, links=[Link(u[3], LinkKind.SINGLE_SWITCH)]),
        gpu(3, numa=0, links=[Link(u[2], LinkKind.SINGLE_SWITCH)]),
    )
    spec = whole_gpus(inv)
    units = [d.unit for d in spec.devices]
    assert sorted(preferred_allocation(spec, [d.id for d in spec.devices], [], 2)) == sorted(u[:2])
    two = Link(u[1], LinkKind.NVLINK, 2)
    assert link_weight(
        whole_gpus(inventory(gpu(0, links=[two]), gpu(1))).devices[0].unit,
        whole_gpus(inventory(gpu(0, links=[two]), gpu(1))).devices[1].unit,
    ) == 2 * link_weight(units[0], units[1])


@pytest.mark.parametrize(("version", "per_link"), [(2, 25), (4, 25), (5, 50), (1, 20)])
def test_nvlink_weight_follows_the_version(version: int, per_link: int) -> None:
    u = [gpu(i).uuid for i in range(2)]
    link = Link(u[1], LinkKind.NVLINK, 4, nvlink_version=version)
    spec = whole_gpus(inventory(gpu(0, links=[link]), gpu(1)))
    a, b = (d.unit for d in spec.devices)
    ref = Link(u[1], LinkKind.NVLINK, 1, nvlink_version=1)
    spec1 = whole_gpus(inventory(gpu(0, links=[ref]), gpu(1)))
    a1, b1 = (d.unit for d in spec1.devices)
    assert link_weight(a, b) * 20 == link_weight(a1, b1) * 4 * per_link


def test_large_pool_search_is_bounded_and_reports_its_gap() -> None:
    """Beyond the exact limit, a small budget: still `need` candidates, an honest bound."""
    inv = inventory(*[gpu(i, numa=i % 3) for i in range(40)])
    units = [d.unit for d in whole_gpus(inv).devices]
    weights = [
        [0 if a is b else numa_term(a, b) * (a.gpu.index % 5 + 1) for b in units] for a in units
    ]
    found = bounded(weights, [0] * len(units), 10, work=64)
    assert len(set(found.picked)) == 10
    assert found.score == sum(weights[a][b] for a, b in itertools.combinations(found.picked, 2))
    assert found.bound >= found.score and 0.0 <= found.gap <= 1.0


def test_replicas_tie_break_by_the_objective() -> None:
    """Distributed replicas, all GPUs equally used: the second replica goes to the GPU
    NVLinked to the first, not to the next index."""
    u = [gpu(i).uuid for i in range(3)]
    inv = inventory(
        gpu(0, links=[Link(u[2], LinkKind.NVLINK, 4)]),
        gpu(1),
        gpu(2, links=[Link(u[0], LinkKind.NVLINK, 4)]),
    )
    shared = (
        "version: v1\nsharing:\n  timeSlicing:\n    resources:\n"
        "    - name: nvidia.com/gpu\n      replicas: 2\n"
    )
    (spec,) = build_resources(inv, parse_config(shared))
    got = preferred_allocation(
        spec, [d.id for d in spec.devices], [], 2, AllocationPolicy.DISTRIBUTED
    )
    assert {spec.by_id[i].unit.gpu.index for i in got} == {0, 2}


@pytest.mark.parametrize("preset", ["dgx1-v100", "hgx-h100", "hgx-h100-2x8", "a10g-4", "h100-8"])
def test_presets_are_placed_optimally_at_every_size(preset: str) -> None:
    """Every request size on the real-machine presets scores the brute-force optimum."""
    spec = whole_gpus(SimulatedBackend.load(preset).discover())
    units = [d.unit for d in spec.devices]
    n = len(units)
    link = [[link_weight(a, b) for b in units] for a in units]
    numa = [[numa_term(a, b) for b in units] for a in units]
    index = {d.id: k for k, d in enumerate(spec.devices)}
    for size in range(1, n + 1):
        best: tuple[int, int] = (-1, -1)
        for combo in itertools.combinations(range(n), size):
            pairs = list(itertools.combinations(combo, 2))
            score = (sum(link[a][b] for a, b in pairs), sum(numa[a][b] for a, b in pairs))
            best = max(best, score)
        got = [index[i] for i in preferred_allocation(spec, list(index), [], size)]
        pairs = list(itertools.combinations(got, 2))
        assert (sum(link[a][b] for a, b in pairs), sum(numa[a][b] for a, b in pairs)) == best


@settings(max_examples=80, deadline=None)
@given(
    boards=st.lists(st.integers(1, 5), min_size=1, max_size=4),
    down=st.lists(st.tuples(st.integers(0, 15), st.integers(0, 15)), max_size=3),
    data=st.data(),
)
def test_symmetric_boards_with_must_include(
    boards: list[int], down: list[tuple[int, int]], data: st.DataObject
) -> None:
    """NVSwitch boards (interchangeable GPUs, which the search takes as prefixes), some
    pairs with a lane down to break the symmetry, random must-include: still the optimum."""
    n = sum(boards)
    board = [b for b, size in enumerate(boards) for _ in range(size)]
    uuids = [gpu(i).uuid for i in range(n)]
    weak = {frozenset((a % n, b % n)) for a, b in down if a % n != b % n}
    gpus = []
    for i in range(n):
        links = []
        for j in range(n):
            if i == j:
                continue
            if board[i] == board[j]:
                lanes = 17 if frozenset((i, j)) in weak else 18
                links.append(Link(uuids[j], LinkKind.NVLINK, lanes, nvlink_version=4))
            else:
                links.append(Link(uuids[j], LinkKind.CROSS_NUMA))
        gpus.append(gpu(i, numa=board[i] % 2, links=links))
    spec = whole_gpus(inventory(*gpus))
    ids = [d.id for d in spec.devices]
    must = data.draw(st.lists(st.sampled_from(ids), max_size=3, unique=True))
    size = data.draw(st.integers(max(1, len(must)), n))
    got = preferred_allocation(spec, ids, must, size)
    assert set(must) <= set(got)
    fixed = [spec.by_id[i].unit for i in must]
    pool = [spec.by_id[i].unit for i in ids if i not in must]
    best = brute_force(fixed, pool, size - len(must))
    assert objective([spec.by_id[i].unit for i in got]) == best
    # Ties go to the lowest indices: the first optimal set in index order.
    first = next(
        c
        for c in itertools.combinations(pool, size - len(must))
        if objective(fixed + list(c)) == best
    )
    assert got[len(must) :] == [u.uuid for u in first]


def test_unknown_ids_in_a_set_are_named_in_a_stable_order() -> None:
    """The server hands the offered IDs over as a set: the error names them sorted, so
    the message does not vary with hash order."""
    spec = whole_gpus(inventory(gpu(0), gpu(1)))
    offered = {"GPU-zz", "GPU-aa", *(d.id for d in spec.devices)}
    with pytest.raises(AllocationError, match="unknown device ID\\(s\\) 'GPU-aa', 'GPU-zz' in"):
        preferred_allocation(spec, offered, [], 1)
