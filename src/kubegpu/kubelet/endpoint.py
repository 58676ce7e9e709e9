"""One connected device plugin, as the kubelet's `endpoint.go` and `plugin/v1beta1/client.go`.

An `Endpoint` is a plugin socket that registered a resource: its typed gRPC client, the
options it answered, the devices its `ListAndWatch` last reported and whether that stream is
still open. `dial` is the connection the kubelet makes inside `Register`; `Endpoint.watch`
follows the stream; `view`, `primary` and `allocating` answer "which endpoint" questions for a
resource served by more than one socket (rolling updates). The endpoint records every call it
makes through the `Recorder` it is given, so the manager keeps one ordered call log.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Protocol, cast

import grpc

from kubegpu.api import HEALTHY, UNHEALTHY, pb, pb_grpc
from kubegpu.kubelet.model import DeviceState
from kubegpu.kubelet.validation import device_id_error

log = logging.getLogger("kubegpu.kubelet")

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
    #: Registration order: the newest live endpoint answers GetPreferredAllocation.
    seq: int
    devices: dict[str, DeviceState] = field(default_factory=dict)
    #: False once ListAndWatch ended: its devices read unhealthy until the grace period ends.
    alive: bool = True
    #: Set when the kubelet itself dropped the endpoint (replaced, expired, kubelet stopped).
    closed: bool = False
    task: asyncio.Task[None] | None = None
    expiry: asyncio.Task[None] | None = None

    def inherit(self, old: Endpoint) -> None:
        """Take over the devices of the endpoint this one replaces (same socket again).

        They stand until the first ListAndWatch update; a dead old endpoint's read unhealthy.
        """
        self.devices = {
            i: replace(d, health=d.health if old.alive else UNHEALTHY, endpoint=self.name)
            for i, d in old.devices.items()
        }

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
        reason = "stream closed by the plugin"
        try:
            call = self.client.list_and_watch()
            record(self.resource, self.name, "ListAndWatch", None)
            async for response in call:
                if self.closed:
                    return
                await on_update(self, response)
        except (grpc.RpcError, grpc.aio.BaseError) as exc:
            reason = go_error(exc) if isinstance(exc, grpc.RpcError) else repr(exc)
        if not self.closed:
            await on_disconnect(self, reason)

    def update(self, response: pb.ListAndWatchResponse) -> list[str]:
        """Take a ListAndWatch update; the invalid device IDs' errors if it was refused whole."""
        errors = [e for e in (device_id_error(d.ID) for d in response.devices) if e]
        if errors:
            return errors
        self.devices = {
            d.ID: DeviceState(
                id=d.ID,
                health=HEALTHY if d.health == HEALTHY else UNHEALTHY,
                numa_nodes=tuple(n.ID for n in d.topology.nodes),
                endpoint=self.name,
            )
            for d in response.devices
        }
        return []


def _ranked(endpoints: Iterable[Endpoint]) -> list[Endpoint]:
    # Live before dead, then newest registration first.
    return sorted(endpoints, key=lambda e: (e.alive, e.seq), reverse=True)


def view(endpoints: Iterable[Endpoint]) -> dict[str, DeviceState]:
    """The union of a resource's endpoints' devices; a live endpoint's report wins."""
    devices: dict[str, DeviceState] = {}
    for ep in _ranked(endpoints):
        for dev_id, dev in ep.devices.items():
            if dev_id not in devices:
                devices[dev_id] = dev if ep.alive else replace(dev, health=UNHEALTHY)
    return devices


def primary(endpoints: Iterable[Endpoint]) -> Endpoint | None:
    """The newest live endpoint: the one whose options and preferences count."""
    return max((e for e in endpoints if e.alive), key=lambda e: e.seq, default=None)


def allocating(
    endpoints: Iterable[Endpoint], device_ids: Sequence[str], *, live_only: bool = True
) -> Endpoint | None:
    """The newest endpoint advertising all the devices (rolling updates have two).

    Without `live_only`, fall back to the best-ranked endpoint when none advertises them all.
    """
    ranked = _ranked(endpoints)
    for ep in ranked:
        if (ep.alive or not live_only) and all(d in ep.devices for d in device_ids):
            return ep
    return None if live_only or not ranked else ranked[0]


def options_text(options: pb.DevicePluginOptions) -> str:
    return (
        f"pre_start_required={options.pre_start_required} "
        f"get_preferred_allocation_available={options.get_preferred_allocation_available}"
    )
