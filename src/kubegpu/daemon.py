"""The `serve` daemon: lifecycle only.

Startup (config, backend, first device list, plugins) → run (root tasks under one
`Supervisor`) → graceful shutdown (plugins stop, sockets removed). The first root task
to fail stops all of them. State lives in one `NodeStore` (inventory, health, config,
MPS readiness); writers (health monitor, config follower, MPS daemons) update it, and
the plugins, metrics and Node events follow it as subscribers. In DRA mode
(`--mode dra`) the DRA kubelet plugin (`kubegpu.dra.DraDriver`) takes the device plugin
servers' place over the same store; everything else is shared. Each room runs its own
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
import socket
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubegpu import labeller
from kubegpu.allocation import select_imex_channels
from kubegpu.api import DEVICE_PLUGIN_PATH, POD_RESOURCES_SOCKET
from kubegpu.cdi import DEFAULT_DIRECTORY as DEFAULT_CDI_DIRECTORY
from kubegpu.cdi import CdiWriter
from kubegpu.config import Config, Flags
from kubegpu.config import driver_files_root as config_driver_files_root
from kubegpu.config.show import log_config
from kubegpu.config.source import POLL_INTERVAL, ConfigSource, ConfigUpdate, NamedConfigs
from kubegpu.devices import (
    DeviceBackend,
    Health,
    Inventory,
    NullBackend,
    Vendor,
    open_backend,
    pci,
)
from kubegpu.devices.nvml import NvmlBackend
from kubegpu.dra.claims import AMD_DRIVER, NVIDIA_DRIVER
from kubegpu.dra.driver import PLUGINS_DIRECTORY, REGISTRAR_DIRECTORY, DraDriver
from kubegpu.dra.health import HealthServicer
from kubegpu.dra.limits import ClaimLimiter
from kubegpu.dra.publisher import SlicePublisher, faults_of
from kubegpu.dra.service import ClaimPreparer
from kubegpu.dra.sizing import sized
from kubegpu.dra.stale import EXTENDED_RESOURCES, StaleResourceCheck
from kubegpu.dra.usage import dra_view
from kubegpu.errors import ConfigError, InitError, KubegpuError, PreconditionError
from kubegpu.events import NodeEvents, Reason
from kubegpu.health import HealthMonitor, health_flags_from_env
from kubegpu.httpserver import HttpServer
from kubegpu.kube import Kube, KubeClient
from kubegpu.metrics import Metrics
from kubegpu.mps import MpsReconciler
from kubegpu.nvidia_paths import MPS_CONTROL_BINARY
from kubegpu.plugin import PluginManager, handover
from kubegpu.plugin.directory import PluginDirectory, Role
from kubegpu.plugin.manager import socket_path_too_long
from kubegpu.resources import ResourceSpec
from kubegpu.state import NodeStore
from kubegpu.supervisor import Supervisor, until_stopped
from kubegpu.usage import DEFAULT_MAX_ROWS, UsageCollector, UsageSettings
from kubegpu.usage.collector import KUBELET_CHECKPOINT

log = logging.getLogger("kubegpu.daemon")


class StartupError(KubegpuError):
    """This node cannot host the daemon as asked: the plugin directory is taken, a port is
    in use, an address is not this host's (exit 1: the environment, not the flags)."""


def _os_reason(exc: OSError) -> str:
    """The cause alone: asyncio wraps it in `error while attempting to bind on ...`."""
    if isinstance(exc, socket.gaierror):
        return f"cannot resolve the address ({exc.strerror})"
    text = os.strerror(exc.errno) if exc.errno else str(exc)
    return text[:1].lower() + text[1:]


def driver_files_root(flags: Flags) -> str:
    """Where this process reads the driver's files from: the one rule of `config.settings`."""
    return config_driver_files_root(flags.nvidia_driver_root, flags.plugin.container_driver_root)


@dataclass(frozen=True)
class DaemonSettings:
    """What `serve` was asked to do; built from flags and env vars by the CLI."""

    plugin_dir: Path = Path(DEVICE_PLUGIN_PATH)
    #: `plugin` (the device plugin API, the default) or `dra` (a DRA kubelet plugin).
    mode: str = "plugin"
    #: DRA: where the kubelet's plugin watcher looks for registration sockets.
    registrar_dir: Path = Path(REGISTRAR_DIRECTORY)
    #: DRA: the kubelet's plugins directory; ours is `<it>/<driver>` (dra.sock, checkpoint).
    kubelet_plugins_dir: Path = Path(PLUGINS_DIRECTORY)
    #: This node's name: the DRA pool the scheduler allocates from.
    node_name: str = ""
    backend: str = "auto"
    simulate: str | None = None
    config_file: Path | None = None
    #: Flag and env values as dotted config paths; they beat the config file.
    overrides: Mapping[str, Any] = field(default_factory=dict)
    named: NamedConfigs | None = None
    #: NVIDIA's DP_DISABLE_HEALTHCHECKS / DP_ENABLE_HEALTHCHECKS, as read at the edge.
    health_env: Mapping[str, str] = field(default_factory=dict)
    metrics_address: str = "127.0.0.1"
    metrics_port: int = 0
    health_address: str = "0.0.0.0"
    health_port: int = 0
    config_poll_interval: float = POLL_INTERVAL
    #: Where CDI specs go when a CDI device-list strategy is on.
    cdi_dir: Path = Path(DEFAULT_CDI_DIRECTORY)
    mps_control_binary: str = MPS_CONTROL_BINARY
    #: Also write GPU Feature Discovery labels (NFD features.d file), as `kubegpu labels`.
    with_labels: bool = False
    #: Start beside a `serve` already on the plugin directory and take over from it.
    handover: bool = False
    #: The host's /proc (process cgroups) and the kubelet's PodResources socket, to tell
    #: which container uses what on the GPUs; the cap on per-container rows per scrape.
    proc_root: Path = Path("/proc")
    pod_resources_socket: Path | None = Path(POD_RESOURCES_SOCKET)
    usage_max_rows: int = DEFAULT_MAX_ROWS


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
        #: DRA mode's API: ResourceSlices written, ResourceClaims read (a client that is
        #: configured on its first call).
        self.kube: Kube = kube if kube is not None else KubeClient()
        #: The DRA kubelet plugin, once start-up knows the node's vendor (DRA mode only).
        self.dra: DraDriver | None = None
        #: DRA mode: device-plugin resources the Node's status still shows.
        self.stale: StaleResourceCheck | None = None
        self.metrics = metrics or Metrics()
        self.events = events or NodeEvents.disabled()
        self._backend = backend
        #: This process's role in the plugin directory and the socket slot it serves. In DRA
        #: mode, the driver's own directory, taken once start-up knows the driver.
        self.directory = (
            PluginDirectory(
                settings.kubelet_plugins_dir,
                what="kubelet plugins directory",
                flag="--kubelet-plugins-directory-path",
            )
            if settings.mode == "dra"
            else PluginDirectory(settings.plugin_dir, handover=settings.handover)
        )
        self.manager = PluginManager(
            settings.plugin_dir,
            metrics=self.metrics,
            on_registered=on_registered,
            cdi_dir=settings.cdi_dir,
            socket_name=self.directory.socket_name,
        )
        #: The one copy of inventory, health, config and MPS readiness; all else derives.
        self.store = NodeStore()
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
            # DRA mode: a memory-sized resource's claims each get a daemon of their own.
            per_claim=sized if settings.mode == "dra" else lambda spec: False,
        )
        #: Who uses what on the GPUs: the per-container metrics, collected when scraped.
        self.usage = self._usage_collector()
        self.metrics.follow_usage(self.usage)
        self.metrics.follow_devices(self.usage.devices)

    def _usage_collector(self) -> UsageCollector:
        s = self.settings
        usage = UsageSettings(
            mode=s.mode,
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
            dra=lambda: (
                None
                if self.dra is None
                else dra_view(self.dra.driver, self.dra.data_dir, s.node_name)
            ),
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

        Order matters for a DaemonSet: the plugin-directory role (`PluginDirectory`) and
        `/healthz` come first (both instant), then what may wait (the API server for the
        config label, NVML, MPS), and all of that is abandoned the moment `stop` is set, so
        SIGTERM always ends us. Shutdown withdraws the plugins and answers the calls on their
        way (`PluginManager.stop`); a process that handed over to a successor does the same.
        """
        updates = self.source.updates()
        http: list[HttpServer] = []
        try:
            self._check_plugin_dir()
            # DRA mode takes the driver's own directory once start-up knows the driver.
            if self.settings.mode != "dra" and self.directory.acquire() is Role.SUCCESSOR:
                log.info(
                    "another kubegpu serve owns %s: starting beside it on socket slot %d, "
                    "to take over",
                    self.settings.plugin_dir,
                    self.directory.slot,
                )
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
                if self.dra is not None:
                    publisher = self._publisher(self.dra.driver, monitor)
                    stale = self.stale = self._stale_check(self.dra.driver)

                    def registered() -> None:
                        # A starting kubelet has just deleted the node's slices (and one
                        # that lost us a while ours): compare with the API now.
                        publisher.resync()
                        stale.poke()

                    self.dra.registration.on_registered = registered
                    # A newer Xid on a GPU already unhealthy renames its taint.
                    monitor.on_reason = lambda uuid: publisher.faults_changed()
                    tasks.start("stale node resources", stale.run())
                    tasks.start("dra sockets", self.dra.run(), root=True)
                    if self.dra.health is not None:
                        # The stream's messages say why, as the health monitor tells it.
                        self.dra.health.reason = monitor.tracker.reason
                        tasks.start("dra health", self.dra.health.follow(), root=True)
                    tasks.start("resource slices", publisher.run(), root=True)
                else:
                    tasks.start("plugins", self.manager.follow(self.store, since), root=True)
                tasks.start("mps", self.mps.follow(since), root=True)
                tasks.start("cdi writer", self.cdi.follow(since), root=True)
                tasks.start("health reporter", self._report_health(), root=True)
                tasks.start("events", self.events.run(), root=True)
                if self.dra is None:
                    tasks.start("kubelet watcher", self.manager.run(), root=True)
                tasks.start("health monitor", monitor.run(), root=True)
                tasks.start("config follower", self._follow_config(updates), root=True)
                tasks.start("handover", handover.follow(self.directory, self.manager), root=True)
                if self.settings.with_labels:
                    tasks.start("labeller", labeller.follow_store(self.store), root=True)
                self.started.set()
                try:
                    await tasks.wait(stop)
                finally:
                    log.info("stopping: removing plugin sockets")
        finally:
            if self.dra is not None:
                await self.dra.stop()
            await self.manager.stop()
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
            self.directory.release()

    async def _startup(self, updates: AsyncIterator[ConfigUpdate]) -> None:
        first = await anext(updates)
        if first.error is not None or first.config is None:
            raise first.error or ConfigError("no configuration")
        config = first.config
        log_config(log, "effective config", first.origin, config)
        try:
            self._check_node_has(config)
        except PreconditionError as exc:
            raise StartupError(str(exc)) from exc
        inventory = await self._open_backend(config)
        # A config that cannot serve this node raises here and ends start-up.
        state = self.store.update(inventory=inventory, config=config)
        if self.settings.mode == "dra":
            dra = self._dra_driver(inventory)
            self._take_driver_dir(dra)
            self.dra = dra
            self._check_dra_socket_paths(self.dra)
        else:
            self._check_socket_paths(state.planned)
        await self.cdi.write(state)
        # MPS daemons before the first list, so the kubelet's first view is the right one.
        await self.mps.reconcile(state)
        state = self.store.state
        if self.dra is not None:
            await self.dra.start()
        else:
            await self.manager.apply(state.specs, state.config)
        through = f" through DRA driver {self.dra.driver}" if self.dra is not None else ""
        for spec in state.specs:
            log.info(
                "advertising %s%s: %d device(s), %d healthy",
                spec.name,
                through,
                len(spec.devices),
                spec.healthy_count,
            )
        if not state.specs:
            log.warning("no GPUs to advertise on this node")

    def _dra_driver(self, inventory: Inventory) -> DraDriver:
        """The DRA plugin for this node's vendor (`gpu.nvidia.com`, or AMD's name)."""
        if not self.settings.node_name:
            raise StartupError(
                "DRA mode needs this node's name (--node-name, NODE_NAME): its ResourceSlices "
                "and pool are named after it"
            )
        amd = bool(inventory.gpus) and all(g.vendor is Vendor.AMD for g in inventory.gpus)
        driver = AMD_DRIVER if amd else NVIDIA_DRIVER
        s = self.settings
        preparer = ClaimPreparer(
            self.store,
            self.kube,
            data_dir=s.kubelet_plugins_dir / driver,
            cdi_dir=s.cdi_dir,
            driver=driver,
            pool=s.node_name,
            limiter=ClaimLimiter(
                control_binary=s.mps_control_binary,
                memory=(
                    self.backend.memory_limiter() if isinstance(self.backend, NvmlBackend) else None
                ),
            ),
        )
        return DraDriver(
            preparer,
            driver=driver,
            registrar_dir=s.registrar_dir,
            plugins_dir=s.kubelet_plugins_dir,
            health=HealthServicer(self.store, driver=driver, pool=s.node_name),
        )

    def _publisher(self, driver: str, monitor: HealthMonitor) -> SlicePublisher:
        """The node's ResourceSlices for `driver`, following the store; an unhealthy
        device's taint names the Xid the health monitor saw."""
        simulated = self.settings.simulate is not None
        return SlicePublisher(
            self.kube,
            self.store,
            self.settings.node_name,
            drivers=(driver,),
            faults=lambda: faults_of(monitor.tracker.xids()),
            # A simulated node's bus IDs are not this host's: no pcieRoot rather than a
            # wrong one.
            pcie_roots=None if simulated else (lambda buses: pci.pcie_roots("/", buses)),
        )

    def _stale_check(self, driver: str) -> StaleResourceCheck:
        """Device-plugin resources left in the Node's status: the extended resource of the
        driver's whole-GPU DeviceClass, and whatever the config makes the device plugin
        mode advertise (MIG, shared and renamed resources)."""

        def names() -> set[str]:
            own = EXTENDED_RESOURCES.get(driver)
            return {spec.name for spec in self.store.state.specs} | ({own} if own else set())

        return StaleResourceCheck(
            self.kube, self.settings.node_name, names, events=self.events, metrics=self.metrics
        )

    def _take_driver_dir(self, dra: DraDriver) -> None:
        """Own the driver's directory under the kubelet's plugins directory (its sockets
        and checkpoint): created if missing, locked against a second `serve`. Nothing is
        written beside it, so a deployment may mount that one directory alone."""
        flag = "--kubelet-plugins-directory-path"
        what = "DRA driver directory"
        _usable_dir(dra.data_dir, what, f"{dra.data_dir} from the host", flag)
        self.directory = PluginDirectory(dra.data_dir, what=what, flag=flag)
        self.directory.acquire()

    def _check_dra_socket_paths(self, dra: DraDriver) -> None:
        for path in (dra.service.path, dra.registrar.path):
            too_long = socket_path_too_long(path)
            if too_long is not None:
                raise StartupError(f"DRA driver {dra.driver}: {too_long}")

    def _check_plugin_dir(self) -> None:
        if self.settings.mode == "dra":
            # The driver's own directory is checked once start-up knows the driver.
            _usable_dir(
                self.settings.registrar_dir,
                "kubelet directory",
                "the kubelet's directory",
                "--kubelet-registrar-directory-path",
            )
            return
        _usable_dir(
            self.settings.plugin_dir,
            "device-plugin directory",
            "the kubelet's device-plugins directory",
            "--device-plugin-path",
        )

    def _check_socket_paths(self, specs: tuple[ResourceSpec, ...]) -> None:
        """A socket path over the unix limit can never be served: say so and stop, rather
        than retry forever (the CLI only knows the kubelet's socket name, not ours)."""
        for spec in specs:
            name = self.directory.socket_name(spec.socket_name)
            too_long = socket_path_too_long(self.settings.plugin_dir / name)
            if too_long is not None:
                raise StartupError(f"{spec.name}: {too_long}")

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
        if self.dra is not None:
            ok, reason = self.dra.ready()
            detail = self.stale.detail() if self.stale is not None else None
            # Still ready: see kubegpu.dra.stale for why a stale Node status is not a reason
            # to take the pod out of service.
            return (ok, f"{reason}; {detail}") if ok and detail else (ok, reason)
        return self.manager.ready()

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
                self._check_node_has(update.config)
                self.store.update(config=update.config)
            except (ConfigError, PreconditionError) as exc:
                self._reject(update.origin, exc)
                continue
            self.metrics.config_reload(ok=True)
            log_config(log, "config reloaded", update.origin, update.config)
            # The counterpart of ConfigRejected: an operator watching the Node sees the
            # reload land, not only the ones refused.
            self.events.emit(Reason.CONFIG_APPLIED, f"{update.origin}: applied")

    def _check_node_has(self, config: Config) -> None:
        """`PreconditionError` when `config` requires IMEX channels this node lacks: every
        Allocate would be refused while the GPUs stay advertised, so, as NVIDIA's plugin,
        such a config is not served (DRA mode does not inject IMEX channels)."""
        if self.settings.mode != "dra":
            select_imex_channels(config)

    def _reject(self, origin: str, error: Exception | None) -> None:
        self.metrics.config_reload(ok=False)
        log.error("config from %s rejected, the last good one keeps serving: %s", origin, error)
        self.events.warning(Reason.CONFIG_REJECTED, f"{origin}: {error}")

    def poke_config(self) -> None:
        """SIGHUP: re-read the config now."""
        log.info("SIGHUP: re-reading the config")
        self.source.poke()


def _usable_dir(path: Path, what: str, mount: str, flag: str) -> None:
    """Create `path` if needed; `InitError` naming `flag` when it cannot be used."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InitError(
            f"{what} {path}: cannot create it ({exc.strerror}); mount {mount} or set {flag}"
        ) from exc
    if not os.access(path, os.W_OK | os.X_OK):
        raise InitError(
            f"{what} {path} is not writable; run as root or mount it read-write "
            f"(set {flag} to test elsewhere)"
        )
