"""`kubegpu.files.read_regular`: only a regular file is read, bounded, never blocking."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from kubegpu.files import NotRegularFile, read_regular


def test_reads_at_most_one_byte_over_the_limit(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"x" * 100)
    assert read_regular(path, 10) == b"x" * 11
    assert read_regular(path, 100) == b"x" * 100


def test_follows_a_link_only_when_asked(tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.write_bytes(b"data")
    link = tmp_path / "link"
    link.symlink_to(target)
    assert read_regular(link, 10) == b"data"
    with pytest.raises(NotRegularFile) as refused:
        read_regular(link, 10, follow_links=False)
    assert refused.value.kind == "a symbolic link"


@pytest.mark.parametrize("follow_links", [True, False])
def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path: Path, follow_links: bool) -> None:
    path = tmp_path / "fifo"
    os.mkfifo(path)
    with pytest.raises(NotRegularFile, match=r"fifo is a FIFO, not a regular file$"):
        read_regular(path, 10, follow_links=follow_links)


def test_a_device_is_refused_through_a_link(tmp_path: Path) -> None:
    link = tmp_path / "random"
    link.symlink_to("/dev/urandom")
    with pytest.raises(NotRegularFile) as refused:
        read_regular(link, 10)
    assert refused.value.kind == "a character device"


def test_a_socket_and_a_directory_are_named(tmp_path: Path) -> None:
    path = tmp_path / "s"
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(str(path))
        with pytest.raises(NotRegularFile) as refused:
            read_regular(path, 10)
    assert refused.value.kind == "a socket"
    with pytest.raises(NotRegularFile) as refused:
        read_regular(tmp_path, 10)
    assert refused.value.kind == "a directory"


def test_a_missing_file_is_file_not_found(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        read_regular(tmp_path / "absent", 10)


def test_a_proc_file_is_read_whole_though_it_reports_size_zero() -> None:
    # procfs reports st_size 0 for files with content: the length is what read() gives.
    path = Path("/proc/self/status")
    assert path.stat().st_size == 0
    data = read_regular(path, 1 << 20, follow_links=False)
    assert data.startswith(b"Name:") and b"\nPid:" in data


def test_a_proc_file_over_the_limit_reads_one_byte_over() -> None:
    data = read_regular("/proc/self/status", 10)
    assert len(data) == 11
