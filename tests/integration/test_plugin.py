"""The real plugin daemon against the kubelet emulator, over real unix sockets."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from kubegpu.api import device_plugin_stub, pb
from kubegpu.daemon import Daemon, DaemonSettings
from kubegpu.devices.simulated import SimulatedBackend
from kubegpu.kubelet import KubeletEmulator
from tests.integration.waiting import eventually

GPU = "nvidia.com/gpu"


@dataclass
class Node:
    kubelet: KubeletEmulator
    daemon: Daemon
    backend: SimulatedBackend
    plugin_dir: Path
    stop: asyncio.Event
    task: asyncio.Task[None]

    @property
    def uuids(self) -> list[str]:
        return [g.uuid for g in self.daemon.inventory.gpus]

    def socket(self, resource: str = GPU) -> Path:
        return self.plugin_dir / f"kubegpu-{resource.replace('/', '-')}.sock"


@contextlib.asynccontextmanager
async def running_node(
    socket_dir: Path,
    preset: str = "h100-8",
    overrides: Mapping[str, Any] | None = None,
    config_file: Path | None = None,
    **settings: Any,
) -> AsyncIterator[Node]:
    plugin_dir = socket_dir / "dp"
    kubelet = KubeletEmulator(plugin_dir, grace_period=0.5)
    await kubelet.start()
    backend = SimulatedBackend.load(preset)
    daemon = Daemon(
        DaemonSettings(
            plugin_dir=plugin_dir,
            backend="simulated",
            overrides=dict(overrides or {}),
            config_file=config_file,
            config_poll_interval=0.05,
            **settings,
        ),
        backend=backend,
    )
    stop = asyncio.Event()
    task = asyncio.create_task(daemon.run(stop))
    try:
        await asyncio.wait_for(daemon.started.wait(), 10)
        yield Node(kubelet, daemon, backend, plugin_dir, stop, task)
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
        await kubelet.stop()


async def test_registers_and_advertises_every_gpu_with_numa(socket_dir: Path) -> None:
    async with running_node(socket_dir) as node:
        await node.kubelet.wait_for_resource(GPU, capacity=8, allocatable=8)
        (record,) = [r for r in node.kubelet.registrations if r.resource == GPU]
        assert record.ok and record.endpoint == "kubegpu-nvidia.com-gpu.sock"
        devices = node.kubelet.devices(GPU)
        assert sorted(devices) == sorted(node.uuids)
        assert [devices[u].numa_nodes for u in node.uuids] == [(0,)] * 4 + [(1,)] * 4
        options = node.kubelet.options(GPU)
        assert options is not None and options.get_preferred_allocation_available
        assert not options.pre_start_required
        assert node.daemon.ready() == (True, "ok")


async def test_health_flips_reach_the_kubelet_and_heal(socket_dir: Path) -> None:
    overrides = {"flags.health.recoverySeconds": 0}  # heal only when told
    async with running_node(socket_dir, "a10g-4", overrides) as node:
        k = node.kubelet
        await k.wait_for_resource(GPU, capacity=4, allocatable=4)
        node.backend.inject_xid(1, 79)
        await k.wait_for_resource(GPU, capacity=4, allocatable=3)
        assert k.devices(GPU)[node.uuids[1]].health == "Unhealthy"
        node.backend.heal(1)
        await k.wait_for_resource(GPU, capacity=4, allocatable=4)
        node.backend.inject_xid(0, 48)
        node.backend.inject_xid(2, 48)
        await k.wait_for_resource(GPU, capacity=4, allocatable=2)
        node.backend.heal(0)
        await k.wait_for_resource(GPU, capacity=4, allocatable=3)
        node.backend.heal(2)
        await k.wait_for_resource(GPU, capacity=4, allocatable=4)
        history = k.history(GPU)
        allocs = [a for i, (c, a) in enumerate(history) if i == 0 or history[i - 1] != (c, a)]
        assert all(c == 4 for c, _ in history[1:])
        # 4 -> 3 -> 4, then two Xids (one update or two) -> 2 -> 3 -> 4.
        two = allocs.index(2)
        assert allocs[two:] == [2, 3, 4]
        assert allocs[:two][-3:] in ([4, 3, 4], [3, 4, 3])


async def test_application_xid_is_ignored_and_gpu_recovers_by_itself(socket_dir: Path) -> None:
    overrides = {"flags.health.recoverySeconds": 0.2, "flags.health.probeIntervalSeconds": 0.05}
    async with running_node(socket_dir, "a10g-4", overrides) as node:
        k = node.kubelet
        await k.wait_for_resource(GPU, allocatable=4)
        node.backend.inject_xid(0, 13)  # application error: no health change
        node.backend.inject_xid(3, 79)
        await k.wait_for_resource(GPU, allocatable=3)
        assert k.devices(GPU)[node.uuids[3]].health == "Unhealthy"
        assert k.devices(GPU)[node.uuids[0]].health == "Healthy"
        # Probes keep passing, so after the recovery window the GPU is healthy again.
        await k.wait_for_resource(GPU, allocatable=4, timeout=5)


async def test_allocate_uuid_strategy_with_device_specs(socket_dir: Path) -> None:
    overrides = {"flags.plugin.passDeviceSpecs": True}
    async with running_node(socket_dir, overrides=overrides) as node:
        await node.kubelet.wait_for_resource(GPU, allocatable=8)
        a = await node.kubelet.allocate(GPU, 2, pod="p")
        assert a.preferred is not None and list(a.preferred) == list(a.device_ids)
        assert a.envs["NVIDIA_VISIBLE_DEVICES"] == ",".join(a.device_ids)
        gpus = {g.uuid: g for g in node.daemon.inventory.gpus}
        minors = sorted(gpus[i].minor for i in a.device_ids)
        paths = [d.container_path for d in a.device_specs]
        assert paths == [f"/dev/nvidia{gpus[i].minor}" for i in a.device_ids] + [
            "/dev/nvidiactl",
            "/dev/nvidia-uvm",
            "/dev/nvidia-uvm-tools",
        ]
        assert sorted(minors) == minors
        # The preferred pair shares a NUMA node (and NVLink on this preset).
        assert len({gpus[i].numa_node for i in a.device_ids}) == 1


async def test_allocate_index_strategy(socket_dir: Path) -> None:
    overrides = {"flags.plugin.deviceIDStrategy": "index"}
    async with running_node(socket_dir, "a10g-4", overrides) as node:
        await node.kubelet.wait_for_resource(GPU, allocatable=4)
        a = await node.kubelet.allocate(GPU, 1, must_include=[node.uuids[2]])
        assert list(a.device_ids) == [node.uuids[2]]
        assert a.envs["NVIDIA_VISIBLE_DEVICES"] == "2"
        assert not a.device_specs


async def test_preferred_allocation_prefers_numa_of_must_include(socket_dir: Path) -> None:
    async with running_node(socket_dir) as node:
        await node.kubelet.wait_for_resource(GPU, allocatable=8)
        async with grpc.aio.insecure_channel(f"unix://{node.socket()}") as channel:
            stub = device_plugin_stub(channel)
            req = pb.ContainerPreferredAllocationRequest(
                available_deviceIDs=node.uuids,
                must_include_deviceIDs=[node.uuids[6]],
                allocation_size=3,
            )
            resp = await stub.GetPreferredAllocation(
                pb.PreferredAllocationRequest(container_requests=[req])
            )
        got = list(resp.container_responses[0].deviceIDs)
        assert got[0] == node.uuids[6] and len(set(got)) == 3
        assert set(got) <= set(node.uuids[4:])


@pytest.mark.parametrize(
    ("ids", "fragment"),
    [
        (["GPU-does-not-exist"], "unknown device ID"),
        ([], "lists no device IDs"),
        (None, "requested twice"),
    ],
)
async def test_bad_allocate_gets_invalid_argument_and_plugin_keeps_serving(
    socket_dir: Path, ids: list[str] | None, fragment: str
) -> None:
    async with running_node(socket_dir, "t4-1") as node:
        await node.kubelet.wait_for_resource(GPU, allocatable=1)
        request_ids = [node.uuids[0]] * 2 if ids is None else ids
        async with grpc.aio.insecure_channel(f"unix://{node.socket()}") as channel:
            stub = device_plugin_stub(channel)
            bad = pb.AllocateRequest(
                container_requests=[pb.ContainerAllocateRequest(devices_ids=request_ids)]
            )
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Allocate(bad)
            assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert fragment in (info.value.details() or "")
            good = pb.AllocateRequest(
                container_requests=[pb.ContainerAllocateRequest(devices_ids=[node.uuids[0]])]
            )
            ok = await stub.Allocate(good)
            assert ok.container_responses[0].envs["NVIDIA_VISIBLE_DEVICES"] == node.uuids[0]


async def test_kubelet_restart_triggers_reregistration(socket_dir: Path) -> None:
    async with running_node(socket_dir, "a10g-4") as node:
        k = node.kubelet
        await k.wait_for_resource(GPU, allocatable=4)
        first = await k.allocate(GPU, 1, pod="keep")
        await k.restart()
        await k.wait_for_resource(GPU, capacity=4, allocatable=4, timeout=5)
        assert len([r for r in k.registrations if r.ok]) >= 1
        assert node.daemon.manager.kubelet_restarts == 1
        (kept,) = k.allocations("keep")
        assert kept.device_ids == first.device_ids
        # A container restart reuses the cached answer: no new Allocate call.
        before = len(k.calls("Allocate"))
        again = await k.allocate(GPU, 1, pod="keep")
        assert again.cached and len(k.calls("Allocate")) == before


async def test_deleted_plugin_socket_is_served_again(socket_dir: Path) -> None:
    async with running_node(socket_dir, "t4-1") as node:
        await node.kubelet.wait_for_resource(GPU, allocatable=1)
        node.socket().unlink()
        await eventually(lambda: node.daemon.manager.kubelet_restarts == 1, 5)
        await eventually(node.socket().exists, 5)
        await node.kubelet.wait_for_resource(GPU, capacity=1, allocatable=1)


async def test_plugin_stop_removes_socket_and_kubelet_marks_unhealthy(socket_dir: Path) -> None:
    async with running_node(socket_dir, "t4-1") as node:
        await node.kubelet.wait_for_resource(GPU, allocatable=1)
        assert node.socket().exists()
        node.stop.set()
        await asyncio.wait_for(node.task, 10)
        assert not node.socket().exists()
        # The stream ended: capacity stays, allocatable drops, no retry by the kubelet.
        await node.kubelet.wait_for_resource(GPU, capacity=1, allocatable=0)


async def test_mig_mixed_registers_one_plugin_per_profile(socket_dir: Path) -> None:
    overrides = {"flags.migStrategy": "mixed"}
    async with running_node(socket_dir, "a100-40gb-mig", overrides) as node:
        k = node.kubelet
        await k.wait_for_resource("nvidia.com/mig-1g.5gb", capacity=7, allocatable=7)
        await k.wait_for_resource("nvidia.com/mig-2g.10gb", capacity=2)
        await k.wait_for_resource("nvidia.com/mig-3g.20gb", capacity=1)
        a = await k.allocate("nvidia.com/mig-2g.10gb", 1)
        assert a.device_ids[0].startswith("MIG-")
        assert a.envs["NVIDIA_VISIBLE_DEVICES"] == a.device_ids[0]
        # An Xid on the parent GPU takes down all its slices.
        node.backend.inject_xid(0, 79)
        await k.wait_for_resource("nvidia.com/mig-1g.5gb", capacity=7, allocatable=0)


async def test_mig_layout_change_is_readvertised_without_restart(socket_dir: Path) -> None:
    overrides = {"flags.migStrategy": "mixed"}
    async with running_node(socket_dir, "a100-40gb-mig", overrides) as node:
        k = node.kubelet
        await k.wait_for_resource("nvidia.com/mig-3g.20gb", capacity=1)
        node.backend.set_mig_layout(1, ["3g.20gb", "3g.20gb"])
        await k.wait_for_resource("nvidia.com/mig-3g.20gb", capacity=2, timeout=5)
        gone = node.plugin_dir / "kubegpu-nvidia.com-mig-2g.10gb.sock"
        await eventually(lambda: not gone.exists(), 5)


async def test_kubelet_down_for_a_while_then_back(socket_dir: Path) -> None:
    async with running_node(socket_dir, "t4-1") as node:
        k = node.kubelet
        await k.wait_for_resource(GPU, allocatable=1)
        await k.stop()
        # With no kubelet the plugin keeps serving and does not spin or crash.
        await asyncio.sleep(0)  # let the stream-end reach the plugin
        assert node.task.done() is False
        await k.start()
        await k.wait_for_resource(GPU, capacity=1, allocatable=1, timeout=5)
        assert node.daemon.manager.kubelet_restarts == 1


@pytest.mark.parametrize(
    ("env", "marked"), [({"DP_DISABLE_HEALTHCHECKS": "all"}, False), ({}, True)]
)
async def test_dp_disable_healthchecks_reaches_the_daemon(
    socket_dir: Path, env: dict[str, str], marked: bool
) -> None:
    async with running_node(socket_dir, "a10g-4", health_env=env) as node:
        await node.kubelet.wait_for_resource(GPU, allocatable=4)
        node.backend.inject_xid(1, 79)
        counted = {"uuid": node.uuids[1], "xid": "79"}
        # The Xid is counted before the health policy sees it, in the same step.
        await eventually(
            lambda: node.daemon.metrics.value("kubegpu_xid_errors_total", counted) == 1.0
        )
        assert (node.uuids[1] in node.daemon.health) is marked
        await node.kubelet.wait_for_resource(GPU, allocatable=3 if marked else 4)
