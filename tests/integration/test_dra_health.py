"""kubegpu's DRA health service (`v1alpha1.DRAResourceHealth`) over a real unix socket:
what it streams, and, read by the kubelet emulator, what a pod's status shows of it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from kubegpu.api import dra_health_pb2 as pb
from kubegpu.api import dra_health_stub
from kubegpu.config import Config, parse_config
from kubegpu.devices import HealthEvent, HealthEventKind
from kubegpu.dra.health import (
    HEALTH_TIMEOUT_S,
    REPORT_INTERVAL_S,
    HealthServicer,
    add_health_servicer,
)
from kubegpu.dra.slices import NVIDIA_DRIVER
from kubegpu.health import HealthTracker
from kubegpu.state import NodeState, NodeStore
from tests.builders import gpu, inventory
from tests.integration.kubelet.dra_fakes import FakeDriver, allocated_claim, pod
from tests.rig.dra import HEALTHY, UNHEALTHY, DRAKubelet
from tests.rig.kube import FakeKube
from tests.waiting import WAIT

NODE = "node-1"
XID_79 = "Xid 79 (GPU has fallen off the bus)"


class Node:
    """The store and the health tracker that fills it, as the daemon wires them."""

    def __init__(self, config: Config | None = None) -> None:
        self.config = config or Config()
        self.tracker = HealthTracker(self.config.flags.health, clock=lambda: 0.0)
        self.store = NodeStore(
            NodeState(inventory=inventory(gpu(0), gpu(1)), config=self.config, version=1)
        )

    def observe(self, event: HealthEvent) -> None:
        self.tracker.observe(event)
        self.store.update(health=self.tracker.health(), faults=self.tracker.faults())

    def servicer(
        self, interval_s: float = REPORT_INTERVAL_S, timeout_s: float = HEALTH_TIMEOUT_S
    ) -> HealthServicer:
        return HealthServicer(
            self.store,
            driver=NVIDIA_DRIVER,
            pool=NODE,
            interval_s=interval_s,
            timeout_s=timeout_s,
        )


@pytest.fixture
async def serve(socket_dir: Path) -> AsyncIterator[Callable[[HealthServicer], Awaitable[Any]]]:
    servers: list[grpc.aio.Server] = []
    channels: list[grpc.aio.Channel] = []
    followers: list[asyncio.Task[None]] = []

    async def start(servicer: HealthServicer) -> AsyncIterator[pb.NodeWatchResourcesResponse]:
        followers.append(asyncio.create_task(servicer.follow()))
        path = socket_dir / f"dra-{len(servers)}.sock"
        server = grpc.aio.server()
        add_health_servicer(servicer, server)
        server.add_insecure_port(f"unix://{path}")
        await server.start()
        servers.append(server)
        channel = grpc.aio.insecure_channel(f"unix://{path}")
        channels.append(channel)
        return aiter(dra_health_stub(channel).NodeWatchResources(pb.NodeWatchResourcesRequest()))

    try:
        yield start
    finally:
        for task in followers:
            task.cancel()
        await asyncio.gather(*followers, return_exceptions=True)
        for channel in channels:
            await channel.close(None)
        for server in servers:
            await server.stop(0)


def lines(response: pb.NodeWatchResourcesResponse) -> list[tuple[str, str, int, str]]:
    return [
        (d.device.pool_name, d.device.device_name, d.health, d.message) for d in response.devices
    ]


async def test_the_stream_reports_every_device_and_follows_the_health_policy(serve: Any) -> None:
    node = Node()
    stream = await serve(node.servicer())
    first = await asyncio.wait_for(anext(stream), WAIT)
    assert lines(first) == [(NODE, "gpu-0", pb.HEALTHY, ""), (NODE, "gpu-1", pb.HEALTHY, "")]
    assert {d.health_check_timeout_seconds for d in first.devices} == {int(HEALTH_TIMEOUT_S)}
    assert all(d.last_updated_time > 0 for d in first.devices)

    # An application Xid is ignored by the device plugin's policy: no new report.
    node.observe(HealthEvent(gpu(1).uuid, HealthEventKind.XID, xid=13))
    node.observe(HealthEvent(gpu(1).uuid, HealthEventKind.XID, xid=79))
    assert lines(await asyncio.wait_for(anext(stream), WAIT)) == [
        (NODE, "gpu-0", pb.HEALTHY, ""),
        (NODE, "gpu-1", pb.UNHEALTHY, XID_79),
    ]
    node.observe(HealthEvent(gpu(1).uuid, HealthEventKind.HEALED))
    assert lines(await asyncio.wait_for(anext(stream), WAIT)) == lines(first)


async def test_a_quiet_stream_repeats_its_report_before_the_kubelet_would_forget_it(
    serve: Any,
) -> None:
    node = Node()
    servicer = node.servicer(interval_s=0.01, timeout_s=1)
    stream = await serve(servicer)
    first = await asyncio.wait_for(anext(stream), WAIT)
    again = await asyncio.wait_for(anext(stream), WAIT)  # nothing changed on the node
    assert lines(again) == lines(first)
    assert servicer.timeout_s > servicer.interval_s


async def test_with_health_checks_off_every_device_is_unknown(serve: Any) -> None:
    node = Node(parse_config("version: v1\nflags:\n  health:\n    disabled: true\n"))
    stream = await serve(node.servicer())
    assert [(name, health) for _, name, health, _ in lines(await anext(stream))] == [
        ("gpu-0", pb.UNKNOWN),
        ("gpu-1", pb.UNKNOWN),
    ]


async def test_an_xid_shows_in_the_pods_status_through_the_kubelet_and_recovery_clears_it(
    socket_dir: Path,
) -> None:
    node = Node()
    kube = FakeKube()
    servicer = node.servicer()
    follower = asyncio.create_task(servicer.follow())
    async with DRAKubelet(socket_dir, kube, retry_initial=0.05) as kubelet:
        driver = FakeDriver(
            kubelet.registry_dir,
            kubelet.plugins_dir,
            name=NVIDIA_DRIVER,
            kube=kube,
            health=servicer,
        )
        await driver.start()
        try:
            p = pod("p1", claims={"gpus": "claim-a"})
            devices = [(NVIDIA_DRIVER, "gpu-0"), (NVIDIA_DRIVER, "gpu-1")]
            allocated_claim(kube, "claim-a", devices, reserved_for=[p], pool=NODE)
            await kubelet.wait_for_driver(NVIDIA_DRIVER, timeout=WAIT)
            await kubelet.prepare(p)

            def health() -> list[tuple[str, str]]:
                return [
                    (r["health"], r.get("message", ""))
                    for s in kubelet.allocated_resources_status(p).get("ctr", [])
                    for r in s["resources"]
                ]

            await kubelet.wait_for(lambda: health() == [(HEALTHY, "")] * 2, WAIT)
            node.observe(HealthEvent(gpu(1).uuid, HealthEventKind.XID, xid=79))
            await kubelet.wait_for(lambda: health() == [(HEALTHY, ""), (UNHEALTHY, XID_79)], WAIT)
            assert kubelet.manager.health_updates[-1] == {"uid-p1"}
            node.observe(HealthEvent(gpu(1).uuid, HealthEventKind.HEALED))
            await kubelet.wait_for(lambda: health() == [(HEALTHY, "")] * 2, WAIT)
            assert kubelet.health_errors == []
        finally:
            servicer.close()
            await driver.stop()
            follower.cancel()
            await asyncio.gather(follower, return_exceptions=True)


async def test_close_ends_the_open_streams(serve: Any) -> None:
    """A server about to stop need not wait out its grace for a stream to end."""
    node = Node()
    servicer = node.servicer()
    stream = await serve(servicer)
    await asyncio.wait_for(anext(stream), WAIT)
    servicer.close()
    with pytest.raises(StopAsyncIteration):
        await asyncio.wait_for(anext(stream), WAIT)
    assert servicer.streams == 0
