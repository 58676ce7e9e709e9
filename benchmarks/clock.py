"""An asyncio loop's clock moved forward without waiting: an hour of a daemon's timers in
seconds of wall time.

`LoopClock` replaces the running loop's `time()` with the real clock plus an offset that
`advance` raises. Every timer of that loop (`asyncio.sleep`, `asyncio.timeout`,
`loop.call_later`) reads that clock, so a periodic task due in 600 s runs as soon as the
offset has moved 600 s on, exactly as it would have after ten real minutes. Threads,
`time.monotonic()` and gRPC deadlines keep real time: move the clock while the code under
it is idle (nothing in flight that a timeout guards), which is what a steady state is.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


class LoopClock:
    """The running loop's clock, movable; a context manager that restores it on exit."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.loop = loop or asyncio.get_running_loop()
        #: Seconds the loop's clock is ahead of the real one.
        self.offset = 0.0
        self._real: Callable[[], float] = time.monotonic

    def __enter__(self) -> LoopClock:
        # BaseEventLoop.time() is time.monotonic(); every timer goes through it.
        self._real = self.loop.time
        self.loop.time = lambda: self._real() + self.offset  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        del self.loop.time  # the class's method again

    async def advance(self, seconds: float, *, step: float = 10.0, settle: float = 0.02) -> None:
        """Move the clock `seconds` on, `step` at a time, letting the loop run `settle`
        real seconds after each step: what a timer started (a sync in a worker thread, the
        next wait) runs and arms its next timer before the clock moves again."""
        left = seconds
        while left > 0:
            moved = min(step, left)
            self.offset += moved
            left -= moved
            await asyncio.sleep(settle)  # real time: the offset does not move meanwhile
