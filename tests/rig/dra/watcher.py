"""The kubelet's plugin watcher and plugin manager, over a real `plugins_registry` directory.

Written from `pkg/kubelet/pluginmanager/`: `pluginwatcher/plugin_watcher.go` (Watcher:
traversePluginDir, handleCreateEvent, handleDeleteEvent), `cache/desired_state_of_world.go`
and `cache/actual_state_of_world.go` (socket path -> timestamp), `reconciler/reconciler.go`
(reconcile: unregister first, then register) and `operationexecutor/operation_generator.go`
(GenerateRegisterPluginFunc, GenerateUnregisterPluginFunc, notifyPlugin). What it keeps:

- Every unix socket under the directory (sub-directories included) whose name does not
  start with "." is a plugin, found when the watcher starts and when it is created; the
  name need not end in ".sock". A socket that disappears is removed from the desired state,
  and the reconciler then deregisters the plugin. A socket re-created at the same path
  (new inode) is deregistered, then registered again.
- Registering one socket: dial it (10 s), `GetInfo` (1 s), pick the handler by
  `PluginInfo.type` (only "DRAPlugin" here), default `endpoint` to the socket path, let the
  handler validate, record the plugin as registered, let the handler register it, then
  `NotifyRegistrationStatus` (5 s) with the outcome. A refusal is notified with the
  kubelet's text ("RegisterPlugin error -- ...") and the operation fails.
- A failed operation is retried for as long as the socket exists, with the kubelet's
  exponential backoff per socket path (500 ms doubling to 2 min 2 s; a success resets it).
  One operation per socket at a time.

Where it differs: the kubelet's reconciler polls its caches every second; this one runs on
every inotify event (through `kubegpu.watch`) and when a backoff ends, which changes when
things happen, not what happens.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import stat
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import grpc

from kubegpu.api import pluginregistration_pb2 as reg
from kubegpu.api import pluginregistration_pb2_grpc as reg_grpc
from kubegpu.watch import PathWatch
from tests.rig.dra.plugins import rpc_error_text

log = logging.getLogger("tests.rig.dra")

DIAL_TIMEOUT = 10.0
GET_INFO_TIMEOUT = 1.0
NOTIFY_TIMEOUT = 5.0
#: goroutinemap/exponentialbackoff: initialDurationBeforeRetry, maxDurationBeforeRetry.
RETRY_INITIAL = 0.5
RETRY_MAX = 122.0
DRA_PLUGIN_TYPE = "DRAPlugin"


class PluginHandler(Protocol):
    """What the watcher calls for one plugin type (`cache.PluginHandler`)."""

    def validate(self, name: str, endpoint: str, versions: list[str]) -> str | None: ...

    async def register(self, name: str, endpoint: str, versions: list[str]) -> str | None: ...

    async def deregister(self, name: str, endpoint: str) -> None: ...


@dataclass(frozen=True)
class RegistrationAttempt:
    """One registration operation on a socket, and how it ended."""

    #: `time.monotonic()` when it started.
    time: float
    socket: str
    #: From GetInfo; empty when the call did not get that far.
    type: str
    name: str
    endpoint: str
    versions: tuple[str, ...]
    #: None on success, else the operation's error (what the kubelet logs).
    error: str | None
    #: What NotifyRegistrationStatus told the plugin: (registered, error); None if not sent.
    notified: tuple[bool, str] | None

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(frozen=True)
class RegisteredPlugin:
    """An entry of the actual state of the world."""

    socket: str
    stamp: tuple[int, int]
    type: str
    name: str
    endpoint: str


def _stamp(st: os.stat_result) -> tuple[int, int]:
    # The kubelet stamps a socket with the time its create event was handled; the inode and
    # change time tell a re-created socket from the same one just as well.
    return (st.st_ino, st.st_ctime_ns)


class PluginWatcher:
    """Finds plugin sockets in `registry_dir` and registers them with their handlers."""

    def __init__(
        self,
        registry_dir: Path,
        handlers: dict[str, PluginHandler],
        *,
        retry_initial: float = RETRY_INITIAL,
        retry_max: float = RETRY_MAX,
        dial_timeout: float = DIAL_TIMEOUT,
        on_change: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.registry_dir = Path(registry_dir)
        self.handlers = handlers
        self.retry_initial = retry_initial
        self.retry_max = retry_max
        self.dial_timeout = dial_timeout
        self._on_change = on_change
        #: Every registration operation, in order (kept across restarts).
        self.attempts: list[RegistrationAttempt] = []
        #: Every deregistration: (socket, driver name, endpoint), in order.
        self.deregistrations: list[tuple[str, str, str]] = []
        self._desired: dict[str, tuple[int, int]] = {}
        self._actual: dict[str, RegisteredPlugin] = {}
        self._ops: dict[str, asyncio.Task[None]] = {}
        self._backoff: dict[str, tuple[float, float]] = {}  # path -> (retry at, last delay)
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self._watch: PathWatch | None = None

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Create the directory if needed, find existing sockets, follow changes."""
        self.registry_dir.mkdir(parents=True, exist_ok=True)
        self._watch = PathWatch(
            self._watched, self._wake.set, poll_interval=0.05, name="plugins_registry"
        )
        self._watch.__enter__()
        self._wake.set()
        self._loop_task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        """Stop watching and forget every plugin without deregistering it (kubelet exit)."""
        if self._watch is not None:
            self._watch.close()
            self._watch = None
        tasks = [t for t in (self._loop_task, *self._ops.values()) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._loop_task = None
        self._ops.clear()
        self._desired.clear()
        self._actual.clear()
        self._backoff.clear()

    # ------------------------------------------------------------ observation

    @property
    def registered(self) -> dict[str, RegisteredPlugin]:
        """Socket path -> the plugin registered from it (the actual state of the world)."""
        return dict(self._actual)

    @property
    def desired(self) -> list[str]:
        """Socket paths the watcher has seen and not seen go (the desired state)."""
        return sorted(self._desired)

    # ------------------------------------------------------------ the loop

    def _watched(self) -> list[Path]:
        dirs = [self.registry_dir]
        with contextlib.suppress(OSError):
            dirs += [p for p in self.registry_dir.rglob("*") if p.is_dir() and not p.is_symlink()]
        return dirs

    def _scan(self) -> dict[str, tuple[int, int]]:
        """Plugin sockets now (`traversePluginDir` + `handleCreateEvent`'s filters)."""
        found: dict[str, tuple[int, int]] = {}
        for root, dirs, files in os.walk(self.registry_dir):
            dirs[:] = [d for d in dirs if not d.startswith(".")]
            for name in files:
                if name.startswith("."):
                    continue
                path = Path(root) / name
                try:
                    st = path.lstat()
                except OSError:
                    continue
                if stat.S_ISSOCK(st.st_mode):
                    found[str(path)] = _stamp(st)
        return found

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            self._desired = self._scan()
            await self._reconcile()

    async def _reconcile(self) -> None:
        """Unregistrations first, then registrations (`reconciler.reconcile`)."""
        for path, plugin in list(self._actual.items()):
            if self._desired.get(path) != plugin.stamp and path not in self._ops:
                self._ops[path] = asyncio.ensure_future(self._unregister(plugin))
        now = time.monotonic()
        for path, stamp in self._desired.items():
            registered = self._actual.get(path)
            if registered is not None and registered.stamp == stamp:
                continue
            if path in self._ops:
                continue
            retry_at, _ = self._backoff.get(path, (0.0, 0.0))
            if now < retry_at:
                continue
            self._ops[path] = asyncio.ensure_future(self._register(path, stamp))

    def _done(self, path: str, failed: bool) -> None:
        self._ops.pop(path, None)
        if failed:
            _, last = self._backoff.get(path, (0.0, 0.0))
            delay = min(self.retry_max, last * 2 if last else self.retry_initial)
            self._backoff[path] = (time.monotonic() + delay, delay)
            asyncio.get_running_loop().call_later(delay, self._wake.set)
        else:
            self._backoff.pop(path, None)
        self._wake.set()

    async def _changed(self) -> None:
        if self._on_change is not None:
            await self._on_change()

    # ------------------------------------------------------------ operations

    async def _unregister(self, plugin: RegisteredPlugin) -> None:
        """`GenerateUnregisterPluginFunc`: forget the plugin, then tell its handler."""
        self._actual.pop(plugin.socket, None)
        handler = self.handlers.get(plugin.type)
        if handler is not None:
            await handler.deregister(plugin.name, plugin.endpoint)
        self.deregistrations.append((plugin.socket, plugin.name, plugin.endpoint))
        log.info(
            "deregistered plugin %s (%s) of socket %s", plugin.name, plugin.type, plugin.socket
        )
        self._done(plugin.socket, failed=False)
        await self._changed()

    async def _register(self, path: str, stamp: tuple[int, int]) -> None:
        started = time.monotonic()
        info = reg.PluginInfo()
        notified: list[tuple[bool, str]] = []
        channel = grpc.aio.insecure_channel(f"unix:{path}")
        try:
            error = await self._register_with(path, stamp, channel, info, notified)
        finally:
            await channel.close(None)
        self.attempts.append(
            RegistrationAttempt(
                started,
                path,
                info.type,
                info.name,
                info.endpoint or (path if info.type else ""),
                tuple(info.supported_versions),
                error,
                notified[0] if notified else None,
            )
        )
        if error is not None:
            log.warning("%s", error)
        self._done(path, failed=error is not None)
        await self._changed()

    async def _register_with(
        self,
        path: str,
        stamp: tuple[int, int],
        channel: grpc.aio.Channel,
        info: reg.PluginInfo,
        notified: list[tuple[bool, str]],
    ) -> str | None:
        """`GenerateRegisterPluginFunc`'s steps; the operation's error text or None."""
        client = reg_grpc.RegistrationStub(channel)  # type: ignore[no-untyped-call]

        async def notify(registered: bool, text: str) -> str | None:
            """`notifyPlugin`: None when sent, else "<text>: <rpc error>"."""
            try:
                await client.NotifyRegistrationStatus(
                    reg.RegistrationStatus(plugin_registered=registered, error=text),
                    timeout=NOTIFY_TIMEOUT,
                )
            except grpc.RpcError as exc:
                return f"{text}: {rpc_error_text(exc)}"
            notified.append((registered, text))
            return None

        def unsent(err: str) -> str:
            return f"RegisterPlugin error -- failed to send error at socket {path}, err: {err}"

        try:
            await asyncio.wait_for(channel.channel_ready(), self.dial_timeout)
        except TimeoutError:
            return (
                f"RegisterPlugin error -- dial failed at socket {path}, err: failed to dial "
                f"socket {path}, err: context deadline exceeded"
            )
        try:
            answer = await client.GetInfo(reg.InfoRequest(), timeout=GET_INFO_TIMEOUT)
        except grpc.RpcError as exc:
            return (
                f"RegisterPlugin error -- failed to get plugin info using RPC GetInfo at "
                f"socket {path}, err: {rpc_error_text(exc)}"
            )
        info.CopyFrom(answer)
        handler = self.handlers.get(info.type)
        if handler is None:
            text = (
                f"RegisterPlugin error -- no handler registered for plugin type: {info.type} "
                f"at socket {path}"
            )
            failed = await notify(False, text)
            return text if failed is None else unsent(failed)
        endpoint = info.endpoint or path
        versions = list(info.supported_versions)
        invalid = handler.validate(info.name, endpoint, versions)
        if invalid is not None:
            text = f"RegisterPlugin error -- plugin validation failed with err: {invalid}"
            failed = await notify(False, text)
            if failed is not None:
                return unsent(failed)
            return "RegisterPlugin error -- pluginHandler.ValidatePluginFunc failed"
        # Recorded before the handler runs, so a delete during it becomes a deregistration;
        # it stays recorded when the handler refuses (so that is not retried).
        self._actual[path] = RegisteredPlugin(path, stamp, info.type, info.name, endpoint)
        refused = await handler.register(info.name, endpoint, versions)
        if refused is not None:
            text = f"RegisterPlugin error -- plugin registration failed with err: {refused}"
            failed = await notify(False, text)
            return text if failed is None else failed
        failed = await notify(True, "")
        if failed is not None:
            return (
                f"RegisterPlugin error -- failed to send registration status at socket {path}, "
                f"err: {failed}"
            )
        return None
