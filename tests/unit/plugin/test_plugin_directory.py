"""The plugin directory's roles and socket slots (plugin/directory.py), with real flocks.

A `flock` belongs to an open file description, so two `PluginDirectory` objects in one
process contend exactly as two processes do.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import shutil
import socket
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kubegpu.plugin.directory import (
    PluginDirectory,
    PluginDirectoryError,
    Role,
    slot_socket_name,
    socket_slot,
)
from tests.waiting import WAIT, eventually

NAME = "kubegpu-nvidia.com-gpu.sock"


@pytest.fixture
def held() -> Iterator[list[PluginDirectory]]:
    """Directories to release at the end, whatever the test left them holding."""
    made: list[PluginDirectory] = []
    yield made
    for d in made:
        d.release()


def listener(path: Path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    s.listen()
    return s


def dead_socket(path: Path) -> None:
    """A socket file nobody listens on: what a process killed by SIGKILL leaves."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(str(path))


def test_slot_names_never_name_another_resource() -> None:
    assert slot_socket_name(NAME, 0) == NAME
    assert slot_socket_name(NAME, 1) == "kubegpu-nvidia.com-gpu+1.sock"
    assert socket_slot(NAME) == 0
    assert socket_slot("kubegpu-nvidia.com-gpu+1.sock") == 1
    assert socket_slot("kubelet.sock") is None
    assert socket_slot("kubegpu-handover") is None


def test_first_owns_second_is_refused_without_handover(
    plugin_dir: Path, held: list[PluginDirectory]
) -> None:
    first = PluginDirectory(plugin_dir)
    held.append(first)
    assert first.acquire() is Role.OWNER
    assert first.slot == 0
    second = PluginDirectory(plugin_dir)
    held.append(second)
    with pytest.raises(PluginDirectoryError, match="in use by another kubegpu serve") as info:
        second.acquire()
    assert "--handover" in str(info.value) and str(plugin_dir) in str(info.value)
    # A refused one holds nothing: the owner gone, the next one owns.
    first.release()
    third = PluginDirectory(plugin_dir)
    held.append(third)
    assert third.acquire() is Role.OWNER


def test_a_successor_serves_the_other_slot_and_a_third_is_refused(
    plugin_dir: Path, held: list[PluginDirectory]
) -> None:
    owner = PluginDirectory(plugin_dir)
    held.append(owner)
    owner.acquire()
    with listener(plugin_dir / owner.socket_name(NAME)):
        successor = PluginDirectory(plugin_dir, handover=True)
        held.append(successor)
        assert successor.acquire() is Role.SUCCESSOR
        assert successor.socket_name(NAME) == "kubegpu-nvidia.com-gpu+1.sock"
        third = PluginDirectory(plugin_dir, handover=True)
        held.append(third)
        with pytest.raises(PluginDirectoryError, match="a handover is under way"):
            third.acquire()


def test_the_takeover_exchange(plugin_dir: Path, held: list[PluginDirectory]) -> None:
    owner = PluginDirectory(plugin_dir)
    successor = PluginDirectory(plugin_dir, handover=True)
    held.extend([owner, successor])
    owner.acquire()
    successor.acquire()
    assert not owner.takeover_requested()
    assert not successor.try_own()  # the owner has not let go
    successor.request_takeover()
    assert owner.takeover_requested()
    owner.yield_ownership()
    assert owner.role is Role.YIELDED and not owner.takeover_requested()
    assert not successor.takeover_file.exists()  # deleting it is what wakes the successor
    assert successor.try_own() and successor.role is Role.OWNER
    # The successor owns now: the next roll finds it as the owner.
    follower = PluginDirectory(plugin_dir, handover=True)
    held.append(follower)
    assert follower.acquire() is Role.SUCCESSOR


def test_an_owner_killed_lets_the_successor_own(
    plugin_dir: Path, held: list[PluginDirectory]
) -> None:
    owner = PluginDirectory(plugin_dir)
    successor = PluginDirectory(plugin_dir, handover=True)
    held.extend([owner, successor])
    owner.acquire()
    successor.acquire()
    successor.request_takeover()
    owner.release()  # what the kernel does when the process dies
    assert successor.try_own()


def test_an_owner_removes_dead_sockets_and_a_dead_request(
    plugin_dir: Path, held: list[PluginDirectory]
) -> None:
    (plugin_dir / "kubegpu-handover").mkdir()
    (plugin_dir / "kubegpu-handover" / "takeover").write_text("1\n")
    dead_socket(plugin_dir / NAME)
    dead_socket(plugin_dir / "kubegpu-nvidia.com-gpu+1.sock")
    dead_socket(plugin_dir / "other-vendor.sock")
    owner = PluginDirectory(plugin_dir)
    held.append(owner)
    assert owner.acquire() is Role.OWNER
    assert sorted(p.name for p in plugin_dir.iterdir()) == ["kubegpu-handover", "other-vendor.sock"]
    assert owner.slot == 0


def test_an_owner_keeps_served_sockets_and_takes_a_free_slot(
    plugin_dir: Path, held: list[PluginDirectory]
) -> None:
    """A former owner still draining serves slot 0 while the successor it handed over to
    restarts: the restarted one owns the directory but must not touch slot 0."""
    with listener(plugin_dir / NAME):
        owner = PluginDirectory(plugin_dir)
        held.append(owner)
        assert owner.acquire() is Role.OWNER
        assert (plugin_dir / NAME).exists()
        assert owner.slot == 1


def test_a_request_whose_successor_died_is_void(
    plugin_dir: Path, held: list[PluginDirectory]
) -> None:
    """Yielding to a successor that is gone would leave nobody registering."""
    owner = PluginDirectory(plugin_dir)
    successor = PluginDirectory(plugin_dir, handover=True)
    held.extend([owner, successor])
    owner.acquire()
    successor.acquire()
    successor.request_takeover()
    successor.release()  # it died after asking
    assert not owner.takeover_requested()
    assert owner.role is Role.OWNER and not owner.takeover_file.exists()


def test_a_successor_waits_while_the_directory_is_missing(
    plugin_dir: Path, held: list[PluginDirectory]
) -> None:
    owner = PluginDirectory(plugin_dir)
    successor = PluginDirectory(plugin_dir, handover=True)
    held.extend([owner, successor])
    owner.acquire()
    successor.acquire()
    owner.release()
    shutil.rmtree(plugin_dir)
    assert not successor.try_own()
    plugin_dir.mkdir()
    assert successor.try_own()


@pytest.mark.parametrize("existing", [None, 0o777], ids=["new", "left-open"])
def test_the_handover_directory_is_the_serve_processes_alone_whatever_the_umask(
    plugin_dir: Path, held: list[PluginDirectory], existing: int | None
) -> None:
    """Created under a permissive umask, or left open by an earlier start: mode 0700, so
    no other user can hold its lock (the successor slot) or write a takeover request."""
    handover_dir = plugin_dir / "kubegpu-handover"
    if existing is not None:
        handover_dir.mkdir()
        handover_dir.chmod(existing)
    umask = os.umask(0)
    try:
        owner = PluginDirectory(plugin_dir)
        held.append(owner)
        assert owner.acquire() is Role.OWNER
    finally:
        os.umask(umask)
    assert stat.S_IMODE(handover_dir.stat().st_mode) == 0o700


def handed_over(plugin_dir: Path, held: list[PluginDirectory]) -> tuple[PluginDirectory, ...]:
    """An owner that yielded to a successor that asked; the successor has not owned yet."""
    owner = PluginDirectory(plugin_dir)
    successor = PluginDirectory(plugin_dir, handover=True)
    held.extend([owner, successor])
    owner.acquire()
    successor.acquire()
    successor.request_takeover()
    owner.yield_ownership()
    return owner, successor


def waiting_on(path: Path) -> bool:
    """Whether a thread of `own_again` waits for the lock on `path`."""
    return any(t.name == f"flock {path}" for t in threading.enumerate())


async def test_an_owner_that_yielded_owns_again_when_its_successor_dies(
    plugin_dir: Path, held: list[PluginDirectory]
) -> None:
    owner, successor = handed_over(plugin_dir, held)
    assert successor.try_own()
    again = asyncio.create_task(owner.own_again())
    await eventually(lambda: waiting_on(plugin_dir))
    assert not again.done()
    successor.release()  # what the kernel does when the successor is killed
    await asyncio.wait_for(again, WAIT)
    assert owner.role is Role.OWNER
    # It owns the directory: the next `serve --handover` is its successor.
    follower = PluginDirectory(plugin_dir, handover=True)
    held.append(follower)
    assert follower.acquire() is Role.SUCCESSOR


async def test_waiting_to_own_again_leaves_the_lock_to_a_successor_on_its_way_to_it(
    plugin_dir: Path, held: list[PluginDirectory]
) -> None:
    """Between the yield and the successor's taking the owner lock, the lock is free; the
    yielded owner must not take it back then, only once the successor has stopped."""
    owner, successor = handed_over(plugin_dir, held)
    again = asyncio.create_task(owner.own_again())
    await eventually(lambda: waiting_on(successor.handover_dir))
    assert successor.try_own()
    await eventually(lambda: waiting_on(plugin_dir))
    assert not again.done()
    successor.release()
    await asyncio.wait_for(again, WAIT)
    assert owner.role is Role.OWNER


async def test_a_cancelled_wait_to_own_again_holds_nothing(
    plugin_dir: Path, held: list[PluginDirectory]
) -> None:
    """SIGTERM while waiting: the thread blocked in flock is left behind, and lets go of
    the lock as soon as it gets it."""
    owner, successor = handed_over(plugin_dir, held)
    assert successor.try_own()
    again = asyncio.create_task(owner.own_again())
    await eventually(lambda: waiting_on(plugin_dir))
    again.cancel()
    with pytest.raises(asyncio.CancelledError):
        await again
    successor.release()
    await eventually(lambda: lockable(plugin_dir))
    assert owner.role is Role.YIELDED


def lockable(path: Path) -> bool:
    """Whether nobody holds the flock on `path` (taken and let go at once)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    return True
