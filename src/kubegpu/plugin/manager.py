"""The set of plugins being served: one `ResourceServer` per resource name.

`follow` subscribes to the node-state store and `apply`s each new version's specs
(config reload, health, MIG or MPS readiness change):
new names get a server and a registration, existing ones push a new device list down
their ListAndWatch streams, vanished ones stop (the kubelet then marks them unhealthy and
drops them after its grace period). `run` re-serves and re-registers everything when the
kubelet restarts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from kubegpu.api import KUBELET_SOCKET
from kubegpu.cdi import DEFAULT_DIRECTORY as DEFAULT_CDI_DIRECTORY
from kubegpu.config import Config
from kubegpu.errors import RegistrationError
from kubegpu.metrics import Metrics
from kubegpu.plugin.registration import listening as _listening
from kubegpu.plugin.registration import watch_kubelet
from kubegpu.plugin.server import ResourceServer
from kubegpu.resources import ResourceSpec
from kubegpu.state import NodeStore
from kubegpu.supervisor import spawn
from kubegpu.watch import Backoff

log = logging.getLogger("kubegpu.plugin")

#: Retry delays while no kubelet answers: fast at first (a new kubelet creates its socket
#: a moment before it listens), capped so a long outage costs little. Any event in the
#: plugin directory cuts a wait short, and a new kubelet.sock restarts the registrar.
BACKOFF_START = 0.002
BACKOFF_CAP = 2.0
#: sun_path holds 108 bytes including the terminating NUL.
MAX_SOCKET_PATH = 107


def socket_path_too_long(path: Path) -> str | None:
    """Why a unix socket cannot be bound at `path` for its length (one line), or None."""
    if len(os.fsencode(path)) <= MAX_SOCKET_PATH:
        return None
    return (
        f"socket path {path} is longer than {MAX_SOCKET_PATH} bytes (the unix limit); "
        f"use a shorter --device-plugin-path"
    )


class PluginManager:
    def __init__(
        self,
        plugin_dir: Path,
        *,
        metrics: Metrics | None = None,
        on_registered: Callable[[str, float], None] | None = None,
        cdi_dir: Path = Path(DEFAULT_CDI_DIRECTORY),
    ) -> None:
        self.plugin_dir = plugin_dir
        #: Where the daemon writes CDI specs; Allocate names only classes found there.
        self._cdi_dir = cdi_dir
        self.kubelet_socket = plugin_dir / KUBELET_SOCKET
        self.servers: dict[str, ResourceServer] = {}
        self._metrics = metrics
        self._on_registered = on_registered
        self._registrars: dict[str, asyncio.Task[None]] = {}
        self._lock = asyncio.Lock()
        self.kubelet_restarts = 0
        #: One per waiting registrar; the kubelet watch sets them all on any directory event.
        self._dir_changed: set[asyncio.Event] = set()

    async def apply(self, specs: Sequence[ResourceSpec], config: Config) -> None:
        async with self._lock:
            wanted = {s.name: s for s in specs}
            for name in [n for n in self.servers if n not in wanted]:
                log.info("resource %s is no longer advertised; stopping its plugin", name)
                await self._drop(name)
            for name, spec in wanted.items():
                server = self.servers.get(name)
                if server is not None:
                    await server.update(spec, config)
                    continue
                server = ResourceServer(
                    spec,
                    config,
                    self.plugin_dir,
                    metrics=self._metrics,
                    cdi_dir=self._cdi_dir,
                )
                self.servers[name] = server
                # A socket that cannot be served now (the kubelet is re-creating the
                # directory) must not end the daemon: the others keep serving and this one
                # is retried until it listens.
                problem = await self._try_serve(server)
                if problem is not None:
                    log.error("%s; serving %s as soon as it can", problem, name)
                self._start_registrar(server, serve=problem is not None)

    async def follow(self, store: NodeStore, since: int) -> None:
        """Serve what the store advertises: every newer state's specs reach the plugins
        (and through them every open ListAndWatch stream); runs until cancelled."""
        async for state in store.subscribe(since):
            await self.apply(state.specs, state.config)

    async def run(self) -> None:
        """Watch for kubelet restarts until cancelled."""

        def wake_registrars() -> None:
            for event in self._dir_changed:
                event.set()

        def lost_sockets() -> list[str]:
            lost = ((s, s.socket_lost()) for s in self.servers.values())
            return [f"plugin socket {s.socket_name} {why}" for s, why in lost if why]

        await watch_kubelet(
            self.kubelet_socket, lost_sockets, self._kubelet_restarted, on_change=wake_registrars
        )

    def ready(self) -> tuple[bool, str]:
        """Ready only while the kubelet holds a device list from every plugin of ours."""
        if not self.servers:
            return True, "no resources to advertise"
        if not _listening(self.kubelet_socket):
            return False, f"no kubelet listening on {self.kubelet_socket}"
        gone = [n for n, s in self.servers.items() if not s.serving or not s.socket_path.exists()]
        if gone:
            return False, f"plugin socket not served: {', '.join(gone)}"
        waiting = [n for n, s in self.servers.items() if not s.registered]
        if waiting:
            return False, f"not registered with the kubelet: {', '.join(waiting)}"
        unsent = [n for n, s in self.servers.items() if not s.servicer.list_sent.is_set()]
        if unsent:
            return False, f"device list not yet sent to the kubelet: {', '.join(unsent)}"
        return True, "ok"

    async def stop(self) -> None:
        async with self._lock:
            for name in list(self.servers):
                await self._drop(name)

    async def _drop(self, name: str) -> None:
        task = self._registrars.pop(name, None)
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        server = self.servers.pop(name)
        await server.stop()
        if self._metrics is not None:
            self._metrics.remove_resource(name)

    async def _kubelet_restarted(self, reason: str) -> None:
        started = time.monotonic()
        self.kubelet_restarts += 1
        log.info("%s: serving and registering %d plugin(s) again", reason, len(self.servers))
        if self._metrics is not None:
            self._metrics.kubelet_restart()
        async with self._lock:
            for server in self.servers.values():
                task = self._registrars.pop(server.name, None)
                if task is not None:
                    task.cancel()
                problem = await self._try_serve(server)
                if problem is not None:
                    log.error("%s; serving %s as soon as it can", problem, server.name)
                self._start_registrar(server, since=started, serve=problem is not None)

    async def _try_serve(self, server: ResourceServer) -> str | None:
        """Listen on a fresh socket; None, or why it could not (one line)."""
        path = server.socket_path
        too_long = socket_path_too_long(path)
        if too_long is not None:
            return too_long
        try:
            await server.serve()
        except (OSError, RuntimeError) as exc:  # grpc reports a failed bind as RuntimeError
            if not self.plugin_dir.is_dir():
                return f"device-plugin directory {self.plugin_dir} is missing"
            return f"cannot listen on {path}: {str(exc).split(';')[0]}"
        return None

    def _start_registrar(
        self, server: ResourceServer, since: float | None = None, *, serve: bool = False
    ) -> None:
        self._registrars[server.name] = spawn(
            f"register {server.name}",
            self._register_until_done(
                server, since if since is not None else time.monotonic(), serve=serve
            ),
        )

    async def _register_until_done(
        self, server: ResourceServer, since: float, *, serve: bool = False
    ) -> None:
        backoff = Backoff(BACKOFF_START, BACKOFF_CAP)
        wake = asyncio.Event()
        self._dir_changed.add(wake)
        try:
            await self._register_with_retries(server, since, serve, backoff, wake)
        finally:
            self._dir_changed.discard(wake)

    async def _register_with_retries(
        self,
        server: ResourceServer,
        since: float,
        serve: bool,
        backoff: Backoff,
        wake: asyncio.Event,
    ) -> None:
        last_error = ""
        while True:
            wake.clear()
            if serve:
                problem = await self._try_serve(server)
                if problem is not None:
                    # Not cut short by directory events: serving makes some of its own.
                    await backoff.wait()
                    continue
                serve = False
                log.info("now serving %s on %s", server.name, server.socket_path)
            # Register only once the kubelet accepts connections: a gRPC channel to a socket
            # that is not listening yet fails, and its reconnect backoff costs a second.
            problem = ""
            if not self.kubelet_socket.exists():
                problem = f"no kubelet socket at {self.kubelet_socket}; is the kubelet running?"
            elif not _listening(self.kubelet_socket):
                problem = f"nothing accepts connections on {self.kubelet_socket} yet"
            else:
                try:
                    await server.register(self.kubelet_socket)
                except RegistrationError as exc:
                    problem = str(exc)
            if problem:
                # Log each distinct failure once, not once per retry.
                if problem != last_error:
                    log.warning("%s; retrying until the kubelet accepts it", problem)
                    last_error = problem
                await backoff.wait(wake)
                continue
            took = time.monotonic() - since
            log.info(
                "registered %s with the kubelet (socket %s) in %.3f s",
                server.name,
                server.socket_name,
                took,
            )
            if self._on_registered is not None:
                self._on_registered(server.name, took)
            return
