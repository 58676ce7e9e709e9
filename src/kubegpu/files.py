"""Reading a file whose path anyone may have filled: bounded, never blocking.

A path can hold anything. A FIFO blocks its reader until some writer comes, in an
uninterruptible `read` that no signal ends (a thread stuck there also keeps the process
alive past SIGTERM); a device such as /dev/urandom never ends and never reads the same
twice; a directory or a socket cannot be read at all. `read_regular` opens without
blocking, checks the kind on the opened descriptor (`fstat`, so nothing can be swapped in
between the check and the read), and reads at most one byte more than the caller's limit,
so the caller can tell a file that is too big without reading it all.

The standard library's `open` and `Path.read_bytes` have none of this, and no library adds
it, so these few lines over `os` are hand-written.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path


class NotRegularFile(OSError):
    """The path holds something other than a regular file (`kind` says what)."""

    def __init__(self, path: Path, kind: str) -> None:
        super().__init__(f"{path} is {kind}, not a regular file")
        self.path = path
        #: What the path holds, worded for a log line: "a FIFO", "a symbolic link", ...
        self.kind = kind


def file_kind(mode: int) -> str:
    """What a non-regular `st_mode` is, worded for a log line."""
    kinds = {
        stat.S_ISLNK: "a symbolic link",
        stat.S_ISDIR: "a directory",
        stat.S_ISFIFO: "a FIFO",
        stat.S_ISCHR: "a character device",
        stat.S_ISBLK: "a block device",
        stat.S_ISSOCK: "a socket",
    }
    return next((name for test, name in kinds.items() if test(mode)), "not a plain file")


def read_regular(path: str | Path, limit: int, *, follow_links: bool = True) -> bytes:
    """The bytes of the regular file at `path`, at most `limit + 1` of them.

    `NotRegularFile` for anything else (with `follow_links=False`, a symbolic link too,
    whatever it points at); `FileNotFoundError` and other `OSError`s as the system gives
    them. Never blocks on what the path holds. The size `fstat` reports is not used:
    procfs files report 0 and still have content, so the length is what `read` gives.
    """
    # `path` goes to the system as given, a Path is built only for an error: some callers
    # read a /proc file per process at every scrape.
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow_links else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise
    except OSError as exc:
        # A link under O_NOFOLLOW (ELOOP) or a socket (ENXIO) fails to open: say what it is.
        kind = _kind_of(Path(path), follow_links)
        if kind is not None:
            raise NotRegularFile(Path(path), kind) from exc
        raise
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotRegularFile(Path(path), file_kind(mode))
        return _read_up_to(fd, limit + 1)
    finally:
        os.close(fd)


def _read_up_to(fd: int, size: int) -> bytes:
    """Up to `size` bytes: a regular file's `read` never blocks, but may return less than
    asked (a file another process is appending to), so read until `size` or the end."""
    chunks: list[bytes] = []
    left = size
    while left > 0:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _kind_of(path: Path, follow_links: bool) -> str | None:
    """What `path` holds when it is not a regular file; None if it is one, or is gone."""
    try:
        mode = path.stat(follow_symlinks=follow_links).st_mode
    except OSError:
        return None
    return None if stat.S_ISREG(mode) else file_kind(mode)


def unusable_dir(path: Path, what: str, mount: str, flag: str) -> str | None:
    """Create `path` if needed; why it cannot be used (one line naming `flag`), or None.

    The caller raises its own error with the line (`InitError` at start-up)."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return f"{what} {path}: cannot create it ({exc.strerror}); mount {mount} or set {flag}"
    if not os.access(path, os.W_OK | os.X_OK):
        return (
            f"{what} {path} is not writable; run as root or mount it read-write "
            f"(set {flag} to test elsewhere)"
        )
    return None


__all__ = ["NotRegularFile", "file_kind", "read_regular", "unusable_dir"]
