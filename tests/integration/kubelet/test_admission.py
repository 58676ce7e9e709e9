"""Admitting containers through the emulator, against small in-test plugins.

Preferred allocation, Allocate, reuse, PreStartContainer, the topology manager
(kubelet/admission.py, kubelet/pod_devices.py).
"""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from kubegpu.api import UNHEALTHY, pb
from kubegpu.kubelet import (
    AdmissionError,
    Allocation,
    ContainerStartError,
    KubeletEmulator,
    merge_responses,
)
from tests.integration.kubelet.fakes import GPU, FakePlugin, MakePlugin, dev, gpus
from tests.waiting import Kubelet

# ------------------------------------------------------------------------ allocation


async def test_allocate_without_preferred(
    kubelet: KubeletEmulator, make_plugin: MakePlugin
) -> None:
    plugin = make_plugin(gpus(4))
    await plugin.serve_and_register()
    await kubelet.wait_for_resource(GPU, capacity=4)
    allocation = await kubelet.allocate(GPU, 2, pod="p1")
    assert plugin.calls["GetPreferredAllocation"] == 0
    assert allocation.preferred is None
    [request] = plugin.allocate_requests
    assert len(request.container_requests) == 1
    assert tuple(request.container_requests[0].devices_ids) == allocation.device_ids
    assert len(set(allocation.device_ids)) == 2
    ids = ",".join(allocation.device_ids)
    assert allocation.envs == {"VISIBLE_DEVICES": ids, "PLUGIN": "fake.sock"}
    assert allocation.annotations == {"example.com/devices": ids}
    assert [m.container_path for m in allocation.mounts] == ["/usr/lib/x"]
    assert [d.host_path for d in allocation.device_specs] == [
        f"/dev/{d}" for d in allocation.device_ids
    ]
    assert allocation.cdi_devices == tuple(f"example.com/gpu={d}" for d in allocation.device_ids)


async def test_allocate_honours_preferred(
    kubelet: KubeletEmulator, make_plugin: MakePlugin
) -> None:
    plugin = make_plugin(gpus(4), preferred_available=True)
    plugin.preferred_answer = ["gpu-3", "gpu-1"]
    await plugin.serve_and_register()
    await kubelet.wait_for_resource(GPU, capacity=4)
    allocation = await kubelet.allocate(GPU, 2, pod="p1")
    assert allocation.device_ids == ("gpu-3", "gpu-1")
    assert allocation.preferred == ("gpu-3", "gpu-1")
    [request] = plugin.preferred_requests
    [creq] = request.container_requests
    assert list(creq.available_deviceIDs) == ["gpu-0", "gpu-1", "gpu-2", "gpu-3"]
    assert list(creq.must_include_deviceIDs) == []
    assert creq.allocation_size == 2
    # The next pod is offered only what is free.
    plugin.preferred_answer = None
    await kubelet.allocate(GPU, 1, pod="p2")
    assert list(plugin.preferred_requests[1].container_requests[0].available_deviceIDs) == [
        "gpu-0",
        "gpu-2",
    ]


async def test_preferred_is_only_a_hint(kubelet: KubeletEmulator, make_plugin: MakePlugin) -> None:
    plugin = make_plugin(gpus(4), preferred_available=True)
    await plugin.serve_and_register()
    await kubelet.wait_for_resource(GPU, capacity=4)
    first = await kubelet.allocate(GPU, 1, pod="p1")  # takes gpu-0
    assert first.device_ids == ("gpu-0",)
    # Unknown and in-use IDs are dropped; the shortfall is filled by the kubelet.
    plugin.preferred_answer = ["bogus", "gpu-0", "gpu-2"]
    allocation = await kubelet.allocate(GPU, 3, pod="p2")
    assert allocation.device_ids[0] == "gpu-2"
    assert set(allocation.device_ids) == {"gpu-1", "gpu-2", "gpu-3"}


async def test_must_include(kubelet: KubeletEmulator, make_plugin: MakePlugin) -> None:
    plugin = make_plugin(gpus(4), preferred_available=True)
    await plugin.serve_and_register()
    await kubelet.wait_for_resource(GPU, capacity=4)
    allocation = await kubelet.allocate(GPU, 2, pod="p1", must_include=["gpu-2"])
    creq = plugin.preferred_requests[0].container_requests[0]
    assert list(creq.must_include_deviceIDs) == ["gpu-2"]
    assert "gpu-2" in creq.available_deviceIDs
    assert allocation.device_ids[0] == "gpu-2" and len(allocation.device_ids) == 2


async def test_preferred_error_fails_admission(
    kubelet: KubeletEmulator, make_plugin: MakePlugin
) -> None:
    plugin = make_plugin(gpus(2), preferred_available=True)
    plugin.fail["GetPreferredAllocation"] = grpc.StatusCode.INTERNAL
    await plugin.serve_and_register()
    await kubelet.wait_for_resource(GPU, capacity=2)
    with pytest.raises(AdmissionError) as info:
        await kubelet.allocate(GPU, 1)
    assert info.value.reason == "UnexpectedAdmissionError"
    assert "GetPreferredAllocation rpc failed" in str(info.value)
    assert plugin.calls["Allocate"] == 0
    assert kubelet.allocations() == []


async def test_allocate_error_fails_admission(
    kubelet: KubeletEmulator, make_plugin: MakePlugin
) -> None:
    plugin = make_plugin(gpus(2))
    plugin.fail["Allocate"] = grpc.StatusCode.FAILED_PRECONDITION
    await plugin.serve_and_register()
    await kubelet.wait_for_resource(GPU, capacity=2)
    with pytest.raises(
        AdmissionError,
        match="Allocate failed due to rpc error: code = "
        "FailedPrecondition desc = Allocate failed on purpose, which is "
        "unexpected",
    ):
        await kubelet.allocate(GPU, 1)
    # Nothing stays reserved after a failed Allocate.
    del plugin.fail["Allocate"]
    allocation = await kubelet.allocate(GPU, 2)
    assert len(allocation.device_ids) == 2


async def test_not_enough_devices(kubelet: KubeletEmulator, make_plugin: MakePlugin) -> None:
    plugin = make_plugin(gpus(2))
    await plugin.serve_and_register()
    await kubelet.wait_for_resource(GPU, capacity=2)
    with pytest.raises(AdmissionError, match=f"Insufficient {GPU}") as info:
        await kubelet.allocate(GPU, 3)
    assert info.value.reason == f"OutOf{GPU}"
    await kubelet.allocate(GPU, 1, pod="p1")
    await plugin.set_health("gpu-0", UNHEALTHY)
    await plugin.set_health("gpu-1", UNHEALTHY)
    await kubelet.wait_for_resource(GPU, allocatable=0)
    with pytest.raises(AdmissionError, match="Insufficient"):
        await kubelet.allocate(GPU, 1, pod="p2")
    with pytest.raises(AdmissionError, match=r"Insufficient other\.com/x"):
        await kubelet.allocate("other.com/x", 1)
    assert plugin.calls["Allocate"] == 1


async def test_unhealthy_devices_are_not_allocated(
    kubelet: KubeletEmulator, make_plugin: MakePlugin
) -> None:
    plugin = make_plugin([dev("gpu-0", UNHEALTHY), dev("gpu-1")])
    await plugin.serve_and_register()
    await kubelet.wait_for_resource(GPU, capacity=2, allocatable=1)
    allocation = await kubelet.allocate(GPU, 1)
    assert allocation.device_ids == ("gpu-1",)


async def test_container_restart_reuses_response(
    kubelet: KubeletEmulator, make_plugin: MakePlugin
) -> None:
    plugin = make_plugin(gpus(2), preferred_available=True)
    await plugin.serve_and_register()
    await kubelet.wait_for_resource(GPU, capacity=2)
    first = await kubelet.allocate(GPU, 1, pod="p1", container="c")
    second = await kubelet.allocate(GPU, 1, pod="p1", container="c")
    assert second.cached and not first.cached
    assert second.device_ids == first.device_ids
    assert second.response == first.response
    assert plugin.calls["Allocate"] == 1
    assert plugin.calls["GetPreferredAllocation"] == 1
    # A different container of the same pod is a new request.
    third = await kubelet.allocate(GPU, 1, pod="p1", container="d")
    assert set(third.device_ids).isdisjoint(first.device_ids)
    assert plugin.calls["Allocate"] == 2
    # Once the pod is gone, its devices are free again.
    assert sorted(kubelet.release("p1")) == ["gpu-0", "gpu-1"]
    await kubelet.allocate(GPU, 2, pod="p2")


async def test_pre_start_only_when_required(
    kubelet: KubeletEmulator, make_plugin: MakePlugin
) -> None:
    plain = make_plugin(gpus(1), resource="example.com/plain", socket="plain.sock")
    needs = make_plugin(
        gpus(1), resource="example.com/needs", socket="needs.sock", pre_start_required=True
    )
    for plugin in (plain, needs):
        await plugin.serve_and_register()
        await kubelet.wait_for_resource(plugin.resource, capacity=1)
    await kubelet.allocate("example.com/plain", 1)
    allocation = await kubelet.allocate("example.com/needs", 1)
    assert plain.calls["PreStartContainer"] == 0
    assert [list(r.devices_ids) for r in needs.pre_start_requests] == [list(allocation.device_ids)]
    # Before every container start, restarts included (the Allocate is cached).
    await kubelet.start_container("pod", "ctr")
    assert needs.calls["PreStartContainer"] == 2 and needs.calls["Allocate"] == 1
    needs.fail["PreStartContainer"] = grpc.StatusCode.UNAVAILABLE
    with pytest.raises(ContainerStartError, match="PreStartContainer rpc failed"):
        await kubelet.start_container("pod", "ctr")


async def test_merge_responses_first_value_wins(
    kubelet: KubeletEmulator, make_plugin: MakePlugin
) -> None:
    a = make_plugin(gpus(1), resource="example.com/a", socket="a.sock")
    b = make_plugin(gpus(1), resource="example.com/b", socket="b.sock")
    for plugin in (a, b):
        await plugin.serve_and_register()
        await kubelet.wait_for_resource(plugin.resource, capacity=1)
    first = await kubelet.allocate("example.com/a", 1, container="c")
    second = await kubelet.allocate("example.com/b", 1, container="c")
    merged = kubelet.container_response("pod", "c")
    assert merged.envs["PLUGIN"] == "a.sock"
    assert [m.container_path for m in merged.mounts] == ["/usr/lib/x"]
    assert len(merged.devices) == 1  # both map /dev/gpu-0: the first one wins
    assert merged == merge_responses([first, second])
    assert merge_responses([second.response, first]).envs["PLUGIN"] == "b.sock"


# ------------------------------------------------------------------------ topology


TOPOLOGY = [
    dev("gpu-a", numa=[1]),
    dev("gpu-b", numa=[0]),
    dev("gpu-c", numa=[1]),
    dev("gpu-d", numa=[1]),
    dev("gpu-x"),
]


async def _topology_setup(
    socket_dir: Path, make_plugin: MakePlugin, manager: bool
) -> tuple[KubeletEmulator, FakePlugin]:
    kubelet = Kubelet(socket_dir, grace_period=0.2, topology_manager=manager)
    await kubelet.start()
    plugin = make_plugin(TOPOLOGY, preferred_available=True)
    await plugin.serve_and_register()
    await kubelet.wait_for_resource(GPU, capacity=5)
    return kubelet, plugin


async def test_topology_aligned_first(socket_dir: Path, make_plugin: MakePlugin) -> None:
    kubelet, plugin = await _topology_setup(socket_dir, make_plugin, manager=True)
    try:
        assert kubelet.is_topology_aware(GPU)
        assert kubelet.devices(GPU)["gpu-b"].numa_nodes == (0,)
        assert kubelet.devices(GPU)["gpu-x"].numa_nodes == ()
        # Fits on NUMA node 1: the plugin chooses among the aligned devices only.
        allocation = await kubelet.allocate(GPU, 2, pod="p1")
        creq = plugin.preferred_requests[0].container_requests[0]
        assert list(creq.available_deviceIDs) == ["gpu-a", "gpu-c", "gpu-d"]
        assert set(allocation.device_ids) <= {"gpu-a", "gpu-c", "gpu-d"}
        kubelet.release("p1")
        # Hint node 0 but 3 devices: aligned first (taken), then unaligned, node -1 last.
        allocation = await kubelet.allocate(GPU, 3, pod="p2", numa_affinity=[0])
        creq = plugin.preferred_requests[1].container_requests[0]
        assert list(creq.available_deviceIDs) == ["gpu-b", "gpu-a", "gpu-c", "gpu-d", "gpu-x"]
        assert list(creq.must_include_deviceIDs) == ["gpu-b"]
        assert allocation.device_ids[0] == "gpu-b"
        # Without a plugin hint, devices without topology are used last.
        kubelet.release("p2")
        plugin.preferred_answer = []
        allocation = await kubelet.allocate(GPU, 5, pod="p3", numa_affinity=[0])
        assert allocation.device_ids == ("gpu-b", "gpu-a", "gpu-c", "gpu-d", "gpu-x")
    finally:
        await kubelet.stop()


async def test_topology_manager_off(socket_dir: Path, make_plugin: MakePlugin) -> None:
    kubelet, plugin = await _topology_setup(socket_dir, make_plugin, manager=False)
    try:
        await kubelet.allocate(GPU, 2)
        creq = plugin.preferred_requests[0].container_requests[0]
        assert list(creq.available_deviceIDs) == ["gpu-a", "gpu-b", "gpu-c", "gpu-d", "gpu-x"]
    finally:
        await kubelet.stop()


def test_allocation_is_frozen() -> None:
    allocation = Allocation(device_ids=("a",), response=pb.ContainerAllocateResponse())
    with pytest.raises(AttributeError):
        allocation.device_ids = ("b",)  # type: ignore[misc]
