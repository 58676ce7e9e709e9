"""Generic fixtures for integration tests over real unix sockets."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    """A short, private directory under /tmp for unix sockets.

    pytest's tmp_path can exceed the ~107-byte limit of a unix socket path.
    """
    path = Path(tempfile.mkdtemp(prefix="kg-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
