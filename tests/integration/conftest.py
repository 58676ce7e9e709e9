"""Generic fixtures for integration tests over real unix sockets."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kubegpu.kubelet import KubeletEmulator
from tests.waiting import Kubelet


@pytest.fixture
async def kubelet(socket_dir: Path) -> AsyncIterator[KubeletEmulator]:
    """A kubelet emulator on `socket_dir/dp` (a short grace period, for `serve` tests)."""
    emulator = Kubelet(socket_dir / "dp", grace_period=0.5)
    await emulator.start()
    try:
        yield emulator
    finally:
        await emulator.stop()
