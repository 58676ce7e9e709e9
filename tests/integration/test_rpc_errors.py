"""Errors at one boundary: every DevicePlugin RPC answers a failure with a proper status.

A servicer whose methods raise stands in for any failure inside kubegpu; the real gRPC
server (with its `Boundary` interceptor) answers over a unix socket, as to the kubelet.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from kubegpu.api import device_plugin_stub, pb, pb_grpc
from kubegpu.config import Config
from kubegpu.errors import (
    AllocationError,
    ConfigError,
    DeviceError,
    KubegpuError,
    PreconditionError,
)
from kubegpu.plugin.server import DevicePluginServicer, ResourceServer, plugin_server
from kubegpu.plugin.status import MAX_DETAILS, status_for
from kubegpu.resources import ResourceSpec, build_resources
from tests import builders
from tests.waiting import WAIT

RPCS = [
    "GetDevicePluginOptions",
    "ListAndWatch",
    "Allocate",
    "GetPreferredAllocation",
    "PreStartContainer",
]
REQUESTS: dict[str, Any] = {
    "GetDevicePluginOptions": pb.Empty(),
    "ListAndWatch": pb.Empty(),
    "Allocate": pb.AllocateRequest(
        container_requests=[pb.ContainerAllocateRequest(devices_ids=["GPU-x"])]
    ),
    "GetPreferredAllocation": pb.PreferredAllocationRequest(
        container_requests=[
            pb.ContainerPreferredAllocationRequest(available_deviceIDs=["GPU-x"], allocation_size=1)
        ]
    ),
    "PreStartContainer": pb.PreStartContainerRequest(devices_ids=["GPU-x"]),
}


def _spec() -> ResourceSpec:
    return build_resources(builders.inventory(builders.gpu(0), builders.gpu(1)), Config())[0]


class Raising(DevicePluginServicer):
    """Every RPC raises `error`; Allocate's own path raises it from inside its try."""

    def __init__(self, error: Exception) -> None:
        super().__init__(_spec(), Config())
        self.error = error

    async def GetDevicePluginOptions(self, request: Any, context: Any) -> Any:
        raise self.error

    async def ListAndWatch(self, request: Any, context: Any) -> AsyncIterator[Any]:
        yield pb.ListAndWatchResponse()  # the failure comes mid-stream
        raise self.error

    async def GetPreferredAllocation(self, request: Any, context: Any) -> Any:
        raise self.error

    async def PreStartContainer(self, request: Any, context: Any) -> Any:
        raise self.error

    def _imex_channels(self, config: Config) -> Any:
        raise self.error  # inside Allocate, where its metrics see the code too


@contextlib.asynccontextmanager
async def _serving(
    socket_dir: Path, servicer: pb_grpc.DevicePluginServicer
) -> AsyncIterator[pb_grpc.DevicePluginStub]:
    server = plugin_server(servicer)
    path = socket_dir / "errors.sock"
    server.add_insecure_port(f"unix://{path}")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"unix://{path}") as channel:
            yield device_plugin_stub(channel)
    finally:
        await server.stop(0)


async def _call(stub: pb_grpc.DevicePluginStub, rpc: str) -> grpc.aio.AioRpcError:
    method: Callable[..., Any] = getattr(stub, rpc)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        if rpc == "ListAndWatch":
            async for _ in method(REQUESTS[rpc]):
                pass
        else:
            await method(REQUESTS[rpc])
    return info.value


@pytest.mark.parametrize("rpc", RPCS)
@pytest.mark.parametrize(
    ("error", "code"),
    [
        (AllocationError("unknown device ID GPU-x"), grpc.StatusCode.INVALID_ARGUMENT),
        (PreconditionError("IMEX channel 0 is required"), grpc.StatusCode.FAILED_PRECONDITION),
        (ConfigError("flags.mpsRoot: is required"), grpc.StatusCode.FAILED_PRECONDITION),
        (DeviceError("GPU-x: NVML lost the GPU"), grpc.StatusCode.UNAVAILABLE),
    ],
    ids=["allocation", "precondition", "config", "device"],
)
async def test_kubegpu_errors_get_their_code(
    socket_dir: Path, rpc: str, error: KubegpuError, code: grpc.StatusCode
) -> None:
    async with _serving(socket_dir, Raising(error)) as stub:
        failure = await _call(stub, rpc)
    assert failure.code() is code
    assert failure.details() == str(error)


@pytest.mark.parametrize("rpc", RPCS)
async def test_a_bug_is_internal_with_one_line_and_logged_with_traceback(
    socket_dir: Path, rpc: str, caplog: pytest.LogCaptureFixture
) -> None:
    bug = KeyError("line one\nline two" + "x" * 5000)
    with caplog.at_level(logging.ERROR, "kubegpu.plugin"):
        async with _serving(socket_dir, Raising(bug)) as stub:
            failure = await _call(stub, rpc)
    assert failure.code() is grpc.StatusCode.INTERNAL
    details = failure.details() or ""
    assert details.startswith("internal error in kubegpu: KeyError: ")
    assert "\n" not in details and len(details) <= MAX_DETAILS + 100
    (record,) = [r for r in caplog.records if r.getMessage().startswith(f"{rpc} failed")]
    assert record.exc_info is not None and record.exc_info[1] is bug


async def test_the_real_servicer_refuses_a_bad_preferred_size(socket_dir: Path) -> None:
    spec = _spec()
    server = ResourceServer(spec, Config(), socket_dir)
    await server.serve()
    try:
        async with grpc.aio.insecure_channel(f"unix://{server.socket_path}") as channel:
            request = pb.ContainerPreferredAllocationRequest(
                available_deviceIDs=[spec.devices[0].id], allocation_size=0
            )
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await device_plugin_stub(channel).GetPreferredAllocation(
                    pb.PreferredAllocationRequest(container_requests=[request])
                )
    finally:
        await server.stop(grace=0)
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "allocation_size must be at least 1" in (info.value.details() or "")


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (AllocationError("bad"), grpc.StatusCode.INVALID_ARGUMENT),
        (PreconditionError("not now"), grpc.StatusCode.FAILED_PRECONDITION),
        (DeviceError("gone"), grpc.StatusCode.UNAVAILABLE),
        (KubegpuError("unmapped"), grpc.StatusCode.INTERNAL),
        (RuntimeError("bug"), grpc.StatusCode.INTERNAL),
    ],
)
def test_status_for_maps_by_class_and_never_unknown(
    error: Exception, code: grpc.StatusCode
) -> None:
    got, message = status_for(error, "Allocate")
    assert got is code and got is not grpc.StatusCode.UNKNOWN
    assert "\n" not in message


class LeftBehind(DevicePluginServicer):
    """Allocate refuses its request only after the caller has gone: grpc's cancel reaches
    the method as the plugin is already answering (a kubelet restarting mid-call)."""

    def __init__(self) -> None:
        super().__init__(_spec(), Config())
        self.entered = asyncio.Event()
        self.answered = asyncio.Event()

    async def Allocate(self, request: Any, context: Any) -> Any:
        self.entered.set()
        try:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.Event().wait()  # until grpc cancels the call
            return await super().Allocate(request, context)
        finally:
            self.answered.set()


async def test_a_refusal_to_a_caller_that_left_is_not_a_bug(
    socket_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The refusal's status cannot be sent to a caller that has gone; grpc says so from
    `context.abort`. The boundary once took that for a bug in the method and aborted a
    second time: "internal error" and an "Abort already called!" traceback in the log."""
    servicer = LeftBehind()
    with caplog.at_level(logging.DEBUG):
        async with _serving(socket_dir, servicer) as stub:
            call = stub.Allocate(REQUESTS["Allocate"])  # GPU-x: refused, INVALID_ARGUMENT
            await asyncio.wait_for(servicer.entered.wait(), WAIT)
            call.cancel()
            await asyncio.wait_for(servicer.answered.wait(), WAIT)
            with pytest.raises(asyncio.CancelledError):
                await call
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == []
    assert "unknown device ID" in caplog.text, "the refusal itself is still logged"
