"""Device health (`kubegpu.health`): the Xid policy, the monitor on a simulated node and on the
fake pynvml, and every device a failed GPU backs going unhealthy together.

Shared here: Xid events for one GPU (`xid`) and a clock the policy tests move by hand
(`Clock`); the monitor's fast settings (`FAST`) and a monitor run as a task for the length of
a block (`running`). The fake pynvml backend is NvmlBackend's room's
(tests.unit.devices.nvml.conftest.open_backend).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from kubegpu.config.v1 import HealthFlags
from kubegpu.devices.model import HealthEvent, HealthEventKind
from kubegpu.health import HealthMonitor
from kubegpu.supervisor import spawn

GPU = "GPU-0"
#: Short enough that a test sees recovery quickly; a test never asserts on these durations.
FAST = HealthFlags(recovery_seconds=0.2, probe_interval_seconds=0.02)


class Clock:
    """The policy's clock, moved by hand (`clock.now += 60`)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def xid(n: int | None, uuid: str = GPU) -> HealthEvent:
    return HealthEvent(uuid, HealthEventKind.XID, xid=n)


@contextlib.asynccontextmanager
async def running(monitor: HealthMonitor) -> AsyncIterator[asyncio.Task[None]]:
    """The monitor's `run` as a task for the block, cancelled and awaited at its end."""
    task = spawn("health monitor", monitor.run())
    try:
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
