"""Linux inotify, called in the C library already loaded into the interpreter.

Three system calls and a fixed event layout are all the watch adapter needs, so they are
bound here rather than through a package: `asyncinotify` finds libc with
`ctypes.util.find_library`, which runs `ldconfig -p` in a subprocess when imported (~2 ms
and a fork of the daemon at every start), then wraps each event in objects the adapter
reads straight back. `CDLL(None)` is the interpreter's own symbol table, which holds libc
on glibc and musl alike.

The descriptor is non-blocking: `sync_get()` returns None once the queue is empty, so the
owner can read it when the event loop (or `select`) says it is readable, and drain it.
"""

from __future__ import annotations

import errno
import os
import struct
from collections import deque
from pathlib import Path

# Event bits, from the kernel's <linux/inotify.h>.
MODIFY = 0x00000002
ATTRIB = 0x00000004
CLOSE_WRITE = 0x00000008
MOVED_FROM = 0x00000040
MOVED_TO = 0x00000080
CREATE = 0x00000100
DELETE = 0x00000200
DELETE_SELF = 0x00000400
MOVE_SELF = 0x00000800
#: The queue overflowed: events were lost (the event's wd is -1).
Q_OVERFLOW = 0x00004000
#: The watch ended (removed, or its inode deleted or unmounted).
IGNORED = 0x00008000
#: Watch flags: only if the path is a directory; no events for entries already unlinked.
ONLYDIR = 0x01000000
EXCL_UNLINK = 0x04000000

#: struct inotify_event: int wd; uint32 mask, cookie, len; then `len` bytes of name.
_HEADER = struct.Struct("iIII")
#: Room for many events per read(2); one event is at most 16 + NAME_MAX + 1 bytes.
_READ_SIZE = 64 * 1024


class Event:
    """One inotify event: the watch descriptor (-1 for an overflow), its bits, and the
    entry's name inside a watched directory (None for the directory itself)."""

    __slots__ = ("mask", "name", "wd")

    def __init__(self, wd: int, mask: int, name: str | None) -> None:
        self.wd = wd
        self.mask = mask
        self.name = name

    def __repr__(self) -> str:
        return f"Event(wd={self.wd}, mask={self.mask:#x}, name={self.name!r})"


class _Libc:
    """The three calls, typed once (a wrong argument type is a TypeError, not a crash)."""

    def __init__(self) -> None:
        # Imported here: importing the watch adapter does not load ctypes, watching does.
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        try:
            self.init1 = libc.inotify_init1
            self.add_watch = libc.inotify_add_watch
            self.rm_watch = libc.inotify_rm_watch
        except AttributeError as exc:
            raise OSError(errno.ENOSYS, "this C library has no inotify") from exc
        self.init1.argtypes = [ctypes.c_int]
        self.add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
        self.rm_watch.argtypes = [ctypes.c_int, ctypes.c_int]
        for call in (self.init1, self.add_watch, self.rm_watch):
            call.restype = ctypes.c_int
        self._errno = ctypes.get_errno

    def check(self, result: int, what: str) -> int:
        """`result`, or the OSError (its errno subclass: FileNotFoundError...) it means."""
        if result < 0:
            code = self._errno()
            raise OSError(code, f"{what}: {os.strerror(code)}")
        return result


_libc: _Libc | None = None


def _calls() -> _Libc:
    global _libc
    if _libc is None:
        _libc = _Libc()
    return _libc


class Inotify:
    """An inotify instance: watches by descriptor, events read without blocking."""

    def __init__(self) -> None:
        self._libc = libc = _calls()
        # IN_NONBLOCK and IN_CLOEXEC are O_NONBLOCK and O_CLOEXEC on Linux.
        self.fd: int | None = libc.check(libc.init1(os.O_NONBLOCK | os.O_CLOEXEC), "inotify_init1")
        self._queued: deque[Event] = deque()

    def add_watch(self, path: Path | str, mask: int) -> int:
        """Watch `path` for `mask`; its watch descriptor (the same one for the same inode,
        whose mask is then replaced)."""
        result = self._libc.add_watch(self._open_fd(), os.fsencode(path), mask)
        return self._libc.check(result, f"inotify_add_watch {path}")

    def rm_watch(self, wd: int) -> None:
        """Stop a watch; its IGNORED event follows."""
        self._libc.check(self._libc.rm_watch(self._open_fd(), wd), "inotify_rm_watch")

    def sync_get(self) -> Event | None:
        """The next queued event, or None when none is queued now (never blocks)."""
        if not self._queued:
            try:
                data = os.read(self._open_fd(), _READ_SIZE)
            except BlockingIOError:
                return None
            self._queued.extend(parse(data))
        return self._queued.popleft() if self._queued else None

    def close(self) -> None:
        fd, self.fd = self.fd, None
        self._queued.clear()
        if fd is not None:
            os.close(fd)

    def _open_fd(self) -> int:
        if self.fd is None:
            raise OSError(errno.EBADF, "the inotify instance is closed")
        return self.fd


def parse(data: bytes) -> list[Event]:
    """The events in one read(2) of an inotify descriptor (the kernel never splits one)."""
    events: list[Event] = []
    offset, end = 0, len(data)
    while offset + _HEADER.size <= end:
        wd, mask, _cookie, length = _HEADER.unpack_from(data, offset)
        offset += _HEADER.size
        # The name is NUL-padded to an alignment boundary; none at all for the directory.
        raw = data[offset : offset + length].split(b"\0", 1)[0]
        offset += length
        events.append(Event(wd, mask, os.fsdecode(raw) if raw else None))
    return events
