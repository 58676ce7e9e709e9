"""Generic fixtures for integration tests over real unix sockets."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from kubegpu.kubelet import KubeletEmulator
from tests.waiting import Kubelet


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


@pytest.fixture
async def kubelet(socket_dir: Path) -> AsyncIterator[KubeletEmulator]:
    """A kubelet emulator on `socket_dir/dp` (a short grace period, for `serve` tests)."""
    emulator = Kubelet(socket_dir / "dp", grace_period=0.5)
    await emulator.start()
    try:
        yield emulator
    finally:
        await emulator.stop()
