"""One device plugin: a `grpc.aio` server for one resource name on its own unix socket.

The servicer reads only the current `ResourceSpec` and `Config` (swapped atomically by
`update`); it never talks to a GPU backend. Every RPC runs inside one error boundary (the
`Boundary` interceptor, with `kubegpu.plugin.status.status_for` as the one mapping), so
errors reach the kubelet as proper status codes, never as tracebacks or UNKNOWN.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc

from kubegpu import cdi, mps
from kubegpu.allocation import (
    CDI_STRATEGIES,
    ContainerEdits,
    ImexChannel,
    build_response,
    describe_ids,
    select_imex_channels,
    validate_request,
)
from kubegpu.api import add_device_plugin_servicer, pb, pb_grpc
from kubegpu.config import AllocationPolicy, Config, DeviceListStrategy
from kubegpu.errors import AllocationError
from kubegpu.metrics import Metrics
from kubegpu.placement import preferred_allocation
from kubegpu.plugin.registration import register
from kubegpu.plugin.status import status_for
from kubegpu.resources import ResourceSpec
from kubegpu.rpc import RETIRE_GRACE_S, Boundary, Calls, UnixServer
from kubegpu.rpc import undecodable as undecodable

log = logging.getLogger("kubegpu.plugin")


def plugin_options() -> pb.DevicePluginOptions:
    """What every kubegpu plugin offers; the kubelet reads it back from the plugin itself."""
    return pb.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True)


def device_list(spec: ResourceSpec) -> pb.ListAndWatchResponse:
    """The ListAndWatch message for a spec: every device with health and NUMA node."""
    response = pb.ListAndWatchResponse()
    # add() builds in place: half the time of constructing and copying sub-messages.
    for d in spec.devices:
        device = response.devices.add(ID=d.id, health=d.health.value)
        if d.numa_node is not None:
            device.topology.nodes.add(ID=d.numa_node)
    return response


def to_pb(edits: ContainerEdits) -> pb.ContainerAllocateResponse:
    out = pb.ContainerAllocateResponse()
    fill_pb(out, edits)
    return out


def fill_pb(out: pb.ContainerAllocateResponse, edits: ContainerEdits) -> None:
    """Write `edits` into `out` in place (Allocate's hot path).

    Building in place with `add()` and item assignment costs about half of constructing
    the message from keyword arguments, which copies every sub-message and fills map
    fields through a Python-level `update`.
    """
    envs = out.envs
    for key, value in edits.envs.items():
        envs[key] = value
    for m in edits.mounts:
        out.mounts.add(
            container_path=m.container_path, host_path=m.host_path, read_only=m.read_only
        )
    for d in edits.device_specs:
        out.devices.add(
            container_path=d.container_path, host_path=d.host_path, permissions=d.permissions
        )
    annotations = out.annotations
    for key, value in edits.annotations.items():
        annotations[key] = value
    for name in edits.cdi_devices:
        out.cdi_devices.add(name=name)


class DevicePluginServicer(pb_grpc.DevicePluginServicer):
    """The five DevicePlugin RPCs over the current spec of one resource."""

    def __init__(
        self,
        spec: ResourceSpec,
        config: Config,
        *,
        metrics: Metrics | None = None,
        cdi_dir: Path = Path(cdi.DEFAULT_DIRECTORY),
    ) -> None:
        self.spec = spec
        self.config = config
        #: The largest request worth decoding for this spec (`request_limit`).
        self.request_limit = request_limit(spec)
        self.cdi_dir = cdi_dir
        self._cdi_classes = cdi.ClassCache(cdi_dir)
        self._metrics = metrics
        self._version = 0
        #: The list message of one spec version: every stream opened on that version (the
        #: kubelet re-opens one after each restart) sends it without rebuilding it; 8,192
        #: IDs take ~13 ms to build in Python and <1 ms to send.
        self._list: tuple[int, pb.ListAndWatchResponse] | None = None
        self._changed = asyncio.Condition()
        #: The serving period, None while closed: a ListAndWatch stream ends with the
        #: period it began in, so a replaced server's streams end while the new one's run.
        self._period: object | None = object()
        #: No more device lists: a successor's are the kubelet's now (`freeze`).
        self._frozen = False
        #: Replaced by `thaw`: streams opened before it belong to an earlier registration.
        self._registration = object()
        #: Set once a ListAndWatch stream has sent a list (readiness).
        self.list_sent = asyncio.Event()
        #: ListAndWatch streams open now.
        self.streams = 0
        #: Called when the kubelet, not this process, ended a stream (`ListAndWatch`).
        self.on_dropped: Callable[[], None] | None = None

    async def update(self, spec: ResourceSpec, config: Config) -> None:
        """Swap in a new spec; open ListAndWatch streams send the new list at once.

        Every store version reaches every resource; one whose devices (and so its list)
        did not change sends nothing, rather than the same list again to the kubelet.
        """
        async with self._changed:
            same_list = spec.devices == self.spec.devices
            self.spec, self.config = spec, config
            self.request_limit = request_limit(spec)
            if same_list:
                return
            self._version += 1
            self._changed.notify_all()

    def reopen(self) -> None:
        """Accept new ListAndWatch streams again after `close` (the socket is re-served)."""
        self._period = object()
        self.list_sent.clear()

    def freeze(self) -> None:
        """Send no more device lists on the open streams, which stay open: the kubelet keeps
        one device set per resource, replaced by any endpoint's update, so a list from this
        process after a successor registered would replace the successor's."""
        self._frozen = True

    async def thaw(self) -> None:
        """Send device lists again after `freeze` (the successor stopped first; the plugin
        registers again next): an open stream sends the newest list at once if it changed
        meanwhile. Those streams belong to the registration before: a kubelet that ends one
        once the new registration replaced it has not dropped the plugin (no `on_dropped`,
        which would register it yet again)."""
        async with self._changed:
            self._frozen = False
            self._registration = object()
            self._changed.notify_all()

    async def close(self) -> None:
        """End every ListAndWatch stream (the server is going away or being replaced)."""
        async with self._changed:
            self._period = None
            self._changed.notify_all()

    async def GetDevicePluginOptions(
        self, request: pb.Empty, context: grpc.aio.ServicerContext[pb.Empty, pb.DevicePluginOptions]
    ) -> pb.DevicePluginOptions:
        return plugin_options()

    async def ListAndWatch(
        self,
        request: pb.Empty,
        context: grpc.aio.ServicerContext[pb.Empty, pb.ListAndWatchResponse],
    ) -> AsyncIterator[pb.ListAndWatchResponse]:
        seen = -1
        period = self._period
        registration = self._registration

        def changed() -> bool:
            return self._period is not period or (self._version != seen and not self._frozen)

        self.streams += 1
        dropped = False
        try:
            while period is not None:
                async with self._changed:
                    await self._changed.wait_for(changed)
                    if self._period is not period:
                        return
                    seen, spec = self._version, self.spec
                if self._list is None or self._list[0] != seen:
                    self._list = (seen, device_list(spec))
                yield self._list[1]
                self.list_sent.set()
                if self._metrics is not None:
                    self._metrics.set_devices(spec.name, len(spec.devices), spec.healthy_count)
        except (asyncio.CancelledError, GeneratorExit):
            # grpc cancels the method (or drops the generator at a yield) when the client
            # goes: with the stream's serving period and registration still current, the
            # kubelet ended the stream, by closing its connection or by exiting.
            dropped = (
                period is not None and self._period is period and self._registration is registration
            )
            raise
        finally:
            self.streams -= 1
            if dropped and self.on_dropped is not None:
                self.on_dropped()

    async def GetPreferredAllocation(
        self,
        request: pb.PreferredAllocationRequest,
        context: grpc.aio.ServicerContext[
            pb.PreferredAllocationRequest, pb.PreferredAllocationResponse
        ],
    ) -> pb.PreferredAllocationResponse:
        spec, config = self.spec, self.config
        policy: AllocationPolicy = config.flags.plugin.shared_devices_allocation_policy
        # Errors (a bad allocation_size, a bug) become a status at the `Boundary`.
        picks = [_prefer(spec, req, policy) for req in request.container_requests]
        answers = [pb.ContainerPreferredAllocationResponse(deviceIDs=ids) for ids in picks]
        return pb.PreferredAllocationResponse(container_responses=answers)

    async def Allocate(
        self,
        request: pb.AllocateRequest,
        context: grpc.aio.ServicerContext[pb.AllocateRequest, pb.AllocateResponse],
    ) -> pb.AllocateResponse:
        started = time.perf_counter()
        spec, config = self.spec, self.config
        code: grpc.StatusCode | None = None
        message = ""
        answer = pb.AllocateResponse()
        try:
            if not request.container_requests:
                raise AllocationError(f"{spec.name}: the request has no container requests")
            extra = mps.resource_edits(spec, config)
            channels = self._imex_channels(config)
            strategies = config.flags.plugin.device_list_strategy
            # Only CDI classes with a spec on this node may be named (a stat per call;
            # listed again only when the directory changed).
            cdi_used = not CDI_STRATEGIES.isdisjoint(strategies)
            classes = self._cdi_classes.get() if cdi_used else None
            # The response ID only names a CDI annotation; a uuid4 costs a syscall.
            annotate = DeviceListStrategy.CDI_ANNOTATIONS in strategies
            for creq in request.container_requests:
                devices = validate_request(spec, list(creq.devices_ids))
                edits = build_response(
                    spec,
                    devices,
                    config,
                    response_id=str(uuid.uuid4()) if annotate else "",
                    extra=extra,
                    imex_channels=channels,
                    cdi_classes=classes,
                )
                fill_pb(answer.container_responses.add(), edits)
        except Exception as exc:
            # Mapped here rather than at the `Boundary` so the metrics see the code.
            code, message = status_for(exc, "Allocate")
        if self._metrics is not None:
            self._metrics.observe_allocate(
                spec.name, time.perf_counter() - started, code.name if code else None
            )
        if code is not None:
            await context.abort(code, message)
        return answer

    def _imex_channels(self, config: Config) -> tuple[ImexChannel, ...]:
        """The configured IMEX channels present on this node (under the dev root or /)."""
        if not config.imex.channel_ids:
            return ()
        return select_imex_channels(config)

    async def PreStartContainer(
        self,
        request: pb.PreStartContainerRequest,
        context: grpc.aio.ServicerContext[
            pb.PreStartContainerRequest, pb.PreStartContainerResponse
        ],
    ) -> pb.PreStartContainerResponse:
        return pb.PreStartContainerResponse()


def _prefer(
    spec: ResourceSpec, req: pb.ContainerPreferredAllocationRequest, policy: AllocationPolicy
) -> list[str]:
    """The preferred IDs for one container, from the offered IDs that still exist.

    Between the kubelet reading ListAndWatch and asking, a reload can remove devices;
    refusing the whole call would fail the pod, so vanished IDs are dropped (logged) and
    the hint is built from the rest. The kubelet makes the final choice anyway.
    """
    # The offered IDs still advertised, as a set (repeats count once, as in the kubelet's
    # own sets); fewer than offered means vanished IDs or repeats.
    offered = req.available_deviceIDs
    known = spec.by_id.keys()
    available = known & set(offered)
    must_include = dict.fromkeys(req.must_include_deviceIDs)
    if len(available) < len(offered) or not must_include.keys() <= known:
        order = dict.fromkeys([*req.must_include_deviceIDs, *offered])
        gone = [i for i in order if i not in known]
        if gone:
            log.info(
                "GetPreferredAllocation for %s: ignoring %d ID(s) no longer advertised: %s",
                spec.name,
                len(gone),
                describe_ids(gone),
            )
        must_include = {i: None for i in must_include if i in known}
    size = req.allocation_size
    if size <= 0:
        raise AllocationError(f"{spec.name}: allocation_size must be at least 1, got {size}")
    pool = len(available) + sum(1 for i in must_include if i not in available)
    if pool == 0:
        return []
    # Fewer devices left than asked for: prefer all of them; the kubelet decides.
    return list(preferred_allocation(spec, available, must_include, min(size, pool), policy))


#: Room in a request for what is not a device ID: sizes, field tags, several containers.
REQUEST_SLACK_BYTES = 64 * 1024


def request_limit(spec: ResourceSpec) -> int:
    """The most bytes a valid Allocate or GetPreferredAllocation request for `spec` can take:
    every advertised ID twice (offered and must-include) with its field overhead, plus
    slack. Anything larger is refused before protobuf makes a string per ID in it, so
    requests of megabytes cannot take the daemon's memory past its limit."""
    return REQUEST_SLACK_BYTES + 2 * sum(len(d.id) + 8 for d in spec.devices)


def plugin_server(
    servicer: pb_grpc.DevicePluginServicer, calls: Calls | None = None
) -> grpc.aio.Server:
    """A grpc.aio server for `servicer` with the error `Boundary` around every RPC (and,
    for kubegpu's own servicer, its request size limit), counting calls into `calls`."""
    limit = (lambda: servicer.request_limit) if isinstance(servicer, DevicePluginServicer) else None
    server = grpc.aio.server(interceptors=[Boundary(limit, status=status_for, calls=calls)])
    add_device_plugin_servicer(servicer, server)
    return server


#: How long a server being replaced (the kubelet restarted, the socket was deleted) may
#: take to finish the calls it already has (`rpc.UnixServer`): an Allocate it answered
#: reaches the kubelet instead of being cut off as CANCELLED, and the new server listens
#: and registers at once.
RESERVE_GRACE_S = RETIRE_GRACE_S


class ResourceServer:
    """Serves one resource on `<plugin_dir>/<socket>` and registers it with the kubelet."""

    def __init__(
        self,
        spec: ResourceSpec,
        config: Config,
        plugin_dir: Path,
        *,
        metrics: Metrics | None = None,
        socket_name: str | None = None,
        cdi_dir: Path = Path(cdi.DEFAULT_DIRECTORY),
    ) -> None:
        self.servicer = DevicePluginServicer(spec, config, metrics=metrics, cdi_dir=cdi_dir)
        self.plugin_dir = plugin_dir
        self.socket_name = socket_name or spec.socket_name
        self._metrics = metrics
        self.registered = False
        #: The unary calls being answered, for `drain`.
        self.calls = Calls()
        self._socket = UnixServer(
            plugin_dir / self.socket_name,
            lambda: plugin_server(self.servicer, self.calls),
            spec.name,
        )

    @property
    def name(self) -> str:
        return self.servicer.spec.name

    @property
    def serving(self) -> bool:
        return self._socket.serving

    @property
    def socket_path(self) -> Path:
        return self.plugin_dir / self.socket_name

    async def serve(self) -> None:
        """(Re)start the gRPC server on a fresh socket file (`rpc.UnixServer`).

        A server this one replaces finishes its calls in the background, so
        re-registration never waits for them: an Allocate in flight, or a call grpc holds
        until the grace runs out, once cost the kubelet up to a second of this resource.
        """
        self.registered = False
        await self.servicer.close()  # the old server's ListAndWatch streams end now
        await self._socket.serve(retire_grace=RESERVE_GRACE_S)
        # Streams reach the new server only once the kubelet hears of it (Register).
        self.servicer.reopen()

    def socket_lost(self) -> str | None:
        """Why the kubelet can no longer reach this server at its socket path (deleted, or
        the name now holds another file), or None while it can or nothing is served."""
        return self._socket.lost()

    async def register(self, kubelet_socket: Path, timeout: float = 5.0) -> None:
        """One Register call; `RegistrationError` if the kubelet is absent or refuses."""
        try:
            await register(
                kubelet_socket,
                endpoint=self.socket_name,
                resource=self.name,
                options=plugin_options(),
                timeout=timeout,
            )
        except Exception:
            if self._metrics is not None:
                self._metrics.registration(self.name, ok=False)
            raise
        self.registered = True
        if self._metrics is not None:
            self._metrics.registration(self.name, ok=True)

    async def update(self, spec: ResourceSpec, config: Config) -> None:
        await self.servicer.update(spec, config)

    async def withdraw(self) -> None:
        """Tell the kubelet this plugin is going: end its ListAndWatch streams. The kubelet
        then admits nothing more onto the resource (or, with a successor registered, drops
        this endpoint), while this server still answers what is already on its way."""
        await self.servicer.close()

    async def drain(self, quiet: float) -> None:
        """Keep answering until no call has run or started for `quiet` seconds."""
        if self.serving:
            await self.calls.quiet(quiet)

    async def stop(self, grace: float = 1.0) -> None:
        if self._socket.serving:
            await self.servicer.close()
        await self._socket.stop(grace)
        self.registered = False
