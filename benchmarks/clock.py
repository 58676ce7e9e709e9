"""An asyncio loop's clock moved forward without waiting: an hour of a daemon's timers in
seconds of wall time.

`LoopClock` replaces the running loop's `time()` with the real clock plus an offset that
`advance` raises. Every timer of that loop (`asyncio.sleep`, `asyncio.timeout`,
`loop.call_later`) reads that clock, so a periodic task due in 600 s runs as soon as the
offset has moved 600 s on, exactly as it would have after ten real minutes. Threads,
`time.monotonic()` and gRPC deadlines keep real time: move the clock while the code under
it is idle (nothing in flight that a timeout guards), which is what a steady state is.

Work a timer hands to a thread (`asyncio.to_thread`: a slice resync, a Node read) runs in
real time, however far the clock moves meanwhile. So the loop's default executor is one
that counts what it runs, and each step waits until that is done: a periodic task waits
its period after work that took 10 ms or 1 s alike, and an hour holds as many of its turns
on a loaded machine as on a quiet one.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

#: How long one step waits for the work in threads before it gives up (the benchmarks'
#: bound on every wait).
IDLE_DEADLINE_S = 300.0


class _CountingExecutor(ThreadPoolExecutor):
    """A thread pool that knows how many of its calls have not finished."""

    def __init__(self) -> None:
        super().__init__(thread_name_prefix="loopclock")
        self._lock = threading.Lock()
        self._running = 0

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        with self._lock:
            self._running += 1
        future = super().submit(fn, *args, **kwargs)
        future.add_done_callback(self._done)
        return future

    def _done(self, _: Future[Any]) -> None:
        with self._lock:
            self._running -= 1

    @property
    def busy(self) -> bool:
        with self._lock:
            return self._running > 0


class LoopClock:
    """The running loop's clock, movable; a context manager that restores it on exit."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.loop = loop or asyncio.get_running_loop()
        #: Seconds the loop's clock is ahead of the real one.
        self.offset = 0.0
        self._real: Callable[[], float] = time.monotonic
        self._threads = _CountingExecutor()

    def __enter__(self) -> LoopClock:
        # BaseEventLoop.time() is time.monotonic(); every timer goes through it.
        self._real = self.loop.time
        self.loop.time = lambda: self._real() + self.offset  # type: ignore[method-assign]
        self.loop.set_default_executor(self._threads)
        return self

    def __exit__(self, *exc: object) -> None:
        del self.loop.time  # the class's method again
        # The executor stays the loop's default (asyncio has no way back to "none yet");
        # it counts, and otherwise is the pool asyncio would have made.

    async def advance(self, seconds: float, *, step: float = 10.0, settle: float = 0.02) -> None:
        """Move the clock `seconds` on, `step` at a time, letting the loop run `settle`
        real seconds after each step: what a timer started (a sync in a worker thread, the
        next wait) runs and arms its next timer before the clock moves again."""
        left = seconds
        while left > 0:
            moved = min(step, left)
            self.offset += moved
            left -= moved
            await self._settled(settle)

    async def _settled(self, settle: float) -> None:
        """Let the loop run `settle` real seconds, and again until no call handed to the
        loop's threads is running: a coroutine that waited on one resumes, and arms its
        next timer, before the clock moves."""
        deadline = time.monotonic() + IDLE_DEADLINE_S
        while True:
            await asyncio.sleep(settle)  # real time: the offset does not move meanwhile
            # Threads signal nothing the loop can await here: poll what they count.
            if not self._threads.busy:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"work in threads still running after {IDLE_DEADLINE_S:g} s")
