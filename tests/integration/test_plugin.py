"""The real plugin daemon against the kubelet emulator, over real unix sockets."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import socket
import stat
import tempfile
import threading
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kubegpu.api import device_plugin_stub, pb, pb_grpc
from kubegpu.config import Config
from kubegpu.daemon import Daemon, DaemonSettings
from kubegpu.devices.simulated import SimulatedBackend
from kubegpu.errors import StartupError
from kubegpu.events import FakeEventSink, NodeEvents
from kubegpu.kubelet import KubeletEmulator
from kubegpu.plugin import server as server_module
from kubegpu.plugin.manager import REDIAL_START
from kubegpu.plugin.server import DevicePluginServicer, ResourceServer, request_limit, undecodable
from kubegpu.resources import ResourceSpec, build_resources, socket_name
from kubegpu.rpc import socket_path_too_long
from tests import builders
from tests.fronts import plugin_manager
from tests.waiting import WAIT, Kubelet, eventually

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
        return self.plugin_dir / socket_name(resource)


@contextlib.asynccontextmanager
async def running_node(
    socket_dir: Path,
    preset: str = "h100-8",
    overrides: Mapping[str, Any] | None = None,
    config_file: Path | None = None,
    events: NodeEvents | None = None,
    **settings: Any,
) -> AsyncIterator[Node]:
    plugin_dir = socket_dir / "dp"
    kubelet = Kubelet(plugin_dir, grace_period=0.5)
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
        events=events,
    )
    stop = asyncio.Event()
    task = asyncio.create_task(daemon.run(stop))
    try:
        await asyncio.wait_for(daemon.started.wait(), WAIT)
        yield Node(kubelet, daemon, backend, plugin_dir, stop, task)
    finally:
        stop.set()
        await asyncio.wait_for(task, WAIT)
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
        # Xid 79 waits for a reset (the GPU drops out of NVML, then answers again); then
        # probes keep passing, so after the recovery window the GPU is healthy again.
        node.backend.fail_probe(3, "GPU is lost (being reset)")
        node.backend.clear_fault(3)
        await k.wait_for_resource(GPU, allocatable=4)


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
        # Control nodes first, as NVIDIA orders them.
        assert paths == [
            "/dev/nvidiactl",
            "/dev/nvidia-uvm",
            "/dev/nvidia-uvm-tools",
        ] + [f"/dev/nvidia{gpus[i].minor}" for i in a.device_ids]
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
    ],
)
async def test_bad_allocate_gets_invalid_argument_and_plugin_keeps_serving(
    socket_dir: Path, ids: list[str], fragment: str
) -> None:
    async with running_node(socket_dir, "t4-1") as node:
        await node.kubelet.wait_for_resource(GPU, allocatable=1)
        request_ids = ids
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
        await k.wait_for_resource(GPU, capacity=4, allocatable=4)
        assert len([r for r in k.registrations if r.ok]) >= 1
        assert plugin_manager(node.daemon).kubelet_restarts == 1
        (kept,) = k.allocations("keep")
        assert kept.device_ids == first.device_ids
        # A container restart reuses the cached answer: no new Allocate call.
        before = len(k.calls("Allocate"))
        again = await k.allocate(GPU, 1, pod="keep")
        assert again.cached and len(k.calls("Allocate")) == before


async def test_a_kubelet_restart_is_one_registration_per_kubelet(socket_dir: Path) -> None:
    """The restart ends every stream too: only the kubelet watch registers again, not the
    re-registration of a stream the kubelet dropped while it ran."""
    async with running_node(socket_dir, "a10g-4") as node:
        k = node.kubelet
        await k.wait_for_resource(GPU, allocatable=4)
        await k.restart()
        await k.wait_for_resource(GPU, capacity=4, allocatable=4)
        await eventually(lambda: node.daemon.ready() == (True, "ok"))
        assert [r.resource for r in k.registrations if r.ok] == [GPU, GPU]


async def test_a_stream_the_kubelet_ends_while_it_runs_is_registered_again(
    socket_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The kubelet ends ListAndWatch and runs on (a 1.36 kubelet does so to a handover's
    successor): the plugin registers again, at once the first time, then after growing
    delays while the kubelet keeps dropping it."""
    async with running_node(socket_dir, "a10g-4") as node:
        k = node.kubelet
        await k.wait_for_resource(GPU, capacity=4, allocatable=4)
        with caplog.at_level(logging.INFO, logger="kubegpu.plugin"):
            for drops in range(1, 4):
                await k.disconnect(GPU)
                await k.wait_for(lambda n=drops: len(k.registrations) == n + 1)  # type: ignore[misc]
                await k.wait_for_resource(GPU, capacity=4, allocatable=4)
        assert k.history(GPU) == [(4, 4), (4, 0)] * 3 + [(4, 4)]
        assert plugin_manager(node.daemon).kubelet_restarts == 0
        again = [r.getMessage() for r in caplog.records if "registering again" in r.getMessage()]
        assert len(again) == 3
        assert again[0].endswith("registering again")
        assert again[1].endswith(f"registering again in {REDIAL_START:.1f} s")
        assert again[2].endswith(f"registering again in {2 * REDIAL_START:.1f} s")
        await eventually(lambda: node.daemon.ready() == (True, "ok"))


async def test_an_owner_that_handed_over_does_not_register_again(
    socket_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with running_node(socket_dir, "t4-1") as node:
        k = node.kubelet
        await k.wait_for_resource(GPU, capacity=1, allocatable=1)
        await plugin_manager(node.daemon).yield_registration()
        with caplog.at_level(logging.INFO, logger="kubegpu.plugin"):
            await k.disconnect(GPU)
            await eventually(
                lambda: any("the successor serves it" in r.getMessage() for r in caplog.records)
            )
        assert len(k.registrations) == 1
        assert k.allocatable(GPU) == 0


async def test_an_owner_that_handed_over_registers_again_what_it_serves_now(
    socket_dir: Path, tmp_path: Path
) -> None:
    """The successor stopped first (`resume_registration`): the process registers again,
    and serves a resource that appeared while the successor served the node."""
    config = tmp_path / "config.yaml"
    config.write_text("version: v1\n")
    async with running_node(socket_dir, "t4-1", config_file=config) as node:
        k = node.kubelet
        await k.wait_for_resource(GPU, capacity=1, allocatable=1)
        manager = plugin_manager(node.daemon)
        await manager.yield_registration()
        tmp = config.with_suffix(".tmp")
        tmp.write_text(
            "version: v1\n"
            "sharing:\n"
            "  timeSlicing:\n"
            "    resources: [{name: nvidia.com/gpu, rename: nvidia.com/gpu.shared, replicas: 2}]\n"
        )
        tmp.replace(config)
        # Applied while yielded: the new name is not served by this process.
        await eventually(lambda: not manager.servers)
        await manager.resume_registration()
        await k.wait_for_resource("nvidia.com/gpu.shared", capacity=2, allocatable=2)
        assert [r.resource for r in k.registrations if r.ok] == [GPU, "nvidia.com/gpu.shared"]
        await eventually(lambda: node.daemon.ready() == (True, "ok"))


async def test_deleted_plugin_socket_is_served_again(socket_dir: Path) -> None:
    async with running_node(socket_dir, "t4-1") as node:
        await node.kubelet.wait_for_resource(GPU, allocatable=1)
        node.socket().unlink()
        await eventually(lambda: plugin_manager(node.daemon).kubelet_restarts == 1)
        await eventually(node.socket().exists)
        await node.kubelet.wait_for_resource(GPU, capacity=1, allocatable=1)


def _registered(kubelet: KubeletEmulator) -> int:
    """How many Register calls the kubelet has accepted so far."""
    return sum(r.ok for r in kubelet.registrations)


async def test_a_plugin_socket_replaced_by_a_file_is_served_again(socket_dir: Path) -> None:
    """A file that is not our socket where the socket was (renamed over it) means the
    kubelet can no longer reach the plugin, as much as a deleted socket does."""
    async with running_node(socket_dir, "t4-1") as node:
        k = node.kubelet
        await k.wait_for_resource(GPU, capacity=1, allocatable=1)
        before = _registered(k)
        staged = node.plugin_dir / "not-a-socket"
        staged.write_text("plain file\n")
        staged.replace(node.socket())
        await eventually(lambda: plugin_manager(node.daemon).kubelet_restarts == 1)
        await k.wait_for(lambda: _registered(k) > before)
        await k.wait_for_resource(GPU, capacity=1, allocatable=1)
        assert node.socket().is_socket()


async def test_a_plugin_socket_deleted_again_and_again_is_served_again(socket_dir: Path) -> None:
    """Each deletion comes as soon as the socket is back, before the plugin registered it:
    the last one is still noticed, and the kubelet ends up with the plugin registered."""
    async with running_node(socket_dir, "t4-1") as node:
        k = node.kubelet
        await k.wait_for_resource(GPU, capacity=1, allocatable=1)
        before = _registered(k)
        for _ in range(5):
            await eventually(node.socket().is_socket)
            node.socket().unlink()
        await eventually(lambda: plugin_manager(node.daemon).kubelet_restarts >= 1)
        await k.wait_for(lambda: _registered(k) > before)
        await k.wait_for_resource(GPU, capacity=1, allocatable=1)
        await eventually(lambda: node.daemon.ready() == (True, "ok"))
        assert node.socket().is_socket()


async def test_re_registration_does_not_wait_for_calls_the_replaced_server_has(
    socket_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server a deleted socket leaves behind finishes its calls in the background:
    the plugin is served and registered again while an Allocate on the old server is still
    running, and that Allocate then reaches its caller."""
    monkeypatch.setattr(server_module, "RESERVE_GRACE_S", WAIT)  # never cut short here
    entered, release = asyncio.Event(), asyncio.Event()
    real = DevicePluginServicer.Allocate

    async def held(self: DevicePluginServicer, request: Any, context: Any) -> Any:
        entered.set()
        await release.wait()
        return await real(self, request, context)

    monkeypatch.setattr(DevicePluginServicer, "Allocate", held)
    async with running_node(socket_dir, "t4-1") as node:
        k = node.kubelet
        await k.wait_for_resource(GPU, capacity=1, allocatable=1)
        async with grpc.aio.insecure_channel(f"unix://{node.socket()}") as channel:
            call = asyncio.ensure_future(
                device_plugin_stub(channel).Allocate(_allocate(node.uuids[0]), timeout=WAIT)
            )
            await asyncio.wait_for(entered.wait(), WAIT)
            before = _registered(k)
            node.socket().unlink()
            try:
                await k.wait_for(lambda: _registered(k) > before)
                await k.wait_for_resource(GPU, capacity=1, allocatable=1)
                assert not call.done(), "the Allocate on the replaced server is still running"
            finally:
                release.set()
            answer = await call
        assert answer.container_responses[0].envs["NVIDIA_VISIBLE_DEVICES"] == node.uuids[0]


async def test_plugin_stop_removes_socket_and_kubelet_marks_unhealthy(socket_dir: Path) -> None:
    async with running_node(socket_dir, "t4-1") as node:
        await node.kubelet.wait_for_resource(GPU, allocatable=1)
        assert node.socket().exists()
        node.stop.set()
        await asyncio.wait_for(node.task, WAIT)
        assert not node.socket().exists()
        # The stream ended: capacity stayed, allocatable dropped, no retry by the kubelet.
        # (In its history: the stop answers calls for a moment after the stream ends, which
        # may outlast this emulator's short grace period.)
        await node.kubelet.wait_for(lambda: (1, 0) in node.kubelet.history(GPU))
        assert len(node.kubelet.calls("ListAndWatch", GPU)) == 1


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
        gone = node.socket("nvidia.com/mig-2g.10gb")
        assert gone.exists()
        node.backend.set_mig_layout(1, ["3g.20gb", "3g.20gb"])
        await k.wait_for_resource("nvidia.com/mig-3g.20gb", capacity=2)
        await eventually(lambda: not gone.exists())


async def test_plugin_sockets_are_owner_only_whatever_the_umask(socket_dir: Path) -> None:
    old = os.umask(0o022)
    try:
        async with running_node(socket_dir, "t4-1") as node:
            await node.kubelet.wait_for_resource(GPU, capacity=1)
            assert stat.S_IMODE(node.socket().stat().st_mode) == 0o600
            await node.kubelet.restart()  # re-served on a new socket: the same mode
            await eventually(lambda: plugin_manager(node.daemon).kubelet_restarts == 1)
            await node.kubelet.wait_for_resource(GPU, capacity=1, allocatable=1)
            assert stat.S_IMODE(node.socket().stat().st_mode) == 0o600
    finally:
        os.umask(old)


async def test_names_that_differ_only_in_dash_and_slash_get_their_own_sockets(
    socket_dir: Path, tmp_path: Path
) -> None:
    """`x.io-a/b` and `x.io/a-b` once shared one socket file: the kubelet saw both names
    behind it, and the renamed replicas were never advertised under their own name."""
    config = tmp_path / "config.yaml"
    config.write_text(
        "version: v1\n"
        "resources:\n"
        "  gpus: [{pattern: '*H100*', name: x.io-a/b}]\n"
        "sharing:\n"
        "  timeSlicing:\n"
        "    resources: [{name: x.io-a/b, rename: x.io/a-b, replicas: 2, devices: [0, 1]}]\n"
    )
    async with running_node(socket_dir, config_file=config) as node:
        k = node.kubelet
        await k.wait_for_resource("x.io-a/b", capacity=6, allocatable=6)
        await k.wait_for_resource("x.io/a-b", capacity=4, allocatable=4)
        assert node.socket("x.io-a/b") != node.socket("x.io/a-b")
        assert node.socket("x.io-a/b").exists() and node.socket("x.io/a-b").exists()
        whole = await k.allocate("x.io-a/b", 1, pod="whole")
        shared = await k.allocate("x.io/a-b", 1, pod="shared")
        assert "::" not in whole.device_ids[0]
        assert "::" in shared.device_ids[0]


async def test_kubelet_down_for_a_while_then_back(socket_dir: Path) -> None:
    async with running_node(socket_dir, "t4-1") as node:
        k = node.kubelet
        await k.wait_for_resource(GPU, allocatable=1)
        await k.stop()
        # With no kubelet the plugin keeps serving and does not spin or crash.
        await asyncio.sleep(0)  # let the stream-end reach the plugin
        assert node.task.done() is False
        await k.start()
        await k.wait_for_resource(GPU, capacity=1, allocatable=1)
        assert plugin_manager(node.daemon).kubelet_restarts == 1


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


# -- the servicer alone, against hostile or stale requests ---------------------------------


@contextlib.asynccontextmanager
async def serving(
    socket_dir: Path, spec: ResourceSpec, config: Config | None = None
) -> AsyncIterator[tuple[ResourceServer, pb_grpc.DevicePluginStub]]:
    server = ResourceServer(spec, config or Config(), socket_dir)
    await server.serve()
    try:
        async with grpc.aio.insecure_channel(f"unix://{server.socket_path}") as channel:
            yield server, device_plugin_stub(channel)
    finally:
        await server.stop(grace=0)


def _spec(count: int = 4, config: Config | None = None) -> ResourceSpec:
    inv = builders.inventory(*(builders.gpu(i) for i in range(count)))
    return build_resources(inv, config or Config())[0]


def _allocate(*ids: str) -> pb.AllocateRequest:
    return pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=ids)])


async def test_a_served_socket_says_how_it_was_lost(socket_dir: Path) -> None:
    """What the kubelet watch asks each plugin: is the name still the socket it listens on."""
    async with serving(socket_dir, _spec()) as (server, stub):
        assert server.socket_lost() is None
        assert (await stub.GetDevicePluginOptions(pb.Empty())).get_preferred_allocation_available
        staged = socket_dir / "staged"
        with socket.socket(socket.AF_UNIX) as other:
            other.bind(str(staged))
            staged.replace(server.socket_path)
            assert server.socket_lost() == "was replaced by another socket"
        staged.write_text("")
        staged.replace(server.socket_path)
        assert server.socket_lost() == "was replaced by a file that is not a socket"
        server.socket_path.unlink()
        assert server.socket_lost() == "was deleted"
        await server.serve()
        assert server.socket_lost() is None
    assert server.socket_lost() is None, "nothing served: nothing to lose"


async def test_allocate_dedups_repeated_ids(socket_dir: Path) -> None:
    spec = _spec()
    u0, u1 = (d.id for d in spec.devices[:2])
    async with serving(socket_dir, spec) as (_, stub):
        resp = await stub.Allocate(_allocate(u0, u1, u0))
    assert resp.container_responses[0].envs["NVIDIA_VISIBLE_DEVICES"] == f"{u0},{u1}"


async def test_allocate_error_is_bounded_and_cannot_forge_log_lines(
    socket_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # 500 IDs of 100 characters would be ~50 KiB of details: over gRPC's 16 KiB limit (and
    # under the request size limit, so the IDs are read and refused one by one).
    ids = ["GPU-evil\nkubegpu INFO all good", *[f"GPU-{n:096d}" for n in range(500)]]
    async with serving(socket_dir, _spec()) as (_, stub):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Allocate(_allocate(*ids))
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    details = info.value.details() or ""
    assert "unknown device ID" in details and "and 496 more" in details
    assert "\n" not in details and len(details) <= 1100
    refused = [r.getMessage() for r in caplog.records if "Allocate refused" in r.getMessage()]
    assert refused and all("\n" not in m for m in refused)


async def test_preferred_allocation_ignores_ids_that_vanished(socket_dir: Path) -> None:
    spec = _spec(4)
    ids = [d.id for d in spec.devices]
    async with serving(socket_dir, spec) as (server, stub):
        # A reload removed GPU 3 after the kubelet read the list.
        await server.update(_spec(3), Config())
        req = pb.ContainerPreferredAllocationRequest(
            available_deviceIDs=ids, must_include_deviceIDs=[ids[3]], allocation_size=2
        )
        resp = await stub.GetPreferredAllocation(
            pb.PreferredAllocationRequest(container_requests=[req])
        )
        got = list(resp.container_responses[0].deviceIDs)
        assert len(got) == 2 and set(got) <= set(ids[:3])
        # Everything offered vanished: an empty hint, not a failed pod.
        gone = pb.ContainerPreferredAllocationRequest(
            available_deviceIDs=["GPU-gone"], allocation_size=1
        )
        resp = await stub.GetPreferredAllocation(
            pb.PreferredAllocationRequest(container_requests=[gone])
        )
        assert list(resp.container_responses[0].deviceIDs) == []


async def test_invalid_utf8_id_gets_a_status_and_plugin_keeps_serving(socket_dir: Path) -> None:
    spec = _spec()
    # ContainerAllocateRequest{devices_ids: b"\xff\xfe"} inside AllocateRequest, by hand:
    # a Python client cannot build a str that is not UTF-8.
    inner = b"\x0a\x02\xff\xfe"
    raw = b"\x0a" + bytes([len(inner)]) + inner
    address = f"unix://{socket_dir / spec.socket_name}"
    async with (
        serving(socket_dir, spec) as (_, stub),
        grpc.aio.insecure_channel(address) as channel,
    ):
        # No serializers: the raw bytes go out as they are and the answer comes back as bytes.
        call = channel.unary_unary("/v1beta1.DevicePlugin/Allocate", None, None)
        # Twice around a good call: the guard is built on the first call, then reused.
        for attempt in range(2):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call(raw)
            assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT, attempt
            ok = await stub.Allocate(_allocate(spec.devices[0].id))
            assert ok.container_responses[0].envs


async def test_undecodable_preferred_request_gets_invalid_argument_in_one_line(
    socket_dir: Path,
) -> None:
    """GetPreferredAllocation is decoded by protobuf like every RPC: bad UTF-8 in an offered
    ID is INVALID_ARGUMENT with protobuf's reason in one line, and the plugin keeps serving."""
    spec = _spec()
    # ContainerPreferredAllocationRequest{available_deviceIDs: b"GPU-\xff", size 1}.
    inner = b"\x0a\x05GPU-\xff\x18\x01"
    raw = b"\x0a" + bytes([len(inner)]) + inner
    with pytest.raises(DecodeError) as decoded:
        pb.PreferredAllocationRequest.FromString(raw)
    expected = str(undecodable(str(decoded.value)))
    address = f"unix://{socket_dir / spec.socket_name}"
    async with (
        serving(socket_dir, spec) as (_, stub),
        grpc.aio.insecure_channel(address) as channel,
    ):
        call = channel.unary_unary("/v1beta1.DevicePlugin/GetPreferredAllocation", None, None)
        for attempt in range(2):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call(raw)
            assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT, attempt
            assert info.value.details() == expected
            assert "\n" not in expected and expected.endswith("; send valid UTF-8 IDs")
            ok = await stub.GetPreferredAllocation(
                pb.PreferredAllocationRequest(
                    container_requests=[
                        pb.ContainerPreferredAllocationRequest(
                            available_deviceIDs=[d.id for d in spec.devices], allocation_size=2
                        )
                    ]
                )
            )
            assert len(ok.container_responses[0].deviceIDs) == 2


# Hypothesis runs each example synchronously, so the server runs on its own loop in a thread.
_IDS = st.one_of(
    st.text(max_size=40),
    st.text(alphabet=st.characters(codec="utf-8"), min_size=1000, max_size=5000),
    st.sampled_from(["\n", "\x00", "\x1b[31m", "GPU-\u202e", "::", "::-1"]),
)


@pytest.fixture(scope="module")
def threaded_server() -> Iterator[tuple[ResourceSpec, str]]:
    spec = _spec(4)
    directory = Path(tempfile.mkdtemp(prefix="kg-", dir="/tmp"))
    loop = asyncio.new_event_loop()
    server = ResourceServer(spec, Config(), directory)
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(server.serve(), loop).result(WAIT)
    try:
        yield spec, f"unix://{server.socket_path}"
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(grace=0), loop).result(WAIT)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(WAIT)
        loop.close()
        shutil.rmtree(directory, ignore_errors=True)


def _sync_call(target: str, method: str, request: Any) -> tuple[grpc.StatusCode, Any]:
    with grpc.insecure_channel(target) as channel:
        stub = device_plugin_stub(channel)
        try:
            return grpc.StatusCode.OK, getattr(stub, method)(request, timeout=WAIT)
        except grpc.RpcError as exc:
            return exc.code(), exc.details()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    real=st.lists(st.integers(0, 3), max_size=6),
    junk=st.lists(_IDS, max_size=5),
    many=st.integers(0, 3000),
    containers=st.integers(0, 3),
)
def test_fuzz_allocate(
    threaded_server: tuple[ResourceSpec, str],
    real: list[int],
    junk: list[str],
    many: int,
    containers: int,
) -> None:
    spec, target = threaded_server
    ids = [spec.devices[i].id for i in real] + junk + ["GPU-x"] * (many if junk else 0)
    request = pb.AllocateRequest(
        container_requests=[pb.ContainerAllocateRequest(devices_ids=ids)] * containers
    )
    code, answer = _sync_call(target, "Allocate", request)
    assert code in (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT), answer
    if code is grpc.StatusCode.OK:
        assert len(answer.container_responses) == containers
    else:
        assert "\n" not in answer and len(answer) <= 1100
    # Still serving, and still right.
    code, answer = _sync_call(target, "Allocate", _allocate(spec.devices[0].id))
    assert code is grpc.StatusCode.OK
    assert answer.container_responses[0].envs["NVIDIA_VISIBLE_DEVICES"] == spec.devices[0].id


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    available=st.lists(st.one_of(st.integers(0, 3), _IDS), max_size=8),
    must=st.lists(st.one_of(st.integers(0, 3), _IDS), max_size=4),
    size=st.integers(-(2**31), 2**31 - 1) | st.integers(-2, 10),
)
def test_fuzz_preferred_allocation(
    threaded_server: tuple[ResourceSpec, str],
    available: list[int | str],
    must: list[int | str],
    size: int,
) -> None:
    spec, target = threaded_server

    def ids(xs: list[int | str]) -> list[str]:
        return [spec.devices[x].id if isinstance(x, int) else x for x in xs]

    req = pb.ContainerPreferredAllocationRequest(
        available_deviceIDs=ids(available), must_include_deviceIDs=ids(must), allocation_size=size
    )
    code, answer = _sync_call(
        target, "GetPreferredAllocation", pb.PreferredAllocationRequest(container_requests=[req])
    )
    assert code in (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT), answer
    if code is grpc.StatusCode.OK:
        got = list(answer.container_responses[0].deviceIDs)
        known = set(spec.by_id) & set(ids(available) + ids(must))
        assert set(got) <= known and len(got) == len(set(got)) <= max(size, 0)
        # Every must-include ID that still exists is in the answer.
        assert {i for i in ids(must) if i in spec.by_id} <= set(got)
    else:
        assert "\n" not in answer


_UNARY = ("Allocate", "GetPreferredAllocation", "GetDevicePluginOptions", "PreStartContainer")
#: Bytes an attacker might send: random, or a valid request's bytes cut or bit-flipped.
_WIRE = st.one_of(
    st.binary(max_size=300),
    st.tuples(st.integers(0, 60), st.integers(0, 255)).map(
        lambda cut: _allocate("GPU-" + "a" * 40).SerializeToString()[: cut[0]] + bytes([cut[1]])
    ),
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(method=st.sampled_from(_UNARY), data=_WIRE)
def test_fuzz_raw_bytes_to_every_method(
    threaded_server: tuple[ResourceSpec, str], method: str, data: bytes
) -> None:
    """Whatever bytes arrive, each call gets OK or a kubegpu status in one line, never
    UNKNOWN or INTERNAL, and the plugin answers the next valid request."""
    spec, target = threaded_server
    with grpc.insecure_channel(target) as channel:
        call = channel.unary_unary(f"/v1beta1.DevicePlugin/{method}", None, None)
        try:
            call(data, timeout=WAIT)
        except grpc.RpcError as exc:
            assert exc.code() in (
                grpc.StatusCode.INVALID_ARGUMENT,
                grpc.StatusCode.FAILED_PRECONDITION,
            ), (exc.code(), exc.details())
            assert "\n" not in (exc.details() or "")
    code, answer = _sync_call(target, "Allocate", _allocate(spec.devices[0].id))
    assert code is grpc.StatusCode.OK, answer


def _counted_device_lists(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The device count of every ListAndWatch list the servicer builds, from now on."""
    from kubegpu.plugin import server as server_module

    builds: list[int] = []
    real = server_module.device_list

    def counted(spec: ResourceSpec) -> pb.ListAndWatchResponse:
        builds.append(len(spec.devices))
        return real(spec)

    monkeypatch.setattr(server_module, "device_list", counted)
    return builds


async def test_list_is_built_once_per_spec_version_and_rebuilt_on_change(
    socket_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kubelet restart re-opens ListAndWatch on an unchanged spec: the list it gets is the
    one already built; a new spec (health, reload) still reaches every stream."""
    builds = _counted_device_lists(monkeypatch)
    spec = _spec(4)
    async with serving(socket_dir, spec) as (server, stub):
        for _ in range(3):  # three kubelet restarts' worth of fresh streams
            stream = stub.ListAndWatch(pb.Empty())
            first = await stream.read()
            stream.cancel()
            assert [d.ID for d in first.devices] == [d.id for d in spec.devices]
        assert builds == [4]
        stream = stub.ListAndWatch(pb.Empty())
        assert len((await stream.read()).devices) == 4
        await server.servicer.update(_spec(2), Config())
        assert len((await stream.read()).devices) == 2
        stream.cancel()
    assert builds == [4, 2]


async def test_an_update_with_the_same_devices_sends_nothing(
    socket_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store wakes every resource on any change (another resource's health, MPS
    readiness); a resource whose devices are unchanged neither rebuilds nor resends."""
    builds = _counted_device_lists(monkeypatch)
    async with serving(socket_dir, _spec(2)) as (server, stub):
        stream = stub.ListAndWatch(pb.Empty())
        assert len((await stream.read()).devices) == 2
        await server.servicer.update(_spec(2), Config())  # equal devices, a new object
        # A round trip on the server's loop: a woken stream would have sent by now.
        await stub.GetDevicePluginOptions(pb.Empty())
        await server.servicer.update(_spec(3), Config())
        # Had the equal update been sent, this read would show 2 devices again.
        assert len((await stream.read()).devices) == 3
        stream.cancel()
    assert builds == [2, 3]


async def test_mps_mounts_follow_from_the_config_alone(socket_dir: Path) -> None:
    """Allocate computes the MPS pipe and shm mounts from the spec and `flags.mpsRoot`;
    no daemon object is asked (its readiness only gates health, in the store)."""
    from kubegpu.config import parse_config

    config = parse_config(
        "version: v1\nflags: {mpsRoot: /run/nvidia/mps}\n"
        "sharing:\n  mps:\n    resources:\n    - {name: nvidia.com/gpu, replicas: 2}\n"
    )
    spec = _spec(2, config)
    async with serving(socket_dir, spec, config) as (_, stub):
        resp = await stub.Allocate(_allocate(spec.devices[0].id))
    (answer,) = resp.container_responses
    assert answer.envs["CUDA_MPS_PIPE_DIRECTORY"] == "/tmp/nvidia-mps"
    mounts = {m.container_path: m.host_path for m in answer.mounts}
    assert mounts["/tmp/nvidia-mps"] == "/run/nvidia/mps/nvidia.com_gpu/pipe"
    assert mounts["/dev/shm"] == "/dev/shm"


async def test_health_transitions_become_node_events_and_metrics(socket_dir: Path) -> None:
    """Metrics and Node events follow the store: one event and one count per transition."""
    sink = FakeEventSink()
    events = NodeEvents("node-a", sink, dedupe_seconds=0)
    overrides = {"flags.health.recoverySeconds": 0}
    async with running_node(socket_dir, "a10g-4", overrides, events=events) as node:
        k = node.kubelet
        await k.wait_for_resource(GPU, allocatable=4)
        node.backend.inject_xid(1, 79)
        await k.wait_for_resource(GPU, allocatable=3)
        node.backend.heal(1)
        await k.wait_for_resource(GPU, allocatable=4)
        await eventually(lambda: len(sink.events) == 2)
        metrics = node.daemon.metrics
        for health in ("Unhealthy", "Healthy"):
            labels = {"resource": GPU, "health": health}
            assert metrics.value("kubegpu_health_transitions_total", labels) == 1
    uuid = node.uuids[1]
    assert [(e.reason, e.message) for e in sink.events] == [
        ("GPUUnhealthy", f"GPU {uuid} is unhealthy"),
        ("GPUHealthy", f"GPU {uuid} is healthy again"),
    ]


async def test_config_reloads_become_applied_and_rejected_node_events(
    socket_dir: Path, tmp_path: Path
) -> None:
    """ConfigRejected was posted but its counterpart never was: an operator saw refusals on
    the Node and never a reload that landed."""
    config = tmp_path / "config.yaml"
    config.write_text("version: v1\n")
    sink = FakeEventSink()
    events = NodeEvents("node-a", sink, dedupe_seconds=0)
    async with running_node(socket_dir, "a10g-4", config_file=config, events=events) as node:
        k = node.kubelet
        await k.wait_for_resource(GPU, capacity=4)
        config.write_text(SHARED_2)
        await k.wait_for_resource(GPU, capacity=8)
        await eventually(lambda: len(sink.events) == 1)
        config.write_text("version: v1\nflags: mps\n")
        await eventually(lambda: len(sink.events) == 2)
        assert k.capacity(GPU) == 8
    assert [(e.reason, e.type) for e in sink.events] == [
        ("ConfigApplied", "Normal"),
        ("ConfigRejected", "Warning"),
    ]
    assert sink.events[0].message == f"file {config}: applied"
    assert "flags: must be a mapping" in sink.events[1].message


SHARED_2 = (
    "version: v1\nsharing:\n  timeSlicing:\n    resources:\n"
    "      - name: nvidia.com/gpu\n        replicas: 2\n"
)


async def test_a_socket_path_over_the_unix_limit_stops_the_daemon_at_start() -> None:
    """Every plugin socket is checked against the 107-byte limit before serving (the CLI
    only knows the kubelet's socket name): a path that can never be bound is one line
    naming the resource, not a retry loop."""
    with tempfile.TemporaryDirectory(dir="/tmp") as root:
        # /tmp/<tmp>/ddd.../kubegpu-nvidia.com-gpu.sock: just over the limit.
        plugin_dir = Path(root) / ("d" * (107 - len(root) - len("/kubegpu-nvidia.com-gpu.sock")))
        plugin_dir.mkdir()
        assert len(str(plugin_dir / "kubegpu-nvidia.com-gpu.sock")) == 108
        daemon = Daemon(
            DaemonSettings(plugin_dir=plugin_dir, backend="simulated"),
            backend=SimulatedBackend.load("t4-1"),
        )
        with pytest.raises(StartupError) as stopped:
            await asyncio.wait_for(daemon.run(asyncio.Event()), WAIT)
        assert str(stopped.value) == (
            f"{GPU}: socket path {plugin_dir}/kubegpu-nvidia.com-gpu.sock is longer than 107 "
            "bytes (the unix limit); use a shorter --device-plugin-path"
        )
        assert socket_path_too_long(plugin_dir / "kubegpu-nvidia.com-gpu.soc") is None


async def test_requests_larger_than_any_valid_one_are_refused_before_decoding(
    socket_dir: Path,
) -> None:
    """Eight concurrent ~3.5 MB Allocates once took the daemon past its memory limit while
    protobuf made a string per ID; each is now refused unread, and the plugin serves on."""
    spec = _spec()
    limit = request_limit(spec)
    ids = [f"GPU-{n:036d}" for n in range(3_500_000 // 42)]
    huge = pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=ids)])
    assert huge.ByteSize() > limit
    async with serving(socket_dir, spec) as (_, stub):
        results = await asyncio.gather(
            *(stub.Allocate(huge) for _ in range(8)), return_exceptions=True
        )
        for result in results:
            assert isinstance(result, grpc.aio.AioRpcError), result
            assert result.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert f"more than any valid Allocate request for this resource ({limit}" in (
                result.details() or ""
            )
        ok = await stub.Allocate(
            pb.AllocateRequest(
                container_requests=[pb.ContainerAllocateRequest(devices_ids=[spec.devices[0].id])]
            )
        )
        assert len(ok.container_responses) == 1
    # Every valid request fits: all advertised IDs twice, as offered and must-include.
    every = [d.id for d in spec.devices]
    valid = pb.PreferredAllocationRequest(
        container_requests=[
            pb.ContainerPreferredAllocationRequest(
                available_deviceIDs=every, must_include_deviceIDs=every, allocation_size=1
            )
        ]
    )
    assert valid.ByteSize() <= limit


async def test_an_allocate_answered_during_a_kubelet_restart_reaches_its_caller(
    socket_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server a restart replaces was stopped with no grace, so an Allocate the plugin
    had answered could reach the kubelet as CANCELLED. Every answered call now arrives;
    calls grpc had only queued when the old server stopped may still be refused."""
    answered = 0
    real = DevicePluginServicer.Allocate

    async def counted(self: DevicePluginServicer, request: Any, context: Any) -> Any:
        nonlocal answered
        response = await real(self, request, context)
        answered += 1
        return response

    monkeypatch.setattr(DevicePluginServicer, "Allocate", counted)
    received = 0
    stop = asyncio.Event()
    async with running_node(socket_dir, "a10g-4") as node:
        k = node.kubelet
        await k.wait_for_resource(GPU, capacity=4)

        async def client() -> None:
            nonlocal received
            while not stop.is_set():
                async with grpc.aio.insecure_channel(f"unix://{node.socket()}") as channel:
                    stub = device_plugin_stub(channel)
                    with contextlib.suppress(grpc.aio.AioRpcError):
                        while not stop.is_set():
                            await stub.Allocate(_allocate(node.uuids[0]), timeout=WAIT)
                            received += 1

        clients = [asyncio.ensure_future(client()) for _ in range(4)]
        watcher = plugin_manager(node.daemon)
        try:
            for restarts in range(1, 6):
                await k.restart()
                await eventually(lambda n=restarts: watcher.kubelet_restarts == n)  # type: ignore[misc]
                await k.wait_for_resource(GPU, capacity=4, allocatable=4)
        finally:
            stop.set()
            await asyncio.gather(*clients)
    assert answered > 0 and received == answered
