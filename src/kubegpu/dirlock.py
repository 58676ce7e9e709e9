"""A directory one `serve` owns: an exclusive kernel lock (`flock`) on the directory itself.

Both fronts own one: the device plugin its device-plugin directory (`PluginDirectory`, which
adds the handover between two processes), a DRA driver its own directory under the kubelet's
plugins directory. A `flock` belongs to the open file description, so a process that dies,
even by SIGKILL, leaves nothing held, and a second `serve` is refused at once with one line.
Directories, not files: the kubelet deletes files (sockets, older kubelets every file but
its checkpoint) in its directories when it starts, never a directory, so a lock outlives a
kubelet restart. Here, below both fronts, so neither imports the other for it.
"""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

from kubegpu.errors import DirectoryLockError

#: The device plugin's handover directory (`kubegpu.plugin.directory`): its lock is the
#: successor slot, and it holds the takeover request. Named here because a DRA driver's
#: directory locked by an earlier kubegpu may hold an empty one, which the DRA front removes.
HANDOVER_DIR = "kubegpu-handover"


def try_lock(path: Path, *, what: str, missing_ok: bool = False) -> int | None:
    """An exclusive `flock` on the directory `path`: its descriptor, or None if another
    process holds it (or, with `missing_ok`, if the directory does not exist). `what` names
    the directory in the error for any other failure."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        if missing_ok:
            return None
        raise
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return None
        raise DirectoryLockError(f"{what} {path}: cannot lock it ({exc})") from exc
    return fd


class DirectoryLock:
    """This process's exclusive hold on one directory, refused while another holds it.

    `what` names the directory in the one line a refusal gives, and `flag` the option that
    moves it (what the operator can do about it)."""

    def __init__(self, path: Path, *, what: str, flag: str) -> None:
        self.path = path
        self.what = what
        self.flag = flag
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock; `DirectoryLockError` when another `serve` holds it."""
        fd = try_lock(self.path, what=self.what)
        if fd is None:
            raise DirectoryLockError(
                f"{self.what} {self.path} is in use by another kubegpu serve; "
                f"stop it first, give this one another {self.flag}"
            )
        self._fd = fd

    def release(self) -> None:
        """Let the lock go (closing the last descriptor releases the flock)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


__all__ = ["HANDOVER_DIR", "DirectoryLock", "try_lock"]
