"""The kubelet emulator's rooms without sockets: admission choices, endpoints, pod devices.

The integration tests in tests/integration/kubelet/ drive these through real gRPC; here the
pure parts are pinned on their own, so a change in the choice rules shows up as a one-line
failure rather than as a different device in an end-to-end test.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from kubegpu.api import HEALTHY, UNHEALTHY, pb
from kubegpu.kubelet import AdmissionError, DeviceState
from kubegpu.kubelet import admission as adm
from kubegpu.kubelet import endpoint as ep_
from kubegpu.kubelet.checkpoint import PodDevicesEntry
from kubegpu.kubelet.pod_devices import PodDevices

GPU = "example.com/gpu"


def state(dev_id: str, numa: Sequence[int] = (), health: str = HEALTHY) -> DeviceState:
    return DeviceState(dev_id, health, tuple(numa), "fake.sock")


def devices(*states: DeviceState) -> dict[str, DeviceState]:
    return {s.id: s for s in states}


def request(count: int, must_include: Sequence[str] = (), pod: str = "p") -> adm.Request:
    return adm.Request(GPU, count, pod, "c", tuple(must_include))


# ------------------------------------------------------------------------ admission


def test_narrowest_hint_prefers_one_node_then_lowest_ids() -> None:
    view = devices(state("a", [1]), state("b", [0]), state("c", [1]), state("d", [0]))
    assert adm.narrowest_hint(view, ["a", "b", "c", "d"], [], 2) == {0}
    assert adm.narrowest_hint(view, ["a", "b", "c"], [], 2) == {1}
    # Three devices fit on no single node: both nodes.
    assert adm.narrowest_hint(view, ["a", "b", "c", "d"], [], 3) == {0, 1}


def test_narrowest_hint_covers_devices_already_chosen() -> None:
    view = devices(state("a", [1]), state("b", [0]), state("c", [0]))
    assert adm.narrowest_hint(view, ["b", "c"], ["a"], 2) == {0, 1}


def test_filter_by_affinity_without_topology_manager_keeps_order() -> None:
    view = devices(state("a", [1]), state("b", [0]))
    got = adm.filter_by_affinity(view, ["a", "b"], [], 1, None, topology_manager=False)
    assert got == ([], [], ["a", "b"])


def test_filter_by_affinity_splits_aligned_unaligned_and_none() -> None:
    view = devices(state("a", [1]), state("b", [0]), state("x"))
    got = adm.filter_by_affinity(view, ["a", "b", "x"], [], 1, {1}, topology_manager=True)
    assert got == (["a"], ["b"], ["x"])


def test_union_keeps_first_occurrence() -> None:
    assert adm.union(["b", "a"], ["a", "c"], ["b"]) == ["b", "a", "c"]


def test_check_refuses_a_device_held_by_another_pod() -> None:
    view = devices(state("a"), state("b"))
    with pytest.raises(AdmissionError, match="device a to include is in use by another pod"):
        adm.check(request(1, ["a"]), view, in_use={"a"}, held_by_pod=set(), allocatable=2)


def test_check_counts_reused_devices_out_of_the_fit() -> None:
    view = devices(state("a"), state("b"))
    # The pod already holds "a": only one more device is requested, and one is free.
    adm.check(request(2, ["a"]), view, in_use={"a"}, held_by_pod={"a"}, allocatable=2)
    with pytest.raises(AdmissionError) as info:
        adm.check(request(2), view, in_use={"a"}, held_by_pod=set(), allocatable=2)
    assert info.value.reason == f"OutOf{GPU}"
    assert "requested: 2, used: 1, capacity: 2" in info.value.message


async def test_devices_to_allocate_takes_the_hint_then_the_rest() -> None:
    view = devices(state("a"), state("b"), state("c", health=UNHEALTHY), state("d"))
    asked: list[tuple[list[str], list[str], int]] = []

    async def preferred(available: list[str], must: list[str], size: int) -> tuple[str, ...] | None:
        asked.append((list(available), list(must), size))
        return ("d", "c")  # "c" is unhealthy: a hint, never obeyed blindly

    got = await adm.devices_to_allocate(
        request(2), view, {"b"}, topology_manager=False, preferred=preferred
    )
    assert got == (["d", "a"], ("d", "c"))
    assert asked == [(["a", "d"], [], 2)]


async def test_devices_to_allocate_asks_nothing_when_must_include_fills_it() -> None:
    async def preferred(available: list[str], must: list[str], size: int) -> tuple[str, ...] | None:
        raise AssertionError("GetPreferredAllocation must not be called")

    got = await adm.devices_to_allocate(
        request(1, ["a"]),
        devices(state("a")),
        set(),
        topology_manager=False,
        preferred=preferred,
    )
    assert got == (["a"], None)


# ------------------------------------------------------------------------ endpoints


class _NoChannel:
    """Stands for a client: ranking never touches it."""


def endpoint(name: str, seq: int, *, alive: bool = True) -> ep_.Endpoint:
    ep = ep_.Endpoint(GPU, name, pb.DevicePluginOptions(), _NoChannel(), seq)  # type: ignore[arg-type]
    ep.alive = alive
    return ep


def test_primary_is_the_newest_live_endpoint() -> None:
    a = endpoint("a.sock", 1)
    b = endpoint("b.sock", 2)
    dead = endpoint("c.sock", 3, alive=False)
    assert ep_.primary([a, b, dead]) is b
    # The primary gone, the surviving sibling takes its place.
    assert ep_.primary([a, dead]) is a
    assert ep_.primary([dead]) is None


def test_parse_gives_the_whole_set_with_the_reporting_endpoint() -> None:
    ep = endpoint("b.sock", 2)
    update = pb.ListAndWatchResponse(
        devices=[pb.Device(ID="b-0", health=HEALTHY), pb.Device(ID="b-1", health="Bogus")]
    )
    assert ep.parse(update) == {
        "b-0": DeviceState("b-0", HEALTHY, (), "b.sock"),
        "b-1": DeviceState("b-1", UNHEALTHY, (), "b.sock"),
    }


def test_parse_refuses_a_list_with_an_invalid_id_whole() -> None:
    ep = endpoint("a.sock", 1)
    errors = ep.parse(pb.ListAndWatchResponse(devices=[pb.Device(ID="x" * 64, health=HEALTHY)]))
    assert isinstance(errors, list) and "x" * 64 in errors[0]


# ------------------------------------------------------------------------ pod devices


def entry(pod: str, container: str, ids: Sequence[str]) -> PodDevicesEntry:
    response = pb.ContainerAllocateResponse(envs={"IDS": ",".join(ids)})
    return PodDevicesEntry(pod, container, GPU, tuple(ids), tuple(-1 for _ in ids), response)


def test_pod_devices_track_holders_and_release() -> None:
    pods = PodDevices()
    pods.add(entry("p1", "c1", ["a"]))
    pods.add(entry("p1", "c2", ["b"]))
    pods.add(entry("p2", "c1", ["c"]))
    assert pods.in_use(GPU) == {"a", "b", "c"}
    assert pods.held_by_pod(GPU, "p1") == {"a", "b"}
    assert [a.device_ids for a in pods.allocations("p1")] == [("a",), ("b",)]
    assert all(a.cached for a in pods.allocations())
    assert pods.release("p1") == ["a", "b"]
    assert pods.in_use(GPU) == {"c"}
    assert len(pods) == 1
