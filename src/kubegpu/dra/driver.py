"""The DRA kubelet plugin's lifecycle: two gRPC servers on one event loop.

Start: the checkpoint is recovered (`DeviceState.start`), then the DRA service listens
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
import logging
from collections.abc import Callable
from pathlib import Path

from kubegpu.dra.health import HealthServicer
from kubegpu.dra.registration import (
    RegistrationServicer,
    registration_server,
    registration_socket_name,
)
from kubegpu.dra.service import ClaimPreparer, DraServicer, dra_server
from kubegpu.kubelet_paths import PLUGINS_DIRECTORY, REGISTRAR_DIRECTORY
from kubegpu.rpc import UnixServer
from kubegpu.watch import Backoff, PathWatch
from kubegpu.watch.paths import InotifyFactory, default_inotify

log = logging.getLogger("kubegpu.dra")

#: The DRA service's socket in the plugin data directory (the kubeletplugin helper's).
SERVICE_SOCKET = "dra.sock"
#: First and longest wait before serving a socket again after a failed attempt.
RETRY_FIRST_S = 0.01
RETRY_MAX_S = 5.0
#: The polling fallback's period where inotify is unavailable.
POLL_INTERVAL = 0.05


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
        self.service = UnixServer(
            endpoint, lambda: dra_server(self.servicer, self.health), "DRA service"
        )
        self.registrar = UnixServer(
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
        await _serve(self.service)
        await _serve(self.registrar)
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
            # The checkpoint beside the service socket is replaced on every prepare and
            # unprepare: only the sockets' own names wake this loop.
            names_only=True,
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
                    lost = server.lost()
                    if lost is None:
                        continue
                    log.warning("%s socket %s %s; serving it again", server.name, server.path, lost)
                    try:
                        await _serve(server)
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
        await self.preparer.state.limiter.close()
        await asyncio.to_thread(self.preparer.stop)

    def ready(self) -> tuple[bool, str]:
        if not self.started.is_set():
            return False, "DRA driver starting"
        gone = [
            s.name for s in (self.service, self.registrar) if not s.serving or s.lost() is not None
        ]
        if gone:
            return False, f"DRA socket not served: {', '.join(gone)}"
        if self.registration.registered is False:
            return False, f"the kubelet refused the DRA driver: {self.registration.error}"
        return True, "ok"


async def _serve(server: UnixServer) -> None:
    """Serve `server` on a fresh socket, its directory made first (the kubelet may have
    removed it)."""
    server.path.parent.mkdir(parents=True, exist_ok=True)
    await server.serve()


__all__ = ["SERVICE_SOCKET", "DraDriver"]
