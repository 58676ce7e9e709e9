"""The DRA kubelet plugin's lifecycle: two gRPC servers on one event loop.

Start: the checkpoint is recovered (`ClaimPreparer.start`), then the DRA service listens
on `<plugins dir>/<driver>/dra.sock`, and only then the registration socket appears in
the registrar directory, so the kubelet never finds a plugin that cannot answer yet (the
order of k8s.io/dynamic-resource-allocation/kubeletplugin). Run: both sockets are watched
(`kubegpu.watch`, inotify), and one that is deleted is served again at once: the kubelet
deregisters a driver whose registration socket disappears and registers it again when
the socket comes back. Stop: the registration socket goes first, so the kubelet stops
sending work before the service closes; prepared claims stay in the checkpoint, which is
removed when there are none.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import stat
from collections.abc import Callable
from pathlib import Path

import grpc

from kubegpu.dra.health import HealthServicer
from kubegpu.dra.registration import (
    RegistrationServicer,
    registration_server,
    registration_socket_name,
)
from kubegpu.dra.service import ClaimPreparer, DraServicer, dra_server
from kubegpu.watch import Backoff, PathWatch
from kubegpu.watch.paths import InotifyFactory, default_inotify

log = logging.getLogger("kubegpu.dra")

#: The DRA service's socket in the plugin data directory (the kubeletplugin helper's).
SERVICE_SOCKET = "dra.sock"
#: Defaults of the kubelet's directories, as NVIDIA's DRA driver's flags have them.
REGISTRAR_DIRECTORY = "/var/lib/kubelet/plugins_registry"
PLUGINS_DIRECTORY = "/var/lib/kubelet/plugins"
#: How long a server being replaced may finish the calls it already has.
RESERVE_GRACE_S = 1.0
#: First and longest wait before serving a socket again after a failed attempt.
RETRY_FIRST_S = 0.01
RETRY_MAX_S = 5.0
#: The polling fallback's period where inotify is unavailable.
POLL_INTERVAL = 0.05


def _is_socket(path: Path) -> bool:
    try:
        return stat.S_ISSOCK(path.stat().st_mode)
    except OSError:
        return False


class SocketServer:
    """One grpc.aio server on a unix socket, served again on a fresh socket on demand."""

    def __init__(self, path: Path, build: Callable[[], grpc.aio.Server], name: str) -> None:
        self.path = path
        self._build = build
        self.name = name
        self._server: grpc.aio.Server | None = None
        #: How many times the socket was served (1 after start; +1 per re-serve).
        self.served = 0

    @property
    def serving(self) -> bool:
        return self._server is not None and _is_socket(self.path)

    async def serve(self) -> None:
        # Built before the old one stops, so grpc's engine is never torn down in between.
        server = self._build()
        await self.stop(RESERVE_GRACE_S)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        if server.add_insecure_port(f"unix://{self.path}") == 0:
            raise OSError(f"cannot listen on {self.path}")
        # Bound, not yet listening: only root (the kubelet) may connect, whatever the umask.
        self.path.chmod(0o600)
        await server.start()
        self._server = server
        self.served += 1

    async def stop(self, grace: float = 1.0) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        await server.stop(grace)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


class DraDriver:
    """The DRA service and its registration for `driver` (see the module doc)."""

    def __init__(
        self,
        preparer: ClaimPreparer,
        *,
        driver: str,
        registrar_dir: Path = Path(REGISTRAR_DIRECTORY),
        plugins_dir: Path = Path(PLUGINS_DIRECTORY),
        inotify: InotifyFactory = default_inotify,
        health: HealthServicer | None = None,
        on_registered: Callable[[], None] | None = None,
    ) -> None:
        self.preparer = preparer
        #: The device health stream served beside the DRAPlugin service, if any.
        self.health = health
        self.driver = driver
        self.data_dir = plugins_dir / driver
        endpoint = self.data_dir / SERVICE_SOCKET
        self.servicer = DraServicer(preparer)
        self.registration = RegistrationServicer(driver, str(endpoint), on_registered=on_registered)
        self.service = SocketServer(
            endpoint, lambda: dra_server(self.servicer, self.health), "DRA service"
        )
        self.registrar = SocketServer(
            registrar_dir / registration_socket_name(driver),
            lambda: registration_server(self.registration),
            "registration",
        )
        self._inotify = inotify
        #: Set once both sockets are served.
        self.started = asyncio.Event()

    async def start(self) -> None:
        """Recover the checkpoint (and the sized claims' MPS daemons), then serve the DRA
        service, then the registration."""
        await asyncio.to_thread(self.preparer.start)
        await self.preparer.resume()
        await self.service.serve()
        await self.registrar.serve()
        log.info(
            "DRA driver %s: serving %s, registration on %s",
            self.driver,
            self.service.path,
            self.registrar.path,
        )
        self.started.set()

    async def run(self) -> None:
        """Serve again any socket that disappears, until cancelled (a root task)."""
        woken = asyncio.Event()
        backoff = Backoff(RETRY_FIRST_S, RETRY_MAX_S)
        with PathWatch(
            lambda: [self.service.path, self.registrar.path],
            woken.set,
            poll_interval=POLL_INTERVAL,
            name="DRA sockets",
            inotify=self._inotify,
        ):
            failed = False
            while True:
                if failed:
                    await backoff.wait(woken)  # a directory event cuts the wait short
                else:
                    await woken.wait()
                woken.clear()
                failed = False
                # The service first: a registration must never name a socket that is gone.
                for server in (self.service, self.registrar):
                    if _is_socket(server.path):
                        continue
                    log.warning("%s socket %s is gone; serving it again", server.name, server.path)
                    try:
                        await server.serve()
                    except (OSError, RuntimeError) as exc:  # grpc reports a failed bind so
                        log.error("cannot serve %s again: %s", server.path, exc)
                        failed = True
                        break
                if not failed:
                    backoff.reset()

    async def stop(self) -> None:
        """Registration first (the kubelet stops calling), then the service, whose health
        streams are ended first: they never end by themselves, and grpc's stop waits on
        them for its whole grace. Last the preparer: its threads, then the checkpoint,
        removed if no claim is prepared, so a stop before an uninstall leaves nothing in the
        data directory."""
        await self.registrar.stop()
        if self.health is not None:
            self.health.close()
        await self.service.stop()
        await self.preparer.limiter.close()
        await asyncio.to_thread(self.preparer.stop)

    def ready(self) -> tuple[bool, str]:
        if not self.started.is_set():
            return False, "DRA driver starting"
        gone = [s.name for s in (self.service, self.registrar) if not s.serving]
        if gone:
            return False, f"DRA socket not served: {', '.join(gone)}"
        if self.registration.registered is False:
            return False, f"the kubelet refused the DRA driver: {self.registration.error}"
        return True, "ok"


__all__ = ["PLUGINS_DIRECTORY", "REGISTRAR_DIRECTORY", "SERVICE_SOCKET", "DraDriver"]
