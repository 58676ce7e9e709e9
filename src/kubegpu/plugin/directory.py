"""Who serves the kubelet from one device-plugin directory, and a handover between two.

A DaemonSet rolled with `maxSurge: 1, maxUnavailable: 0` starts the new pod beside the old
one on each node. The old `serve` (the *owner*) keeps serving while the new one (the
*successor*) starts, registers its own sockets with the kubelet, and asks the owner to
yield; the owner then stops registering and stops sending device lists, and drains and
exits when the DaemonSet sends it SIGTERM. The kubelet (1.37+) keeps both endpoints of a
resource while both are connected, allocates through the newest, and drops the old one
when its stream ends without touching the devices: the node's allocatable never drops.
A 1.36 kubelet disconnects the successor instead when the old stream ends; the
successor registers again at once (`PluginManager`, a stream the kubelet ended).

The roles are kernel locks (`flock`, `kubegpu.dirlock`), so a process that dies, even by
SIGKILL, leaves nothing held:

- *owner*: an exclusive lock on the plugin directory itself. Exactly one process owns
  registration; a second one without `--handover` is refused, as before.
- *successor*: an exclusive lock on the `kubegpu-handover` directory inside it, held by
  every process while it starts and by a successor until it owns the directory. So a
  third `serve` while a handover runs is refused (one line, exit 1), never a second
  successor registering beside the first. Directories, not files: the kubelet deletes
  the sockets (older kubelets every file but its checkpoint) in the plugin directory when
  it starts, never a directory, so the locks and the request below outlive a kubelet
  restart in the middle of a handover.

The request to yield is the file `kubegpu-handover/takeover`, written by the successor once
the kubelet holds its device lists; the owner watches for it (inotify), yields (releases
the owner lock) and deletes it, which wakes the successor to take the owner lock. The
process that yielded then waits for the owner lock itself (`own_again`): should the
successor stop or die before this process gets its SIGTERM, it owns the directory again
and registers again, so a successor that dies never leaves the node with nobody
registered.

Socket names: the successor must not clobber the sockets the owner serves (the owner would
see its socket vanish and re-register, fighting the successor for the kubelet). Each
process serves on one *slot*: slot 0 is `kubegpu-<resource>.sock`, slot 1 inserts `+1`
before `.sock` (`+` is not in the resource-name alphabet, so it never names another
resource's socket). A process takes the lowest slot nobody listens on; an owner deletes
our sockets that nobody listens on (a crashed predecessor's) when it starts. Two slots
suffice because at most two processes serve: an owner and one successor.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import functools
import logging
import os
import re
import stat
import threading
from enum import StrEnum
from pathlib import Path

from kubegpu.dirlock import HANDOVER_DIR, try_lock
from kubegpu.errors import DirectoryLockError
from kubegpu.plugin.registration import listening

log = logging.getLogger("kubegpu.plugin")

#: `HANDOVER_DIR`'s mode: only the `serve` processes, all of one user, use it
#: (`_make_handover_dir`).
HANDOVER_DIR_MODE = 0o700
#: The successor's request to the owner: yield registration to me.
TAKEOVER_FILE = "takeover"
#: Socket-name slots: one for the owner, one for its successor.
SLOTS = 2
#: Our socket names (`resources.socket_name`), with the slot suffix of slots above 0.
_OURS = re.compile(r"^kubegpu-[^+]+(?:\+(\d+))?\.sock$")


class PluginDirectoryError(DirectoryLockError):
    """The device-plugin directory is taken: by a `serve` (without `--handover`), by a
    handover already under way, or every socket slot is served (exit 1)."""


class Role(StrEnum):
    OWNER = "owner"
    SUCCESSOR = "successor"
    #: A former owner that handed registration to its successor and only drains now.
    YIELDED = "yielded"


def slot_socket_name(name: str, slot: int) -> str:
    """`name` (a `kubegpu-*.sock`) as served on `slot`."""
    return name if slot == 0 else f"{name.removesuffix('.sock')}+{slot}.sock"


def socket_slot(name: str) -> int | None:
    """The slot of one of our socket names; None for any other file name."""
    match = _OURS.match(name)
    if match is None:
        return None
    return int(match[1] or 0)


#: How messages name the device-plugin directory.
DEVICE_PLUGINS = "device-plugin directory"


class PluginDirectory:
    """This process's role in one device-plugin directory, and the socket slot it serves."""

    def __init__(self, path: Path, *, handover: bool = False) -> None:
        self.path = path
        #: Whether this process may start as a successor beside a serving one.
        self.handover = handover
        self.role: Role | None = None
        self.slot = 0
        self._owner_fd: int | None = None
        self._successor_fd: int | None = None

    @property
    def handover_dir(self) -> Path:
        return self.path / HANDOVER_DIR

    @property
    def takeover_file(self) -> Path:
        return self.handover_dir / TAKEOVER_FILE

    def socket_name(self, name: str) -> str:
        return slot_socket_name(name, self.slot)

    def acquire(self) -> Role:
        """Take this process's role; `PluginDirectoryError` when it has none to take."""
        self._make_handover_dir()
        self._successor_fd = try_lock(self.handover_dir, what=DEVICE_PLUGINS)
        if self._successor_fd is None:
            raise PluginDirectoryError(
                f"{DEVICE_PLUGINS} {self.path}: a handover is under way (a kubegpu "
                f"serve is taking over from the one serving); start this one once it is done"
            )
        self._owner_fd = try_lock(self.path, what=DEVICE_PLUGINS)
        if self._owner_fd is not None:
            self.role = Role.OWNER
            # Nobody owns the directory: a request left by a successor that died is void.
            self.takeover_file.unlink(missing_ok=True)
            self._release_successor()
            for name in self.remove_stale_sockets():
                log.info("removed %s: nobody serves it (a previous kubegpu serve died)", name)
            self.slot = self._free_slot()
            return self.role
        if not self.handover:
            self.release()
            raise PluginDirectoryError(
                f"{DEVICE_PLUGINS} {self.path} is in use by another kubegpu serve; "
                f"stop it first, give this one another --device-plugin-path, or start it "
                f"with --handover to take over from it"
            )
        self.role = Role.SUCCESSOR
        self.slot = self._free_slot()
        return self.role

    def _make_handover_dir(self) -> None:
        """Create `kubegpu-handover/` for the `serve` processes alone (mode 0700).

        Only they open it (its flock is the successor slot) and write in it (the takeover
        request), all as the same user. Anyone else who could open it could hold that lock
        and write a request, and an owner would hand registration over to nobody. mkdir's
        mode is cut by the umask, and a directory made before (by an older kubegpu, under a
        permissive umask) keeps its mode, so the mode is set outright.
        """
        path = self.handover_dir
        path.mkdir(mode=HANDOVER_DIR_MODE, exist_ok=True)
        try:
            if stat.S_IMODE(path.stat().st_mode) != HANDOVER_DIR_MODE:
                path.chmod(HANDOVER_DIR_MODE)
        except OSError as exc:
            log.warning(
                "cannot set the mode of %s to %o (%s); other users may open it",
                path,
                HANDOVER_DIR_MODE,
                exc.strerror or exc,
            )

    def _free_slot(self) -> int:
        busy = {
            slot
            for entry in _entries(self.path)
            if (slot := socket_slot(entry.name)) is not None and listening(entry)
        }
        for slot in range(SLOTS):
            if slot not in busy:
                return slot
        self.release()
        raise PluginDirectoryError(
            f"{DEVICE_PLUGINS} {self.path}: kubegpu sockets of {SLOTS} processes are "
            f"served there already; start this one once one of them has stopped"
        )

    def remove_stale_sockets(self) -> list[str]:
        """Delete our sockets that nobody listens on; their names."""
        removed = []
        for entry in _entries(self.path):
            if socket_slot(entry.name) is not None and not listening(entry):
                with contextlib.suppress(FileNotFoundError):
                    entry.unlink()
                    removed.append(entry.name)
        return removed

    # -- the successor's side -----------------------------------------------------------

    def request_takeover(self) -> None:
        """Ask the owner to yield (written once the kubelet holds our device lists)."""
        tmp = self.handover_dir / f".{TAKEOVER_FILE}.{os.getpid()}"
        tmp.write_text(f"{os.getpid()}\n")
        tmp.replace(self.takeover_file)

    def try_own(self) -> bool:
        """Take the owner lock if the owner has let it go; True once this process owns."""
        if self.role is Role.OWNER:
            return True
        # The directory may be gone for a moment (the kubelet re-creating it): not yet.
        self._owner_fd = try_lock(self.path, what=DEVICE_PLUGINS, missing_ok=True)
        if self._owner_fd is None:
            return False
        self.role = Role.OWNER
        self.takeover_file.unlink(missing_ok=True)
        self._release_successor()
        return True

    # -- the owner's side ---------------------------------------------------------------

    def takeover_requested(self) -> bool:
        """Whether a live successor asks for the directory. A request whose writer has
        died since (its successor lock is free) is void: yielding to it would leave nobody
        registering, so it is deleted instead."""
        if self.role is not Role.OWNER or not self.takeover_file.exists():
            return False
        probe = try_lock(self.handover_dir, what=DEVICE_PLUGINS, missing_ok=True)
        if probe is None:
            return True
        os.close(probe)
        self.takeover_file.unlink(missing_ok=True)
        log.info("ignored a takeover request: the kubegpu serve that made it has stopped")
        return False

    def yield_ownership(self) -> None:
        """Let the successor own the directory (registration is already handed over)."""
        self.role = Role.YIELDED
        fd, self._owner_fd = self._owner_fd, None
        if fd is not None:
            os.close(fd)  # closing the last descriptor releases the flock
        # Deleting the request is what wakes the successor to take the lock.
        self.takeover_file.unlink(missing_ok=True)

    async def own_again(self) -> None:
        """After `yield_ownership`: return once this process owns the directory again,
        which is once its successor has stopped (or died) and no other process owns it.

        First the successor lock: the successor lets it go only after it took the owner
        lock, or when it dies, so waiting for it never takes the owner lock from a
        successor on its way to it. Then the owner lock itself. Both waits are the
        kernel's (`_wait_lock`): a successor killed by SIGKILL wakes this at once.
        """
        # No handover directory: nobody holds the successor lock.
        with contextlib.suppress(FileNotFoundError):
            os.close(await _wait_lock(self.handover_dir))
        self._owner_fd = await _wait_lock(self.path)
        self.role = Role.OWNER

    def release(self) -> None:
        """Let go of every lock (the process is stopping)."""
        fd, self._owner_fd = self._owner_fd, None
        if fd is not None:
            os.close(fd)
        self._release_successor()

    def _release_successor(self) -> None:
        fd, self._successor_fd = self._successor_fd, None
        if fd is not None:
            os.close(fd)


async def _wait_lock(path: Path) -> int:
    """An exclusive `flock` on the directory `path`, waited for: its descriptor.

    The kernel wakes a blocked `flock` the moment the holder lets go or dies, SIGKILL
    included, so nothing polls; the libraries that wait for a lock (filelock, fasteners)
    retry a non-blocking one at an interval instead, hence this. The blocking call runs in
    a thread of its own, not the loop's executor: it cannot be interrupted, so a cancelled
    wait leaves it behind (a daemon thread, which never holds up an exit), and a lock it
    gets after that is let go at once.
    """
    loop = asyncio.get_running_loop()
    got: asyncio.Future[int] = loop.create_future()

    def deliver(fd: int) -> None:  # on the loop
        if got.cancelled():
            os.close(fd)
        else:
            got.set_result(fd)

    def fail(exc: OSError) -> None:  # on the loop
        if not got.cancelled():
            got.set_exception(exc)

    def wait() -> None:  # in the thread
        fd: int | None = None
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as exc:
            if fd is not None:
                os.close(fd)
            fd = None
            done = functools.partial(fail, exc)
        else:
            done = functools.partial(deliver, fd)
        try:
            loop.call_soon_threadsafe(done)
        except RuntimeError:  # the loop is closed: nobody waits for the lock any more
            if fd is not None:
                os.close(fd)

    threading.Thread(target=wait, name=f"flock {path}", daemon=True).start()
    return await got


def _entries(path: Path) -> list[Path]:
    try:
        return list(path.iterdir())
    except OSError:
        return []
