"""One retry pacing for every loop that waits for something outside to come back.

Exponential and capped, without jitter (a node runs one plugin per resource, so there is
no herd to spread, and tests can assert the exact delays), resettable after a success,
with the sleep and the clock injectable so tests run on a fake clock instead of waiting.
A server that says when to come back (HTTP `Retry-After`) is heeded: `at_least`
lengthens one delay up to the cap, never past it, so a wrong or hostile header cannot
park a loop for hours.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

from kubegpu.supervisor import until_stopped


class StopWait(Protocol):
    """What a thread's retry loop blocks on: `threading.Event.wait`, True once stopped."""

    def wait(self, timeout: float | None = None) -> bool: ...


class Backoff:
    """Delays `start`, `start*factor`, ... up to `cap`; `reset()` starts over.

    Async loops call `await backoff.wait()`; threads call `backoff.block(stop)`.
    """

    def __init__(
        self,
        start: float,
        cap: float,
        *,
        factor: float = 2.0,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0 < start <= cap or factor < 1:
            raise ValueError(
                f"backoff: need 0 < start <= cap and factor >= 1 "
                f"(got start={start}, cap={cap}, factor={factor})"
            )
        self.start = start
        self.cap = cap
        self.factor = factor
        self._sleep = sleep
        self._clock = clock
        self._next = start
        self._since = clock()

    @property
    def delay(self) -> float:
        """The delay the next `wait()` or `advance()` uses."""
        return self._next

    def advance(self, at_least: float | None = None) -> float:
        """The delay to wait now; the one after it grows by `factor`, up to `cap`.

        `at_least` (a server's Retry-After, in seconds) lengthens this delay, up to `cap`;
        the delays after it grow as they would have.
        """
        delay = self._next
        self._next = min(delay * self.factor, self.cap)
        if at_least is not None and at_least > delay:
            delay = min(at_least, self.cap)
        return delay

    def reset(self) -> None:
        """Start over at `start` (the thing came back)."""
        self._next = self.start
        self._since = self._clock()

    def reset_if_stable(self, stable_for: float) -> bool:
        """Reset when the last `reset()` is at least `stable_for` seconds ago.

        For supervisors of a process: one that ran long before dying starts over fast,
        one that keeps crashing keeps its long delays.
        """
        if self._clock() - self._since < stable_for:
            return False
        self._next = self.start
        return True

    def mark(self) -> None:
        """Note now as the start of a run, for `reset_if_stable`."""
        self._since = self._clock()

    def block(self, stop: StopWait, at_least: float | None = None) -> bool:
        """Threads: block the next delay on `stop`, so setting it ends the wait; True if set.

        The wait goes through `stop.wait` rather than an injected sleep: a thread must
        wake the moment it is told to stop, and tests pass a flag that records the delays.
        """
        return stop.wait(self.advance(at_least))

    async def wait(self, wake: asyncio.Event | None = None, at_least: float | None = None) -> bool:
        """Sleep the next delay, or less if `wake` is set first; True when woken.

        `wake` is how a watch cuts a retry short: a new kubelet.sock needs no 2 s wait.
        """
        delay = self.advance(at_least)
        if wake is None:
            await self._sleep(delay)
            return False
        if wake.is_set():
            return True
        # The supervisor's race of work against a stop event: the sleep ends it, or `wake`.
        await until_stopped("backoff", _awaited(self._sleep(delay)), wake)
        return wake.is_set()


async def _awaited(sleep: Awaitable[object]) -> None:
    """A coroutine of any awaitable, as the supervisor runs coroutines."""
    await sleep
