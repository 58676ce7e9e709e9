"""The kubelet's store of DRA driver plugins: validation, connections, calls.

Written from `pkg/kubelet/cm/dra/plugin/dra_plugin_manager.go` (DRAPluginManager:
ValidatePlugin, RegisterPlugin, DeRegisterPlugin, GetPlugin, sync, wipeResourceSlices) and
`dra_plugin.go` (DRAPlugin: NodePrepareResources, NodeUnprepareResources,
servicesSupportedByKubelet, defaultClientCallTimeout). What the kubelet does and we do too:

- `validate_services`: the service to use is the FIRST entry of the plugin's
  `supported_versions` that the kubelet knows ("v1.DRAPlugin", "v1beta1.DRAPlugin"); so a
  plugin that lists both gets v1 only if it lists v1 first. Nothing known: refused.
- One plugin per (driver, endpoint): a second registration of the same endpoint while the
  first is still registered is refused ("endpoint ... already registered").
- The connection is made once, lazily, and monitored: a plugin whose socket stops answering
  stays registered but reads "not connected"; `get` prefers the newest connected plugin and
  falls back to the newest one (whose calls then fail with gRPC Unavailable).
- Each call has a 45 s deadline; the v1beta1 service gets the same messages (its protobuf
  wire format is identical) under its own method names.
- ResourceSlices of the node are deleted when the kubelet starts (all drivers) and when a
  driver has had no connected plugin for `wiping_delay` (30 s); a connected plugin cancels
  a pending wipe. Done only when the emulator is given a `SliceWiper`.

- With a health handler (the DRA manager's, `ResourceHealthStatus` being on by default in
  1.36), each registered plugin gets its health stream: `NodeWatchResources` is opened at
  registration and again `HEALTH_RETRY` (5 s) after each end, until the plugin goes; a
  stream that fails is recorded in `health_errors` as the kubelet logs it ("Error
  receiving from WatchResources stream", e.g. Unimplemented for a driver without it).

Left out: metrics interceptors.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, cast

import grpc

from kubegpu.api import dra_health_pb2, dra_health_stub
from kubegpu.api import dra_pb2 as dra
from kubegpu.kubelet.endpoint import go_error

log = logging.getLogger("tests.rig.dra")

V1_SERVICE = "v1.DRAPlugin"
V1BETA1_SERVICE = "v1beta1.DRAPlugin"
#: Most recent first (`servicesSupportedByKubelet`).
SUPPORTED_SERVICES = (V1_SERVICE, V1BETA1_SERVICE)
#: gRPC package of each service name the plugin may advertise.
_PACKAGES = {
    V1_SERVICE: "k8s.io.kubelet.pkg.apis.dra.v1",
    V1BETA1_SERVICE: "k8s.io.kubelet.pkg.apis.dra.v1beta1",
}
CALL_TIMEOUT = 45.0
WIPING_DELAY = 30.0
#: The period of the kubelet's `wait.UntilWithContext` around the health stream.
HEALTH_RETRY = 5.0

Req = TypeVar("Req", dra.NodePrepareResourcesRequest, dra.NodeUnprepareResourcesRequest)


class HealthHandler(Protocol):
    """Reads one health stream of a driver to its end (`HandleWatchResourcesStream`)."""

    def __call__(
        self, driver: str, stream: AsyncIterator[dra_health_pb2.NodeWatchResourcesResponse]
    ) -> Awaitable[None]: ...


class SliceWiper(Protocol):
    """Deletes the node's ResourceSlices, of one driver or (driver None) of all."""

    def __call__(self, driver: str | None) -> None: ...


def go_quote_list(items: list[str]) -> str:
    """A []string as Go's %q prints it: ["a" "b"]."""
    return "[" + " ".join(json.dumps(i) for i in items) + "]"


def validate_services(driver: str, endpoint: str, services: list[str]) -> tuple[str, str | None]:
    """(chosen service, None) or ("", the kubelet's refusal text) (`validateSupportedServices`)."""
    prefix = f"invalid supported gRPC versions of DRA driver plugin {driver} at endpoint {endpoint}"
    if not services:
        return "", f"{prefix}: empty list of supported gRPC services (aka supported versions)"
    for service in services:
        if service in SUPPORTED_SERVICES:
            return service, None
    return "", (
        f"{prefix}: none of services supported by the plugin ({go_quote_list(services)}) "
        f"are supported by the kubelet ({go_quote_list(list(SUPPORTED_SERVICES))})"
    )


@dataclass(eq=False)
class DRAPlugin:
    """One registered plugin of a driver: its endpoint, chosen service and connection."""

    driver: str
    endpoint: str
    service: str
    channel: grpc.aio.Channel
    call_timeout: float
    connected: bool = False
    monitor: asyncio.Task[None] | None = field(default=None, repr=False)
    health: asyncio.Task[None] | None = field(default=None, repr=False)

    async def _call(self, method: str, request: Req, reply: type[Any]) -> Any:
        path = f"/{_PACKAGES[self.service]}.DRAPlugin/{method}"
        call = self.channel.unary_unary(
            path,
            request_serializer=type(request).SerializeToString,
            response_deserializer=reply.FromString,
        )
        return await call(request, timeout=self.call_timeout)

    async def prepare(
        self, request: dra.NodePrepareResourcesRequest
    ) -> dra.NodePrepareResourcesResponse:
        return cast(
            dra.NodePrepareResourcesResponse,
            await self._call("NodePrepareResources", request, dra.NodePrepareResourcesResponse),
        )

    async def unprepare(
        self, request: dra.NodeUnprepareResourcesRequest
    ) -> dra.NodeUnprepareResourcesResponse:
        return cast(
            dra.NodeUnprepareResourcesResponse,
            await self._call("NodeUnprepareResources", request, dra.NodeUnprepareResourcesResponse),
        )


class PluginError(Exception):
    """The driver cannot be used; the message is the kubelet's (names the driver)."""


class DRAPluginManager:
    """The `DRAPlugin` handler of the plugin watcher, and the manager's way to a driver."""

    def __init__(
        self,
        *,
        call_timeout: float = CALL_TIMEOUT,
        wiping_delay: float = WIPING_DELAY,
        wipe: SliceWiper | None = None,
        on_change: Callable[[], Awaitable[None]] | None = None,
        health_retry: float = HEALTH_RETRY,
    ) -> None:
        self.call_timeout = call_timeout
        self.health_retry = health_retry
        #: Set by the DRA manager: reads each plugin's health stream.
        self.health_handler: HealthHandler | None = None
        #: (driver, the kubelet's error text) of every health stream that failed.
        self.health_errors: list[tuple[str, str]] = []
        #: How many health streams were opened, by driver.
        self.health_streams: dict[str, int] = {}
        self.wiping_delay = wiping_delay
        self._wipe = wipe
        self._on_change = on_change
        #: Driver -> plugins in the order they registered.
        self._store: dict[str, list[DRAPlugin]] = {}
        self._wipes: dict[str, asyncio.Task[None]] = {}
        #: Every wipe done: None for "all drivers" (kubelet start), else the driver.
        self.wiped: list[str | None] = []

    # ------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """The kubelet's start: no driver is usable yet, so the node's slices go."""
        self._do_wipe(None)

    async def stop(self) -> None:
        for task in self._wipes.values():
            task.cancel()
        self._wipes.clear()
        for plugins in self._store.values():
            for p in plugins:
                await self._close(p)
        self._store.clear()

    # ------------------------------------------------------------ handler API

    def validate(self, driver: str, endpoint: str, services: list[str]) -> str | None:
        return validate_services(driver, endpoint, services)[1]

    async def register(self, driver: str, endpoint: str, services: list[str]) -> str | None:
        """Add a plugin (`RegisterPlugin` / `add`); the error text, or None."""
        service, error = validate_services(driver, endpoint, services)
        if error is not None:
            return error
        plugins = self._store.setdefault(driver, [])
        if any(p.endpoint == endpoint for p in plugins):
            return f"endpoint {endpoint} already registered for DRA driver plugin {driver}"
        channel = grpc.aio.insecure_channel(f"unix:{endpoint}")
        plugin = DRAPlugin(driver, endpoint, service, channel, self.call_timeout)
        plugins.append(plugin)
        plugin.monitor = asyncio.ensure_future(self._follow(plugin))
        if self.health_handler is not None:
            plugin.health = asyncio.ensure_future(self._watch_health(plugin, self.health_handler))
        log.info(
            "registered DRA plugin %s at %s (service %s, %d plugins)",
            driver,
            endpoint,
            service,
            len(plugins),
        )
        await self._sync(driver)
        return None

    async def deregister(self, driver: str, endpoint: str) -> None:
        """Drop a plugin whose registration socket went away (`DeRegisterPlugin`)."""
        plugins = self._store.get(driver, [])
        found = next((p for p in plugins if p.endpoint == endpoint), None)
        if found is None:
            return
        # Closed before it leaves the store: closing waits on its tasks, and a watcher
        # woken meanwhile must not see the driver gone before the deregistration is done.
        await self._close(found)
        plugins.remove(found)
        if not plugins:
            del self._store[driver]
        log.info("unregistered DRA plugin %s at %s (%d left)", driver, endpoint, len(plugins))
        await self._sync(driver)

    # ------------------------------------------------------------ lookups

    def get(self, driver: str) -> DRAPlugin:
        """The plugin to call for a driver (`GetPlugin`); `PluginError` when there is none."""
        if not driver:
            raise PluginError("DRA driver name is empty")
        plugins = self._store.get(driver)
        if not plugins:
            raise PluginError(f"DRA driver {driver} is not registered")
        for p in reversed(plugins):
            if p.connected:
                return p
        return plugins[-1]

    def plugins(self, driver: str | None = None) -> list[DRAPlugin]:
        return [p for d, ps in sorted(self._store.items()) if driver in (None, d) for p in ps]

    @property
    def drivers(self) -> list[str]:
        return sorted(self._store)

    def usable(self, driver: str) -> bool:
        return any(p.connected for p in self._store.get(driver, ()))

    # ------------------------------------------------------------ internals

    async def _follow(self, plugin: DRAPlugin) -> None:
        """Track the connection (the kubelet's stats handler asks gRPC to reconnect on loss)."""
        state = plugin.channel.get_state(try_to_connect=True)
        while True:
            connected = state == grpc.ChannelConnectivity.READY
            if connected != plugin.connected:
                plugin.connected = connected
                log.info(
                    "DRA plugin %s at %s %s",
                    plugin.driver,
                    plugin.endpoint,
                    "connected" if connected else "disconnected",
                )
                await self._sync(plugin.driver)
            await plugin.channel.wait_for_state_change(state)
            state = plugin.channel.get_state(try_to_connect=True)

    async def _watch_health(self, plugin: DRAPlugin, handler: HealthHandler) -> None:
        """Open the plugin's health stream, again `health_retry` after each end."""
        while True:
            call = dra_health_stub(plugin.channel).NodeWatchResources(
                dra_health_pb2.NodeWatchResourcesRequest()
            )
            self.health_streams[plugin.driver] = self.health_streams.get(plugin.driver, 0) + 1
            try:
                await handler(plugin.driver, _responses(call))
            except grpc.RpcError as exc:
                text = rpc_error_text(exc)
                log.error(
                    "DRA plugin %s: error receiving from WatchResources stream: %s",
                    plugin.driver,
                    text,
                )
                self.health_errors.append((plugin.driver, text))
                if self._on_change is not None:
                    await self._on_change()
            finally:
                call.cancel()
            await asyncio.sleep(self.health_retry)

    async def _close(self, plugin: DRAPlugin) -> None:
        for task in (plugin.monitor, plugin.health):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        plugin.connected = False
        await plugin.channel.close(None)

    async def _sync(self, driver: str) -> None:
        """Schedule or cancel the driver's slice wipe (`sync`), then tell the watchers."""
        if self._wipe is not None:
            pending = self._wipes.get(driver)
            if self.usable(driver):
                if pending is not None:
                    pending.cancel()
                    del self._wipes[driver]
            elif pending is None:
                self._wipes[driver] = asyncio.ensure_future(self._wipe_later(driver))
        if self._on_change is not None:
            await self._on_change()

    async def _wipe_later(self, driver: str) -> None:
        await asyncio.sleep(self.wiping_delay)
        if self._wipes.get(driver) is asyncio.current_task():
            del self._wipes[driver]
            self._do_wipe(driver)
            if self._on_change is not None:
                await self._on_change()

    def _do_wipe(self, driver: str | None) -> None:
        if self._wipe is None:
            return
        log.info("deleting ResourceSlices of %s", driver or "every driver")
        self._wipe(driver)
        self.wiped.append(driver)


async def _responses(
    call: Any,
) -> AsyncIterator[dra_health_pb2.NodeWatchResourcesResponse]:
    """The stream's responses, typed (the generated stub is not)."""
    async for response in call:
        yield cast(dra_health_pb2.NodeWatchResourcesResponse, response)


def rpc_error_text(exc: BaseException) -> str:
    """How the kubelet prints a failed call (grpc-go's status error)."""
    return go_error(exc) if isinstance(exc, grpc.RpcError) else repr(exc)
