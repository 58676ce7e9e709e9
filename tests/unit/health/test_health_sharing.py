"""Every device a failed GPU backs (time-sliced replicas, MPS replicas, MIG slices under the
mixed strategy) goes unhealthy together and comes back together, in one store update, while
the other GPU keeps serving. NvmlBackend on the project's fake pynvml, the HealthMonitor and
the node store whose specs the plugins advertise.

Elsewhere: tests/unit/core/test_resources.py (replicas and slices of an unhealthy GPU, built from a
health map), tests/integration/test_sharing.py (time-sliced replicas through the kubelet
emulator), tests/fakenvml/test_nvml_on_fakenvml.py (a GPU-wide Xid marks every slice).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import pytest

from kubegpu.config import parse_config
from kubegpu.devices.model import Health, HealthEvent
from kubegpu.health import HealthMonitor
from kubegpu.state import NodeState, NodeStore
from kubegpu.supervisor import spawn
from kubegpu.testing import FakeGpu, FakeNvml
from tests.unit.devices.nvml.conftest import open_backend
from tests.unit.health.conftest import FAST
from tests.waiting import WAIT

TIME_SLICED = """
version: v1
sharing:
  timeSlicing:
    resources:
    - {name: nvidia.com/gpu, replicas: 4}
"""
MPS = """
version: v1
flags: {mpsRoot: /run/mps}
sharing:
  mps:
    resources:
    - {name: nvidia.com/gpu, replicas: 4}
"""
MIG_MIXED = "version: v1\nflags: {migStrategy: mixed}\n"


def health_by_gpu(state: NodeState) -> dict[str, set[Health]]:
    """Physical GPU UUID -> the healths of every device advertised on it."""
    result: dict[str, set[Health]] = {}
    for spec in state.specs:
        for device in spec.devices:
            result.setdefault(device.unit.gpu.uuid, set()).add(device.health)
    return result


def devices_of(state: NodeState, gpu: str) -> list[str]:
    return [d.id for s in state.specs for d in s.devices if d.unit.gpu.uuid == gpu]


class Node:
    """Two H100s on the fake NVML, the store with `config`, every state the store passes."""

    def __init__(self, config: str, *, migs: int = 0) -> None:
        self.fake = FakeNvml()
        self.sick: FakeGpu = self.fake.add_gpu()
        for _ in range(migs):
            self.sick.add_mig("3g.40gb")
        self.fake.add_gpu()
        self.backend = open_backend(self.fake)
        self.store = NodeStore()
        self.store.update(inventory=self.backend.discover(), config=parse_config(config))
        if "mps:" in config:
            self.store.update(mps_ready={"nvidia.com/gpu": True})
        self.states: list[NodeState] = [self.store.state]
        self.monitor = HealthMonitor(self.backend, FAST, self.store)
        self._changed = asyncio.Event()
        handle = self.monitor.handle

        def wrapped(event: HealthEvent) -> None:
            handle(event)
            self._changed.set()

        self.monitor.handle = wrapped  # type: ignore[method-assign]

    async def record(self) -> None:
        async for _, after in self.store.changes():
            self.states.append(after)
            self._changed.set()

    async def until(self, predicate: Callable[[], bool]) -> None:
        async def wait() -> None:
            while not predicate():
                self._changed.clear()
                await self._changed.wait()

        await asyncio.wait_for(wait(), WAIT)

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        recorder = spawn("recorder", self.record())
        task = spawn("health monitor", self.monitor.run())
        try:
            assert await asyncio.to_thread(self.fake.wait_registered, 2)
            yield
        finally:
            for t in (task, recorder):
                t.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await t

    def healths(self) -> dict[str, set[Health]]:
        return health_by_gpu(self.store.state)

    async def reset_sick_gpu(self, faulty: str | None = None) -> None:
        """The GPU drops out of NVML for a moment and answers again: what a reset looks like.

        `faulty`: the device whose probes must see it (the GPU, or one of its slices).
        """
        uuid = faulty or self.sick.uuid
        self.sick.lost = True
        await self.until(lambda: not self.monitor.tracker.awaiting_reset(uuid))
        self.sick.lost = False


@pytest.mark.parametrize(
    ("config", "migs", "expected"),
    [(TIME_SLICED, 0, 4), (MPS, 0, 4), (MIG_MIXED, 2, 2)],
    ids=["time-sliced replicas", "MPS replicas", "MIG slices (mixed)"],
)
async def test_a_failed_gpu_takes_down_and_brings_back_everything_it_backs(
    config: str, migs: int, expected: int
) -> None:
    node = Node(config, migs=migs)
    sick, well = (g.uuid for g in node.fake.gpus)
    assert len(devices_of(node.store.state, sick)) == expected
    async with node.running():
        node.fake.emit_xid(0, 79)  # RESTART_BM: unhealthy until the GPU is reset
        await node.until(lambda: node.healths()[sick] == {Health.UNHEALTHY})
        assert node.healths()[well] == {Health.HEALTHY}
        await node.reset_sick_gpu()
        await node.until(lambda: node.healths()[sick] == {Health.HEALTHY})
    # Never a state with some of the GPU's devices healthy and others not.
    assert all(len(health_by_gpu(s)[sick]) == 1 for s in node.states)
    assert all(health_by_gpu(s)[well] == {Health.HEALTHY} for s in node.states)
    assert {Health.UNHEALTHY} in [health_by_gpu(s)[sick] for s in node.states]


async def test_an_xid_on_one_mig_slice_takes_down_that_slice_only() -> None:
    node = Node(MIG_MIXED, migs=2)
    one, other = node.sick.migs
    async with node.running():
        node.fake.emit_xid(0, 95, mig=one)  # uncontained: that slice needs a reset

        def slice_health(state: NodeState) -> dict[str, Health]:
            return {d.id: d.health for s in state.specs for d in s.devices}

        await node.until(lambda: slice_health(node.store.state)[one.uuid] is Health.UNHEALTHY)
        healths = slice_health(node.store.state)
        assert healths[other.uuid] is Health.HEALTHY
        assert healths[node.fake.gpus[1].uuid] is Health.HEALTHY
        await node.reset_sick_gpu(one.uuid)
        await node.until(lambda: node.store.state.health == {})
