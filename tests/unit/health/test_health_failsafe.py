"""Failing safe when NVML breaks, end to end: NvmlBackend on the project's fake pynvml
(`kubegpu.testing.FakeNvml`), the HealthMonitor and the node store the plugins serve from.

The faults here are ones the shared simulated libnvidia-ml cannot express (a driver unloaded
and reloaded under the process, a GPU lost without an Xid, NVML calls that hang, a reset NVML
reports pending); the Xid policy on the real pynvml is in tests/fakenvml/test_health_policy.py.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import pynvml
import pytest

from kubegpu.config import parse_config
from kubegpu.config.v1 import HealthFlags
from kubegpu.devices.model import Health, HealthEvent
from kubegpu.devices.nvml import NvmlBackend
from kubegpu.devices.simulated import SimulatedBackend
from kubegpu.health import HealthMonitor
from kubegpu.state import NodeState, NodeStore
from kubegpu.testing import FakeNvml
from tests.unit.devices.nvml.conftest import open_backend
from tests.unit.health.conftest import FAST, running
from tests.waiting import WAIT


async def until(store: NodeStore, predicate: Callable[[NodeState], bool]) -> None:
    """Wait for a store state that satisfies `predicate` (the current one included)."""
    changes = store.changes()

    async def wait() -> None:
        while not predicate(store.state):
            await anext(changes)

    await asyncio.wait_for(wait(), WAIT)


class Handled:
    """Wakes a waiting test after every event the monitor handles (probes included)."""

    def __init__(self, monitor: HealthMonitor) -> None:
        self._changed = asyncio.Event()
        handle = monitor.handle

        def wrapped(event: HealthEvent) -> None:
            handle(event)
            self._changed.set()

        monitor.handle = wrapped  # type: ignore[method-assign]

    async def until(self, predicate: Callable[[], bool]) -> None:
        async def wait() -> None:
            while not predicate():
                self._changed.clear()
                await self._changed.wait()

        await asyncio.wait_for(wait(), WAIT)


def node(fake: FakeNvml, **backend: object) -> tuple[NvmlBackend, NodeStore]:
    nvml_backend = open_backend(fake, **backend)
    store = NodeStore()
    store.update(inventory=nvml_backend.discover())
    return nvml_backend, store


def advertised_healthy(state: NodeState) -> set[str]:
    """Device IDs the plugins would advertise as Healthy right now."""
    return {d.id for spec in state.specs for d in spec.devices if d.health is Health.HEALTHY}


def two_gpus() -> FakeNvml:
    fake = FakeNvml()
    fake.add_gpu()
    fake.add_gpu()
    return fake


async def registered(fake: FakeNvml, count: int) -> None:
    assert await asyncio.to_thread(fake.wait_registered, count), fake.registered()


# -- the driver goes away under the plugin and comes back --------------------------------------


async def test_driver_unloaded_fences_every_gpu_and_recovery_follows_the_reload() -> None:
    fake = two_gpus()
    backend, store = node(fake, layout_check_seconds=0.05)
    uuids = {g.uuid for g in fake.gpus}
    monitor = HealthMonitor(backend, FAST, store)
    async with running(monitor) as task:
        await registered(fake, 2)
        fake.unload_driver()
        await until(store, lambda s: set(s.health) == uuids)
        assert advertised_healthy(store.state) == set(), "no pod can be admitted onto them"
        fake.load_driver()
        await until(store, lambda s: s.health == {})
        assert advertised_healthy(store.state) == uuids
        assert not task.done(), "the monitor never crashed"
    assert fake.inits >= 2, "NVML was initialised again after the reload"


async def test_a_watch_that_cannot_start_fences_the_discovered_gpus() -> None:
    """NVIDIA's PR #1641: when the health watch fails to start, report every device
    unhealthy rather than leave a node that advertises GPUs it cannot watch."""
    fake = two_gpus()
    fake.fail("nvmlEventSetCreate", pynvml.NVML_ERROR_UNKNOWN)
    backend, store = node(fake)
    monitor = HealthMonitor(backend, FAST, store)
    async with running(monitor):
        await until(store, lambda s: set(s.health) == {g.uuid for g in fake.gpus})
        fake.unfail("nvmlEventSetCreate")
        await until(store, lambda s: s.health == {})
    assert set(fake.registered()) == set(), "the set it finally made was freed on exit"


# -- one GPU goes away; the others keep serving ---------------------------------------------------


async def test_a_gpu_lost_without_an_xid_is_fenced_and_the_rest_keep_serving() -> None:
    fake = two_gpus()
    backend, store = node(fake, layout_check_seconds=0.05)
    good, bad = (g.uuid for g in fake.gpus)
    monitor = HealthMonitor(backend, FAST, store)
    async with running(monitor):
        await registered(fake, 2)
        fake.gpus[1].lost = True  # off the bus: every call on it says GPU_IS_LOST
        await until(store, lambda s: bad in s.health)
        assert advertised_healthy(store.state) == {good}
        assert "no longer answers NVML" in (monitor.tracker.reason(bad) or "")
        fake.gpus[1].lost = False
        await until(store, lambda s: advertised_healthy(s) == {good, bad})


async def test_a_hung_nvml_call_fails_its_probe_without_stalling_the_others() -> None:
    fake = two_gpus()
    # No layout checks: they would block the watch thread on the hung GPU, as on a node.
    backend, store = node(fake, layout_check_seconds=3600)
    good, bad = (g.uuid for g in fake.gpus)
    in_flight: list[int] = []
    probe = backend.probe

    def counting_probe(uuid: str) -> str | None:
        in_flight.append(uuid == bad)
        try:
            return probe(uuid)
        finally:
            in_flight.remove(uuid == bad)

    backend.probe = counting_probe  # type: ignore[method-assign]
    monitor = HealthMonitor(backend, FAST, store, probe_timeout=0.05)
    hang = threading.Event()
    try:
        async with running(monitor) as task:
            await registered(fake, 2)
            fake.emit_xid(0, 999)  # not in the catalog: unhealthy until probes pass
            fake.emit_xid(1, 999)
            await until(store, lambda s: set(s.health) == {good, bad})
            fake.gpus[1].hang = hang
            await until(store, lambda s: set(s.health) == {bad})
            reason = monitor.tracker.reason(bad) or ""
            assert "NVML did not answer" in reason or "has not answered" in reason
            assert in_flight.count(True) <= 1, "one stuck probe, not one per round"
            hang.set()
            fake.gpus[1].hang = None
            await until(store, lambda s: s.health == {})
            assert not task.done()
    finally:
        hang.set()


async def test_a_probe_that_raises_counts_as_failed_and_never_ends_the_monitor() -> None:
    class Broken(SimulatedBackend):
        def probe(self, uuid: str) -> str | None:
            raise RuntimeError("bug in a backend")

    backend = Broken.load("t4-1")
    store = NodeStore()
    store.update(inventory=backend.discover())
    monitor = HealthMonitor(backend, FAST, store)
    handled = Handled(monitor)
    async with running(monitor) as task:
        backend.inject_xid(0, 999)
        uuid = backend.discover().gpus[0].uuid
        await until(store, lambda s: uuid in s.health)
        await handled.until(
            lambda: "probe error: bug in a backend" in (monitor.tracker.reason(uuid) or "")
        )
        assert not task.done()


# -- a reset NVML reports pending ------------------------------------------------------------------


async def test_pending_row_remapping_keeps_an_ecc_fault_until_the_reset() -> None:
    fake = two_gpus()
    backend, store = node(fake)
    uuid = fake.gpus[0].uuid
    fake.gpus[0].rows_pending = True
    monitor = HealthMonitor(backend, FAST, store)
    handled = Handled(monitor)
    async with running(monitor):
        await registered(fake, 2)
        fake.emit_xid(0, 48)
        await until(store, lambda s: uuid in s.health)
        await handled.until(lambda: not monitor.tracker.awaiting_reset(uuid))
        # The failing probe ended the wait for a reset; the fault keeps its cause.
        assert backend.probe(uuid) == f"{uuid}: row remapping is waiting for a GPU reset"
        assert monitor.tracker.reason(uuid) == "Xid 48 (double-bit ECC error)"
        assert uuid in store.state.health
        fake.gpus[0].rows_pending = False  # the GPU was reset
        await until(store, lambda s: s.health == {})


async def test_a_reset_requiring_xid_outlasts_passing_probes_until_the_gpu_drops_out() -> None:
    fake = two_gpus()
    backend, store = node(fake)
    uuid = fake.gpus[0].uuid
    probes: list[str] = []
    probe = backend.probe

    def counting_probe(uuid: str) -> str | None:
        probes.append(uuid)
        return probe(uuid)

    backend.probe = counting_probe  # type: ignore[method-assign]
    monitor = HealthMonitor(backend, FAST, store)
    handled = Handled(monitor)
    async with running(monitor):
        await registered(fake, 2)
        fake.emit_xid(0, 79)
        await until(store, lambda s: uuid in s.health)
        # Passing probes over several recovery periods (0.2 s each at 20 ms a round).
        await handled.until(lambda: probes.count(uuid) >= 40)
        assert uuid in store.state.health and monitor.tracker.awaiting_reset(uuid)
        fake.gpus[0].lost = True  # the reset: the GPU drops out of NVML ...
        await handled.until(lambda: not monitor.tracker.awaiting_reset(uuid))
        fake.gpus[0].lost = False  # ... and answers again
        await until(store, lambda s: s.health == {})


async def test_the_recovery_action_nvml_reports_gates_a_reset_gpu_xid() -> None:
    fake = two_gpus()
    backend, store = node(fake)
    uuid = fake.gpus[1].uuid
    settings = HealthFlags(recovery_seconds=0.2, probe_interval_seconds=0.02, ignored_xids=())
    monitor = HealthMonitor(backend, settings, store)
    handled = Handled(monitor)
    async with running(monitor):
        await registered(fake, 2)
        fake.gpus[1].recovery_action = pynvml.NVML_GPU_RECOVERY_ACTION_GPU_RESET
        fake.emit_xid(1, 109)  # RESET_GPU in the catalog, once off NVIDIA's ignore list
        await until(store, lambda s: uuid in s.health)
        await handled.until(lambda: not monitor.tracker.awaiting_reset(uuid))
        fake.gpus[1].recovery_action = pynvml.NVML_GPU_RECOVERY_ACTION_NONE
        await until(store, lambda s: s.health == {})


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ("rows_pending", "row remapping is waiting for a GPU reset"),
        ("pages_pending", "page retirement is waiting for a GPU reset"),
        ("recovery_action", "NVML reports a node reboot pending"),
    ],
)
def test_a_mig_slice_probe_reads_its_parents_pending_reset(setting: str, message: str) -> None:
    fake = FakeNvml()
    gpu = fake.add_gpu()
    mig = gpu.add_mig("3g.40gb")
    backend = open_backend(fake)
    assert backend.probe(mig.uuid) is None
    value = pynvml.NVML_GPU_RECOVERY_ACTION_NODE_REBOOT if setting == "recovery_action" else True
    setattr(gpu, setting, value)
    assert backend.probe(mig.uuid) == f"{mig.uuid}: {message}"


def test_readings_the_driver_does_not_support_do_not_fail_a_probe() -> None:
    fake = two_gpus()
    for function in (
        "nvmlDeviceGetFieldValues",
        "nvmlDeviceGetRemappedRows",
        "nvmlDeviceGetRetiredPagesPendingStatus",
    ):
        fake.fail(function, pynvml.NVML_ERROR_NOT_SUPPORTED)
    assert open_backend(fake).probe(fake.gpus[0].uuid) is None


def test_a_probe_initialises_nvml_again_once_the_driver_is_back() -> None:
    fake = two_gpus()
    backend = open_backend(fake)
    uuid = fake.gpus[0].uuid
    fake.unload_driver()
    assert backend.probe(uuid) == f"{uuid}: Driver Not Loaded"
    fake.load_driver()
    assert backend.probe(uuid) is None
    assert fake.initialized


# -- MIG slices follow their GPU --------------------------------------------------------------


async def test_mig_slices_of_a_lost_gpu_are_fenced_with_it() -> None:
    fake = FakeNvml()
    gpu = fake.add_gpu()
    gpu.add_mig("3g.40gb")
    gpu.add_mig("3g.40gb")
    fake.add_gpu()
    backend, store = node(fake, layout_check_seconds=0.05)
    store.update(config=parse_config("version: v1\nflags: {migStrategy: mixed}"))
    migs = {m.uuid for m in gpu.migs}
    monitor = HealthMonitor(backend, FAST, store)
    async with running(monitor):
        await registered(fake, 2)
        assert migs <= advertised_healthy(store.state)
        fake.unload_driver()
        await until(store, lambda s: advertised_healthy(s) == set())
        fake.load_driver()
        await until(store, lambda s: migs <= advertised_healthy(s))
