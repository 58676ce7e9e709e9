"""Replica requests through the spec's replica index: the same picks as the rules of
`sharedDevicesAllocationPolicy` written out plainly (a reference over AdvertisedDevices),
on random NVLink fabrics, random free replicas, must-include IDs and unhealthy GPUs."""

from __future__ import annotations

import itertools
import logging

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kubegpu.api import pb
from kubegpu.config import AllocationPolicy, parse_config
from kubegpu.devices import Health, Link, LinkKind
from kubegpu.devices.model import DeviceID
from kubegpu.errors import AllocationError
from kubegpu.placement import link_weight, preferred_allocation
from kubegpu.plugin.server import _prefer
from kubegpu.resources import AdvertisedDevice, ResourceSpec, build_resources
from tests.builders import gpu, inventory


def _reference(
    spec: ResourceSpec, free: list[str], must: list[str], size: int, policy: AllocationPolicy
) -> list[str]:
    """The policy's rules, one replica at a time: distributed takes the unit with the fewest
    replicas in this request, then the least used; packed the most used; ties go to
    healthy units, then the most summed pair weight with the request's replicas, then
    (GPU index, GPU instance, compute instance); each unit hands out its lowest replica."""
    chosen = [spec.by_id[i] for i in dict.fromkeys(must)]
    left: dict[str, list[AdvertisedDevice]] = {}
    for i in dict.fromkeys([*must, *free]):
        if i not in must:
            left.setdefault(spec.by_id[i].unit.uuid, []).append(spec.by_id[i])
    in_request = {u: sum(d.unit.uuid == u for d in chosen) for u in left}
    # Used: replicas taken elsewhere plus those in this request (each counted as the
    # kubegpu rule always has: a pick makes one fewer free and one more in the request).
    used = {u: spec.replicas - len(lst) + in_request[u] for u, lst in left.items()}
    picked: list[AdvertisedDevice] = []
    for _ in range(size - len(chosen)):

        def gain(u: str) -> int:
            unit = left[u][0].unit
            # Each must-include replica counts; a picked unit counts once, on joining.
            distinct = {d.unit.uuid: d.unit for d in picked}
            weights = [link_weight(unit, d.unit) for d in chosen]
            weights += [
                link_weight(unit, v)
                for v in distinct.values()
                if v.uuid not in {d.unit.uuid for d in chosen}
            ]
            return sum(weights)

        def order(u: str) -> tuple[int, int, int]:
            d = left[u][0]
            mig = d.unit.mig
            return (d.unit.gpu.index, mig.gi_id if mig else -1, mig.ci_id if mig else -1)

        def unhealthy(u: str) -> bool:
            return left[u][0].health is not Health.HEALTHY

        units = [u for u, lst in left.items() if lst]
        if policy is AllocationPolicy.PACKED:
            target = min(units, key=lambda u: (-used[u], unhealthy(u), -gain(u), order(u)))
        else:
            target = min(
                units, key=lambda u: (in_request[u], used[u], unhealthy(u), -gain(u), order(u))
            )
        lst = left[target]
        best = min(lst, key=lambda d: d.replica if d.replica is not None else -1)
        lst.remove(best)
        picked.append(best)
        used[target] += 2
        in_request[target] += 1
    return [d.id for d in chosen + picked]


@st.composite
def cases(
    draw: st.DrawFn,
) -> tuple[ResourceSpec, list[DeviceID], list[DeviceID], int, AllocationPolicy]:
    n = draw(st.integers(1, 6))
    uuids = [gpu(i).uuid for i in range(n)]
    lanes = {pair: draw(st.integers(0, 4)) for pair in itertools.combinations(range(n), 2)}
    sick = draw(st.sets(st.integers(0, n - 1), max_size=1))
    gpus = []
    for i in range(n):
        links = [
            Link(uuids[j], LinkKind.NVLINK, lanes[min(i, j), max(i, j)])
            for j in range(n)
            if j != i and lanes[min(i, j), max(i, j)]
        ]
        g = gpu(i, numa=draw(st.sampled_from([0, 1])), links=links)
        gpus.append(g)
    inv = inventory(*gpus).with_health({uuids[i]: Health.UNHEALTHY for i in sick})
    replicas = draw(st.integers(2, 5))
    config = (
        "version: v1\nsharing:\n  timeSlicing:\n    resources:\n"
        f"    - name: nvidia.com/gpu\n      replicas: {replicas}\n"
    )
    (spec,) = build_resources(inv, parse_config(config))
    ids = [d.id for d in spec.devices]
    free = draw(st.lists(st.sampled_from(ids), min_size=1, unique=True))
    must = draw(st.lists(st.sampled_from(free), max_size=2, unique=True))
    size = draw(st.integers(max(1, len(must)), len(free)))
    return spec, free, must, size, draw(st.sampled_from(list(AllocationPolicy)))


@given(cases())
@settings(max_examples=300, deadline=None)
def test_replicas_follow_the_policy_rules(
    case: tuple[ResourceSpec, list[str], list[str], int, AllocationPolicy],
) -> None:
    spec, free, must, size, policy = case
    expected = _reference(spec, free, must, size, policy)
    assert preferred_allocation(spec, free, must, size, policy) == expected
    # The server hands the offered IDs over as a set (a dict is taken as is too): the same.
    assert preferred_allocation(spec, set(free), must, size, policy) == expected
    assert preferred_allocation(spec, dict.fromkeys(free), must, size, policy) == expected
    # The server's own path: the protobuf field turned into a set in one pass. An ID
    # offered twice counts once (set semantics), so repeating every ID changes nothing.
    req = pb.ContainerPreferredAllocationRequest(
        available_deviceIDs=[*free, *reversed(free)],
        must_include_deviceIDs=must,
        allocation_size=size,
    )
    assert _prefer(spec, req, policy) == expected


@given(cases(), st.data())
@settings(max_examples=200, deadline=None)
def test_a_pool_offered_but_for_a_few_ids_gets_the_same_picks(
    case: tuple[ResourceSpec, list[str], list[str], int, AllocationPolicy], data: st.DataObject
) -> None:
    """The kubelet offers every free replica; an idle node's request lacks few or none, in
    any order: the picks are the policy's still."""
    spec, _, _, _, policy = case
    ids: list[str] = [d.id for d in spec.devices]
    lacking = data.draw(st.sets(st.sampled_from(ids), max_size=len(ids) // 2 - 1))
    free = data.draw(st.permutations([i for i in ids if i not in lacking]))
    size = data.draw(st.integers(1, len(free)))
    expected = _reference(spec, free, [], size, policy)
    assert preferred_allocation(spec, set(free), [], size, policy) == expected
    req = pb.ContainerPreferredAllocationRequest(available_deviceIDs=free, allocation_size=size)
    assert _prefer(spec, req, policy) == expected


def _shared(replicas: int = 3) -> ResourceSpec:
    config = (
        "version: v1\nsharing:\n  timeSlicing:\n    resources:\n"
        f"    - name: nvidia.com/gpu\n      replicas: {replicas}\n"
    )
    (spec,) = build_resources(inventory(gpu(0), gpu(1)), parse_config(config))
    return spec


def test_unknown_replica_id_is_refused_by_name() -> None:
    # Replica pools are checked by counting IDs per unit (no separate pass): an unknown
    # ID must still be named, before any size check.
    spec = _shared()
    ids = [d.id for d in spec.devices]
    with pytest.raises(AllocationError, match=r"unknown device ID\(s\) 'GPU-gone::0'"):
        preferred_allocation(spec, {*ids, "GPU-gone::0"}, [], 99)


def test_repeated_offers_are_not_reported_as_vanished(caplog: pytest.LogCaptureFixture) -> None:
    spec = _shared()
    ids = [d.id for d in spec.devices]
    req = pb.ContainerPreferredAllocationRequest(
        available_deviceIDs=[ids[0], ids[0], ids[4]], allocation_size=2
    )
    with caplog.at_level(logging.INFO, "kubegpu.plugin"):
        got = _prefer(spec, req, AllocationPolicy.DISTRIBUTED)
    assert sorted(got) == sorted([ids[0], ids[4]])
    assert "no longer advertised" not in caplog.text
    # A vanished ID among them is still reported, and only it.
    req.available_deviceIDs.append("GPU-gone::1")
    with caplog.at_level(logging.INFO, "kubegpu.plugin"):
        assert sorted(_prefer(spec, req, AllocationPolicy.DISTRIBUTED)) == sorted(got)
    assert "ignoring 1 ID(s) no longer advertised" in caplog.text
