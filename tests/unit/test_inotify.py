"""libc's inotify as `kubegpu.watch.inotify` binds it: the event layout, and the calls on
the running kernel.

The layout is the kernel's ABI (`struct inotify_event` in <linux/inotify.h>: int wd,
u32 mask, u32 cookie, u32 len, then `len` bytes of NUL-padded name), and the bit values
are the header's; the kernel tests below read real events, so a wrong constant or offset
fails here rather than in a watch that never wakes.
"""

from __future__ import annotations

import errno
import os
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kubegpu.watch import inotify
from kubegpu.watch.inotify import Event, Inotify, parse


def _raw(wd: int, mask: int, name: bytes = b"", pad: int = 0) -> bytes:
    """One event as the kernel writes it: the name NUL-terminated and padded."""
    body = name + b"\0" * (pad or (16 - len(name) % 16 if name else 0))
    return struct.pack("iIII", wd, mask, 0, len(body)) + body


def _drain(notify: Inotify) -> list[Event]:
    events = []
    while (event := notify.sync_get()) is not None:
        events.append(event)
    return events


@pytest.fixture
def notify() -> Iterator[Inotify]:
    instance = Inotify()
    yield instance
    instance.close()


def test_parse_reads_names_without_their_padding_and_none_for_the_directory() -> None:
    data = (
        _raw(1, inotify.CREATE, b"config.yaml")
        + _raw(1, inotify.DELETE_SELF)
        + _raw(2, inotify.MOVED_TO, b"..data", pad=26)
    )
    got = [(e.wd, e.mask, e.name) for e in parse(data)]
    assert got == [
        (1, inotify.CREATE, "config.yaml"),
        (1, inotify.DELETE_SELF, None),
        (2, inotify.MOVED_TO, "..data"),
    ]


def test_parse_keeps_an_overflow_as_wd_minus_one() -> None:
    (event,) = parse(_raw(-1, inotify.Q_OVERFLOW))
    assert (event.wd, event.mask, event.name) == (-1, inotify.Q_OVERFLOW, None)


def test_parse_decodes_a_non_utf8_name_losslessly() -> None:
    (event,) = parse(_raw(3, inotify.CREATE, b"caf\xe9"))
    assert event.name is not None and os.fsencode(event.name) == b"caf\xe9"


@given(st.binary(max_size=512))
def test_parse_never_raises_on_any_bytes(data: bytes) -> None:
    # A read is never torn by the kernel; still, no input may crash the watch's thread.
    for event in parse(data):
        assert isinstance(event.wd, int) and isinstance(event.mask, int)


@given(
    st.lists(
        st.tuples(
            st.integers(-1, 2**31 - 1),
            st.integers(0, 2**32 - 1),
            st.binary(max_size=40).map(lambda b: b.replace(b"\0", b"x")),
        ),
        max_size=20,
    )
)
def test_parse_round_trips_what_the_kernel_layout_holds(
    events: list[tuple[int, int, bytes]],
) -> None:
    data = b"".join(_raw(wd, mask, name) for wd, mask, name in events)
    got = [(e.wd, e.mask, None if e.name is None else os.fsencode(e.name)) for e in parse(data)]
    assert got == [(wd, mask, name or None) for wd, mask, name in events]


def test_the_kernel_reports_a_create_and_a_close_write_by_name(
    notify: Inotify, tmp_path: Path
) -> None:
    wd = notify.add_watch(tmp_path, inotify.CREATE | inotify.CLOSE_WRITE | inotify.ONLYDIR)
    assert notify.sync_get() is None  # nothing yet, and it does not block
    (tmp_path / "a").write_text("x")
    got = [(e.wd, e.mask, e.name) for e in _drain(notify)]
    assert got == [(wd, inotify.CREATE, "a"), (wd, inotify.CLOSE_WRITE, "a")]


def test_renames_and_deletes_carry_their_bits(notify: Inotify, tmp_path: Path) -> None:
    (tmp_path / "a").write_text("x")
    mask = inotify.MOVED_FROM | inotify.MOVED_TO | inotify.DELETE | inotify.ATTRIB
    wd = notify.add_watch(tmp_path, mask)
    (tmp_path / "a").rename(tmp_path / "b")
    (tmp_path / "b").chmod(0o600)
    (tmp_path / "b").unlink()
    got = [(e.wd, e.mask, e.name) for e in _drain(notify)]
    assert got == [
        (wd, inotify.MOVED_FROM, "a"),
        (wd, inotify.MOVED_TO, "b"),
        (wd, inotify.ATTRIB, "b"),
        (wd, inotify.DELETE, "b"),
    ]


def test_a_removed_directory_ends_its_watch(notify: Inotify, tmp_path: Path) -> None:
    watched = tmp_path / "d"
    watched.mkdir()
    wd = notify.add_watch(watched, inotify.DELETE_SELF)
    watched.rmdir()
    got = [(e.wd, e.mask & ~0x40000000, e.name) for e in _drain(notify)]
    assert got == [(wd, inotify.DELETE_SELF, None), (wd, inotify.IGNORED, None)]


def test_rm_watch_is_followed_by_ignored(notify: Inotify, tmp_path: Path) -> None:
    wd = notify.add_watch(tmp_path, inotify.CREATE)
    notify.rm_watch(wd)
    assert [(e.wd, e.mask) for e in _drain(notify)] == [(wd, inotify.IGNORED)]


def test_one_inode_watched_twice_has_one_descriptor(notify: Inotify, tmp_path: Path) -> None:
    assert notify.add_watch(tmp_path, inotify.CREATE) == notify.add_watch(
        str(tmp_path), inotify.DELETE
    )


def test_errors_are_oserrors_with_the_errno(notify: Inotify, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="inotify_add_watch"):
        notify.add_watch(tmp_path / "missing", inotify.CREATE)
    (tmp_path / "file").write_text("")
    with pytest.raises(NotADirectoryError):
        notify.add_watch(tmp_path / "file", inotify.CREATE | inotify.ONLYDIR)
    with pytest.raises(OSError) as bad:
        notify.rm_watch(12345)
    assert bad.value.errno == errno.EINVAL


def test_a_closed_instance_refuses_calls_and_frees_its_descriptor(tmp_path: Path) -> None:
    notify = Inotify()
    fd = notify.fd
    link = Path(f"/proc/self/fd/{fd}")
    assert fd is not None and str(link.readlink()) == "anon_inode:inotify"
    notify.close()
    notify.close()  # twice is harmless
    assert not link.exists() or str(link.readlink()) != "anon_inode:inotify"
    with pytest.raises(OSError) as closed:
        notify.add_watch(tmp_path, inotify.CREATE)
    assert closed.value.errno == errno.EBADF


def test_the_descriptor_is_non_blocking_and_close_on_exec(notify: Inotify) -> None:
    assert notify.fd is not None
    assert not os.get_blocking(notify.fd)
    assert not os.get_inheritable(notify.fd)
