"""An emulator of the kubelet's device manager, over real gRPC on unix sockets.

It does what `pkg/kubelet/cm/devicemanager` does with a device plugin (see
shared/KUBELET.md): serves `Registration` on `kubelet.sock`, validates and connects
inside `Register`, watches `ListAndWatch`, marks a dead plugin's devices unhealthy and
drops them after a grace period, wipes sockets on (re)start, keeps allocations in
`kubelet_internal_checkpoint`, and admits containers with `GetPreferredAllocation` /
`Allocate` / `PreStartContainer` in the kubelet's order. Tests and `kubegpu demo` watch
it through `capacity`, `allocatable`, `history` and the `wait_for*` helpers, which wake on
every state change instead of polling.

Deliberate simplifications: one node, pods admitted one resource at a time
(`allocate`), a topology manager reduced to "pick the narrowest NUMA node set that fits"
(or the `numa_affinity` a test passes), and a checkpoint checksum of our own.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import stat
import time
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import cast

import grpc

from kubegpu.api import HEALTHY, KUBELET_SOCKET, UNHEALTHY, pb, pb_grpc
from kubegpu.kubelet import checkpoint as ckpt
from kubegpu.kubelet.model import (
    AdmissionError,
    Allocation,
    ContainerStartError,
    DeviceState,
    RegistrationRecord,
    RpcRecord,
    merge_responses,
)
from kubegpu.kubelet.validation import device_id_error, register_request_error

log = logging.getLogger("kubegpu.kubelet")

#: The kubelet's timeouts and grace period (devicemanager constants).
DIAL_TIMEOUT = 10.0
PRE_START_TIMEOUT = 30.0
GRACE_PERIOD = 300.0
UNEXPECTED = "UnexpectedAdmissionError"

_GO_CODE_NAMES = {grpc.StatusCode.OK: "OK", grpc.StatusCode.CANCELLED: "Canceled"}


def go_error(exc: grpc.RpcError) -> str:
    """Render a gRPC error as grpc-go's `status.Error` prints it (what the kubelet reports)."""
    if isinstance(exc, grpc.aio.AioRpcError):
        code, details = exc.code(), exc.details() or ""
    else:
        return f"rpc error: {exc}"
    name = _GO_CODE_NAMES.get(code) or "".join(p.capitalize() for p in code.name.split("_"))
    return f"rpc error: code = {name} desc = {details}"


class _PluginClient:
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


@dataclass(eq=False)
class _Endpoint:
    """One registered plugin socket serving a resource."""

    resource: str
    name: str
    options: pb.DevicePluginOptions
    client: _PluginClient
    #: Registration order: the newest live endpoint answers GetPreferredAllocation.
    seq: int
    devices: dict[str, DeviceState] = field(default_factory=dict)
    #: False once ListAndWatch ended: its devices read unhealthy until the grace period ends.
    alive: bool = True
    #: Set when the kubelet itself dropped the endpoint (replaced, expired, kubelet stopped).
    closed: bool = False
    task: asyncio.Task[None] | None = None
    expiry: asyncio.Task[None] | None = None


class _RegistrationServicer(pb_grpc.RegistrationServicer):
    def __init__(self, emulator: KubeletEmulator) -> None:
        self._emulator = emulator

    async def Register(
        self,
        request: pb.RegisterRequest,
        context: grpc.aio.ServicerContext[pb.RegisterRequest, pb.Empty],
    ) -> pb.Empty:
        error = await self._emulator._register(request)
        if error is not None:
            # The kubelet returns a plain Go error, which grpc-go sends as code Unknown.
            await context.abort(grpc.StatusCode.UNKNOWN, error)
        return pb.Empty()


class KubeletEmulator:
    """The kubelet's device manager for one node, serving `plugin_dir/kubelet.sock`."""

    def __init__(
        self,
        plugin_dir: Path,
        *,
        grace_period: float = GRACE_PERIOD,
        topology_manager: bool = False,
        dial_timeout: float = DIAL_TIMEOUT,
        pre_start_timeout: float = PRE_START_TIMEOUT,
    ) -> None:
        self.plugin_dir = Path(plugin_dir)
        self.grace_period = grace_period
        self.topology_manager = topology_manager
        self.dial_timeout = dial_timeout
        self.pre_start_timeout = pre_start_timeout
        #: Every Register call received, in order (kept across restarts).
        self.registrations: list[RegistrationRecord] = []
        #: Every call made to a plugin, in order (kept across restarts).
        self.rpcs: list[RpcRecord] = []
        #: ListAndWatch updates ignored because a device ID was invalid (kept across restarts).
        self.rejected_updates: list[str] = []
        self._server: grpc.aio.Server | None = None
        self._endpoints: dict[str, dict[str, _Endpoint]] = {}
        # Resources known only from the checkpoint after a restart: capacity 0 until their
        # plugin registers again, gone after the grace period if it never does.
        self._restored: dict[str, asyncio.Task[None]] = {}
        self._entries: dict[tuple[str, str, str], ckpt.PodDevicesEntry] = {}
        self._history: dict[str, list[tuple[int, int]]] = {}
        self._subscribers: list[Callable[[str], None]] = []
        self._cond = asyncio.Condition()
        # Admission is serial in the kubelet: a hung Allocate blocks the next pod.
        self._admission = asyncio.Lock()
        self._tasks: set[asyncio.Task[None]] = set()
        self._seq = itertools.count(1)

    # ------------------------------------------------------------------ lifecycle

    @property
    def socket_path(self) -> Path:
        return self.plugin_dir / KUBELET_SOCKET

    @property
    def checkpoint_path(self) -> Path:
        return self.plugin_dir / ckpt.CHECKPOINT_FILE

    @property
    def running(self) -> bool:
        return self._server is not None

    async def start(self) -> None:
        """Start as the kubelet does: wipe sockets, reload the checkpoint, serve kubelet.sock."""
        if self._server is not None:
            raise RuntimeError("the kubelet emulator is already running")
        self.plugin_dir.mkdir(parents=True, exist_ok=True)
        self._remove_sockets()
        restored = ckpt.load(self.checkpoint_path)
        if restored is not None:
            self._entries = {(e.pod, e.container, e.resource): e for e in restored.entries}
            for resource in restored.registered or {}:
                self._restored[resource] = self._spawn(self._expire_restored(resource))
        server = grpc.aio.server()
        pb_grpc.add_RegistrationServicer_to_server(  # type: ignore[no-untyped-call]
            _RegistrationServicer(self), server
        )
        address = f"unix://{self.socket_path}"
        if not server.add_insecure_port(address):
            raise RuntimeError(f"cannot serve {address}")
        await server.start()
        self._server = server
        log.info(
            "kubelet emulator serving %s (%d allocations restored)",
            self.socket_path,
            len(self._entries),
        )
        for resource in list(self._restored):
            await self._changed(resource)

    async def stop(self) -> None:
        """Stop serving and forget everything not in the checkpoint (like a kubelet exit)."""
        server, self._server = self._server, None
        if server is None:
            return
        await server.stop(0)
        resources = self.resources
        for endpoints in self._endpoints.values():
            for ep in endpoints.values():
                await self._close(ep)
        self._endpoints.clear()
        pending = [*self._restored.values(), *self._tasks]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        self._restored.clear()
        self._entries.clear()
        log.info("kubelet emulator stopped")
        for resource in resources:
            await self._changed(resource)

    async def restart(self) -> None:
        """A kubelet restart: plugins see their sockets vanish and a new kubelet.sock."""
        await self.stop()
        await self.start()

    async def __aenter__(self) -> KubeletEmulator:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def _remove_sockets(self) -> None:
        for entry in self.plugin_dir.iterdir():
            if entry.name == ckpt.CHECKPOINT_FILE:
                continue
            try:
                if stat.S_ISSOCK(entry.lstat().st_mode):
                    entry.unlink(missing_ok=True)
                    log.debug("removed stale socket %s", entry)
            except FileNotFoundError:
                continue

    def _spawn(self, coro: Awaitable[None]) -> asyncio.Task[None]:
        task: asyncio.Task[None] = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("kubelet emulator task failed", exc_info=task.exception())

    def _require_running(self) -> None:
        if self._server is None:
            raise RuntimeError("the kubelet emulator is not running; call start() first")

    # --------------------------------------------------------------- registration

    async def _register(self, request: pb.RegisterRequest) -> str | None:
        """Handle one Register call; the error text to return, or None on success."""
        arrived = time.monotonic()
        resource, endpoint = request.resource_name, request.endpoint
        log.info(
            "got registration request from device plugin with resource %s (endpoint %s)",
            resource,
            endpoint,
        )
        error = register_request_error(request.version, resource, endpoint)
        if error is None:
            error = await self._connect(resource, endpoint)
        if error is not None:
            log.warning("registration of %s from %s refused: %s", resource, endpoint, error)
        self.registrations.append(
            RegistrationRecord(arrived, resource, endpoint, request.version, error)
        )
        await self._notify()
        return error

    async def _connect(self, resource: str, endpoint: str) -> str | None:
        """Dial the plugin and ask its options, inside Register, as the kubelet does."""
        channel = grpc.aio.insecure_channel(f"unix://{self.plugin_dir / endpoint}")
        client = _PluginClient(channel)
        try:
            try:
                await asyncio.wait_for(channel.channel_ready(), self.dial_timeout)
            except TimeoutError:
                await channel.close(None)
                return "failed to dial device plugin: context deadline exceeded"
            try:
                options = await client.options()
            except grpc.RpcError as exc:
                self._record(resource, endpoint, "GetDevicePluginOptions", go_error(exc))
                await channel.close(None)
                return f"failed to get device plugin options: {go_error(exc)}"
        except asyncio.CancelledError:
            await channel.close(None)
            raise
        self._record(resource, endpoint, "GetDevicePluginOptions", None)
        if self._server is None:
            await channel.close(None)
            return "kubelet is shutting down"
        ep = _Endpoint(resource, endpoint, options, client, next(self._seq))
        endpoints = self._endpoints.setdefault(resource, {})
        old = endpoints.get(endpoint)
        if old is not None:
            # Same socket registering again (plugin restart): the new endpoint replaces
            # the old one; its devices stand until the first ListAndWatch update.
            ep.devices = {
                i: replace(d, health=d.health if old.alive else UNHEALTHY, endpoint=endpoint)
                for i, d in old.devices.items()
            }
            await self._close(old)
        endpoints[endpoint] = ep
        restored = self._restored.pop(resource, None)
        if restored is not None:
            restored.cancel()
        ep.task = self._spawn(self._watch(ep))
        log.info(
            "registered device plugin for %s at %s (options: %s)",
            resource,
            endpoint,
            _options_text(options),
        )
        await self._changed(resource)
        return None

    async def _close(self, ep: _Endpoint) -> None:
        ep.closed = True
        for task in (ep.task, ep.expiry):
            if task is not None and task is not asyncio.current_task():
                task.cancel()
        await ep.client.channel.close(None)

    # --------------------------------------------------------------- ListAndWatch

    async def _watch(self, ep: _Endpoint) -> None:
        """Follow ListAndWatch until it ends; the kubelet never reopens it."""
        reason = "stream closed by the plugin"
        try:
            call = ep.client.list_and_watch()
            self._record(ep.resource, ep.name, "ListAndWatch", None)
            async for response in call:
                if ep.closed:
                    return
                await self._on_update(ep, response)
        except (grpc.RpcError, grpc.aio.BaseError) as exc:
            reason = go_error(exc) if isinstance(exc, grpc.RpcError) else repr(exc)
        if not ep.closed:
            await self._on_disconnect(ep, reason)

    async def _on_update(self, ep: _Endpoint, response: pb.ListAndWatchResponse) -> None:
        errors = [e for e in (device_id_error(d.ID) for d in response.devices) if e]
        if errors:
            message = f"ignoring ListAndWatch update of {ep.resource} from {ep.name}: " + "; ".join(
                errors
            )
            log.error("%s", message)
            self.rejected_updates.append(message)
            await self._notify()
            return
        ep.devices = {
            d.ID: DeviceState(
                id=d.ID,
                health=HEALTHY if d.health == HEALTHY else UNHEALTHY,
                numa_nodes=tuple(n.ID for n in d.topology.nodes),
                endpoint=ep.name,
            )
            for d in response.devices
        }
        log.debug(
            "%s from %s: %d devices, %d healthy",
            ep.resource,
            ep.name,
            len(ep.devices),
            sum(d.healthy for d in ep.devices.values()),
        )
        self._save()
        await self._changed(ep.resource)

    async def _on_disconnect(self, ep: _Endpoint, reason: str) -> None:
        ep.alive = False
        log.warning(
            "ListAndWatch of %s from %s ended (%s): its devices are unhealthy until "
            "the plugin registers again (grace period %ss)",
            ep.resource,
            ep.name,
            reason,
            self.grace_period,
        )
        ep.expiry = self._spawn(self._expire_endpoint(ep))
        self._save()
        await self._changed(ep.resource)

    async def _expire_endpoint(self, ep: _Endpoint) -> None:
        await asyncio.sleep(self.grace_period)
        endpoints = self._endpoints.get(ep.resource)
        if endpoints is None or endpoints.get(ep.name) is not ep:
            return
        del endpoints[ep.name]
        ep.closed = True
        await ep.client.channel.close(None)
        if not endpoints:
            del self._endpoints[ep.resource]
            log.info(
                "resource %s removed: its plugin did not return within %ss",
                ep.resource,
                self.grace_period,
            )
        self._save()
        await self._changed(ep.resource)

    async def _expire_restored(self, resource: str) -> None:
        await asyncio.sleep(self.grace_period)
        if self._restored.get(resource) is asyncio.current_task():
            del self._restored[resource]
            log.info(
                "resource %s removed: no plugin registered within %ss after restart",
                resource,
                self.grace_period,
            )
            await self._changed(resource)

    # --------------------------------------------------------------- observation

    @property
    def resources(self) -> list[str]:
        """Resources the node reports (registered, in their grace period, or restored)."""
        return sorted(set(self._endpoints) | set(self._restored))

    def devices(self, resource: str) -> dict[str, DeviceState]:
        """The union of the resource's endpoints' devices; a live endpoint's report wins."""
        ranked = sorted(
            self._endpoints.get(resource, {}).values(), key=lambda e: (e.alive, e.seq), reverse=True
        )
        view: dict[str, DeviceState] = {}
        for ep in ranked:
            for dev_id, dev in ep.devices.items():
                if dev_id not in view:
                    view[dev_id] = dev if ep.alive else replace(dev, health=UNHEALTHY)
        return view

    def capacity(self, resource: str) -> int:
        return len(self.devices(resource))

    def allocatable(self, resource: str) -> int:
        return sum(d.healthy for d in self.devices(resource).values())

    def is_topology_aware(self, resource: str) -> bool:
        return any(d.numa_nodes for d in self.devices(resource).values())

    def endpoints(self, resource: str) -> dict[str, bool]:
        """Socket name → alive, for each endpoint of the resource."""
        return {name: ep.alive for name, ep in self._endpoints.get(resource, {}).items()}

    def options(self, resource: str) -> pb.DevicePluginOptions | None:
        """The options (from GetDevicePluginOptions) of the newest live endpoint."""
        ep = self._primary(resource)
        return None if ep is None else ep.options

    def history(self, resource: str) -> list[tuple[int, int]]:
        """(capacity, allocatable) after each change, starting from an implicit (0, 0)."""
        return list(self._history.get(resource, []))

    def calls(self, method: str, resource: str | None = None) -> list[RpcRecord]:
        """The kubelet's calls of `method` (e.g. "Allocate"), optionally for one resource."""
        return [
            r
            for r in self.rpcs
            if r.method == method and (resource is None or r.resource == resource)
        ]

    def on_change(self, callback: Callable[[str], None]) -> Callable[[], None]:
        """Call `callback(resource)` after every state change; returns an unsubscribe."""
        self._subscribers.append(callback)
        return lambda: self._subscribers.remove(callback)

    async def wait_for(
        self,
        predicate: Callable[[], bool],
        timeout: float = 5.0,
        *,
        describe: Callable[[], str] | None = None,
    ) -> None:
        """Wait until `predicate()` holds, re-checking on every state change.

        On timeout raise `TimeoutError` with `describe()` (the expected vs actual state).
        """
        try:
            async with asyncio.timeout(timeout):
                async with self._cond:
                    await self._cond.wait_for(predicate)
        except TimeoutError:
            what = (
                describe()
                if describe is not None
                else (f"{getattr(predicate, '__qualname__', predicate)!s} still false")
            )
            raise TimeoutError(f"timed out after {timeout}s: {what}") from None

    async def wait_for_resource(
        self,
        resource: str,
        capacity: int | None = None,
        allocatable: int | None = None,
        timeout: float = 5.0,
    ) -> None:
        """Wait until the resource reads the given capacity/allocatable (None: any).

        With both None, wait until the resource is reported at all.
        """

        def ok() -> bool:
            if capacity is None and allocatable is None:
                return resource in self.resources
            return (capacity is None or self.capacity(resource) == capacity) and (
                allocatable is None or self.allocatable(resource) == allocatable
            )

        def describe() -> str:
            return (
                f"expected {resource} capacity={capacity} allocatable={allocatable}, "
                f"actual capacity={self.capacity(resource)} "
                f"allocatable={self.allocatable(resource)} "
                f"(reported: {resource in self.resources}, "
                f"history: {self.history(resource)}, "
                f"endpoints: {self.endpoints(resource)}, "
                f"registrations: {[(r.endpoint, r.error) for r in self.registrations]})"
            )

        await self.wait_for(ok, timeout, describe=describe)

    async def _changed(self, resource: str) -> None:
        point = (self.capacity(resource), self.allocatable(resource))
        history = self._history.setdefault(resource, [])
        if (history[-1] if history else (0, 0)) != point:
            history.append(point)
        for callback in list(self._subscribers):
            try:
                callback(resource)
            except Exception:
                log.exception("on_change subscriber failed")
        await self._notify()

    async def _notify(self) -> None:
        async with self._cond:
            self._cond.notify_all()

    def _record(self, resource: str, endpoint: str, method: str, error: str | None) -> None:
        self.rpcs.append(RpcRecord(time.monotonic(), resource, endpoint, method, error))

    # --------------------------------------------------------------- allocation

    def allocations(self, pod: str | None = None) -> list[Allocation]:
        """What containers hold now (restored from the checkpoint after a restart)."""
        return [
            _allocation(e, cached=True)
            for e in self._entries.values()
            if pod is None or e.pod == pod
        ]

    def container_response(self, pod: str, container: str) -> pb.ContainerAllocateResponse:
        """The merged answer of every resource of one container, as given to the runtime."""
        return merge_responses(
            e.response for e in self._entries.values() if e.pod == pod and e.container == container
        )

    def release(self, pod: str) -> list[str]:
        """Free a deleted pod's devices; returns their IDs."""
        self._require_running()
        freed = [
            d
            for k, e in list(self._entries.items())
            if k[0] == pod
            for d in self._entries.pop(k).device_ids
        ]
        if freed:
            log.info("released devices %s of pod %s", freed, pod)
            self._save()
        return freed

    async def allocate(
        self,
        resource: str,
        count: int,
        *,
        pod: str = "pod",
        container: str = "ctr",
        must_include: Sequence[str] = (),
        numa_affinity: Collection[int] | None = None,
        start: bool = True,
    ) -> Allocation:
        """Admit one container's request for `count` devices of `resource`, as the kubelet.

        A container that already holds devices of the resource (a restart) gets its
        cached response without any Allocate. `numa_affinity` stands for the topology
        manager's merged hint (default: the narrowest NUMA node set that fits). With
        `start`, the container is then started (PreStartContainer when required).
        Raises `AdmissionError` when the pod is rejected, `ContainerStartError` when
        PreStartContainer fails.
        """
        if count < 1:
            raise ValueError(f"count must be at least 1, got {count}")
        self._require_running()
        async with self._admission:
            entry = self._entries.get((pod, container, resource))
            if entry is not None:
                log.info(
                    "container %s/%s already has %s devices %s: reusing its response",
                    pod,
                    container,
                    resource,
                    list(entry.device_ids),
                )
                allocation = _allocation(entry, cached=True)
            else:
                allocation = await self._admit(
                    resource,
                    count,
                    pod,
                    container,
                    list(dict.fromkeys(must_include)),
                    numa_affinity,
                )
        if start:
            await self._pre_start(allocation)
        return allocation

    async def start_container(self, pod: str, container: str) -> None:
        """(Re)start a container: PreStartContainer for each of its resources that needs it."""
        self._require_running()
        for entry in [
            e for e in self._entries.values() if e.pod == pod and e.container == container
        ]:
            await self._pre_start(_allocation(entry, cached=True))

    async def _admit(
        self,
        resource: str,
        count: int,
        pod: str,
        container: str,
        must_include: list[str],
        numa_affinity: Collection[int] | None,
    ) -> Allocation:
        def unexpected(why: str) -> AdmissionError:
            return AdmissionError(
                UNEXPECTED,
                f"Allocate failed due to {why}, which is unexpected",
                resource=resource,
                pod=pod,
                container=container,
            )

        view = self.devices(resource)
        held_by_pod = {
            d
            for e in self._entries.values()
            if e.resource == resource and e.pod == pod
            for d in e.device_ids
        }
        in_use = {d for e in self._entries.values() if e.resource == resource for d in e.device_ids}
        for dev in must_include:
            if dev not in view:
                raise unexpected(f"device {dev} to include is not a device of {resource}")
            if dev in in_use and dev not in held_by_pod:
                raise unexpected(f"device {dev} to include is in use by another pod")
        if len(must_include) > count:
            raise unexpected(f"{len(must_include)} devices to include but only {count} requested")

        # The node-resources fit check the kubelet repeats at admission.
        requested = count - len(held_by_pod.intersection(must_include))
        used = len(in_use)
        node_allocatable = self.allocatable(resource)
        if requested > node_allocatable - used:
            raise AdmissionError(
                f"OutOf{resource}",
                f"Pod was rejected: Insufficient {resource}: Node didn't have enough resource: "
                f"{resource}, requested: {requested}, used: {used}, capacity: {node_allocatable}",
                resource=resource,
                pod=pod,
                container=container,
            )

        # devicesToAllocate: reusable devices first, then aligned, hint, the rest.
        allocated: list[str] = list(must_include)
        needed = count - len(allocated)
        preferred: tuple[str, ...] | None = None
        if needed > 0:
            available = sorted(
                d for d, s in view.items() if s.healthy and d not in in_use and d not in allocated
            )
            if len(available) < needed:
                raise unexpected(
                    f"requested number of devices unavailable for {resource}. "
                    f"Requested: {needed}, Available: {len(available)}"
                )
            aligned, unaligned, no_affinity = self._filter_by_affinity(
                view, available, allocated, count, numa_affinity
            )

            def take(candidates: Sequence[str], allowed: Collection[str]) -> None:
                nonlocal needed
                for dev in candidates:
                    if needed == 0:
                        return
                    if dev in allowed and dev not in allocated:
                        allocated.append(dev)
                        needed -= 1

            if needed < len(aligned):
                # All of it fits in the aligned set: let the plugin choose within it.
                preferred = await self._preferred(
                    resource, pod, container, _union(aligned, allocated), allocated, count
                )
                take(preferred or (), set(aligned))
                take(aligned, aligned)
            else:
                # Honour alignment first, then let the plugin choose the remainder.
                take(aligned, aligned)
                if needed > 0:
                    ordered = _union(aligned, unaligned, no_affinity, allocated)
                    preferred = await self._preferred(
                        resource, pod, container, ordered, allocated, count
                    )
                    take(preferred or (), set(available))
                    take(unaligned, unaligned)
                    take(no_affinity, no_affinity)
            if needed > 0:
                raise unexpected(
                    f"unexpectedly allocated less resources than required. "
                    f"Requested: {count}, Got: {count - needed}"
                )

        ep = self._allocating_endpoint(resource, allocated)
        if ep is None:
            if resource not in self._endpoints:
                raise unexpected(f"unknown Device Plugin {resource}")
            raise unexpected(f"no live endpoint of {resource} advertises devices {allocated}")
        request = pb.AllocateRequest(
            container_requests=[pb.ContainerAllocateRequest(devices_ids=allocated)]
        )
        log.info(
            "allocating %s devices %s for %s/%s through %s",
            resource,
            allocated,
            pod,
            container,
            ep.name,
        )
        try:
            answer = await ep.client.allocate(request)
        except grpc.RpcError as exc:
            self._record(resource, ep.name, "Allocate", go_error(exc))
            raise unexpected(go_error(exc)) from exc
        self._record(resource, ep.name, "Allocate", None)
        if not answer.container_responses:
            raise unexpected(f"no containers return in allocation response {answer}")
        response = pb.ContainerAllocateResponse()
        response.CopyFrom(answer.container_responses[0])
        entry = ckpt.PodDevicesEntry(
            pod=pod,
            container=container,
            resource=resource,
            device_ids=tuple(allocated),
            numa=tuple((view[d].numa_nodes or (-1,))[0] for d in allocated),
            response=response,
        )
        self._entries[(pod, container, resource)] = entry
        self._save()
        return replace(_allocation(entry, cached=False), preferred=preferred)

    def _filter_by_affinity(
        self,
        view: dict[str, DeviceState],
        available: list[str],
        must_include: list[str],
        count: int,
        numa_affinity: Collection[int] | None,
    ) -> tuple[list[str], list[str], list[str]]:
        """Split available devices into NUMA-aligned, unaligned and without topology."""
        if not self.topology_manager or not any(d.numa_nodes for d in view.values()):
            return [], [], list(available)
        mask = (
            set(numa_affinity)
            if numa_affinity is not None
            else _narrowest_hint(view, available, must_include, count)
        )
        aligned = [d for d in available if mask.intersection(view[d].numa_nodes)]
        unaligned = [d for d in available if view[d].numa_nodes and d not in aligned]
        no_affinity = [d for d in available if not view[d].numa_nodes]
        return aligned, unaligned, no_affinity

    async def _preferred(
        self,
        resource: str,
        pod: str,
        container: str,
        available: list[str],
        must_include: list[str],
        size: int,
    ) -> tuple[str, ...] | None:
        """GetPreferredAllocation when the plugin offers it; its answer is only a hint."""
        ep = self._primary(resource)
        if ep is None or not ep.options.get_preferred_allocation_available:
            return None
        request = pb.PreferredAllocationRequest(
            container_requests=[
                pb.ContainerPreferredAllocationRequest(
                    available_deviceIDs=available,
                    must_include_deviceIDs=must_include,
                    allocation_size=size,
                )
            ]
        )
        try:
            answer = await ep.client.preferred(request)
        except grpc.RpcError as exc:
            self._record(resource, ep.name, "GetPreferredAllocation", go_error(exc))
            raise AdmissionError(
                UNEXPECTED,
                f"Allocate failed due to device plugin GetPreferredAllocation rpc failed with "
                f"err: {go_error(exc)}, which is unexpected",
                resource=resource,
                pod=pod,
                container=container,
            ) from exc
        self._record(resource, ep.name, "GetPreferredAllocation", None)
        if not answer.container_responses:
            return ()
        return tuple(answer.container_responses[0].deviceIDs)

    async def _pre_start(self, allocation: Allocation) -> None:
        resource = allocation.resource
        ep = self._allocating_endpoint(resource, allocation.device_ids, live_only=False)
        if ep is None:
            if resource in self._restored:
                return  # the kubelet has no options for it yet, so it skips PreStart
            raise ContainerStartError(
                f"endpoint not found in cache for a registered resource: {resource}"
            )
        if not ep.options.pre_start_required:
            return
        prefix = "device plugin PreStartContainer rpc failed with err"
        if not ep.alive:
            raise ContainerStartError(f"{prefix}: endpoint {ep.name} has been stopped")
        request = pb.PreStartContainerRequest(devices_ids=allocation.device_ids)
        try:
            await ep.client.pre_start(request, self.pre_start_timeout)
        except grpc.RpcError as exc:
            self._record(resource, ep.name, "PreStartContainer", go_error(exc))
            raise ContainerStartError(f"{prefix}: {go_error(exc)}") from exc
        self._record(resource, ep.name, "PreStartContainer", None)

    def _primary(self, resource: str) -> _Endpoint | None:
        live = [e for e in self._endpoints.get(resource, {}).values() if e.alive]
        return max(live, key=lambda e: e.seq, default=None)

    def _allocating_endpoint(
        self, resource: str, device_ids: Sequence[str], *, live_only: bool = True
    ) -> _Endpoint | None:
        """The newest endpoint advertising all the devices (rolling updates have two)."""
        ranked = sorted(
            self._endpoints.get(resource, {}).values(), key=lambda e: (e.alive, e.seq), reverse=True
        )
        for ep in ranked:
            if (ep.alive or not live_only) and all(d in ep.devices for d in device_ids):
                return ep
        return None if live_only or not ranked else ranked[0]

    def _save(self) -> None:
        if self._server is None:
            return
        registered = {r: tuple(self.devices(r)) for r in self.resources}
        ckpt.save(self.checkpoint_path, ckpt.Checkpoint(tuple(self._entries.values()), registered))


def _allocation(entry: ckpt.PodDevicesEntry, *, cached: bool) -> Allocation:
    return Allocation(
        device_ids=entry.device_ids,
        response=entry.response,
        preferred=None,
        resource=entry.resource,
        pod=entry.pod,
        container=entry.container,
        cached=cached,
    )


def _union(*groups: Sequence[str]) -> list[str]:
    return list(dict.fromkeys(d for group in groups for d in group))


def _narrowest_hint(
    view: dict[str, DeviceState], available: list[str], must_include: list[str], count: int
) -> set[int]:
    """The topology manager's preferred hint: fewest NUMA nodes holding enough devices.

    Masks are tried narrowest first, lowest node IDs first; they must cover the devices
    already chosen. When nothing fits, every node (no alignment possible).
    """
    nodes = sorted({n for d in view.values() for n in d.numa_nodes})
    for size in range(1, len(nodes) + 1):
        for combo in itertools.combinations(nodes, size):
            mask = set(combo)
            if not all(
                mask.intersection(view[d].numa_nodes) or not view[d].numa_nodes
                for d in must_include
            ):
                continue
            fits = sum(
                1 for d in [*available, *must_include] if mask.intersection(view[d].numa_nodes)
            )
            if fits >= count:
                return mask
    return set(nodes)


def _options_text(options: pb.DevicePluginOptions) -> str:
    return (
        f"pre_start_required={options.pre_start_required} "
        f"get_preferred_allocation_available={options.get_preferred_allocation_available}"
    )
