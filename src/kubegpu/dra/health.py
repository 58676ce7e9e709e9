"""The DRA device health stream the kubelet reads (`v1alpha1.DRAResourceHealth`).

The kubelet (1.36: ResourceHealthStatus, beta and on by default) opens
`NodeWatchResources` on the driver's dra.sock once the driver is registered, and again
5 s after the stream ends; each response must list every device of the driver. What it
learns reaches the pods: a container holding a claim shows each of the claim's devices in
`status.containerStatuses[].allocatedResourcesStatus`, Healthy, Unhealthy or Unknown.

`HealthServicer` reports the node-state store's health, so the Xid policy is the device
plugin's (the same `HealthTracker` fills the store), for the devices the slices publish
(pool = node name, device names of `kubegpu.dra.slices`):

- HEALTHY / UNHEALTHY as the store has each device (a MIG device takes its GPU's fault),
  with the store's reason for it (`NodeState.faults`) as the message ("Xid 79 (GPU has
  fallen off the bus)");
- UNKNOWN for every device while health checks are off (`flags.health.disabled`): the
  driver cannot tell, and says so rather than claim a health nobody checked;
- a response at once, then on every change of what it shows, and again every
  `interval_s` even without one: the kubelet turns a device it has not heard about for
  `health_check_timeout_seconds` into Unknown.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Final

import grpc

from kubegpu.api import add_dra_health_servicer
from kubegpu.api import dra_health_pb2 as pb
from kubegpu.api import dra_health_pb2_grpc as pb_grpc
from kubegpu.devices import Health
from kubegpu.dra.slices import dra_devices
from kubegpu.state import NodeState, NodeStore

log = logging.getLogger("kubegpu.dra")

#: Seconds between responses when nothing changes.
REPORT_INTERVAL_S: Final = 20.0
#: What each device's report tells the kubelet to wait before showing it as Unknown: a
#: few missed responses, not one late one.
HEALTH_TIMEOUT_S: Final = 3 * REPORT_INTERVAL_S
#: The longest message the kubelet keeps (`ResourceHealthMessageMaxLength`).
MESSAGE_MAX: Final = 1024

#: One device's line of a report: (device name, health, message).
Line = tuple[str, "pb.HealthStatus", str]


class HealthServicer(pb_grpc.DRAResourceHealthServicer):
    """Streams the health of `driver`'s devices in pool `pool` from `store`."""

    def __init__(
        self,
        store: NodeStore,
        *,
        driver: str,
        pool: str,
        interval_s: float = REPORT_INTERVAL_S,
        timeout_s: float = HEALTH_TIMEOUT_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.driver = driver
        self.pool = pool
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.clock = clock
        #: Streams open now (for tests and `kubegpu status`).
        self.streams = 0
        #: Set and replaced on every change that may alter a report (`follow`, `close`).
        self._wake = asyncio.Event()
        #: Bumped by `close`: a stream opened before it ends.
        self._generation = 0
        self._closed = False

    async def follow(self) -> None:
        """Wake the streams on every change of the store; runs until cancelled (run it
        next to the server: without it a stream reports only every `interval_s`)."""
        async for _ in self.store.subscribe():
            self._changed()

    def close(self) -> None:
        """End the open streams, and any opened from now on until `open`, as their server
        is about to stop: a stream never ends by itself, and grpc's stop waits on it."""
        self._closed = True
        self._generation += 1
        self._changed()

    def open(self) -> None:
        """Serve streams again after `close`."""
        self._closed = False

    def _changed(self) -> None:
        wake, self._wake = self._wake, asyncio.Event()
        wake.set()

    def report(self, state: NodeState) -> list[Line]:
        """Every device of the driver with its health and message, in slice order."""
        if state.config.flags.health.disabled:
            return [
                (d.name, pb.UNKNOWN, "health checks are disabled")
                for d in dra_devices(self.driver, state.planned)
            ]
        lines: list[Line] = []
        for device in dra_devices(self.driver, state.planned):
            unit = device.unit
            if unit.health is Health.UNHEALTHY:
                fault = state.faults.get(unit.uuid) or state.faults.get(unit.gpu.uuid)
                why = (fault.reason if fault is not None else "") or "unhealthy"
                lines.append((device.name, pb.UNHEALTHY, _fit(why)))
            else:
                lines.append((device.name, pb.HEALTHY, ""))
        return lines

    def response(self, lines: list[Line]) -> pb.NodeWatchResourcesResponse:
        now = int(self.clock())
        return pb.NodeWatchResourcesResponse(
            devices=[
                pb.DeviceHealth(
                    device=pb.DeviceIdentifier(pool_name=self.pool, device_name=name),
                    health=health,
                    last_updated_time=now,
                    health_check_timeout_seconds=max(1, round(self.timeout_s)),
                    message=message,
                )
                for name, health, message in lines
            ]
        )

    async def NodeWatchResources(
        self,
        request: pb.NodeWatchResourcesRequest,
        context: grpc.aio.ServicerContext[
            pb.NodeWatchResourcesRequest, pb.NodeWatchResourcesResponse
        ],
    ) -> AsyncIterator[pb.NodeWatchResourcesResponse]:
        self.streams += 1
        generation = self._generation
        log.info("the kubelet watches the health of %s's devices", self.driver)
        loop = asyncio.get_running_loop()
        try:
            sent: list[Line] | None = None
            due = 0.0
            while generation == self._generation and not self._closed:
                wake = self._wake
                lines = self.report(self.store.state)
                if lines != sent or loop.time() >= due:
                    yield self.response(lines)
                    sent, due = lines, loop.time() + self.interval_s
                # asyncio.timeout, not wait_for, which on Python 3.11 can lose a
                # cancellation that arrives as `wake` is set (the stream never ends).
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(max(0.0, due - loop.time())):
                        await wake.wait()
        finally:
            self.streams -= 1


def add_health_servicer(servicer: HealthServicer, server: grpc.aio.Server) -> None:
    """Serve `servicer` on `server` (the driver's, next to the DRAPlugin service)."""
    add_dra_health_servicer(servicer, server)


def _fit(message: str) -> str:
    """At most `MESSAGE_MAX` characters, as the kubelet would cut it."""
    return message if len(message) <= MESSAGE_MAX else message[: MESSAGE_MAX - 3] + "..."


__all__ = [
    "HEALTH_TIMEOUT_S",
    "REPORT_INTERVAL_S",
    "HealthServicer",
    "add_health_servicer",
]
