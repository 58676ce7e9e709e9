"""Waiting on conditions that no emulator change signals (files, daemon state, metrics)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


async def eventually(predicate: Callable[[], bool], timeout: float = 10) -> None:
    """Re-check `predicate` every 10 ms until it holds; TimeoutError after `timeout`."""
    async with asyncio.timeout(timeout):
        # Nothing signals these conditions, so re-check them (ASYNC110 wants an Event).
        while not predicate():  # noqa: ASYNC110
            await asyncio.sleep(0.01)
