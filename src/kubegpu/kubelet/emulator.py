"""An emulator of the kubelet's device manager, over real gRPC on unix sockets.

It does what `pkg/kubelet/cm/devicemanager` does with a device plugin (see
shared/KUBELET.md): serves `Registration` on `kubelet.sock`, validates and connects
inside `Register`, watches `ListAndWatch`, marks a dead plugin's devices unhealthy and
drops them after a grace period, wipes sockets on (re)start, keeps allocations in
`kubelet_internal_checkpoint`, and admits containers with `GetPreferredAllocation` /
`Allocate` / `PreStartContainer` in the kubelet's order. Tests and `kubegpu demo` watch
it through `capacity`, `allocatable`, `history` and the `wait_for*` helpers, which wake on
every state change instead of polling.

`KubeletEmulator` is the manager (`manager.go`): it owns the state and composes the
rooms that mirror the devicemanager's files: `registration` (the Registration server),
`endpoint` (one connected plugin and its ListAndWatch stream), `admission` (choosing
devices, preferred allocation, Allocate and PreStartContainer), `pod_devices` (who holds
what) and `checkpoint` (what survives a restart).

With `dra=` (a `DRASide`: the repository's test rig has one, `tests.rig.dra.DRAKubelet`) it
is also the kubelet's DRA side: the plugin watcher and DRA manager start, stop and restart
with it, share its change notifications (so `wait_for` sees both), and `run_pod` /
`delete_pod` take a whole v1 Pod through device-plugin admission and DRA prepare, as the
kubelet does for one pod.

Two kubelets are modelled, chosen with `version` (see `KubeletEmulator`): up to 1.36 the
device manager holds one client per resource (`plugin/v1beta1/handler.go`), and the end of
any client's ListAndWatch disconnects whichever client is registered then; from 1.37 it
holds an endpoint per socket (`endpointStore`), and an ended endpoint with a live sibling
just goes.

Deliberate simplifications: one node, pods admitted one resource at a time
(`allocate`), a topology manager reduced to "pick the narrowest NUMA node set that fits"
(or the `numa_affinity` a test passes), and a checkpoint checksum of our own.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import re
import time
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol

import grpc

from kubegpu.api import KUBELET_SOCKET, UNHEALTHY, pb
from kubegpu.kubelet import admission, registration
from kubegpu.kubelet import checkpoint as ckpt
from kubegpu.kubelet import endpoint as endpoints_
from kubegpu.kubelet.admission import UNEXPECTED
from kubegpu.kubelet.changes import Changes
from kubegpu.kubelet.endpoint import Endpoint, go_error
from kubegpu.kubelet.model import (
    Allocation,
    ContainerStartError,
    DeviceState,
    RegistrationRecord,
    RpcRecord,
)
from kubegpu.kubelet.pod_devices import PodDevices, containers_of, to_allocation

log = logging.getLogger("kubegpu.kubelet")

#: The kubelet's timeouts and grace period (devicemanager constants).
DIAL_TIMEOUT = 10.0
PRE_START_TIMEOUT = 30.0
GRACE_PERIOD = 300.0

#: The kubelet modelled unless told otherwise: the release operators run (see
#: `KubeletEmulator`).
DEFAULT_VERSION = "1.36"
#: The first release whose device manager keeps an endpoint per plugin socket.
ENDPOINT_STORE_SINCE = (1, 37)

__all__ = [
    "DEFAULT_VERSION",
    "DIAL_TIMEOUT",
    "ENDPOINT_STORE_SINCE",
    "GRACE_PERIOD",
    "PRE_START_TIMEOUT",
    "UNEXPECTED",
    "DRASide",
    "KubeletEmulator",
    "go_error",
]


def parse_version(version: str) -> tuple[int, int]:
    """`"1.36"` (or `"v1.36.2"`) as `(1, 36)`; ValueError naming the bad value."""
    match = re.fullmatch(r"v?(\d+)\.(\d+)(?:\.\d+)?", version)
    if match is None:
        raise ValueError(
            f"kubelet version {version!r} is not MAJOR.MINOR; give e.g. {DEFAULT_VERSION!r}"
        )
    return int(match[1]), int(match[2])


def _newest(endpoints: dict[str, Endpoint]) -> Endpoint | None:
    """Before 1.37, the resource's one endpoint (`m.endpoints[resource]`): the newest
    registration, stopped or not."""
    return max(endpoints.values(), key=lambda e: e.seq, default=None)


class DRASide(Protocol):
    """The kubelet's DRA side, run beside the device manager (`KubeletEmulator(dra=...)`).

    A protocol, so the device manager the package ships depends on no DRA kubelet: the one
    the tests use lives in the repository's test rig (`tests.rig.dra.DRAKubelet`).
    """

    #: The change notifications the device manager shares, so `wait_for` sees both sides.
    changes: Changes

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def prepare(self, pod: dict[str, Any]) -> None: ...

    def cdi_devices(self, pod: dict[str, Any], container: str) -> list[str]: ...

    async def unprepare(self, pod: dict[str, Any]) -> None: ...


class KubeletEmulator:
    """The kubelet's device manager for one node, serving `plugin_dir/kubelet.sock`.

    `version` picks the device manager's behaviour when one of several plugin sockets of a
    resource ends its ListAndWatch (a rolling update with surge, `serve --handover`):

    - before 1.37 (`"1.36"`, the default): the device plugin server keeps one client per
      resource (`server.clients`, `plugin/v1beta1/handler.go`). `runClient` runs the
      client's ListAndWatch loop (`client.Run`, `client.go`) and, when it returns, looks up
      whichever client is registered *now* (`getClient`) and disconnects it
      (`disconnectClient`: `deregisterClient`, then `client.Disconnect`, which closes that
      client's connection and calls `ManagerImpl.PluginDisconnected`, `manager.go`). So an
      older plugin's stream ending disconnects its successor: `markResourceUnhealthy` makes
      every device of the resource unhealthy, `endpointImpl.setStopTime` (`endpoint.go`)
      starts the grace period, the successor's stream is cancelled by the kubelet, and
      nothing in the kubelet registers it again.
    - 1.37 and later: endpoints per socket (`endpointStore`); an ended endpoint with a live
      sibling is dropped at once and the devices stay as they are.

    The default is 1.36 because that is what the clusters operators run today: a plugin
    tested only against the newer behaviour would pass here and leave a node's GPUs
    unhealthy for the whole grace period on a real cluster.
    """

    def __init__(
        self,
        plugin_dir: Path,
        *,
        grace_period: float = GRACE_PERIOD,
        topology_manager: bool = False,
        dial_timeout: float = DIAL_TIMEOUT,
        pre_start_timeout: float = PRE_START_TIMEOUT,
        dra: DRASide | None = None,
        version: str = DEFAULT_VERSION,
    ) -> None:
        self.plugin_dir = Path(plugin_dir)
        #: The kubelet release modelled, as (major, minor).
        self.version = parse_version(version)
        #: The kubelet's DRA side, when this node also serves DRA drivers.
        self.dra = dra
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
        #: Endpoints by resource and socket name (the kubelet's `endpointStore`): several
        #: while a rolling update with surge runs, and a dead one only while it was the last.
        self._endpoints: dict[str, dict[str, Endpoint]] = {}
        #: Before 1.37, the plugin server's one client per resource (`server.clients`):
        #: the newest registration until something disconnects it.
        self._clients: dict[str, Endpoint] = {}
        #: Before 1.37, replaced clients whose stream still runs (a plugin that registered
        #: again on the same socket without ending it): in no map of the kubelet.
        self._detached: set[Endpoint] = set()
        #: One device set per resource, whichever endpoint reported it last.
        self._devices: dict[str, dict[str, DeviceState]] = {}
        # Resources known only from the checkpoint after a restart: capacity 0 until their
        # plugin registers again, gone after the grace period if it never does.
        self._restored: dict[str, asyncio.Task[None]] = {}
        self._pods = PodDevices()
        self._changes = dra.changes if dra is not None else Changes()
        # Admission is serial in the kubelet: a hung Allocate blocks the next pod.
        self._admission = asyncio.Lock()
        self._tasks: set[asyncio.Task[None]] = set()
        self._seq = itertools.count(1)

    # ------------------------------------------------------------------ lifecycle

    @property
    def endpoint_store(self) -> bool:
        """Whether this kubelet keeps an endpoint per plugin socket (1.37 and later)."""
        return self.version >= ENDPOINT_STORE_SINCE

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
        registration.remove_stale_sockets(self.plugin_dir)
        restored = ckpt.load(self.checkpoint_path)
        if restored is not None:
            self._pods.replace_all(restored.entries)
            for resource in restored.registered or {}:
                self._restored[resource] = self._spawn(self._expire_restored(resource))
        servicer = registration.RegistrationServicer(self._connect, self._registered)
        self._server = await registration.serve(self.socket_path, servicer)
        log.info(
            "kubelet emulator serving %s (%d allocations restored)",
            self.socket_path,
            len(self._pods),
        )
        for resource in list(self._restored):
            await self._changed(resource)
        if self.dra is not None:
            await self.dra.start()

    async def stop(self) -> None:
        """Stop serving and forget everything not in the checkpoint (like a kubelet exit)."""
        server, self._server = self._server, None
        if server is None:
            return
        if self.dra is not None:
            await self.dra.stop()
        await server.stop(0)
        resources = self.resources
        for eps in self._endpoints.values():
            for ep in eps.values():
                await ep.close()
        for ep in self._detached:
            await ep.close()
        self._detached.clear()
        self._endpoints.clear()
        self._clients.clear()
        self._devices.clear()
        pending = [*self._restored.values(), *self._tasks]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        self._restored.clear()
        self._pods.replace_all(())
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

    async def _registered(
        self, request: pb.RegisterRequest, arrived: float, error: str | None
    ) -> None:
        self.registrations.append(
            RegistrationRecord(
                arrived, request.resource_name, request.endpoint, request.version, error
            )
        )
        await self._changes.notify()

    async def _connect(self, resource: str, endpoint: str) -> str | None:
        """Dial a validated registration's plugin and make it the resource's newest endpoint."""
        dialled = await endpoints_.dial(
            self.plugin_dir, resource, endpoint, self.dial_timeout, self._record
        )
        if isinstance(dialled, str):
            return dialled
        client, options = dialled
        if self._server is None:
            await client.channel.close(None)
            return "kubelet is shutting down"
        ep = Endpoint(resource, endpoint, options, client, next(self._seq))
        eps = self._endpoints.setdefault(resource, {})
        # The newest registration is the primary. An endpoint still connected on another
        # socket stays beside it (a rolling update with surge); one that already ended
        # (in its grace period) or sat on this same socket (a plugin restart) is replaced.
        # The resource's devices stand, as they were, until the first ListAndWatch update.
        for name, old in list(eps.items()):
            if name == endpoint or not old.alive:
                del eps[name]
                if self.endpoint_store or not old.alive:
                    await old.close()
                else:
                    # Before 1.37 `registerClient` only replaces the client: the old one's
                    # loop runs on until its stream ends, and then disconnects whichever
                    # client is registered, this one (`runClient`).
                    self._detached.add(old)
        eps[endpoint] = ep
        self._clients[resource] = ep
        restored = self._restored.pop(resource, None)
        if restored is not None:
            restored.cancel()
        # Looked up on the instance at each update, so a benchmark may wrap `_on_update`.
        ep.task = self._spawn(
            ep.watch(self._record, lambda e, r: self._on_update(e, r), self._on_disconnect)
        )
        log.info(
            "registered device plugin for %s at %s (options: %s)",
            resource,
            endpoint,
            endpoints_.options_text(options),
        )
        await self._changed(resource)
        return None

    # --------------------------------------------------------------- ListAndWatch

    async def _on_update(self, ep: Endpoint, response: pb.ListAndWatchResponse) -> None:
        devices = ep.parse(response)
        if isinstance(devices, list):
            errors = devices
            message = f"ignoring ListAndWatch update of {ep.resource} from {ep.name}: " + "; ".join(
                errors
            )
            log.error("%s", message)
            self.rejected_updates.append(message)
            await self._changes.notify()
            return
        # Whole, and from whichever endpoint sent it: with two endpoints the last update
        # wins, even one from the older instance (genericDeviceUpdateCallback).
        self._devices[ep.resource] = devices
        log.debug(
            "%s from %s: %d devices, %d healthy",
            ep.resource,
            ep.name,
            len(devices),
            sum(d.healthy for d in devices.values()),
        )
        # The kubelet's order (genericDeviceUpdateCallback): devices in memory first, then
        # the checkpoint write, so the new capacity does not wait for the disk.
        await self._changed(ep.resource)
        self._save()

    async def _on_disconnect(self, ep: Endpoint, reason: str) -> None:
        if not self.endpoint_store:
            await self._run_client_ended(ep, reason)
            return
        eps = self._endpoints.get(ep.resource, {})
        if any(e.alive and e is not ep for e in eps.values()):
            # PluginDisconnected with a sibling left: only this endpoint goes, the sibling
            # is the primary now and the devices stay as they are (Kubernetes 1.37+).
            del eps[ep.name]
            await ep.close()
            log.info(
                "ListAndWatch of %s from %s ended (%s): %s serves it on",
                ep.resource,
                ep.name,
                reason,
                ", ".join(sorted(eps)),
            )
            await self._changed(ep.resource)
            return
        ep.alive = False
        devices = self._devices.get(ep.resource, {})
        self._devices[ep.resource] = {i: replace(d, health=UNHEALTHY) for i, d in devices.items()}
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

    async def _run_client_ended(self, ep: Endpoint, reason: str) -> None:
        """Before 1.37: `runClient` after `client.Run` returned (`plugin/v1beta1/handler.go`).

        The client disconnected is not necessarily the one whose stream ended:
        `getClient(name)` returns whichever client is registered for the resource now, the
        successor's when an older plugin stopped. Its connection is closed, so its own
        stream ends next and comes back here, finding no client (or a re-registration that
        arrived in between, which is then disconnected in turn, as in the kubelet).
        """
        resource = ep.resource
        # The kubelet's wording; it logs this as an error, here a warning, since every
        # plugin that stops ends its stream (and benchmarks show only errors).
        log.warning(
            '"ListAndWatch ended unexpectedly for device plugin" err="%s" resource="%s"',
            reason,
            resource,
        )
        ep.alive = False
        eps = self._endpoints.get(resource, {})
        if ep in self._detached:
            self._detached.discard(ep)
            await ep.close()
        elif eps.get(ep.name) is ep and ep is not _newest(eps):
            # An older plugin's client: in no map of the kubelet any more, only its loop ran.
            del eps[ep.name]
            await ep.close()
        await self._disconnect_client(resource, ended=ep)
        await self._changed(resource)

    async def _disconnect_client(self, resource: str, ended: Endpoint | None) -> None:
        """Before 1.37: `disconnectClient` of the resource's current client, if any.

        `ended` is the endpoint whose stream already ended: when it is the current client
        (a lone plugin stopped), its connection stays for the grace period, as the
        emulator keeps every ended endpoint's; any other client's connection is closed.
        """
        current = self._clients.pop(resource, None)
        if current is None:
            return
        log.info('"Deregistered client" name="%s"', resource)
        if current is not ended:
            await current.disconnect()
        # PluginDisconnected: the registered endpoint (`m.endpoints[resource]`) stops.
        stopped = _newest(self._endpoints.get(resource, {}))
        if stopped is not None:
            stopped.alive = False
            log.info('"Mark all resources Unhealthy for resource" resourceName="%s"', resource)
            devices = self._devices.get(resource, {})
            self._devices[resource] = {i: replace(d, health=UNHEALTHY) for i, d in devices.items()}
            log.info('"Endpoint became unhealthy" resourceName="%s"', resource)
            if stopped.expiry is None:
                stopped.expiry = self._spawn(self._expire_endpoint(stopped))
        log.info('"Device plugin disconnected" resource="%s"', resource)
        self._save()

    async def disconnect(self, resource: str) -> None:
        """The kubelet disconnects the resource's current client while it runs on.

        Before 1.37 this is `DeRegisterPlugin` (`plugin/v1beta1/handler.go`), and what an
        older plugin's stream ending does to its successor: the connection closes, the
        devices turn unhealthy and stay so until the plugin registers again. From 1.37 the
        newest live endpoint's connection is closed and its end is handled as any other.
        """
        self._require_running()
        if not self.endpoint_store:
            await self._disconnect_client(resource, ended=None)
            await self._changed(resource)
            return
        ep = endpoints_.primary(self._endpoints.get(resource, {}).values())
        if ep is not None:
            await ep.disconnect()

    async def _expire_endpoint(self, ep: Endpoint) -> None:
        await asyncio.sleep(self.grace_period)
        eps = self._endpoints.get(ep.resource)
        if eps is None or eps.get(ep.name) is not ep:
            return
        del eps[ep.name]
        ep.closed = True
        await ep.client.channel.close(None)
        if not eps:
            del self._endpoints[ep.resource]
            self._devices.pop(ep.resource, None)
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
        """The resource's one device set, as its endpoints last reported it."""
        return dict(self._devices.get(resource, {}))

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
        ep = endpoints_.primary(self._endpoints.get(resource, {}).values())
        return None if ep is None else ep.options

    def history(self, resource: str) -> list[tuple[int, int]]:
        """(capacity, allocatable) after each change, starting from an implicit (0, 0)."""
        return self._changes.history(resource)

    def calls(self, method: str, resource: str | None = None) -> list[RpcRecord]:
        """The kubelet's calls of `method` (e.g. "Allocate"), optionally for one resource."""
        return [
            r
            for r in self.rpcs
            if r.method == method and (resource is None or r.resource == resource)
        ]

    def on_change(self, callback: Callable[[str], None]) -> Callable[[], None]:
        """Call `callback(resource)` after every state change; returns an unsubscribe."""
        return self._changes.subscribe(callback)

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
        await self._changes.wait_for(predicate, timeout, describe)

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
        await self._changes.changed(resource, (self.capacity(resource), self.allocatable(resource)))

    def _record(self, resource: str, endpoint: str, method: str, error: str | None) -> None:
        self.rpcs.append(RpcRecord(time.monotonic(), resource, endpoint, method, error))

    # --------------------------------------------------------------- allocation

    def allocations(self, pod: str | None = None) -> list[Allocation]:
        """What containers hold now (restored from the checkpoint after a restart)."""
        return self._pods.allocations(pod)

    def container_response(self, pod: str, container: str) -> pb.ContainerAllocateResponse:
        """The merged answer of every resource of one container, as given to the runtime."""
        return self._pods.container_response(pod, container)

    def release(self, pod: str) -> list[str]:
        """Free a deleted pod's devices; returns their IDs."""
        self._require_running()
        freed = self._pods.release(pod)
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
            entry = self._pods.get(pod, container, resource)
            if entry is not None:
                log.info(
                    "container %s/%s already has %s devices %s: reusing its response",
                    pod,
                    container,
                    resource,
                    list(entry.device_ids),
                )
                allocation = to_allocation(entry, cached=True)
            else:
                allocation = await self._admit(
                    admission.Request(
                        resource,
                        count,
                        pod,
                        container,
                        tuple(dict.fromkeys(must_include)),
                        None if numa_affinity is None else frozenset(numa_affinity),
                    )
                )
        if start:
            await self._pre_start(allocation)
        return allocation

    async def start_container(self, pod: str, container: str) -> None:
        """(Re)start a container: PreStartContainer for each of its resources that needs it."""
        self._require_running()
        for entry in self._pods.of_container(pod, container):
            await self._pre_start(to_allocation(entry, cached=True))

    async def _admit(self, req: admission.Request) -> Allocation:
        resource = req.resource
        view = self.devices(resource)
        in_use = self._pods.in_use(resource)
        admission.check(
            req, view, in_use, self._pods.held_by_pod(resource, req.pod), self.allocatable(resource)
        )

        def preferred(
            available: list[str], must_include: list[str], size: int
        ) -> Awaitable[tuple[str, ...] | None]:
            # The newest live endpoint at the time of the call answers the hint.
            ep = endpoints_.primary(self._endpoints.get(resource, {}).values())
            return admission.ask_preferred(ep, req, available, must_include, size, self._record)

        allocated, hint = await admission.devices_to_allocate(
            req, view, in_use, topology_manager=self.topology_manager, preferred=preferred
        )
        # The primary endpoint allocates, whichever instance advertised the devices.
        eps = self._endpoints.get(resource)
        if not eps:
            raise req.unexpected(f"unknown Device Plugin {resource}")
        ep = endpoints_.primary(eps.values())
        if ep is None:
            raise req.unexpected(f"endpoint {next(iter(eps))} has been stopped")
        response = await admission.allocate(ep, req, allocated, self._record)
        entry = ckpt.PodDevicesEntry(
            pod=req.pod,
            container=req.container,
            resource=resource,
            device_ids=tuple(allocated),
            numa=tuple((view[d].numa_nodes or (-1,))[0] for d in allocated),
            response=response,
        )
        self._pods.add(entry)
        self._save()
        return replace(to_allocation(entry, cached=False), preferred=hint)

    async def _pre_start(self, allocation: Allocation) -> None:
        resource = allocation.resource
        eps = self._endpoints.get(resource, {})
        ep = endpoints_.primary(eps.values()) or next(iter(eps.values()), None)
        if ep is None:
            if resource in self._restored:
                return  # the kubelet has no options for it yet, so it skips PreStart
            raise ContainerStartError(
                f"endpoint not found in cache for a registered resource: {resource}"
            )
        await admission.pre_start(ep, allocation, self.pre_start_timeout, self._record)

    # --------------------------------------------------------------- whole pods

    async def run_pod(self, pod: dict[str, Any]) -> dict[str, list[str]]:
        """Admit and start a v1 Pod (a dict): container name -> the CDI devices it gets.

        Extended resources registered by a device plugin go through `allocate` for each
        container, except those the scheduler mapped to DRA in
        `status.extendedResourceClaimStatus`; then the DRA manager prepares the pod's claims
        (`PrepareError` when the kubelet would fail the sync). The CDI devices are the device
        plugins' `cdi_devices` followed by the DRA claims' CDI IDs, as the runtime gets them.
        """
        self._require_running()
        meta = pod.get("metadata") or {}
        uid = str(meta.get("uid") or meta.get("name"))
        mapped = {
            (m.get("containerName"), m.get("resourceName"))
            for m in ((pod.get("status") or {}).get("extendedResourceClaimStatus") or {}).get(
                "requestMappings"
            )
            or []
        }
        for container in containers_of(pod):
            name = str(container.get("name"))
            res = container.get("resources") or {}
            asked = {**(res.get("limits") or {}), **(res.get("requests") or {})}
            for resource, quantity in sorted(asked.items()):
                if (name, resource) in mapped or resource not in self.resources:
                    continue
                count = int(str(quantity))
                if count > 0:
                    await self.allocate(resource, count, pod=uid, container=name)
        if self.dra is not None:
            await self.dra.prepare(pod)
        devices: dict[str, list[str]] = {}
        for container in containers_of(pod):
            name = str(container.get("name"))
            plugin_cdi = [d.name for d in self.container_response(uid, name).cdi_devices]
            dra_cdi = self.dra.cdi_devices(pod, name) if self.dra is not None else []
            devices[name] = [*plugin_cdi, *dra_cdi]
        return devices

    async def delete_pod(self, pod: dict[str, Any]) -> None:
        """A pod's containers stopped: unprepare its claims, then free its devices."""
        self._require_running()
        if self.dra is not None:
            await self.dra.unprepare(pod)
        meta = pod.get("metadata") or {}
        self.release(str(meta.get("uid") or meta.get("name")))

    def _save(self) -> None:
        if self._server is None:
            return
        registered = {r: tuple(self.devices(r)) for r in self.resources}
        ckpt.save(self.checkpoint_path, ckpt.Checkpoint(tuple(self._pods), registered))
