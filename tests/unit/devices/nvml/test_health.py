"""NVML health (devices/nvml/health.py) on the fake pynvml: probes, Xid/ECC events, MIG layout."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator

import pynvml
import pytest

from kubegpu.devices.model import HealthEvent, HealthEventKind
from kubegpu.devices.nvml import (
    NvmlBackend,
)
from kubegpu.devices.stop import Stop
from kubegpu.testing import FakeNvml
from tests.unit.devices.nvml.conftest import open_backend as _open
from tests.waiting import WAIT

# -- probe ----------------------------------------------------------------------------------


def test_probe(fake: FakeNvml) -> None:
    backend = _open(fake)
    uuid = fake.gpus[0].uuid
    assert backend.probe(uuid) is None
    fake.gpus[0].lost = True
    assert backend.probe(uuid) == f"{uuid}: GPU is lost"
    assert "Not Found" in (backend.probe("GPU-nope") or "")


def test_probe_mig_uuid() -> None:
    fake = FakeNvml()
    mig = fake.add_gpu().add_mig("1g.10gb")
    assert _open(fake).probe(mig.uuid) is None


# -- watch ----------------------------------------------------------------------------------


class InstantBackoff(Stop):
    """A stop flag whose timed waits (the watch's back-off) return at once, recorded.

    The back-off is a length of time, not a behaviour worth waiting for in real time.
    """

    def __init__(self) -> None:
        super().__init__()
        self.waits: list[float | None] = []

    def wait(self, timeout: float | None = None) -> bool:
        if timeout is None:
            return super().wait()
        self.waits.append(timeout)
        return self.is_set()


class Watcher:
    """Runs backend.watch in a thread and collects events; waits on a condition."""

    def __init__(self, backend: NvmlBackend) -> None:
        self.events: list[HealthEvent] = []
        self._cond = threading.Condition()
        self.stop = InstantBackoff()
        self.thread = threading.Thread(target=backend.watch, args=(self.stop, self._emit))

    def _emit(self, event: HealthEvent) -> None:
        with self._cond:
            self.events.append(event)
            self._cond.notify_all()

    def wait_for(
        self, predicate: Callable[[list[HealthEvent]], bool], timeout: float = WAIT
    ) -> None:
        with self._cond:
            assert self._cond.wait_for(lambda: predicate(self.events), timeout), self.events


@pytest.fixture
def watching(fake: FakeNvml) -> Iterator[tuple[FakeNvml, Watcher]]:
    watcher = Watcher(_open(fake))
    watcher.thread.start()
    try:
        yield fake, watcher
    finally:
        watcher.stop.set()
        watcher.thread.join(WAIT)
        assert not watcher.thread.is_alive()


def _wait_registered(fake: FakeNvml, count: int) -> None:
    assert fake.wait_registered(count), fake.registered()


def test_watch_registers_xid_and_ecc_events(watching: tuple[FakeNvml, Watcher]) -> None:
    fake, _ = watching
    _wait_registered(fake, 2)
    mask = fake.registered()[fake.gpus[0].uuid]
    assert mask & pynvml.nvmlEventTypeXidCriticalError
    assert mask & pynvml.nvmlEventTypeDoubleBitEccError


def test_watch_reports_xid(watching: tuple[FakeNvml, Watcher]) -> None:
    fake, watcher = watching
    _wait_registered(fake, 2)
    fake.emit_xid(1, 79)
    watcher.wait_for(lambda events: len(events) >= 1)
    assert watcher.events == [HealthEvent(fake.gpus[1].uuid, HealthEventKind.XID, xid=79)]


def test_double_bit_ecc_is_xid_48_and_single_bit_ignored(
    watching: tuple[FakeNvml, Watcher],
) -> None:
    fake, watcher = watching
    _wait_registered(fake, 2)
    fake.emit_event(0, pynvml.nvmlEventTypeSingleBitEccError, 0)
    fake.emit_event(0, pynvml.nvmlEventTypeDoubleBitEccError, 0)
    watcher.wait_for(lambda events: len(events) >= 1)
    assert [(e.uuid, e.xid) for e in watcher.events] == [(fake.gpus[0].uuid, 48)]


def test_event_without_device_hits_every_gpu(watching: tuple[FakeNvml, Watcher]) -> None:
    fake, watcher = watching
    _wait_registered(fake, 2)
    fake.emit_xid(None, 119)
    watcher.wait_for(lambda events: len(events) >= 2)
    assert {(e.uuid, e.xid) for e in watcher.events} == {(g.uuid, 119) for g in fake.gpus}


def test_failing_wait_reports_probe_failures_and_recovers(
    watching: tuple[FakeNvml, Watcher],
) -> None:
    fake, watcher = watching
    _wait_registered(fake, 2)
    fake.fail_wait(pynvml.NVML_ERROR_UNKNOWN)
    watcher.wait_for(lambda events: len(events) >= 2)
    assert {e.kind for e in watcher.events} == {HealthEventKind.PROBE_FAILED}
    assert "Unknown Error" in watcher.events[0].detail
    # After the back-off (its first step, 1 s) the set is registered again and events flow.
    _wait_registered(fake, 2)
    fake.emit_xid(0, 94)
    watcher.wait_for(lambda events: any(e.xid == 94 for e in events))
    assert watcher.stop.waits == [1.0]


def test_not_supported_gpu_is_skipped(fake: FakeNvml, caplog: pytest.LogCaptureFixture) -> None:
    fake.gpus[0].supported_events = 0
    watcher = Watcher(_open(fake))
    with caplog.at_level(logging.INFO, "kubegpu.devices.nvml"):
        watcher.thread.start()
        try:
            _wait_registered(fake, 1)
            fake.emit_xid(1, 79)
            watcher.wait_for(lambda events: len(events) >= 1)
        finally:
            watcher.stop.set()
            watcher.thread.join(WAIT)
    assert list(fake.registered()) == []  # freed on exit
    assert [e.uuid for e in watcher.events] == [fake.gpus[1].uuid]
    assert "does not report Xid events" in caplog.text


def test_mig_event_maps_to_slice() -> None:
    fake = FakeNvml()
    gpu = fake.add_gpu()
    gpu.add_mig("3g.40gb")
    other = gpu.add_mig("3g.40gb")
    watcher = Watcher(_open(fake))
    watcher.thread.start()
    try:
        _wait_registered(fake, 1)
        fake.emit_xid(0, 31, mig=other)
        watcher.wait_for(lambda events: len(events) >= 1)
    finally:
        watcher.stop.set()
        watcher.thread.join(WAIT)
    assert watcher.events[0].uuid == other.uuid


def test_mig_layout_change_reports_reconfigured() -> None:
    fake = FakeNvml()
    gpu = fake.add_gpu()
    gpu.add_mig("3g.40gb")
    fake.add_gpu()
    now = [0.0]
    backend = NvmlBackend(
        fake,
        exists=lambda p: True,
        wait_timeout_ms=10,
        layout_check_seconds=5,
        clock=lambda: now[0],
    )
    fake.nvmlInit()
    watcher = Watcher(backend)
    watcher.thread.start()
    try:
        _wait_registered(fake, 2)
        gpu.add_mig("2g.20gb")
        now[0] = 10.0
        watcher.wait_for(lambda events: len(events) >= 1)
    finally:
        watcher.stop.set()
        watcher.thread.join(WAIT)
    assert watcher.events == [HealthEvent(gpu.uuid, HealthEventKind.RECONFIGURED)]


def test_watch_never_raises_when_event_set_cannot_be_created(fake: FakeNvml) -> None:
    fake.fail("nvmlEventSetCreate", pynvml.NVML_ERROR_UNKNOWN)
    backend = _open(fake)
    stop = Stop()
    thread = threading.Thread(target=backend.watch, args=(stop, lambda e: None))
    thread.start()
    stop.set()
    thread.join(WAIT)
    assert not thread.is_alive()
