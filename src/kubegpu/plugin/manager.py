"""The set of plugins being served: one `ResourceServer` per resource name.

`follow` subscribes to the node-state store and `apply`s each new version's specs
(config reload, health, MIG or MPS readiness change):
new names get a server and a registration, existing ones push a new device list down
their ListAndWatch streams, vanished ones stop (the kubelet then marks them unhealthy and
drops them after its grace period). `run` re-serves and re-registers everything when the
kubelet restarts. A stream the kubelet ends while it runs on (kubelet.sock unchanged) has
its resource registered again at once, then on a `Redial` backoff should the kubelet keep
dropping it: a kubelet before 1.37 does that to a successor when the plugin it replaced
stops (`runClient` disconnects whichever client is registered). After
`yield_registration` (a successor took over, `plugin.handover`) nothing registers or
sends a device list any more; the servers only answer calls, until SIGTERM or, should the
successor stop first, `resume_registration`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
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
from kubegpu.rpc import socket_path_too_long
from kubegpu.state import NodeStore
from kubegpu.supervisor import spawn
from kubegpu.watch import Backoff

log = logging.getLogger("kubegpu.plugin")

#: Retry delays while no kubelet answers: fast at first (a new kubelet creates its socket
#: a moment before it listens), capped so a long outage costs little. Any event in the
#: plugin directory cuts a wait short, and a new kubelet.sock restarts the registrar.
BACKOFF_START = 0.002
BACKOFF_CAP = 2.0
#: A stopping plugin answers calls until none has run or started for this long, after its
#: ListAndWatch ended (`ResourceServer.drain`): long enough for an Allocate the kubelet
#: sent just before it saw the stream end to arrive, short against any pod's
#: termination grace period.
DRAIN_QUIET_S = 0.5
#: The most a stop waits for quiet: clients that never pause cannot hold the process.
DRAIN_LIMIT_S = 5.0
#: Registering again a resource whose stream the kubelet ended while it runs: the first
#: time at once, then after these delays while it keeps ending it (a kubelet that drops
#: every registration gets one every REDIAL_CAP seconds, not a storm); a resource that went
#: REDIAL_STABLE_S without a drop starts over at once.
REDIAL_START = 0.1
REDIAL_CAP = 30.0
REDIAL_STABLE_S = 60.0


def _socket_identity(path: Path) -> tuple[int, int, int] | None:
    """What tells one kubelet.sock from the next (a restarted kubelet makes a new one)."""
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_ctime_ns)


class Redial:
    """How soon to register again a resource whose ListAndWatch the kubelet ended.

    At once the first time, and again once the last drop is `stable_for` seconds old;
    within that, the backoff's next delay (`kubegpu.watch.Backoff`).
    """

    def __init__(self, backoff: Backoff, stable_for: float = REDIAL_STABLE_S) -> None:
        self._backoff = backoff
        self._stable_for = stable_for
        self._first = True

    def next_delay(self) -> float:
        """The delay before registering again after a drop now."""
        if self._first or self._backoff.reset_if_stable(self._stable_for):
            delay = 0.0
        else:
            delay = self._backoff.advance()
        self._first = False
        self._backoff.mark()
        return delay


class PluginManager:
    def __init__(
        self,
        plugin_dir: Path,
        *,
        metrics: Metrics | None = None,
        on_registered: Callable[[str, float], None] | None = None,
        cdi_dir: Path = Path(DEFAULT_CDI_DIRECTORY),
        socket_name: Callable[[str], str] = lambda name: name,
    ) -> None:
        self.plugin_dir = plugin_dir
        #: The socket file name to serve a resource on, from its usual name (the slot).
        self._socket_name = socket_name
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
        #: Set on every successful registration (`wait_registered`).
        self._registered = asyncio.Event()
        #: True once registration is handed to a successor.
        self.yielded = False
        #: The specs and config last applied: what to serve should registration resume.
        self._applied: tuple[Sequence[ResourceSpec], Config] | None = None
        #: Per resource: the kubelet.sock it last registered with, and its `Redial`.
        self._registered_with: dict[str, tuple[int, int, int] | None] = {}
        self._redials: dict[str, Redial] = {}

    async def apply(self, specs: Sequence[ResourceSpec], config: Config) -> None:
        async with self._lock:
            self._applied = (specs, config)
            wanted = {s.name: s for s in specs}
            for name in [n for n in self.servers if n not in wanted]:
                log.info("resource %s is no longer advertised; stopping its plugin", name)
                await self._drop(name)
            for name, spec in wanted.items():
                server = self.servers.get(name)
                if server is not None:
                    await server.update(spec, config)
                    continue
                if self.yielded:
                    log.info("resource %s is new; the successor serves it, not this process", name)
                    continue
                server = ResourceServer(
                    spec,
                    config,
                    self.plugin_dir,
                    metrics=self._metrics,
                    socket_name=self._socket_name(spec.socket_name),
                    cdi_dir=self._cdi_dir,
                )
                self.servers[name] = server
                server.servicer.on_dropped = lambda name=name: self._stream_dropped(name)
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
        if self.yielded:
            return True, "handed over to a successor"
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

    async def wait_registered(self) -> None:
        """Until the kubelet holds a device list from every plugin of ours."""
        while True:
            self._registered.clear()
            servers = list(self.servers.values())
            if not all(s.registered for s in servers):
                await self._registered.wait()
                continue
            # The kubelet opens ListAndWatch once Register has returned.
            await asyncio.gather(*(s.servicer.list_sent.wait() for s in servers))
            if all(s.registered and s.servicer.list_sent.is_set() for s in self.servers.values()):
                return

    async def yield_registration(self) -> None:
        """A successor registered: never register again (not after a kubelet restart
        either) and send no more device lists, which would replace the successor's in the
        kubelet; keep answering calls until `stop`."""
        async with self._lock:
            self.yielded = True
            for task in self._registrars.values():
                task.cancel()
            for server in self.servers.values():
                server.servicer.freeze()

    async def resume_registration(self) -> None:
        """The successor stopped before this process did: register every plugin again and
        send device lists again, and serve what appeared while yielded.

        The servers' sockets and open streams stay as they are where they can: a kubelet
        that still holds this process's endpoint beside the successor's (1.37+) then keeps
        the devices healthy throughout; a socket lost meanwhile (a kubelet restart) is
        served again first.
        """
        async with self._lock:
            if not self.yielded:
                return
            self.yielded = False
            for server in self.servers.values():
                await server.servicer.thaw()
                server.registered = False
                server.servicer.list_sent.clear()
                lost = not server.serving or server.socket_lost() is not None
                self._start_registrar(server, serve=lost)
            applied = self._applied
        if applied is not None:
            await self.apply(*applied)

    async def stop(self) -> None:
        """Withdraw every plugin, answer the calls on their way, then stop serving."""
        async with self._lock:
            for task in self._registrars.values():
                task.cancel()
            servers = list(self.servers.values())
            await asyncio.gather(*(s.withdraw() for s in servers))
            if any(s.serving for s in servers):
                log.info("ListAndWatch ended; answering calls until none for %.1f s", DRAIN_QUIET_S)
                try:
                    async with asyncio.timeout(DRAIN_LIMIT_S):
                        await asyncio.gather(*(s.drain(DRAIN_QUIET_S) for s in servers))
                except TimeoutError:
                    log.warning("calls still arriving after %.0f s; stopping", DRAIN_LIMIT_S)
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
        if self.yielded:
            log.info("%s: the successor registers again, not this process", reason)
            return
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

    def _stream_dropped(self, name: str) -> None:
        """The kubelet ended a ListAndWatch stream of `name`: register it again, unless the
        kubelet is restarting (its watch re-registers everything), another stream is still
        open, or a successor serves the resource now."""
        server = self.servers.get(name)
        if server is None or not server.serving or server.servicer.streams:
            return
        if self.yielded:
            log.info(
                "the kubelet ended ListAndWatch of %s; the successor serves it, "
                "so this process does not register again",
                name,
            )
            return
        kubelet = _socket_identity(self.kubelet_socket)
        if (
            kubelet is None
            or kubelet != self._registered_with.get(name)
            or not _listening(self.kubelet_socket)
        ):
            return
        registrar = self._registrars.get(name)
        if registrar is not None and not registrar.done():
            return  # a registration is already on its way
        server.registered = False
        server.servicer.list_sent.clear()
        redial = self._redials.get(name)
        if redial is None:
            redial = self._redials[name] = Redial(Backoff(REDIAL_START, REDIAL_CAP))
        delay = redial.next_delay()
        log.warning(
            "the kubelet ended ListAndWatch of %s while it runs on (a kubelet before 1.37 "
            "does so to a successor when the plugin it replaced stops); registering again%s",
            name,
            f" in {delay:.1f} s" if delay else "",
        )
        self._start_registrar(server, delay=delay)

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
        self,
        server: ResourceServer,
        since: float | None = None,
        *,
        serve: bool = False,
        delay: float = 0.0,
    ) -> None:
        self._registrars[server.name] = spawn(
            f"register {server.name}",
            self._register_until_done(
                server, since if since is not None else time.monotonic(), serve=serve, delay=delay
            ),
        )

    async def _register_until_done(
        self, server: ResourceServer, since: float, *, serve: bool = False, delay: float = 0.0
    ) -> None:
        if delay > 0:
            await asyncio.sleep(delay)
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
            self._registered_with[server.name] = _socket_identity(self.kubelet_socket)
            self._registered.set()
            log.info(
                "registered %s with the kubelet (socket %s) in %.3f s",
                server.name,
                server.socket_name,
                took,
            )
            if self._on_registered is not None:
                self._on_registered(server.name, took)
            return
