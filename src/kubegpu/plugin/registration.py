"""Registering with the kubelet, and noticing when the kubelet restarts.

A restarting kubelet deletes every socket in the device-plugin directory (often the
directory itself) and serves a new `kubelet.sock`; it never calls plugins back. So the
plugin watches the directory with inotify (`kubegpu.watch`): a new inode behind
`kubelet.sock` means a new kubelet, one of our sockets lost (deleted, or another file
renamed over it) means the kubelet can no longer reach that plugin. The watch re-arms
itself when the directory is removed and re-created, costs nothing while the kubelet
runs, and falls back to polling `stat` every `POLL_INTERVAL` only where inotify is
unavailable.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path

import grpc

from kubegpu.api import VERSION, pb, registration_stub
from kubegpu.errors import RegistrationError
from kubegpu.watch import PathWatch
from kubegpu.watch.paths import InotifyFactory, default_inotify

log = logging.getLogger("kubegpu.plugin")

#: How often the kubelet socket is checked where inotify is unavailable (the fallback).
POLL_INTERVAL = 0.05


def listening(path: Path) -> bool:
    """Whether something accepts connections on the unix socket `path`.

    A kubelet that died leaves its socket file behind, and a starting one creates the file
    (bind) a moment before it listens, so the file existing proves little; a refused
    connect proves nobody is there yet. The connect never blocks: a unix connect either
    completes at once, is refused, or (a full backlog) says EAGAIN, which means alive.
    """
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.setblocking(False)
        try:
            probe.connect(str(path))
        except BlockingIOError:
            return True
        except OSError:
            return False
    return True


async def register(
    kubelet_socket: Path,
    *,
    endpoint: str,
    resource: str,
    options: pb.DevicePluginOptions,
    timeout: float = 5.0,
) -> None:
    """Call `Registration.Register` on the kubelet; `RegistrationError` on any failure."""
    if not kubelet_socket.exists():
        raise RegistrationError(f"no kubelet socket at {kubelet_socket}; is the kubelet running?")
    request = pb.RegisterRequest(
        version=VERSION, endpoint=endpoint, resource_name=resource, options=options
    )
    async with grpc.aio.insecure_channel(f"unix://{kubelet_socket}") as channel:
        stub = registration_stub(channel)
        try:
            await stub.Register(request, timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            raise RegistrationError(
                f"kubelet at {kubelet_socket} did not register {resource}: "
                f"{exc.code().name}: {exc.details()}"
            ) from exc


def _identity(path: Path) -> tuple[int, int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_ctime_ns)


async def watch_kubelet(
    kubelet_socket: Path,
    lost_sockets: Callable[[], Iterable[str]],
    on_restart: Callable[[str], Awaitable[None]],
    *,
    interval: float = POLL_INTERVAL,
    on_change: Callable[[], None] | None = None,
    inotify: InotifyFactory = default_inotify,
) -> None:
    """Run forever; await `on_restart(reason)` when the kubelet socket is recreated or
    `lost_sockets()` names some of our sockets (one line each: which, and what happened).

    `on_change` is called on every event in the directory (before the check), so a
    registrar waiting for the kubelet to listen can retry at once instead of backing off.
    `interval` is the polling fallback's period.
    """
    woken = asyncio.Event()

    def changed() -> None:
        woken.set()
        if on_change is not None:
            on_change()

    with PathWatch(
        lambda: [kubelet_socket],
        changed,
        poll_interval=interval,
        name=f"kubelet directory {kubelet_socket.parent}",
        inotify=inotify,
    ):
        last = _identity(kubelet_socket)
        while True:
            await woken.wait()
            woken.clear()
            current = _identity(kubelet_socket)
            reason = ""
            if current is not None and current != last:
                reason = "kubelet.sock was recreated (kubelet restarted)"
            elif current is not None:
                reason = "; ".join(lost_sockets())
            last = current
            if reason:
                await on_restart(reason)
                last = _identity(kubelet_socket)
