"""The `serve` daemon: lifecycle only.

Startup (config, backend, first device list, front) → run (root tasks under one
`Supervisor`) → graceful shutdown (front stops, sockets removed). The first root task
to fail stops all of them. State lives in one `NodeStore` (inventory, health and why,
config, MPS readiness); writers (health monitor, config follower, MPS daemons) update it,
and the front, metrics and Node events follow it as subscribers.

The daemon starts the shared core and then exactly one `Front`, chosen by the mode in
one place (`FRONTS`): `kubegpu.plugin.front.PluginFront` (the device plugin API) or
`kubegpu.dra.front.DraFront` (a DRA kubelet plugin). Each is assembled in its own
package; the daemon knows only the contract (`kubegpu.front`: the `Front` protocol, and
the `Core` and `DaemonSettings` every front's class is called with). `FRONTS` names each
front's class rather than importing it, and `front_factory` imports the one the mode
chooses when the daemon is built, so a `serve` loads its own mode and nothing of the
other's (neither its package nor the libraries only it uses). Each room runs its own
loop over the store and the daemon only starts, supervises and stops it: the MPS control
daemons (`mps.MpsReconciler`), the CDI spec files (`cdi.CdiWriter`) and, with
`--with-labels`, the node labels (`labeller.follow_store`). Who uses what on the GPUs
(`usage.UsageCollector`) is read at each scrape of /metrics, off the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pkgutil
import socket
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Final

from kubegpu import labeller
from kubegpu.cdi import CdiWriter
from kubegpu.config import Config, Flags
from kubegpu.config import driver_files_root as config_driver_files_root
from kubegpu.config.show import log_config
from kubegpu.config.source import ConfigSource, ConfigUpdate
from kubegpu.devices import DeviceBackend, Health, Inventory, NullBackend, open_backend
from kubegpu.errors import ConfigError, InitError, PreconditionError, StartupError
from kubegpu.events import NodeEvents, Reason
from kubegpu.front import Core, DaemonSettings, Front, FrontFactory
from kubegpu.health import HealthMonitor, health_flags_from_env
from kubegpu.httpserver import HttpServer
from kubegpu.kube import Kube, KubeClient
from kubegpu.metrics import Metrics
from kubegpu.mode import Mode
from kubegpu.mps import MpsReconciler
from kubegpu.resources import ResourceSpec
from kubegpu.state import NodeStore
from kubegpu.supervisor import Supervisor, until_stopped
from kubegpu.usage import UsageCollector, UsageSettings
from kubegpu.usage.collector import KUBELET_CHECKPOINT

log = logging.getLogger("kubegpu.daemon")


def _os_reason(exc: OSError) -> str:
    """The cause alone: asyncio wraps it in `error while attempting to bind on ...`."""
    if isinstance(exc, socket.gaierror):
        return f"cannot resolve the address ({exc.strerror})"
    text = os.strerror(exc.errno) if exc.errno else str(exc)
    return text[:1].lower() + text[1:]


def driver_files_root(flags: Flags) -> str:
    """Where this process reads the driver's files from: the one rule of `config.settings`."""
    return config_driver_files_root(flags.nvidia_driver_root, flags.plugin.container_driver_root)


#: The one choice the mode makes: the front the daemon starts over the core, as
#: `module:class`. Named, not imported: a `serve` loads its own mode's front and nothing of
#: the other (`front_factory`), as the CLI loads only the command that runs.
FRONTS: Final[Mapping[Mode, str]] = {
    Mode.PLUGIN: "kubegpu.plugin.front:PluginFront",
    Mode.DRA: "kubegpu.dra.front:DraFront",
}


def front_factory(mode: Mode) -> FrontFactory:
    """The class of `mode`'s front, imported now (the standard library's name resolver)."""
    factory: FrontFactory = pkgutil.resolve_name(FRONTS[mode])
    return factory


class Daemon:
    def __init__(
        self,
        settings: DaemonSettings,
        *,
        backend: DeviceBackend | None = None,
        metrics: Metrics | None = None,
        events: NodeEvents | None = None,
        on_registered: Callable[[str, float], None] | None = None,
        kube: Kube | None = None,
    ) -> None:
        self.settings = settings
        #: The Kubernetes API (DRA mode: ResourceSlices written, ResourceClaims read; a
        #: client that is configured on its first call).
        self.kube: Kube = kube if kube is not None else KubeClient()
        self.metrics = metrics or Metrics()
        self.events = events or NodeEvents.disabled()
        self._backend = backend
        #: The one copy of inventory, health, config and MPS readiness; all else derives.
        self.store = NodeStore()
        core = Core(
            self.store, self.kube, self.metrics, self.events, lambda: self.backend, on_registered
        )
        #: The mode's front: the one place the mode is chosen.
        self.front: Front = front_factory(settings.mode)(settings, core)
        self.source = ConfigSource(
            config_file=settings.config_file,
            overrides=settings.overrides,
            named=settings.named,
            poll_interval=settings.config_poll_interval,
        )
        self.started = asyncio.Event()
        #: The CDI spec files, kept in step with the store.
        self.cdi = CdiWriter(self.store, settings.cdi_dir)
        #: One supervised MPS control daemon per MPS-shared resource of the store.
        self.mps = MpsReconciler(
            self.store,
            control_binary=settings.mps_control_binary,
            per_claim=self.front.per_claim,
        )
        #: Who uses what on the GPUs: the per-container metrics, collected when scraped.
        self.usage = self._usage_collector()
        self.metrics.follow_usage(self.usage)
        self.metrics.follow_devices(self.usage.devices)

    def _usage_collector(self) -> UsageCollector:
        s = self.settings
        usage = UsageSettings(
            proc_root=s.proc_root,
            pod_resources_socket=s.pod_resources_socket,
            kubelet_checkpoint=s.plugin_dir / KUBELET_CHECKPOINT,
            hostname=s.node_name or socket.gethostname(),
            max_rows=s.usage_max_rows,
        )
        return UsageCollector(
            usage,
            backend=lambda: self._backend,
            state=lambda: self.store.state,
            dra=self.front.claims_view(),
        )

    @property
    def backend(self) -> DeviceBackend:
        assert self._backend is not None, "daemon not started"
        return self._backend

    # Read-only views of the store, for tests, the demo and benchmarks.
    @property
    def inventory(self) -> Inventory:
        return self.store.state.inventory

    @property
    def config(self) -> Config:
        return self.store.state.config

    @property
    def health(self) -> Mapping[str, Health]:
        return self.store.state.health

    @property
    def specs(self) -> tuple[ResourceSpec, ...]:
        """What is advertised now (derived from the store)."""
        return self.store.state.specs

    # -- lifecycle ----------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Serve until `stop` is set. Raises `ConfigError`/`InitError` when startup fails.

        Order matters for a DaemonSet: the front's place on the node (`Front.open`: the
        plugin-directory role) and `/healthz` come first (both instant), then what may wait
        (the API server for the config label, NVML, MPS), and all of that is abandoned the
        moment `stop` is set, so SIGTERM always ends us. Shutdown stops the front first
        (`Front.stop`: the plugins withdraw and answer the calls on their way) and lets its
        directories go last.
        """
        updates = self.source.updates()
        http: list[HttpServer] = []
        try:
            self.front.open()
            http = await self._start_http()
            # Every task from here on (registrars, MPS supervisors, roots) is named by the
            # supervisor; leaving the block cancels them all before the plugins stop.
            async with Supervisor("serve") as tasks:
                if not await until_stopped("start-up", self._startup(updates), stop):
                    log.info("stopped during start-up")
                    return
                # Before any root starts, so a bad DP_*_HEALTHCHECKS value ends start-up.
                health_flags = health_flags_from_env(
                    self.settings.health_env, self.config.flags.health
                )
                monitor = HealthMonitor(
                    self.backend, health_flags, self.store, metrics=self.metrics
                )
                since = self.store.state.version
                # Subscribers first (they miss nothing), then the writers.
                for name, task in self.front.root_tasks(since):
                    tasks.start(name, task, root=True)
                tasks.start("mps", self.mps.follow(since), root=True)
                tasks.start("cdi writer", self.cdi.follow(since), root=True)
                tasks.start("health reporter", self._report_health(), root=True)
                tasks.start("events", self.events.run(), root=True)
                tasks.start("health monitor", monitor.run(), root=True)
                tasks.start("config follower", self._follow_config(updates), root=True)
                if self.settings.with_labels:
                    tasks.start("labeller", labeller.follow_store(self.store), root=True)
                self.started.set()
                try:
                    await tasks.wait(stop)
                finally:
                    log.info("stopping: removing plugin sockets")
        finally:
            await self.front.stop()
            for server in http:
                await server.stop()
            await self.mps.stop()
            self.usage.close()
            closer = getattr(updates, "aclose", None)
            if closer is not None:
                with contextlib.suppress(Exception):
                    await closer()
            if self._backend is not None:
                await asyncio.to_thread(self._backend.close)
            self.front.close()

    async def _startup(self, updates: AsyncIterator[ConfigUpdate]) -> None:
        first = await anext(updates)
        if first.error is not None or first.config is None:
            raise first.error or ConfigError("no configuration")
        config = first.config
        log_config(log, "effective config", first.origin, config)
        try:
            self.front.check(config)
        except PreconditionError as exc:
            raise StartupError(str(exc)) from exc
        inventory = await self._open_backend(config)
        # A config that cannot serve this node raises here and ends start-up.
        state = self.store.update(inventory=inventory, config=config)
        await self.cdi.write(state)
        # MPS daemons before the first list, so the kubelet's first view is the right one.
        await self.mps.reconcile(state)
        state = self.store.state
        await self.front.start(state)
        for spec in state.specs:
            log.info(
                "advertising %s: %d device(s), %d healthy",
                spec.name,
                len(spec.devices),
                spec.healthy_count,
            )
        if not state.specs:
            log.warning("no GPUs to advertise on this node")

    async def _open_backend(self, config: Config) -> Inventory:
        try:
            if self._backend is None:
                self._backend = await asyncio.to_thread(
                    open_backend,
                    self.settings.backend,
                    simulate=self.settings.simulate,
                    driver_root=driver_files_root(config.flags),
                    # Device nodes go to the kubelet as host paths, so they keep the host root.
                    dev_root=config.flags.dev_root,
                )
            inventory = await asyncio.to_thread(self._backend.discover)
            if not inventory.gpus:
                raise InitError(f"the {self._backend.name} backend found no GPUs on this node")
        except InitError as exc:
            if config.flags.fail_on_init_error:
                raise
            log.error(
                "%s; advertising nothing and staying up because --fail-on-init-error=false", exc
            )
            self._backend = NullBackend(str(exc))
            inventory = Inventory(gpus=(), backend="null")
        log.info(
            "backend %s: %d GPU(s), driver %s",
            inventory.backend or self.backend.name,
            len(inventory.gpus),
            inventory.driver_version or "unknown",
        )
        return inventory

    async def _start_http(self) -> list[HttpServer]:
        """Probes and metrics on their own ports: probes may listen on every address for
        the kubelet while metrics stay on the pod IP."""
        s = self.settings
        servers = []
        if s.health_port:
            servers.append(
                HttpServer(s.health_address, s.health_port, metrics=None, ready=self.ready)
            )
        if s.metrics_port:
            servers.append(
                HttpServer(
                    s.metrics_address, s.metrics_port, metrics=self.metrics, ready=self.ready
                )
            )
        started: list[HttpServer] = []
        try:
            for server in servers:
                try:
                    await server.start()
                except OSError as exc:
                    which = (
                        "--health-address/--health-port"
                        if server.metrics is None
                        else "--metrics-address/--metrics-port"
                    )
                    raise StartupError(
                        f"cannot listen on {server.host}:{server.port} ({which}): "
                        f"{_os_reason(exc)}; pick a free port or an address of this host"
                    ) from exc
                started.append(server)
                log.info("HTTP endpoints on %s:%d", server.host, server.port)
        except StartupError:
            for server in started:
                await server.stop()
            raise
        return servers

    def ready(self) -> tuple[bool, str]:
        if not self.started.is_set():
            return False, "starting"
        waiting = self.mps.waiting()
        if waiting:
            return False, f"MPS control daemon not ready: {', '.join(waiting)}"
        return self.front.ready()

    # -- changes ------------------------------------------------------------------------

    async def _report_health(self) -> None:
        """Metrics and Node events for every health transition the store records."""
        async for before, after in self.store.changes():
            if before.health is after.health:
                continue
            owners = after.owners
            for uuid in sorted(set(before.health) | set(after.health)):
                old = before.health.get(uuid, Health.HEALTHY)
                new = after.health.get(uuid, Health.HEALTHY)
                if old is new:
                    continue
                if uuid in owners:
                    self.metrics.health_transition(owners[uuid], healthy=new is Health.HEALTHY)
                if new is Health.UNHEALTHY:
                    self.events.warning(Reason.GPU_UNHEALTHY, f"GPU {uuid} is unhealthy")
                else:
                    self.events.emit(Reason.GPU_HEALTHY, f"GPU {uuid} is healthy again")

    async def _follow_config(self, updates: AsyncIterator[ConfigUpdate]) -> None:
        """Each new config into the store, unless it cannot serve this node."""
        async for update in updates:
            if update.config is None:
                self._reject(update.origin, update.error)
                continue
            try:
                self.front.check(update.config)
                self.store.update(config=update.config)
            except (ConfigError, PreconditionError) as exc:
                self._reject(update.origin, exc)
                continue
            self.metrics.config_reload(ok=True)
            log_config(log, "config reloaded", update.origin, update.config)
            # The counterpart of ConfigRejected: an operator watching the Node sees the
            # reload land, not only the ones refused.
            self.events.emit(Reason.CONFIG_APPLIED, f"{update.origin}: applied")

    def _reject(self, origin: str, error: Exception | None) -> None:
        self.metrics.config_reload(ok=False)
        log.error("config from %s rejected, the last good one keeps serving: %s", origin, error)
        self.events.warning(Reason.CONFIG_REJECTED, f"{origin}: {error}")

    def poke_config(self) -> None:
        """SIGHUP: re-read the config now."""
        log.info("SIGHUP: re-reading the config")
        self.source.poke()


__all__ = [
    "FRONTS",
    "Core",
    "Daemon",
    "DaemonSettings",
    "Front",
    "driver_files_root",
    "front_factory",
]
