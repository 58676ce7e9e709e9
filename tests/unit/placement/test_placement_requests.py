"""Preferred allocation: validity of the hint, NUMA and NVLink scoring, replica policies."""

from __future__ import annotations

import pytest

from kubegpu.config import AllocationPolicy, parse_config
from kubegpu.devices import Link, LinkKind
from kubegpu.errors import AllocationError
from kubegpu.placement import preferred_allocation
from kubegpu.resources import ResourceSpec, build_resources
from tests.builders import gpu, inventory, nvlinked


def plain(inv: object) -> ResourceSpec:
    (spec,) = build_resources(inv, parse_config("version: v1"))  # type: ignore[arg-type]
    return spec


def ids(spec: ResourceSpec) -> list[str]:
    return [d.id for d in spec.devices]


def test_prefers_same_numa_node() -> None:
    inv = inventory(gpu(0, numa=0), gpu(1, numa=1), gpu(2, numa=0), gpu(3, numa=1))
    spec = plain(inv)
    got = preferred_allocation(spec, ids(spec)[1:], [], 2)
    assert sorted(got) == sorted([inv.gpus[1].uuid, inv.gpus[3].uuid])


def test_prefers_nvlink_peers_over_pcie() -> None:
    u = [gpu(i).uuid for i in range(4)]
    nv = [Link(u[2], LinkKind.NVLINK, 4)]
    inv = inventory(
        gpu(0, links=[Link(u[1], LinkKind.CROSS_NUMA)]),
        gpu(1),
        gpu(2, links=[Link(u[3], LinkKind.NVLINK, 4)]),
        gpu(3, links=nv),
    )
    spec = plain(inv)
    assert sorted(preferred_allocation(spec, ids(spec), [], 2)) == sorted([u[2], u[3]])


def test_must_include_is_kept_and_partner_chosen_by_topology() -> None:
    inv = nvlinked(8, numa_split=4)
    spec = plain(inv)
    u = ids(spec)
    got = preferred_allocation(spec, u, [u[5]], 4)
    assert got[0] == u[5] and len(got) == 4 and len(set(got)) == 4
    # All NVLinked, so the NUMA bonus keeps the rest on node 1 with GPU 5.
    assert {spec.by_id[i].numa_node for i in got} == {1}


def test_never_returns_ids_outside_the_offer() -> None:
    inv = nvlinked(8)
    spec = plain(inv)
    offer = ids(spec)[2:6]
    got = preferred_allocation(spec, offer, [], 3)
    assert set(got) <= set(offer)


def test_large_pool_uses_greedy_and_stays_valid() -> None:
    inv = inventory(*[gpu(i, numa=i % 2) for i in range(40)])
    spec = plain(inv)
    got = preferred_allocation(spec, ids(spec), [], 10)
    assert len(set(got)) == 10
    assert len({spec.by_id[i].numa_node for i in got}) == 1


@pytest.mark.parametrize(
    ("available", "must", "size", "message"),
    [
        (["GPU-x"], [], 1, "unknown device"),
        ([], [], 0, "at least 1"),
        (None, None, 1, "must-include devices exceed"),
        (None, [], 9, "exceeds the"),
    ],
)
def test_invalid_requests(
    available: list[str] | None, must: list[str] | None, size: int, message: str
) -> None:
    spec = plain(nvlinked(4))
    avail = ids(spec) if available is None else available
    must_include = ids(spec)[:2] if must is None else must
    with pytest.raises(AllocationError, match=message):
        preferred_allocation(spec, avail, must_include, size)


SHARED = """
version: v1
sharing:
  timeSlicing:
    resources:
    - name: nvidia.com/gpu
      replicas: 4
"""


def shared_spec() -> ResourceSpec:
    (spec,) = build_resources(inventory(gpu(0), gpu(1), gpu(2)), parse_config(SHARED))
    return spec


def test_distributed_spreads_over_gpus() -> None:
    spec = shared_spec()
    got = preferred_allocation(spec, ids(spec), [], 3, AllocationPolicy.DISTRIBUTED)
    assert len({spec.by_id[i].unit.uuid for i in got}) == 3


def test_distributed_prefers_least_used_gpu() -> None:
    spec = shared_spec()
    # GPU 0 has 3 of 4 replicas taken elsewhere, GPU 1 has 1 taken, GPU 2 none.
    free = [d.id for d in spec.devices if not (d.unit.gpu.index == 0 and d.replica != 3)]
    free = [
        i for i in free if not (spec.by_id[i].unit.gpu.index == 1 and spec.by_id[i].replica == 0)
    ]
    got = preferred_allocation(spec, free, [], 1, AllocationPolicy.DISTRIBUTED)
    assert spec.by_id[got[0]].unit.gpu.index == 2


def test_packed_fills_one_gpu_first() -> None:
    spec = shared_spec()
    got = preferred_allocation(spec, ids(spec), [], 4, AllocationPolicy.PACKED)
    assert len({spec.by_id[i].unit.uuid for i in got}) == 1


def test_packed_prefers_partly_used_gpu() -> None:
    spec = shared_spec()
    free = [
        i
        for i in ids(spec)
        if not (spec.by_id[i].unit.gpu.index == 1 and spec.by_id[i].replica == 0)
    ]
    got = preferred_allocation(spec, free, [], 2, AllocationPolicy.PACKED)
    assert {spec.by_id[i].unit.gpu.index for i in got} == {1}
