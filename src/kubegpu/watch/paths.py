"""Watching files and directories: inotify on the loop, polling only where it cannot work.

A watch covers *paths* (files or directories that may not exist yet) and wakes its owner
when one of them may have changed; the owner then looks at what it cares about (a
socket's inode, a config's bytes). Waking is level-triggered on purpose: an owner that
re-checks on every wake cannot miss a change that raced with re-arming the watch.

inotify watches inodes, not names, so each path is covered through the directory that
holds it (the nearest one that exists, so a directory created later is seen) and, for a
symlink, also through the directory of its target. After every batch of events the set
is computed again and the watches re-armed: a directory removed and re-created (a kubelet
restart wipes the device-plugin directory) or a ConfigMap's `..data` symlink swapped
moves the watch to the new inode.

Where inotify is unavailable (no kernel support, the per-user instance or watch limit
reached), the watch says so once in the log and compares `stat` fingerprints every
`poll_interval` instead.

The events also tell whether a write is complete: a file modified (IN_MODIFY) stays
"being written" until it is closed (IN_CLOSE_WRITE), renamed or deleted, while a file
renamed into place (a ConfigMap swap, an editor's save) arrives whole. `PathWatch.quiet()`
lets an owner read such a file once instead of twice, a settle interval apart. Only the
watched paths' own files count (each path and, through its symlinks, the file it resolves
to): a log or an editor's swap file held open beside a config file says nothing about it.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import selectors
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from types import TracebackType
from typing import Any

from asyncinotify import Inotify, Mask

from kubegpu.supervisor import spawn

log = logging.getLogger("kubegpu.watch")

#: The paths to cover, asked again on every re-arm (an owner's set may change).
Paths = Callable[[], Iterable[Path]]
#: Opens an inotify instance (`asyncinotify.Inotify`); tests inject failing ones.
InotifyFactory = Callable[[], Any]
#: stat identity and version of each covered path and directory; for the fallback only.
Fingerprint = tuple[tuple[str, str, int, int, int, int, int] | tuple[str], ...]


def default_inotify() -> Any:
    return Inotify()


def _masks() -> tuple[Any, Any]:
    """(for a directory that holds a path, for an ancestor that holds such a directory)."""
    moves = Mask.CREATE | Mask.DELETE | Mask.MOVED_FROM | Mask.MOVED_TO
    own = Mask.DELETE_SELF | Mask.MOVE_SELF | Mask.ONLYDIR | Mask.EXCL_UNLINK
    return moves | Mask.MODIFY | Mask.CLOSE_WRITE | Mask.ATTRIB | own, moves | own


def _write_masks() -> tuple[Any, Any]:
    """(events that open a write on a name, events after which the name is complete)."""
    return Mask.MODIFY, Mask.CLOSE_WRITE | Mask.MOVED_FROM | Mask.MOVED_TO | Mask.DELETE


def _existing_dir(directory: Path) -> Path:
    """`directory`, or its nearest ancestor that exists (where it would be created)."""
    while not directory.is_dir() and directory != directory.parent:
        directory = directory.parent
    return directory


#: A watched directory -> the entry names that matter there (None: every entry).
Coverage = dict[Path, frozenset[str] | None]


def watched_dirs(paths: Iterable[Path], *, names_only: bool = False) -> Coverage:
    """The directories whose inotify events cover `paths` (and their symlink targets).

    A path is covered by its directory (every entry: a symlink swap renames a sibling;
    with `names_only`, the path's own name only) and by that directory's parent, for the
    directory's own name only: a removed directory's inode outlives it while anything
    holds it (a socket bound inside it, an open descriptor), so its own DELETE_SELF can
    come late, but the parent reports the removal and the re-creation at once. A missing
    directory is covered by its nearest existing ancestor, for the name of the next
    directory down.
    """
    names: dict[Path, set[str] | None] = {}

    def cover(directory: Path, name: str | None) -> None:
        if name is None or names.get(directory, set()) is None:
            names[directory] = None
        else:
            entry = names.setdefault(directory, set())
            assert entry is not None
            entry.add(name)

    for path in paths:
        path = path.absolute()
        for each in {path, Path(os.path.realpath(path))}:
            for directory in ([each] if each.is_dir() else []) + [each.parent]:
                existing = _existing_dir(directory)
                if existing == directory:
                    cover(directory, each.name if names_only and directory != each else None)
                    if directory.parent != directory:
                        cover(directory.parent, directory.name)
                else:
                    cover(existing, directory.relative_to(existing).parts[0])
    return {d: None if n is None else frozenset(n) for d, n in names.items()}


def written_files(paths: Iterable[Path]) -> set[tuple[str, str]]:
    """(real directory, entry name) of each file whose writes decide whether `paths` are
    whole: the path itself and, through every symlink (a ConfigMap's `..data` chain), the
    file it resolves to. Symlinks themselves are never written in place, so the ends of the
    chain are enough; a path that does not exist yet is named where it would be created."""
    out: set[tuple[str, str]] = set()
    for path in paths:
        path = path.absolute()
        for each in (path, Path(os.path.realpath(path))):
            out.add((os.path.realpath(each.parent), each.name))
    return out


def fingerprint(paths: Iterable[Path], *, names_only: bool = False) -> Fingerprint:
    """What the polling fallback compares: every covered path's and directory's stat
    (with `names_only`, a directory's identity alone: its size and times change with
    every entry)."""
    listed = [p.absolute() for p in paths]
    own = set(listed)
    marks: list[tuple[str, str, int, int, int, int, int] | tuple[str]] = []
    for path in sorted({*listed, *watched_dirs(listed, names_only=names_only)}):
        try:
            st = path.stat()
        except OSError:
            marks.append((str(path),))
            continue
        real = os.path.realpath(path)
        if names_only and path not in own:
            marks.append((str(path), real, st.st_dev, st.st_ino, 0, 0, 0))
            continue
        marks.append(
            (str(path), real, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        )
    return tuple(marks)


class _Core:
    """The inotify instance and its watches, shared by the loop and the thread flavours."""

    def __init__(
        self, paths: Paths, name: str, inotify: InotifyFactory, *, names_only: bool = False
    ) -> None:
        self.paths = paths
        self.name = name
        #: Only the paths' own entries count, not their siblings (`watched_dirs`).
        self.names_only = names_only
        self._factory = inotify
        self._poll_interval = 0.0
        self._inotify: Any = None
        self._watches: dict[int, Any] = {}
        self._names: dict[int, frozenset[str] | None] = {}
        #: Why this watch polls (one line), or None while inotify serves it.
        self.polling: str | None = None
        #: (watch descriptor, entry name) of files modified and not yet closed or moved,
        #: any entry of a watched directory (filtered by `_files` when asked).
        self._writing: set[tuple[int, str]] = set()
        #: (watch descriptor, entry name) of the watched paths' own files (`written_files`).
        self._files: frozenset[tuple[int, str]] = frozenset()
        #: The queue overflowed since the last look: writes may have gone unseen.
        self._overflowed = False

    def open_writes(self) -> bool:
        """Whether a watched path's file was modified and not yet closed, moved or deleted
        (another entry of its directory held open for writing does not count)."""
        return not self._files.isdisjoint(self._writing)

    def settled(self) -> bool:
        """No watched file half-written (as of the events drained so far); a queue overflow
        counts as a possible write once."""
        overflowed, self._overflowed = self._overflowed, False
        return not self.open_writes() and not overflowed

    @property
    def fd(self) -> int | None:
        return None if self._inotify is None else int(self._inotify.fd)

    def open(self, poll_interval: float) -> None:
        self._poll_interval = poll_interval
        try:
            self._inotify = self._factory()
            # sync_get() then never blocks: it returns None once the queue is empty.
            self._inotify.sync_timeout = 0
        except (OSError, RuntimeError, ImportError) as exc:
            self._fall_back(exc)
            return
        self.rearm()

    def rearm(self) -> None:
        """Watch exactly the directories that cover the paths now."""
        if self._inotify is None:
            return
        full, ancestor = _masks()
        for _ in range(8):
            wanted: dict[int, Any] = {}
            names: dict[int, frozenset[str] | None] = {}
            #: Real directory path -> the watch descriptor that reports its entries.
            entries: dict[str, int] = {}
            try:
                paths = list(self.paths())
                # Narrow watches first: when two paths are one inode, the wider mask wins.
                covered = watched_dirs(paths, names_only=self.names_only)
                coverage = sorted(covered.items(), key=lambda i: i[1] is None)
                for directory, only in coverage:
                    watch = self._inotify.add_watch(directory, ancestor if only else full)
                    before = names.get(watch.wd, frozenset())
                    names[watch.wd] = None if only is None or before is None else before | only
                    wanted[watch.wd] = watch
                    if only is None:
                        entries[os.path.realpath(directory)] = watch.wd
            except (FileNotFoundError, NotADirectoryError):
                continue  # a directory went away between looking and watching: look again
            except OSError as exc:  # ENOSPC: max_user_watches reached
                self._fall_back(exc)
                return
            break
        for wd, watch in self._watches.items():
            if wd not in wanted:
                with contextlib.suppress(OSError):  # its directory is already gone
                    self._inotify.rm_watch(watch)
        self._watches = wanted
        self._names = names
        self._writing = {key for key in self._writing if key[0] in wanted}
        self._files = frozenset(
            (entries[directory], name)
            for directory, name in written_files(paths)
            if directory in entries
        )

    def _matters(self, event: Any) -> bool:
        """Whether an event can change what the owner looks at (a sibling's churn cannot)."""
        watch = event.watch
        if watch is not None and watch.wd not in self._watches:
            return False  # a watch re-arming dropped (its IN_IGNORED), or events before that
        if event.name is None or watch is None:
            return True  # the directory itself, an overflow, a watch that ended
        only = self._names.get(watch.wd)
        return only is None or str(event.name) in only

    def drain(self) -> bool:
        """Read every queued event (the owner re-checks once per batch); True if any matters."""
        if self._inotify is None:
            return False
        seen = False
        try:
            while (event := self._inotify.sync_get()) is not None:
                seen = seen or self._matters(event)
                self._track(event)
        except BlockingIOError:
            pass
        except OSError as exc:
            self._fall_back(exc)
            return True
        return seen

    def _track(self, event: Any) -> None:
        """Follow which entries are being written (see `writing`)."""
        if event.watch is None:  # the queue overflowed: events, writes among them, lost
            self._overflowed = True
            return
        if event.name is None:
            return
        opens, completes = _write_masks()
        key = (event.watch.wd, str(event.name))
        if event.mask & completes:
            self._writing.discard(key)
        elif event.mask & opens:
            self._writing.add(key)

    def close(self) -> None:
        if self._inotify is not None:
            self._inotify.close()
            self._inotify = None
        self._watches = {}
        self._writing = set()
        self._files = frozenset()

    def _fall_back(self, exc: BaseException) -> None:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        hint = ""
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EMFILE):
            hint = " (raise fs.inotify.max_user_watches / max_user_instances)"
        self.polling = f"inotify unavailable: {reason}{hint}"
        log.warning(
            "%s: %s; checking it every %.2f s instead",
            self.name,
            self.polling,
            self._poll_interval,
        )
        self.close()


class PathWatch:
    """Calls `on_change()` on the event loop when one of `paths()` may have changed.

    Use as a context manager inside a running loop. No thread and no timer while inotify
    works: the loop reads the inotify descriptor when the kernel says it is readable.

    `names_only`: only the paths' own entries count (created, deleted, renamed), not
    another entry of their directory nor a write into one: for paths that are replaced
    whole and never through a symlink swap, such as sockets, beside files rewritten often.
    """

    def __init__(
        self,
        paths: Paths,
        on_change: Callable[[], None],
        *,
        poll_interval: float,
        name: str,
        inotify: InotifyFactory = default_inotify,
        names_only: bool = False,
    ) -> None:
        self._core = _Core(paths, name, inotify, names_only=names_only)
        self._on_change = on_change
        self._poll_interval = poll_interval
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reading: int | None = None
        self._poller: asyncio.Task[None] | None = None

    @property
    def polling(self) -> str | None:
        """Why this watch polls, or None while inotify serves it."""
        return self._core.polling

    def __enter__(self) -> PathWatch:
        self._loop = asyncio.get_running_loop()
        self._core.open(self._poll_interval)
        self._follow()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def rearm(self) -> None:
        """Cover `paths()` again now (the owner's set changed)."""
        self._core.rearm()
        self._follow()

    def quiet(self) -> bool:
        """Whether the watched files are complete now: inotify serves this watch, no event
        is queued, and no file was modified without being closed, moved or deleted since.

        For an owner that has just read a file it was woken for: True means the bytes it
        read are a finished write (no second read needed). Events found queued are handed
        on as usual (`on_change`), so the owner looks again.
        """
        if self._core.fd is None:
            return False  # polling: nothing says when a write ends
        if self._core.drain():
            self._core.rearm()
            self._follow()
            self._on_change()
            return False
        return self._core.settled()

    def writing(self) -> bool:
        """Whether inotify shows a watched file modified and not yet closed, moved or
        deleted: bytes read now may be half of a write, however long the writer pauses.
        False where the watch polls (nothing says when a write ends there)."""
        if self._core.fd is None:
            return False
        if self._core.drain():
            self._core.rearm()
            self._follow()
            self._on_change()
        return self._core.open_writes()

    def close(self) -> None:
        self._stop_reading()
        if self._poller is not None:
            self._poller.cancel()
            self._poller = None
        self._core.close()

    def _follow(self) -> None:
        """Read the inotify descriptor, or poll once inotify has failed."""
        assert self._loop is not None
        fd = self._core.fd
        if fd is not None:
            if self._reading != fd:
                self._stop_reading()
                self._loop.add_reader(fd, self._readable)
                self._reading = fd
            return
        self._stop_reading()
        if self._poller is None:
            # The baseline is taken now, not when the task first runs: a change made
            # right after the watch is set up must count as a change.
            last = fingerprint(self._core.paths(), names_only=self._core.names_only)
            self._poller = spawn(f"poll {self._core.name}", self._poll(last))

    def _stop_reading(self) -> None:
        if self._reading is not None and self._loop is not None:
            self._loop.remove_reader(self._reading)
            self._reading = None

    def _readable(self) -> None:
        if self._core.drain():
            self._core.rearm()
            self._follow()
            self._on_change()

    async def _poll(self, last: Fingerprint) -> None:
        while True:
            await asyncio.sleep(self._poll_interval)
            now = fingerprint(self._core.paths(), names_only=self._core.names_only)
            if now != last:
                last = now
                self._on_change()


class BlockingPathWatch:
    """The same watch for a thread that must block: `wait()` until a change or `interrupt()`.

    For backends whose watch runs in a thread by contract (the simulated node); the
    thread sleeps in `select` on the inotify descriptor and a pipe, so it costs nothing
    while nothing happens.
    """

    def __init__(
        self,
        paths: Paths,
        *,
        poll_interval: float,
        name: str,
        inotify: InotifyFactory = default_inotify,
    ) -> None:
        self._core = _Core(paths, name, inotify)
        self._poll_interval = poll_interval
        self._read_end, self._write_end = os.pipe()
        #: Guards the pipe against a write after close (its fd number may be reused).
        self._closing = threading.Lock()
        self._closed = False
        os.set_blocking(self._read_end, False)
        os.set_blocking(self._write_end, False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._read_end, selectors.EVENT_READ)
        self._core.open(poll_interval)
        self._registered: int | None = None
        self._register()
        self._last = fingerprint(paths()) if self._core.polling else ()

    @property
    def polling(self) -> str | None:
        return self._core.polling

    def _register(self) -> None:
        fd = self._core.fd
        if fd == self._registered:
            return
        if self._registered is not None:
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(self._registered)
        if fd is not None:
            self._selector.register(fd, selectors.EVENT_READ)
        self._registered = fd

    def wait(self) -> bool:
        """Block until a path may have changed (True) or `interrupt()` was called (False)."""
        while True:
            timeout = self._poll_interval if self._core.polling else None
            ready = {key.fd for key, _ in self._selector.select(timeout)}
            interrupted = self._read_end in ready
            if interrupted:
                with contextlib.suppress(BlockingIOError):
                    while os.read(self._read_end, 512):
                        pass
            changed = False
            if self._registered is not None and self._registered in ready:
                # Re-armed only when something mattered, as on the loop: churn that cannot
                # change a watched path (another entry beside a watched directory) leaves
                # the watches as they are.
                changed = self._core.drain()
                if changed:
                    self._core.rearm()
                    self._register()
                    if self._core.polling:
                        self._last = fingerprint(self._core.paths())
            elif self._core.polling:
                now = fingerprint(self._core.paths())
                changed, self._last = now != self._last, now
            if changed or interrupted:
                return changed

    def interrupt(self) -> None:
        """Make `wait()` return now; safe from any thread, and after `close()`."""
        with self._closing, contextlib.suppress(OSError):
            if not self._closed:
                os.write(self._write_end, b"\0")

    def close(self) -> None:
        with self._closing:
            if self._closed:
                return
            self._closed = True
            self._core.close()
            self._selector.close()
            os.close(self._read_end)
            os.close(self._write_end)
