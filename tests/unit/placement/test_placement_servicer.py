"""GetPreferredAllocation through the servicer: any request gets a valid, stable answer or
one clear error; vanished IDs are dropped and logged; a hostile request cannot blow up.
(Undecodable bytes over a socket: tests/integration/test_plugin.py.)"""

from __future__ import annotations

import dataclasses
import logging

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kubegpu.api import pb
from kubegpu.config import AllocationPolicy, Config, parse_config
from kubegpu.devices.simulated import SimulatedBackend, parse_node
from kubegpu.errors import AllocationError
from kubegpu.placement import preferred_allocation
from kubegpu.plugin.server import DevicePluginServicer, _prefer
from kubegpu.resources import ResourceSpec, build_resources
from tests.builders import gpu, inventory

# Odd IDs among the usual: one of 10 bytes, one holding a newline, a long one, non-ASCII.
ODD_UUIDS = ("GPU-10byte", "GPU-new\nline", "GPU-" + "x" * 126, "GPU-é-ünï")


def _spec(uuids: tuple[str, ...] = (), replicas: int | None = 4) -> ResourceSpec:
    gpus = [gpu(i) for i in range(3)]
    gpus += [dataclasses.replace(gpu(3 + n), uuid=u) for n, u in enumerate(uuids)]
    config = "version: v1\n"
    if replicas is not None:
        config += (
            "sharing:\n  timeSlicing:\n    resources:\n"
            f"    - name: nvidia.com/gpu\n      replicas: {replicas}\n"
        )
    (spec,) = build_resources(inventory(*gpus), parse_config(config))
    return spec


SHARED = _spec()
ODD = _spec(ODD_UUIDS, replicas=None)  # whole GPUs: the IDs are the UUIDs


def _answer(
    spec: ResourceSpec, req: pb.ContainerPreferredAllocationRequest, policy: AllocationPolicy
) -> list[str] | str:
    try:
        return _prefer(spec, req, policy)
    except AllocationError as exc:
        return str(exc)


_ALL_IDS = [d.id for d in SHARED.devices] + [d.id for d in ODD.devices] + ["GPU-gone", ""]


@given(
    st.sampled_from([SHARED, ODD]),
    st.lists(st.sampled_from(_ALL_IDS), max_size=20),
    st.lists(st.sampled_from(_ALL_IDS), max_size=3),
    st.integers(-(2**31), 2**31 - 1) | st.integers(-1, 20),
    st.sampled_from(list(AllocationPolicy)),
    st.randoms(use_true_random=False),
)
@settings(max_examples=400, deadline=None)
def test_any_request_gets_a_valid_stable_answer_or_one_clear_error(
    spec: ResourceSpec,
    offered: list[str],
    must: list[str],
    size: int,
    policy: AllocationPolicy,
    rng: object,
) -> None:
    """Vanished IDs are dropped, repeats count once, the order of the offer does not
    matter, and the answer is the placement's own for what is left; a bad size gets the
    placement's message."""
    req = pb.ContainerPreferredAllocationRequest(
        available_deviceIDs=offered, must_include_deviceIDs=must, allocation_size=size
    )
    got = _answer(spec, req, policy)
    shuffled = list(offered) * 2
    rng.shuffle(shuffled)  # type: ignore[attr-defined]
    again = pb.ContainerPreferredAllocationRequest(
        available_deviceIDs=shuffled, must_include_deviceIDs=must, allocation_size=size
    )
    assert _answer(spec, again, policy) == got
    known = [i for i in dict.fromkeys(offered) if i in spec.by_id]
    known_must = [i for i in dict.fromkeys(must) if i in spec.by_id]
    pool = set(known) | set(known_must)
    if size <= 0:
        assert got == f"{spec.name}: allocation_size must be at least 1, got {size}"
        return
    if not pool:
        assert got == []
        return
    try:
        expected: list[str] | str = list(
            preferred_allocation(spec, known, known_must, min(size, len(pool)), policy)
        )
    except AllocationError as exc:
        expected = str(exc)
    assert got == expected
    if isinstance(got, list):
        assert got[: len(known_must)] == known_must
        assert len(got) == len(set(got)) == min(size, len(pool)) and set(got) <= pool
    else:
        assert "must-include devices exceed allocation_size" in got


async def test_every_container_request_is_answered_alike() -> None:
    servicer = DevicePluginServicer(ODD, Config())
    req = pb.ContainerPreferredAllocationRequest(
        available_deviceIDs=[d.id for d in ODD.devices], allocation_size=3
    )
    answer = await servicer.GetPreferredAllocation(
        pb.PreferredAllocationRequest(container_requests=[req, req]),
        None,  # type: ignore[arg-type]
    )
    first, second = (list(r.deviceIDs) for r in answer.container_responses)
    assert first == second == _prefer(ODD, req, AllocationPolicy.DISTRIBUTED)


def test_vanished_ids_are_dropped_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    ids = [d.id for d in SHARED.devices]
    policy = AllocationPolicy.DISTRIBUTED
    for offered, must in (([*ids, "GPU-gone::1"], []), (ids[2:], ["GPU-gone::2", ids[0]])):
        req = pb.ContainerPreferredAllocationRequest(
            available_deviceIDs=offered, must_include_deviceIDs=must, allocation_size=2
        )
        caplog.clear()
        with caplog.at_level(logging.INFO, "kubegpu.plugin"):
            got = _prefer(SHARED, req, policy)
        gone = next(i for i in [*offered, *must] if i.startswith("GPU-gone"))
        assert f"ignoring 1 ID(s) no longer advertised: {gone!r}" in caplog.text
        kept = [i for i in must if i in SHARED.by_id]
        assert got == preferred_allocation(
            SHARED, [i for i in offered if i in SHARED.by_id], kept, 2
        )


def _boards(count: int, replicas: int | None) -> ResourceSpec:
    gpus = [{"numa_node": b % 2, "nvswitch": f"board{b}"} for b in range(count) for _ in range(8)]
    inv = SimulatedBackend(parse_node({"gpus": gpus}, "boards", "test")).discover()
    config = "version: v1\n"
    if replicas:
        config += (
            "sharing:\n  timeSlicing:\n    resources:\n"
            f"    - name: nvidia.com/gpu\n      replicas: {replicas}\n"
        )
    return build_resources(inv, parse_config(config))[0]


@pytest.mark.parametrize("replicas", [None, 48])
def test_a_hostile_request_cannot_blow_up(replicas: int | None) -> None:
    """The largest size the field holds, thousands of unknown and repeated IDs, every ID
    as must-include: clamped to what is offered, or refused in one line."""
    spec = _boards(8, replicas)  # 64 GPUs, or 64 x 48 replicas
    ids: list[str] = [d.id for d in spec.devices]
    junk = [f"GPU-junk-{n}" for n in range(5000)]
    policy = AllocationPolicy.PACKED
    huge = pb.ContainerPreferredAllocationRequest(
        available_deviceIDs=ids + junk + ids, allocation_size=2**31 - 1
    )
    got = _prefer(spec, huge, policy)
    assert sorted(got) == sorted(ids)
    every = pb.ContainerPreferredAllocationRequest(
        available_deviceIDs=ids, must_include_deviceIDs=ids + junk, allocation_size=3
    )
    with pytest.raises(
        AllocationError,
        match=f"^{spec.name}: {len(ids)} must-include devices exceed allocation_size 3$",
    ):
        _prefer(spec, every, policy)
    half = pb.ContainerPreferredAllocationRequest(
        available_deviceIDs=ids[::2], allocation_size=len(ids) // 4
    )
    assert len(set(_prefer(spec, half, policy))) == len(ids) // 4
