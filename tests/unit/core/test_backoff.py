"""`Backoff` heeds a server that says when to come back (Retry-After), up to its cap."""

from __future__ import annotations

import asyncio

from kubegpu.watch import Backoff


def test_a_longer_retry_after_lengthens_one_delay_up_to_the_cap() -> None:
    backoff = Backoff(1.0, 30.0)
    assert backoff.advance(at_least=7.0) == 7.0
    assert backoff.advance(at_least=3600.0) == 30.0  # a wrong or hostile header: capped
    # A shorter one changes nothing; the progression went on as without the headers.
    assert backoff.advance(at_least=0.5) == 4.0
    assert [backoff.advance() for _ in range(4)] == [8.0, 16.0, 30.0, 30.0]


def test_a_thread_blocks_for_the_retry_after() -> None:
    waited: list[float | None] = []

    class Stop:
        def wait(self, timeout: float | None = None) -> bool:
            waited.append(timeout)
            return False

    backoff = Backoff(1.0, 30.0)
    assert backoff.block(Stop(), at_least=12.0) is False
    assert backoff.block(Stop()) is False
    assert waited == [12.0, 2.0]


async def test_the_loop_sleeps_for_the_retry_after() -> None:
    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)

    backoff = Backoff(1.0, 30.0, sleep=sleep)
    assert await backoff.wait(asyncio.Event(), at_least=9.0) is False
    assert await backoff.wait(at_least=60.0) is False
    assert slept == [9.0, 30.0]
