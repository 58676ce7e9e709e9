"""Clients that call Allocate on a plugin socket without pause, as a busy kubelet would.

Shared by the shutdown and handover tests: each call is recorded with its status and with
whether it started before the test signalled the plugin, so a test can say precisely
which calls had to succeed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from kubegpu.api import pb, pb_grpc


@dataclass(frozen=True)
class Outcome:
    """One Allocate call: the socket it went to, its status and when it started."""

    socket: str
    code: grpc.StatusCode
    details: str
    #: Whether the call started before `Hammer.signalled` was set.
    before_signal: bool


class Hammer:
    """`clients` loops, each on its own connection, calling Allocate for one device.

    `target()` names the socket each new call goes to, so a test can follow a handover the
    way the kubelet does (new calls to the newest endpoint). Once `signalled` is set no
    loop starts another call: a call either started before the signal or not at all.
    """

    def __init__(
        self, target: Callable[[], Path], device_ids: Sequence[str], clients: int = 8
    ) -> None:
        self.target = target
        self.device_ids = list(device_ids)
        self.signalled = False
        #: Stops the loops without marking any call (the end of a test's observation).
        self.done = False
        self.outcomes: list[Outcome] = []
        self._channels: dict[tuple[int, Path], grpc.aio.Channel] = {}
        self._tasks = [asyncio.ensure_future(self._loop(n)) for n in range(clients)]

    @property
    def ok(self) -> int:
        return sum(o.code is grpc.StatusCode.OK for o in self.outcomes)

    def failures(self, *, before_signal: bool = True) -> list[Outcome]:
        """The calls that did not succeed (by default those started before the signal)."""
        return [
            o
            for o in self.outcomes
            if o.code is not grpc.StatusCode.OK and o.before_signal == before_signal
        ]

    async def _loop(self, n: int) -> None:
        i = n
        while not (self.signalled or self.done):
            path = self.target()
            channel = self._channels.get((n, path))
            if channel is None:
                channel = self._channels[(n, path)] = grpc.aio.insecure_channel(f"unix://{path}")
            stub = pb_grpc.DevicePluginStub(channel)  # type: ignore[no-untyped-call]
            device = self.device_ids[i % len(self.device_ids)]
            i += 1
            request = pb.AllocateRequest(
                container_requests=[pb.ContainerAllocateRequest(devices_ids=[device])]
            )
            before = not self.signalled
            try:
                await stub.Allocate(request)
            except grpc.aio.AioRpcError as exc:
                self.outcomes.append(Outcome(path.name, exc.code(), exc.details() or "", before))
            else:
                self.outcomes.append(Outcome(path.name, grpc.StatusCode.OK, "", before))

    async def join(self) -> None:
        """Wait for every loop to end (after `signalled` or `done`), then close channels."""
        await asyncio.gather(*self._tasks)
        for channel in self._channels.values():
            await channel.close(None)
