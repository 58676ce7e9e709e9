"""One connected device plugin, as the kubelet's `endpoint.go` and `plugin/v1beta1/client.go`.

An `Endpoint` is a plugin socket that registered a resource: its typed gRPC client, the
options it answered and whether its `ListAndWatch` stream is still open. The devices are not
the endpoint's: the kubelet keeps one device set per resource, which every update of any of
the resource's endpoints replaces whole (`genericDeviceUpdateCallback` is keyed by resource
name), so `Endpoint.parse` only validates and converts an update for the manager. `dial` is
the connection the kubelet makes inside `Register`; `Endpoint.watch` follows the stream;
`primary` answers "which endpoint" for a resource served by more than one socket (a rolling
update with surge). The endpoint records every call it makes through the `Recorder` it is
given, so the manager keeps one ordered call log.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, cast

import grpc

from kubegpu.api import HEALTHY, UNHEALTHY, pb, pb_grpc
from kubegpu.kubelet.model import DeviceState
from kubegpu.kubelet.validation import device_id_error

log = logging.getLogger("kubegpu.kubelet")

#: What grpc-go's `Recv` returns on a stream whose connection the kubelet closed itself.
CLIENT_CONN_CLOSING = "rpc error: code = Canceled desc = grpc: the client connection is closing"

_GO_CODE_NAMES = {grpc.StatusCode.OK: "OK", grpc.StatusCode.CANCELLED: "Canceled"}


def go_error(exc: grpc.RpcError) -> str:
    """Render a gRPC error as grpc-go's `status.Error` prints it (what the kubelet reports)."""
    if isinstance(exc, grpc.aio.AioRpcError):
        code, details = exc.code(), exc.details() or ""
    else:
        return f"rpc error: {exc}"
    name = _GO_CODE_NAMES.get(code) or "".join(p.capitalize() for p in code.name.split("_"))
    return f"rpc error: code = {name} desc = {details}"


class Recorder(Protocol):
    """Where calls to a plugin are logged: `(resource, endpoint, method, error or None)`."""

    def __call__(self, resource: str, endpoint: str, method: str, error: str | None) -> None: ...


class PluginClient:
    """Typed calls to one plugin socket (the generated stub is untyped)."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.channel = channel
        self._stub = pb_grpc.DevicePluginStub(channel)  # type: ignore[no-untyped-call]

    async def options(self) -> pb.DevicePluginOptions:
        return cast(pb.DevicePluginOptions, await self._stub.GetDevicePluginOptions(pb.Empty()))

    def list_and_watch(self) -> grpc.aio.UnaryStreamCall[pb.Empty, pb.ListAndWatchResponse]:
        return cast(
            "grpc.aio.UnaryStreamCall[pb.Empty, pb.ListAndWatchResponse]",
            self._stub.ListAndWatch(pb.Empty()),
        )

    async def preferred(
        self, request: pb.PreferredAllocationRequest
    ) -> pb.PreferredAllocationResponse:
        return cast(
            pb.PreferredAllocationResponse, await self._stub.GetPreferredAllocation(request)
        )

    async def allocate(self, request: pb.AllocateRequest) -> pb.AllocateResponse:
        return cast(pb.AllocateResponse, await self._stub.Allocate(request))

    async def pre_start(
        self, request: pb.PreStartContainerRequest, timeout: float
    ) -> pb.PreStartContainerResponse:
        return cast(
            pb.PreStartContainerResponse,
            await self._stub.PreStartContainer(request, timeout=timeout),
        )


#: Every dial gets a grpc subchannel pool of its own, as each of the kubelet's grpc-go client
#: connections has its own connection and reconnect backoff. With grpc-core's default, one
#: pool per process, any other channel of this process to the same socket path (a test's or
#: a benchmark's Allocate client that failed while the socket was gone) would lend the dial
#: its connection attempt, and with it a reconnect backoff of about a second.
DIAL_OPTIONS: tuple[tuple[str, int], ...] = (("grpc.use_local_subchannel_pool", 1),)


async def dial(
    plugin_dir: Path, resource: str, endpoint: str, timeout: float, record: Recorder
) -> tuple[PluginClient, pb.DevicePluginOptions] | str:
    """Connect to a plugin and ask its options, inside Register, as the kubelet does.

    Returns the client and options, or the error text `Register` returns to the plugin
    (the channel is then closed).
    """
    channel = grpc.aio.insecure_channel(f"unix://{plugin_dir / endpoint}", options=DIAL_OPTIONS)
    client = PluginClient(channel)
    try:
        try:
            await asyncio.wait_for(channel.channel_ready(), timeout)
        except TimeoutError:
            await channel.close(None)
            return "failed to dial device plugin: context deadline exceeded"
        try:
            options = await client.options()
        except grpc.RpcError as exc:
            record(resource, endpoint, "GetDevicePluginOptions", go_error(exc))
            await channel.close(None)
            return f"failed to get device plugin options: {go_error(exc)}"
    except asyncio.CancelledError:
        await channel.close(None)
        raise
    record(resource, endpoint, "GetDevicePluginOptions", None)
    return client, options


@dataclass(eq=False)
class Endpoint:
    """One registered plugin socket serving a resource."""

    resource: str
    name: str
    options: pb.DevicePluginOptions
    client: PluginClient
    #: Registration order: the newest live endpoint is the resource's primary.
    seq: int
    #: False once ListAndWatch ended: its devices read unhealthy until the grace period ends.
    alive: bool = True
    #: Set when the kubelet itself dropped the endpoint (replaced, expired, kubelet stopped).
    closed: bool = False
    #: Set when the kubelet closed the connection (`disconnect`): what the stream still
    #: delivers is not read, and its end is reported as usual.
    disconnected: bool = False
    task: asyncio.Task[None] | None = None
    expiry: asyncio.Task[None] | None = None

    async def disconnect(self) -> None:
        """Close the connection only, as `client.Disconnect` does (`plugin/v1beta1/client.go`):
        the stream then ends on its own and `watch` reports it like any other end."""
        self.alive = False
        self.disconnected = True
        await self.client.channel.close(None)

    async def close(self) -> None:
        """Drop the endpoint: stop its tasks (unless called from one) and its channel."""
        self.closed = True
        for task in (self.task, self.expiry):
            if task is not None and task is not asyncio.current_task():
                task.cancel()
        await self.client.channel.close(None)

    async def watch(
        self,
        record: Recorder,
        on_update: Callable[[Endpoint, pb.ListAndWatchResponse], Awaitable[None]],
        on_disconnect: Callable[[Endpoint, str], Awaitable[None]],
    ) -> None:
        """Follow ListAndWatch until it ends; the kubelet never reopens it."""
        # What grpc-go's Recv returns when the plugin ends the stream (io.EOF).
        reason = "EOF"
        try:
            call = self.client.list_and_watch()
            record(self.resource, self.name, "ListAndWatch", None)
            async for response in call:
                if self.closed:
                    return
                if not self.disconnected:
                    await on_update(self, response)
        except (grpc.RpcError, grpc.aio.BaseError) as exc:
            reason = go_error(exc) if isinstance(exc, grpc.RpcError) else repr(exc)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # the watch itself is being stopped
            # grpc.aio ends the iteration of a call whose channel was closed with
            # CancelledError; grpc-go's Recv says this.
            reason = CLIENT_CONN_CLOSING
        if not self.closed:
            await on_disconnect(self, reason)

    def parse(self, response: pb.ListAndWatchResponse) -> dict[str, DeviceState] | list[str]:
        """An update as the resource's new device set, or its invalid IDs' errors (the
        kubelet then ignores the whole update)."""
        errors = [e for e in (device_id_error(d.ID) for d in response.devices) if e]
        if errors:
            return errors
        return {
            d.ID: DeviceState(
                id=d.ID,
                health=HEALTHY if d.health == HEALTHY else UNHEALTHY,
                numa_nodes=tuple(n.ID for n in d.topology.nodes),
                endpoint=self.name,
            )
            for d in response.devices
        }


def primary(endpoints: Iterable[Endpoint]) -> Endpoint | None:
    """The resource's primary endpoint (the kubelet's `m.endpoints[resource]`): the newest
    live registration; when it goes, a surviving sibling takes its place."""
    return max((e for e in endpoints if e.alive), key=lambda e: e.seq, default=None)


def options_text(options: pb.DevicePluginOptions) -> str:
    return (
        f"pre_start_required={options.pre_start_required} "
        f"get_preferred_allocation_available={options.get_preferred_allocation_available}"
    )
