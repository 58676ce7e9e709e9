"""The `serve` daemon: lifecycle only.

Startup (config, backend, first device list, plugins) → run (root tasks under one
TaskGroup: kubelet watcher, health monitor, config follower, refresher, HTTP, events) →
graceful shutdown (plugins stop, sockets removed). The first root task to fail stops all
of them. Every change (health, MIG layout, config) funnels into one place, `_refresh`,
which rebuilds the resource specs and lets the plugin manager reconcile.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import logging
import os
import socket
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubegpu import cdi
from kubegpu.allocation import ContainerEdits
from kubegpu.api import DEVICE_PLUGIN_PATH
from kubegpu.config import Config, DeviceListStrategy, Flags
from kubegpu.config.loader import config_to_json
from kubegpu.config.names import parse_quantity
from kubegpu.config.source import POLL_INTERVAL, ConfigSource, ConfigUpdate, NamedConfigs
from kubegpu.devices import (
    DeviceBackend,
    Health,
    HealthEvent,
    HealthEventKind,
    Inventory,
    NullBackend,
    open_backend,
)
from kubegpu.errors import ConfigError, InitError, KubegpuError
from kubegpu.events import NodeEvents, Reason
from kubegpu.health import HealthMonitor, health_flags_from_env
from kubegpu.httpserver import HttpServer
from kubegpu.metrics import Metrics
from kubegpu.mps import MpsDaemon, MpsError
from kubegpu.plugin import PluginManager
from kubegpu.plugin.manager import MAX_SOCKET_PATH
from kubegpu.resources import ResourceSpec, SharingKind, build_resources

log = logging.getLogger("kubegpu.daemon")


class StartupError(KubegpuError):
    """This node cannot host the daemon as asked: the plugin directory is taken, a port is
    in use, an address is not this host's (exit 1: the environment, not the flags)."""


async def _unless_stopped(work: Coroutine[Any, Any, None], stop: asyncio.Event) -> bool:
    """Run `work` until it ends (True) or `stop` is set first (False, `work` cancelled)."""
    task = asyncio.ensure_future(work)
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        return False
    task.result()  # start-up's own error, if any
    return True


def _os_reason(exc: OSError) -> str:
    """The cause alone: asyncio wraps it in `error while attempting to bind on ...`."""
    if isinstance(exc, socket.gaierror):
        return f"cannot resolve the address ({exc.strerror})"
    text = os.strerror(exc.errno) if exc.errno else str(exc)
    return text[:1].lower() + text[1:]


def driver_files_root(flags: Flags) -> str:
    """Where this process reads the driver's files (the NVML library) from.

    `nvidiaDriverRoot` is a host path; in the DaemonSet it is mounted at
    `containerDriverRoot`, which is where NVIDIA's plugin loads NVML from too. Run straight
    on the host (no such mount), the host path itself is the right place.
    """
    host = flags.nvidia_driver_root
    if host in ("", "/"):
        return "/"
    mounted = flags.plugin.container_driver_root
    return mounted if Path(mounted).is_dir() else host


@dataclass(frozen=True)
class DaemonSettings:
    """What `serve` was asked to do; built from flags and env vars by the CLI."""

    plugin_dir: Path = Path(DEVICE_PLUGIN_PATH)
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
    cdi_dir: Path = Path(cdi.DEFAULT_DIRECTORY)
    mps_control_binary: str = "nvidia-cuda-mps-control"
    #: Also write GPU Feature Discovery labels (NFD features.d file), as `kubegpu labels`.
    with_labels: bool = False


class Daemon:
    def __init__(
        self,
        settings: DaemonSettings,
        *,
        backend: DeviceBackend | None = None,
        metrics: Metrics | None = None,
        events: NodeEvents | None = None,
        on_registered: Callable[[str, float], None] | None = None,
    ) -> None:
        self.settings = settings
        self.metrics = metrics or Metrics()
        self.events = events or NodeEvents.disabled()
        self._backend = backend
        self.manager = PluginManager(
            settings.plugin_dir,
            metrics=self.metrics,
            extra_edits=self._extra_edits,
            on_registered=on_registered,
            cdi_dir=settings.cdi_dir,
        )
        self.config = Config()
        self.inventory = Inventory(gpus=())
        self.health: Mapping[str, Health] = {}
        self.specs: tuple[ResourceSpec, ...] = ()
        self.source = ConfigSource(
            config_file=settings.config_file,
            overrides=settings.overrides,
            named=settings.named,
            poll_interval=settings.config_poll_interval,
        )
        self.started = asyncio.Event()
        self._dirty = asyncio.Event()
        self._rediscover = False
        #: One supervised MPS control daemon per MPS-shared resource, and its supervisor.
        self.mps: dict[str, MpsDaemon] = {}
        self._mps_tasks: dict[str, asyncio.Task[None]] = {}
        self._mps_keys: dict[str, tuple[object, ...]] = {}
        self._refresh_lock = asyncio.Lock()
        #: The open plugin directory holding our flock, while we run.
        self._lock_fd: int | None = None

    @property
    def backend(self) -> DeviceBackend:
        assert self._backend is not None, "daemon not started"
        return self._backend

    # -- lifecycle ----------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Serve until `stop` is set. Raises `ConfigError`/`InitError` when startup fails.

        Order matters for a DaemonSet: the plugin-directory lock and `/healthz` come first
        (both instant), then what may wait (the API server for the config label, NVML, MPS),
        and all of that is abandoned the moment `stop` is set, so SIGTERM always ends us.
        """
        updates = self.source.updates()
        http: list[HttpServer] = []
        try:
            self._check_plugin_dir()
            self._lock_plugin_dir()
            http = await self._start_http()
            if not await _unless_stopped(self._startup(updates), stop):
                log.info("stopped during start-up")
                return
            # Computed before the task group so a bad DP_*_HEALTHCHECKS value is one
            # ConfigError, not an ExceptionGroup.
            health_flags = health_flags_from_env(self.settings.health_env, self.config.flags.health)
            async with asyncio.TaskGroup() as tasks:
                monitor = HealthMonitor(
                    self.backend,
                    health_flags,
                    on_change=self._health_changed,
                    on_reconfigured=self._reconfigured,
                )
                monitor.on_event = self._count_event
                roots = [
                    tasks.create_task(self.manager.run(), name="kubelet watcher"),
                    tasks.create_task(monitor.run(), name="health monitor"),
                    tasks.create_task(self._follow_config(updates), name="config follower"),
                    tasks.create_task(self._refresher(), name="refresher"),
                    tasks.create_task(self.events.run(), name="events"),
                ]
                if self.settings.with_labels:
                    roots.append(tasks.create_task(self._label(), name="labeller"))
                self.started.set()
                await stop.wait()
                log.info("stopping: removing plugin sockets")
                for task in roots:
                    task.cancel()
        finally:
            await self.manager.stop()
            for server in http:
                await server.stop()
            for name in list(self.mps):
                await self._stop_mps(name)
            closer = getattr(updates, "aclose", None)
            if closer is not None:
                with contextlib.suppress(Exception):
                    await closer()
            if self._backend is not None:
                await asyncio.to_thread(self._backend.close)
            self._unlock_plugin_dir()

    async def _startup(self, updates: AsyncIterator[ConfigUpdate]) -> None:
        first = await anext(updates)
        if first.error is not None or first.config is None:
            raise first.error or ConfigError("no configuration")
        self.config = first.config
        log.info("effective config (%s): %s", first.origin, config_to_json(self.config))
        await self._open_backend()
        self._check_socket_paths(build_resources(self.inventory, self.config))
        await self._write_cdi_spec()
        await self._refresh(self.config)
        for spec in self.specs:
            log.info(
                "advertising %s: %d device(s), %d healthy",
                spec.name,
                len(spec.devices),
                spec.healthy_count,
            )
        if not self.specs:
            log.warning("no GPUs to advertise on this node")

    def _check_plugin_dir(self) -> None:
        path = self.settings.plugin_dir
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise InitError(
                f"device-plugin directory {path}: cannot create it ({exc.strerror}); "
                f"mount the kubelet's device-plugins directory or set --device-plugin-path"
            ) from exc
        if not os.access(path, os.W_OK | os.X_OK):
            raise InitError(
                f"device-plugin directory {path} is not writable; run as root or mount it "
                f"read-write (set --device-plugin-path to test elsewhere)"
            )

    def _check_socket_paths(self, specs: tuple[ResourceSpec, ...]) -> None:
        """A socket path over the unix limit can never be served: say so and stop, rather
        than retry forever (the CLI only knows the kubelet's socket name, not ours)."""
        for spec in specs:
            path = self.settings.plugin_dir / spec.socket_name
            if len(os.fsencode(path)) > MAX_SOCKET_PATH:
                raise StartupError(
                    f"socket path {path} for {spec.name} is longer than {MAX_SOCKET_PATH} "
                    f"bytes (the unix limit); use a shorter --device-plugin-path"
                )

    def _lock_plugin_dir(self) -> None:
        """Refuse to share the plugin directory with another `serve` (they would delete
        each other's sockets and register twice).

        The lock is `flock` on the directory itself, not on a file in it: the kubelet
        empties that directory when it restarts, which would delete a lock file and let a
        second instance in. The directory's inode outlives the wipe, is the one every
        container mounting the host path sees, and the kernel drops the lock when the
        process dies, even by SIGKILL, so nothing stale is ever left behind.
        """
        path = self.settings.plugin_dir
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise StartupError(
                    f"device-plugin directory {path} is in use by another kubegpu serve; "
                    f"stop it first or give this one another --device-plugin-path"
                ) from exc
            raise StartupError(f"device-plugin directory {path}: cannot lock it ({exc})") from exc
        self._lock_fd = fd

    def _unlock_plugin_dir(self) -> None:
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            os.close(fd)  # closing the last descriptor releases the flock

    async def _open_backend(self) -> None:
        try:
            if self._backend is None:
                self._backend = await asyncio.to_thread(
                    open_backend,
                    self.settings.backend,
                    simulate=self.settings.simulate,
                    driver_root=driver_files_root(self.config.flags),
                    # Device nodes go to the kubelet as host paths, so they keep the host root.
                    dev_root=self.config.flags.dev_root,
                )
            self.inventory = await asyncio.to_thread(self._backend.discover)
            if not self.inventory.gpus:
                raise InitError(f"the {self._backend.name} backend found no GPUs on this node")
        except InitError as exc:
            if self.config.flags.fail_on_init_error:
                raise
            log.error(
                "%s; advertising nothing and staying up because --fail-on-init-error=false", exc
            )
            self._backend = NullBackend(str(exc))
            self.inventory = Inventory(gpus=(), backend="null")
        log.info(
            "backend %s: %d GPU(s), driver %s",
            self.inventory.backend or self.backend.name,
            len(self.inventory.gpus),
            self.inventory.driver_version or "unknown",
        )

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
        waiting = [name for name, d in self.mps.items() if not d.ready]
        if waiting:
            return False, f"MPS control daemon not ready: {', '.join(waiting)}"
        return self.manager.ready()

    # -- changes ------------------------------------------------------------------------

    def _count_event(self, event: HealthEvent) -> None:
        if event.kind is HealthEventKind.XID and event.xid is not None:
            self.metrics.xid(event.uuid, event.xid)

    def _health_changed(self, health: Mapping[str, Health]) -> None:
        before = self.health
        self.health = dict(health)
        owners = {d.unit.uuid: s.name for s in self.specs for d in s.devices}
        owners.update({d.unit.gpu.uuid: s.name for s in self.specs for d in s.devices})
        for uuid in set(before) | set(health):
            old = before.get(uuid, Health.HEALTHY)
            new = health.get(uuid, Health.HEALTHY)
            if old is new:
                continue
            if uuid in owners:
                self.metrics.health_transition(owners[uuid], healthy=new is Health.HEALTHY)
            if new is Health.UNHEALTHY:
                self.events.warning(Reason.GPU_UNHEALTHY, f"GPU {uuid} is unhealthy")
            else:
                self.events.emit(Reason.GPU_HEALTHY, f"GPU {uuid} is healthy again")
        self._dirty.set()

    def _reconfigured(self) -> None:
        self._rediscover = True
        self._dirty.set()

    async def _refresher(self) -> None:
        while True:
            await self._dirty.wait()
            self._dirty.clear()
            if self._rediscover:
                self._rediscover = False
                try:
                    self.inventory = await asyncio.to_thread(self.backend.discover)
                except Exception as exc:  # keep serving the last inventory
                    log.error("re-discovery failed, keeping the last device list: %s", exc)
                else:
                    await self._write_cdi_spec()
            try:
                await self._refresh(self.config)
            except ConfigError as exc:
                # A MIG layout the config can't use (e.g. single with mixed profiles).
                log.error(
                    "the new device layout does not fit the config; keeping the last: %s", exc
                )

    async def _refresh(self, config: Config) -> None:
        """Rebuild specs from inventory+health+config and reconcile the plugins.

        Raises `ConfigError` if `config` can't apply; nothing changes then.
        """
        # Health, MIG and config changes all land here; MPS start-up awaits midway, so
        # one refresh at a time keeps two of them from starting the same daemon.
        async with self._refresh_lock:
            await self._refresh_locked(config)

    async def _refresh_locked(self, config: Config) -> None:
        specs = build_resources(self.inventory.with_health(self.health), config)
        await self._reconcile_mps(specs, config)
        not_ready = {
            g.uuid: Health.UNHEALTHY for d in self.mps.values() if not d.ready for g in d.gpus
        }
        if not_ready:
            # An MPS resource whose daemon is down is shown but not allocatable.
            health = {**self.health, **not_ready}
            specs = build_resources(self.inventory.with_health(health), config)
        await self.manager.apply(specs, config)
        self.specs, self.config = specs, config

    async def _follow_config(self, updates: AsyncIterator[ConfigUpdate]) -> None:
        async for update in updates:
            if update.config is None:
                self._reject(update.origin, update.error)
                continue
            try:
                await self._refresh(update.config)
            except ConfigError as exc:
                self._reject(update.origin, exc)
                continue
            self.metrics.config_reload(ok=True)
            log.info("config reloaded from %s: %s", update.origin, config_to_json(update.config))
            # Strategies, modes (gdsEnabled...) and IMEX channels decide the CDI files.
            await self._write_cdi_spec()

    def _reject(self, origin: str, error: Exception | None) -> None:
        self.metrics.config_reload(ok=False)
        log.error("config from %s rejected, the last good one keeps serving: %s", origin, error)
        self.events.warning(Reason.CONFIG_REJECTED, f"{origin}: {error}")

    def poke_config(self) -> None:
        """SIGHUP: re-read the config now."""
        self.source.poke()

    def _extra_edits(self, spec: ResourceSpec) -> ContainerEdits | None:
        mps = self.mps.get(spec.name)
        if spec.sharing is not SharingKind.MPS or mps is None:
            return None
        envs, mounts = mps.allocate_edits()
        return ContainerEdits(envs=envs, mounts=mounts)

    async def _label(self) -> None:
        """Publish node labels from the daemon's own view; a failure never stops serving."""
        # Imported here: only `--with-labels` needs the labeller, and start-up pays for
        # every module imported before registering.
        from kubegpu import labeller

        gfd = self.config.flags.gfd
        interval = labeller.parse_duration(gfd.sleep_interval)
        sink = labeller.FeatureFileSink(gfd.output_file)
        while True:
            try:
                await labeller.run_labeller(
                    lambda: self.inventory.with_health(self.health),
                    lambda: self.config,
                    sink,
                    interval=interval,
                    machine_type=lambda: labeller.read_machine_type(gfd.machine_type_file),
                    timestamps=not gfd.no_timestamp,
                )
            except KubegpuError as exc:
                log.error("labelling failed, retrying in %.0f s: %s", min(interval, 60), exc)
            await asyncio.sleep(min(interval, 60))

    # -- CDI and MPS ----------------------------------------------------------------------

    async def _write_cdi_spec(self) -> None:
        plugin = self.config.flags.plugin
        wanted = {DeviceListStrategy.CDI_ANNOTATIONS, DeviceListStrategy.CDI_CRI}
        if not wanted & set(plugin.device_list_strategy) or not self.inventory.gpus:
            return
        directory = self.settings.cdi_dir
        try:
            specs = await asyncio.to_thread(cdi.node_specs, self.inventory, self.config)
            for name, spec in specs.items():
                path = await asyncio.to_thread(cdi.write_spec, spec, str(directory), name)
                log.info("wrote CDI spec %s (%d devices)", path, len(spec.get("devices", [])))
            # A class switched off (gdsEnabled: false) must stop being named by Allocate.
            for cdi_class in cdi.available_classes(directory):
                stale = directory / cdi.spec_name(cdi_class)
                if stale.name not in specs and stale.exists():
                    stale.unlink()
                    log.info("removed CDI spec %s: no longer enabled", stale)
        except OSError as exc:
            log.error(
                "cannot write the CDI spec to %s (%s): CDI device names will not resolve; "
                "mount /var/run/cdi read-write",
                directory,
                exc,
            )

    async def _reconcile_mps(self, specs: tuple[ResourceSpec, ...], config: Config) -> None:
        """Start a control daemon for each MPS resource, stop those no longer wanted.

        A daemon is restarted when its resource's GPUs or limits change.
        """
        wanted: dict[str, ResourceSpec] = {s.name: s for s in specs if s.sharing is SharingKind.MPS}
        for name in list(self.mps):
            spec = wanted.get(name)
            if spec is None or self._mps_key(spec) != self._mps_keys.get(name):
                await self._stop_mps(name)
        for name, spec in wanted.items():
            if name not in self.mps:
                await self._start_mps(spec, config)

    @staticmethod
    def _mps_key(spec: ResourceSpec) -> tuple[object, ...]:
        entry = spec.shared_by
        gpus = tuple(sorted({d.unit.gpu.uuid for d in spec.devices}))
        limits = (entry.memory_limit, entry.active_thread_percentage) if entry else (None, None)
        return (gpus, spec.replicas, *limits)

    async def _start_mps(self, spec: ResourceSpec, config: Config) -> None:
        root = config.flags.mps_root
        if root is None:  # validation requires it; be explicit anyway
            raise ConfigError("sharing.mps needs flags.mpsRoot (--mps-root); set it")
        entry = spec.shared_by
        memory = entry.memory_limit if entry else None
        gpus = {d.unit.gpu.uuid: d.unit.gpu for d in spec.devices}
        daemon = MpsDaemon(
            spec.name,
            Path(root),
            list(gpus.values()),
            spec.replicas,
            memory_limit_mib=parse_quantity(memory) // (1 << 20) if memory else None,
            active_thread_percentage=entry.active_thread_percentage if entry else None,
            control_binary=self.settings.mps_control_binary,
            on_change=lambda ready: self._dirty.set(),
        )
        self._mps_keys[spec.name] = self._mps_key(spec)
        self.mps[spec.name] = daemon
        try:
            await daemon.start()
        except MpsError as exc:
            log.error("%s: advertised as unhealthy until it starts", exc)
        self._mps_tasks[spec.name] = asyncio.create_task(
            daemon.supervise(), name=f"mps {spec.name}"
        )
        log.info("MPS control daemon for %s: ready=%s", spec.name, daemon.ready)

    async def _stop_mps(self, name: str) -> None:
        task = self._mps_tasks.pop(name, None)
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        daemon = self.mps.pop(name)
        self._mps_keys.pop(name, None)
        with contextlib.suppress(MpsError):
            await daemon.stop()
