"""The kubelet emulator against small in-test plugins, over real unix sockets.

Each test follows one expectation of shared/KUBELET.md. Synchronisation is always a wait
on the emulator's condition with a timeout, never a sleep.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any, TypeAlias

import grpc
import pytest

from kubegpu.api import HEALTHY, KUBELET_SOCKET, UNHEALTHY, VERSION, pb, pb_grpc
from kubegpu.kubelet import (
    CHECKPOINT_FILE,
    AdmissionError,
    Allocation,
    CheckpointError,
    ContainerStartError,
    KubeletEmulator,
    merge_responses,
)

GPU = "example.com/gpu"
Ctx: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"


def dev(dev_id: str, health: str = HEALTHY, numa: Sequence[int] = ()) -> pb.Device:
    device = pb.Device(ID=dev_id, health=health)
    if numa:
        device.topology.nodes.extend(pb.NUMANode(ID=n) for n in numa)
    return device


class FakePlugin(pb_grpc.DevicePluginServicer):
    """A minimal device plugin: serves a device list and counts every call it gets."""

    def __init__(
        self,
        plugin_dir: Path,
        devices: Sequence[pb.Device],
        *,
        resource: str = GPU,
        socket: str = "fake.sock",
        pre_start_required: bool = False,
        preferred_available: bool = False,
    ) -> None:
        self.plugin_dir = plugin_dir
        self.resource = resource
        self.socket = socket
        self.options = pb.DevicePluginOptions(
            pre_start_required=pre_start_required,
            get_preferred_allocation_available=preferred_available,
        )
        self.devices = list(devices)
        self.calls: Counter[str] = Counter()
        self.preferred_requests: list[pb.PreferredAllocationRequest] = []
        self.allocate_requests: list[pb.AllocateRequest] = []
        self.pre_start_requests: list[pb.PreStartContainerRequest] = []
        #: What GetPreferredAllocation answers; None: the first allocation_size available.
        self.preferred_answer: list[str] | None = None
        #: Status codes to fail a method with.
        self.fail: dict[str, grpc.StatusCode] = {}
        self._cond = asyncio.Condition()
        self._generation = 0
        self._end_streams = False
        self._server: grpc.aio.Server | None = None

    # -- control from the test
    async def start(self) -> None:
        self._end_streams = False
        server = grpc.aio.server()
        pb_grpc.add_DevicePluginServicer_to_server(self, server)  # type: ignore[no-untyped-call]
        server.add_insecure_port(f"unix://{self.plugin_dir / self.socket}")
        await server.start()
        self._server = server

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(0)
            self._server = None

    async def register(
        self,
        *,
        version: str = VERSION,
        resource: str | None = None,
        endpoint: str | None = None,
        options: pb.DevicePluginOptions | None = None,
    ) -> None:
        async with grpc.aio.insecure_channel(
            f"unix://{self.plugin_dir / KUBELET_SOCKET}"
        ) as channel:
            stub = pb_grpc.RegistrationStub(channel)  # type: ignore[no-untyped-call]
            await stub.Register(
                pb.RegisterRequest(
                    version=version,
                    endpoint=self.socket if endpoint is None else endpoint,
                    resource_name=self.resource if resource is None else resource,
                    options=options or self.options,
                ),
                timeout=15,
            )

    async def serve_and_register(self) -> None:
        await self.start()
        await self.register()

    async def set_devices(self, devices: Sequence[pb.Device]) -> None:
        async with self._cond:
            self.devices = list(devices)
            self._generation += 1
            self._cond.notify_all()

    async def set_health(self, dev_id: str, health: str) -> None:
        await self.set_devices(
            [
                dev(d.ID, health, [n.ID for n in d.topology.nodes]) if dev_id == d.ID else d
                for d in self.devices
            ]
        )

    async def end_streams(self) -> None:
        async with self._cond:
            self._end_streams = True
            self._cond.notify_all()

    # -- the DevicePlugin service
    async def _maybe_fail(self, method: str, context: Ctx) -> None:
        self.calls[method] += 1
        if method in self.fail:
            await context.abort(self.fail[method], f"{method} failed on purpose")

    async def GetDevicePluginOptions(
        self, request: pb.Empty, context: Ctx
    ) -> pb.DevicePluginOptions:
        await self._maybe_fail("GetDevicePluginOptions", context)
        return self.options

    async def ListAndWatch(
        self, request: pb.Empty, context: Ctx
    ) -> AsyncIterator[pb.ListAndWatchResponse]:
        await self._maybe_fail("ListAndWatch", context)
        sent = -1

        def news() -> bool:
            return self._end_streams or self._generation != sent

        while True:
            async with self._cond:
                await self._cond.wait_for(news)
                if self._end_streams:
                    return
                sent = self._generation
                response = pb.ListAndWatchResponse(devices=self.devices)
            yield response

    async def GetPreferredAllocation(
        self, request: pb.PreferredAllocationRequest, context: Ctx
    ) -> pb.PreferredAllocationResponse:
        await self._maybe_fail("GetPreferredAllocation", context)
        self.preferred_requests.append(request)
        req = request.container_requests[0]
        answer = (
            self.preferred_answer
            if self.preferred_answer is not None
            else list(req.available_deviceIDs)[: req.allocation_size]
        )
        return pb.PreferredAllocationResponse(
            container_responses=[pb.ContainerPreferredAllocationResponse(deviceIDs=answer)]
        )

    async def Allocate(self, request: pb.AllocateRequest, context: Ctx) -> pb.AllocateResponse:
        await self._maybe_fail("Allocate", context)
        self.allocate_requests.append(request)
        responses = []
        for creq in request.container_requests:
            ids = ",".join(creq.devices_ids)
            responses.append(
                pb.ContainerAllocateResponse(
                    envs={"VISIBLE_DEVICES": ids, "PLUGIN": self.socket},
                    annotations={"example.com/devices": ids},
                    mounts=[
                        pb.Mount(container_path="/usr/lib/x", host_path="/opt/x", read_only=True)
                    ],
                    devices=[
                        pb.DeviceSpec(
                            container_path=f"/dev/{d}", host_path=f"/dev/{d}", permissions="rw"
                        )
                        for d in creq.devices_ids
                    ],
                    cdi_devices=[
                        pb.CDIDevice(name=f"example.com/gpu={d}") for d in creq.devices_ids
                    ],
                )
            )
        return pb.AllocateResponse(container_responses=responses)

    async def PreStartContainer(
        self, request: pb.PreStartContainerRequest, context: Ctx
    ) -> pb.PreStartContainerResponse:
        await self._maybe_fail("PreStartContainer", context)
        self.pre_start_requests.append(request)
        return pb.PreStartContainerResponse()


@pytest.fixture
async def kubelet(socket_dir: Path) -> AsyncIterator[KubeletEmulator]:
    emulator = KubeletEmulator(socket_dir, grace_period=0.2, dial_timeout=2.0)
    await emulator.start()
    try:
        yield emulator
    finally:
        await emulator.stop()


MakePlugin = Callable[..., FakePlugin]


@pytest.fixture
async def make_plugin(socket_dir: Path) -> AsyncIterator[MakePlugin]:
    """Build plugins serving in `socket_dir`; every one is stopped at the end."""
    made: list[FakePlugin] = []

    def make(devices: Sequence[pb.Device], **kwargs: Any) -> FakePlugin:
        plugin = FakePlugin(socket_dir, devices, **kwargs)
        made.append(plugin)
        return plugin

    try:
        yield make
    finally:
        for plugin in made:
            await plugin.stop()


def gpus(n: int) -> list[pb.Device]:
    return [dev(f"gpu-{i}") for i in range(n)]


# ------------------------------------------------------------------------ registration


async def test_registration_reports_capacity(
    kubelet: KubeletEmulator, make_plugin: MakePlugin
) -> None:
    plugin = make_plugin(gpus(2))
    await plugin.serve_and_register()
    await kubelet.wait_for_resource(GPU, capacity=2, allocatable=2)
    [record] = kubelet.registrations
    assert record.ok and record.resource == GPU and record.endpoint == "fake.sock"
    assert plugin.calls["GetDevicePluginOptions"] == 1
    assert plugin.calls["ListAndWatch"] == 1
    assert kubelet.history(GPU) == [(2, 2)]
    assert set(kubelet.devices(GPU)) == {"gpu-0", "gpu-1"}
    assert kubelet.resources == [GPU]


@pytest.mark.parametrize(
    ("version", "resource", "endpoint", "message"),
    [
        (
            "v1alpha1",
            GPU,
            "fake.sock",
            'requested API version "v1alpha1" is not supported by kubelet',
        ),
        (VERSION, "gpu", "fake.sock", 'the ResourceName "gpu" is invalid'),
        (VERSION, "kubernetes.io/gpu", "fake.sock", "is invalid"),
        (VERSION, "gpu.kubernetes.io/gpu", "fake.sock", "is invalid"),
        (VERSION, "requests.example.com/gpu", "fake.sock", "is invalid"),
        (VERSION, "example.com/" + "g" * 64, "fake.sock", "is invalid"),
        (VERSION, "example.com/gpu!", "fake.sock", "is invalid"),
        (VERSION, "example.com/-gpu", "fake.sock", "is invalid"),
        (VERSION, "Example.com/gpu", "fake.sock", "is invalid"),
        (VERSION, GPU, "sub/fake.sock", "invalid endpoint"),
        (VERSION, GPU, "", "invalid endpoint"),
    ],
    ids=[
        "version",
        "no-slash",
        "k8s-namespace",
        "k8s-subdomain",
        "requests-prefix",
        "name-too-long",
        "bad-char",
        "bad-start",
        "uppercase-prefix",
        "endpoint-slash",
        "endpoint-empty",
    ],
)
async def test_registration_validation(
    kubelet: KubeletEmulator,
    make_plugin: MakePlugin,
    version: str,
    resource: str,
    endpoint: str,
    message: str,
) -> None:
    plugin = make_plugin(gpus(1))
    await plugin.start()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await plugin.register(version=version, resource=resource, endpoint=endpoint)
    assert info.value.code() == grpc.StatusCode.UNKNOWN
    assert message in (info.value.details() or "")
    assert plugin.calls["GetDevicePluginOptions"] == 0
    assert plugin.calls["ListAndWatch"] == 0
    [record] = kubelet.registrations
    assert not record.ok and message in (record.error or "")
    assert kubelet.resources == []


async def test_longest_valid_name_is_accepted(
    kubelet: KubeletEmulator, make_plugin: MakePlugin
) -> None:
    name = "example.com/" + "g" * 63
    plugin = make_plugin(gpus(1), resource=name)
    await plugin.serve_and_register()
    await kubelet.wait_for_resource(name, capacity=1)


async def test_options_failure_fails_register(
    kubelet: KubeletEmulator, make_plugin: MakePlugin
) -> None:
    plugin = make_plugin(gpus(1))
    plugin.fail["GetDevicePluginOptions"] = grpc.StatusCode.INTERNAL
    await plugin.start()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await plugin.register()
    assert (info.value.details() or "").startswith(
        "failed to get device plugin options: rpc error: code = Internal desc = "
    )
    assert plugin.calls["ListAndWatch"] == 0
    assert kubelet.calls("ListAndWatch") == []
    assert kubelet.resources == [] and kubelet.capacity(GPU) == 0
    assert not kubelet.registrations[0].ok


async def test_register_before_serving_fails_to_dial(
    socket_dir: Path, make_plugin: MakePlugin
) -> None:
    async with KubeletEmulator(socket_dir, dial_timeout=0.3) as kubelet:
        plugin = make_plugin(gpus(1))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await plugin.register()
        assert "failed to dial device plugin" in (info.value.details() or "")
        assert kubelet.resources == []


async def test_options_come_from_the_plugin_not_the_request(
    kubelet: KubeletEmulator,
    make_plugin: MakePlugin,
) -> None:
    plugin = make_plugin(gpus(2), preferred_available=False)
    await plugin.start()
    await plugin.register(
        options=pb.DevicePluginOptions(
            get_preferred_allocation_available=True, pre_start_required=True
        )
    )
    await kubelet.wait_for_resource(GPU, capacity=2)
    options = kubelet.options(GPU)
    assert options is not None and not options.get_preferred_allocation_available
    await kubelet.allocate(GPU, 1)
    assert plugin.calls["GetPreferredAllocation"] == 0
    assert plugin.calls["PreStartContainer"] == 0


async def test_reregistration_replaces_the_endpoint(
    kubelet: KubeletEmulator, make_plugin: MakePlugin
) -> None:
    plugin = make_plugin(gpus(2))
    await plugin.serve_and_register()
    await kubelet.wait_for_resource(GPU, capacity=2, allocatable=2)
    await plugin.register()
    await kubelet.wait_for(lambda: len(kubelet.calls("ListAndWatch")) == 2)
    await plugin.set_devices(gpus(3))
    await kubelet.wait_for_resource(GPU, capacity=3, allocatable=3)
    assert kubelet.endpoints(GPU) == {"fake.sock": True}
    assert kubelet.history(GPU) == [(2, 2), (3, 3)]


# ------------------------------------------------------------------------ ListAndWatch


async def test_one_device_health_flips(kubelet: KubeletEmulator, make_plugin: MakePlugin) -> None:
    plugin = make_plugin([dev("gpu-0")])
    await plugin.serve_and_register()
    await kubelet.wait_for_resource(GPU, capacity=1, allocatable=1)
    await plugin.set_health("gpu-0", UNHEALTHY)
    await kubelet.wait_for_resource(GPU, capacity=1, allocatable=0)
    assert not kubelet.devices(GPU)["gpu-0"].healthy
    await plugin.set_health("gpu-0", HEALTHY)
    await kubelet.wait_for_resource(GPU, capacity=1, allocatable=1)
    assert kubelet.history(GPU) == [(1, 1), (1, 0), (1, 1)]


async def test_four_devices_health_flips(kubelet: KubeletEmulator, make_plugin: MakePlugin) -> None:
    plugin = make_plugin(gpus(4))
    await plugin.serve_and_register()
    await kubelet.wait_for_resource(GPU, capacity=4, allocatable=4)
    # The node e2e sequence: 4/4 → 3/4 → 4/4 → 2/4 → 3/4 → 4/4.
    for unhealthy, expected in [
        ({"gpu-0"}, 3),
        (set(), 4),
        ({"gpu-1", "gpu-2"}, 2),
        ({"gpu-2"}, 3),
        (set(), 4),
    ]:
        await plugin.set_devices(
            [dev(f"gpu-{i}", UNHEALTHY if f"gpu-{i}" in unhealthy else HEALTHY) for i in range(4)]
        )
        await kubelet.wait_for_resource(GPU, capacity=4, allocatable=expected)
    assert kubelet.history(GPU) == [(4, 4), (4, 3), (4, 4), (4, 2), (4, 3), (4, 4)]


async def test_update_replaces_whole_device_set(
    kubelet: KubeletEmulator, make_plugin: MakePlugin
) -> None:
    plugin = make_plugin(gpus(4))
    await plugin.serve_and_register()
    await kubelet.wait_for_resource(GPU, capacity=4)
    await plugin.set_devices([dev("gpu-9", UNHEALTHY)])
    await kubelet.wait_for_resource(GPU, capacity=1, allocatable=0)
    assert list(kubelet.devices(GPU)) == ["gpu-9"]


async def test_stream_end_marks_unhealthy_no_retry_then_gone(
    kubelet: KubeletEmulator,
    make_plugin: MakePlugin,
) -> None:
    plugin = make_plugin(gpus(4))
    await plugin.serve_and_register()
    await kubelet.wait_for_resource(GPU, capacity=4, allocatable=4)
    await plugin.end_streams()
    await kubelet.wait_for_resource(GPU, capacity=4, allocatable=0)
    assert GPU in kubelet.resources
    # After the grace period (0.2 s here) the resource disappears; no retry meanwhile.
    await kubelet.wait_for(lambda: GPU not in kubelet.resources, timeout=5)
    assert plugin.calls["ListAndWatch"] == 1
    assert len(kubelet.calls("ListAndWatch")) == 1
    assert kubelet.history(GPU) == [(4, 4), (4, 0), (0, 0)]


async def test_plugin_death_marks_unhealthy(
    kubelet: KubeletEmulator, make_plugin: MakePlugin
) -> None:
    plugin = make_plugin(gpus(2))
    await plugin.serve_and_register()
    await kubelet.wait_for_resource(GPU, capacity=2, allocatable=2)
    await plugin.stop()
    await kubelet.wait_for_resource(GPU, capacity=2, allocatable=0)
    assert kubelet.endpoints(GPU) == {"fake.sock": False}


async def test_plugin_restart_restores_capacity_keeps_assignments(
    kubelet: KubeletEmulator,
    make_plugin: MakePlugin,
) -> None:
    plugin = make_plugin(gpus(2))
    await plugin.serve_and_register()
    await kubelet.wait_for_resource(GPU, capacity=2, allocatable=2)
    first = await kubelet.allocate(GPU, 1, pod="p1")
    await plugin.stop()
    await kubelet.wait_for_resource(GPU, capacity=2, allocatable=0)
    await plugin.serve_and_register()
    await kubelet.wait_for_resource(GPU, capacity=2, allocatable=2)
    again = await kubelet.allocate(GPU, 1, pod="p1")
    assert again.cached and again.device_ids == first.device_ids
    other = await kubelet.allocate(GPU, 1, pod="p2")
    assert set(other.device_ids).isdisjoint(first.device_ids)


async def test_device_id_longer_than_63_is_rejected(
    kubelet: KubeletEmulator, make_plugin: MakePlugin
) -> None:
    plugin = make_plugin(gpus(1))
    await plugin.serve_and_register()
    await kubelet.wait_for_resource(GPU, capacity=1)
    await plugin.set_devices([dev("x" * 64), dev("gpu-1")])
    await kubelet.wait_for(lambda: bool(kubelet.rejected_updates))
    assert "63" in kubelet.rejected_updates[0]
    assert list(kubelet.devices(GPU)) == ["gpu-0"]


# ------------------------------------------------------------------------ kubelet restart


async def test_kubelet_restart(
    kubelet: KubeletEmulator, make_plugin: MakePlugin, socket_dir: Path
) -> None:
    plugin = make_plugin(gpus(4))
    await plugin.serve_and_register()
    await kubelet.wait_for_resource(GPU, capacity=4, allocatable=4)
    first = await kubelet.allocate(GPU, 2, pod="p1")
    assert plugin.calls["Allocate"] == 1

    await kubelet.restart()
    assert not (socket_dir / "fake.sock").exists()
    assert (socket_dir / KUBELET_SOCKET).exists()
    assert (socket_dir / CHECKPOINT_FILE).exists()
    assert GPU in kubelet.resources
    assert (kubelet.capacity(GPU), kubelet.allocatable(GPU)) == (0, 0)
    [restored] = kubelet.allocations("p1")
    assert restored.device_ids == first.device_ids
    assert restored.envs == first.envs

    # The plugin notices, serves again and re-registers: capacity comes back.
    await plugin.stop()
    await plugin.serve_and_register()
    await kubelet.wait_for_resource(GPU, capacity=4, allocatable=4)
    assert kubelet.history(GPU) == [(4, 4), (0, 0), (4, 4)]
    # The running pod keeps its devices; a restart of its container makes no RPC.
    again = await kubelet.allocate(GPU, 2, pod="p1")
    assert again.cached and again.device_ids == first.device_ids
    assert plugin.calls["Allocate"] == 1
    # The surviving allocation is still in use.
    with pytest.raises(AdmissionError, match=f"Insufficient {GPU}"):
        await kubelet.allocate(GPU, 3, pod="p2")


async def test_restored_resource_disappears_without_plugin(
    kubelet: KubeletEmulator, make_plugin: MakePlugin
) -> None:
    plugin = make_plugin(gpus(1))
    await plugin.serve_and_register()
    await kubelet.wait_for_resource(GPU, capacity=1)
    await plugin.stop()
    await kubelet.restart()
    assert GPU in kubelet.resources
    await kubelet.wait_for(lambda: GPU not in kubelet.resources)


async def test_checkpoint_is_kubelet_json(
    kubelet: KubeletEmulator, make_plugin: MakePlugin, socket_dir: Path
) -> None:
    plugin = make_plugin([dev("gpu-0", numa=[1]), dev("gpu-1")])
    await plugin.serve_and_register()
    await kubelet.wait_for_resource(GPU, capacity=2)
    await kubelet.allocate(GPU, 2, pod="uid-1", container="main")
    doc = json.loads((socket_dir / CHECKPOINT_FILE).read_text())
    assert set(doc) == {"Data", "Checksum"}
    [entry] = doc["Data"]["PodDeviceEntries"]
    assert (entry["PodUID"], entry["ContainerName"], entry["ResourceName"]) == (
        "uid-1",
        "main",
        GPU,
    )
    assert entry["DeviceIDs"] == {"1": ["gpu-0"], "-1": ["gpu-1"]}
    assert doc["Data"]["RegisteredDevices"] == {GPU: ["gpu-0", "gpu-1"]}
    assert kubelet.release("uid-1") == ["gpu-0", "gpu-1"]
    assert json.loads((socket_dir / CHECKPOINT_FILE).read_text())["Data"]["PodDeviceEntries"] == []


async def test_corrupt_checkpoint_refuses_start(socket_dir: Path) -> None:
    (socket_dir / CHECKPOINT_FILE).write_text('{"Data": {"PodDeviceEntries": []}, "Checksum": 1}')
    with pytest.raises(CheckpointError, match="corrupted"):
        await KubeletEmulator(socket_dir).start()


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


# ------------------------------------------------------------------------ rolling update


async def test_two_endpoints_keep_capacity(
    kubelet: KubeletEmulator, make_plugin: MakePlugin
) -> None:
    old = make_plugin(gpus(2), socket="old.sock")
    await old.serve_and_register()
    await kubelet.wait_for_resource(GPU, capacity=2, allocatable=2)
    new = make_plugin(gpus(2), socket="new.sock")
    await new.serve_and_register()
    # Wait until the new instance's own report is the one in force.
    await kubelet.wait_for(
        lambda: (
            kubelet.endpoints(GPU) == {"old.sock": True, "new.sock": True}
            and all(d.endpoint == "new.sock" for d in kubelet.devices(GPU).values())
        )
    )
    await old.stop()
    await kubelet.wait_for(lambda: kubelet.endpoints(GPU).get("old.sock") is False)
    assert (kubelet.capacity(GPU), kubelet.allocatable(GPU)) == (2, 2)
    allocation = await kubelet.allocate(GPU, 1)
    assert allocation.envs["PLUGIN"] == "new.sock"
    # The old endpoint expires after the grace period; capacity never dipped.
    await kubelet.wait_for(lambda: kubelet.endpoints(GPU) == {"new.sock": True})
    assert kubelet.history(GPU) == [(2, 2)]


async def test_allocate_through_advertising_endpoint(
    kubelet: KubeletEmulator, make_plugin: MakePlugin
) -> None:
    a = make_plugin([dev("a-0")], socket="a.sock")
    b = make_plugin([dev("b-0")], socket="b.sock")
    await a.serve_and_register()
    await b.serve_and_register()
    await kubelet.wait_for_resource(GPU, capacity=2, allocatable=2)
    first = await kubelet.allocate(GPU, 1, pod="p1")
    second = await kubelet.allocate(GPU, 1, pod="p2")
    assert (first.device_ids, first.envs["PLUGIN"]) == (("a-0",), "a.sock")
    assert (second.device_ids, second.envs["PLUGIN"]) == (("b-0",), "b.sock")
    assert a.calls["Allocate"] == b.calls["Allocate"] == 1


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
    kubelet = KubeletEmulator(socket_dir, grace_period=0.2, topology_manager=manager)
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


# ------------------------------------------------------------------------ observation


async def test_wait_timeout_names_expected_and_actual(kubelet: KubeletEmulator) -> None:
    with pytest.raises(TimeoutError) as info:
        await kubelet.wait_for_resource(GPU, capacity=4, allocatable=4, timeout=0.05)
    assert "expected example.com/gpu capacity=4 allocatable=4" in str(info.value)
    assert "actual capacity=0 allocatable=0" in str(info.value)


async def test_on_change_subscribers(kubelet: KubeletEmulator, make_plugin: MakePlugin) -> None:
    seen: list[str] = []
    unsubscribe = kubelet.on_change(seen.append)
    plugin = make_plugin(gpus(1))
    await plugin.serve_and_register()
    await kubelet.wait_for_resource(GPU, capacity=1)
    assert GPU in seen
    unsubscribe()
    seen.clear()
    await plugin.set_health("gpu-0", UNHEALTHY)
    await kubelet.wait_for_resource(GPU, allocatable=0)
    assert seen == []


def test_allocation_is_frozen() -> None:
    allocation = Allocation(device_ids=("a",), response=pb.ContainerAllocateResponse())
    with pytest.raises(AttributeError):
        allocation.device_ids = ("b",)  # type: ignore[misc]
