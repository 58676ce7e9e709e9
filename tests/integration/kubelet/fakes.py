"""A minimal in-test device plugin for the kubelet emulator's tests, and its devices."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any, TypeAlias

import grpc

from kubegpu.api import HEALTHY, KUBELET_SOCKET, VERSION, pb, pb_grpc
from tests.waiting import WAIT

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
        #: Streams opened so far, and those told to end (by opening order, from 1).
        self._streams = 0
        self._ended: set[int] = set()
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
                timeout=WAIT,
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

    async def end_stream(self, n: int) -> None:
        """End only the `n`th ListAndWatch stream opened (from 1)."""
        async with self._cond:
            self._ended.add(n)
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
        self._streams += 1
        me = self._streams

        def news() -> bool:
            return self._end_streams or me in self._ended or self._generation != sent

        while True:
            async with self._cond:
                await self._cond.wait_for(news)
                if self._end_streams or me in self._ended:
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


MakePlugin = Callable[..., FakePlugin]


def gpus(n: int) -> list[pb.Device]:
    return [dev(f"gpu-{i}") for i in range(n)]
