"""How long a test waits for something that should happen, and waiting on conditions.

Every wait in the suite is on a condition (an event, a queue item, a process exit, a state
the kubelet emulator reports) and returns as soon as it holds; `WAIT` only bounds it, so a
test that will never see its condition fails with a message instead of hanging until the
suite's hang guard (pytest `timeout` in pyproject.toml). It is generous on purpose: on a
loaded 2-core machine under coverage a process start alone takes seconds, and how fast
kubegpu is gets measured by `make bench`, never by a test's deadline.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from kubegpu.kubelet import KubeletEmulator

#: Seconds a test waits for a condition before it fails.
WAIT = 60.0


async def eventually(predicate: Callable[[], bool], timeout: float = WAIT) -> None:
    """Re-check `predicate` every 10 ms until it holds; TimeoutError after `timeout`.

    For conditions that no emulator change signals (files, daemon state, metrics).
    """
    async with asyncio.timeout(timeout):
        # Nothing signals these conditions, so re-check them (ASYNC110 wants an Event).
        while not predicate():  # noqa: ASYNC110
            await asyncio.sleep(0.01)


class Kubelet(KubeletEmulator):
    """The kubelet emulator, waiting up to `WAIT` unless a test names its own deadline.

    The library's own default (5 s) suits an idle machine; the suite runs on loaded ones.
    """

    async def wait_for(
        self,
        predicate: Callable[[], bool],
        timeout: float = WAIT,
        *,
        describe: Callable[[], str] | None = None,
    ) -> None:
        await super().wait_for(predicate, timeout, describe=describe)

    async def wait_for_resource(
        self,
        resource: str,
        capacity: int | None = None,
        allocatable: int | None = None,
        timeout: float = WAIT,
    ) -> None:
        await super().wait_for_resource(resource, capacity, allocatable, timeout)
