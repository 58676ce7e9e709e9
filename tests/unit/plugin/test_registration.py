"""Kubelet restart detection (`watch_kubelet`) and the listening probe, on real sockets."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from kubegpu.plugin.registration import listening, watch_kubelet
from tests.waiting import WAIT


def _serve_unix(path: Path, *, listen: bool = True) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    if listen:
        sock.listen()
    return sock


def _no_inotify() -> Any:
    raise OSError(errno.EMFILE, "Too many open files")


class Restarts:
    def __init__(self) -> None:
        self.reasons: asyncio.Queue[str] = asyncio.Queue()

    async def __call__(self, reason: str) -> None:
        self.reasons.put_nowait(reason)

    async def next(self) -> str:
        return await asyncio.wait_for(self.reasons.get(), WAIT)


@contextlib.asynccontextmanager
async def watching(plugin_dir: Path, own: list[Path], **options: Any) -> AsyncIterator[Restarts]:
    """Watch with `own` as our sockets, each lost once its file is gone."""
    restarts = Restarts()
    ready = asyncio.Event()

    def on_change() -> None:
        ready.set()

    task = asyncio.create_task(
        watch_kubelet(
            plugin_dir / "kubelet.sock",
            lambda: [f"plugin socket {p.name} was deleted" for p in own if not p.exists()],
            restarts,
            on_change=on_change,
            **options,
        )
    )
    await asyncio.sleep(0)  # let the watch arm before the test changes anything
    try:
        yield restarts
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@pytest.mark.parametrize(
    "options", [{}, {"inotify": _no_inotify, "interval": 0.01}], ids=["inotify", "polling"]
)
async def test_a_new_kubelet_socket_is_a_restart(plugin_dir: Path, options: Any) -> None:
    kubelet = plugin_dir / "kubelet.sock"
    old = _serve_unix(kubelet)
    async with watching(plugin_dir, [], **options) as restarts:
        old.close()
        kubelet.unlink()
        new = _serve_unix(kubelet)
        try:
            assert await restarts.next() == "kubelet.sock was recreated (kubelet restarted)"
        finally:
            new.close()


@pytest.mark.parametrize(
    "options", [{}, {"inotify": _no_inotify, "interval": 0.01}], ids=["inotify", "polling"]
)
async def test_our_socket_deleted_is_a_restart(plugin_dir: Path, options: Any) -> None:
    kubelet = _serve_unix(plugin_dir / "kubelet.sock")
    ours = plugin_dir / "kubegpu-nvidia.com-gpu.sock"
    ours.write_text("")
    try:
        async with watching(plugin_dir, [ours], **options) as restarts:
            ours.unlink()
            assert await restarts.next() == "plugin socket kubegpu-nvidia.com-gpu.sock was deleted"
    finally:
        kubelet.close()


async def test_the_directory_wiped_and_re_created_is_a_restart_every_time(
    plugin_dir: Path,
) -> None:
    kubelet = plugin_dir / "kubelet.sock"
    sock = _serve_unix(kubelet)
    async with watching(plugin_dir, []) as restarts:
        for _ in range(3):
            sock.close()
            kubelet.unlink()
            plugin_dir.rmdir()
            plugin_dir.mkdir()
            sock = _serve_unix(kubelet)
            assert await restarts.next() == "kubelet.sock was recreated (kubelet restarted)"
    sock.close()


def test_listening_tells_a_bound_socket_from_a_listening_one(plugin_dir: Path) -> None:
    path = plugin_dir / "kubelet.sock"
    assert not listening(path), "no file"
    bound = _serve_unix(path, listen=False)
    try:
        assert not listening(path), "bound, not yet listening (a kubelet starting up)"
        bound.listen()
        assert listening(path)
    finally:
        bound.close()
    assert not listening(path), "closed: the file is left behind by a dead kubelet"
