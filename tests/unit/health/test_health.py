"""Health policy (with an injected clock) and the async monitor on a simulated node."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Mapping

import pytest

from kubegpu.config import build_config
from kubegpu.config.v1 import HealthFlags
from kubegpu.devices.model import Fault, Health, HealthEvent, HealthEventKind
from kubegpu.devices.simulated import SimulatedBackend
from kubegpu.errors import ConfigError
from kubegpu.health import HealthMonitor, HealthTracker, describe_xid, health_flags_from_env
from kubegpu.state import NodeStore
from tests.unit.health.conftest import GPU, Clock, running, xid
from tests.waiting import WAIT

MIG = "MIG-0"
#: An Xid the catalog does not list: unhealthy until probes pass (NVIDIA saw 999 in the field).
UNLISTED = 999


def ok(uuid: str = GPU) -> HealthEvent:
    return HealthEvent(uuid, HealthEventKind.PROBE_OK)


def tracker(clock: Clock | None = None, **settings: object) -> HealthTracker:
    return HealthTracker(HealthFlags(**settings), clock or Clock())  # type: ignore[arg-type]


# -- policy -------------------------------------------------------------------------------


def test_default_ignore_list_ignores_application_xids() -> None:
    t = tracker()
    for n in (13, 31, 43, 45, 68, 109):
        assert not t.observe(xid(n))
    assert t.health() == {}


def test_critical_xid_marks_unhealthy_with_reason() -> None:
    t = tracker()
    assert t.observe(xid(79))
    assert t.health() == {GPU: Health.UNHEALTHY}
    assert t.reason(GPU) == "Xid 79 (GPU has fallen off the bus)"
    assert not t.observe(xid(79)), "already unhealthy: map unchanged"


def test_critical_overrides_ignored() -> None:
    t = tracker(critical_xids=(13,))
    assert t.observe(xid(13))
    assert not t.observe(xid(31, "GPU-1"))


def test_custom_ignore_list() -> None:
    t = tracker(ignored_xids=(79,))
    assert not t.observe(xid(79))
    # 109 is off the list, so the catalog decides: RESET_GPU marks it (13, an application
    # error in the catalog, would stay ignored).
    assert t.observe(xid(109))


def test_xid_overrides_from_the_config_file_say_what_each_xid_does() -> None:
    """`flags.health.xidOverrides` beats the catalog and `ignoredXids`, not `criticalXids`."""
    config = build_config(
        {
            "flags": {
                "health": {
                    "ignoredXids": [13],
                    "criticalXids": [94],
                    "xidOverrides": {48: "ignore", "13": "unhealthy", 94: "ignore"},
                }
            }
        },
        {},
        source="config.yaml",
    )
    t = tracker_from(config.flags.health)
    assert not t.observe(xid(48, "GPU-a"))  # the catalog would wait for a reset
    assert t.observe(xid(13, "GPU-b"))  # on the ignore list, but the override says unhealthy
    assert t.observe(xid(94, "GPU-c"))  # critical wins over an override that ignores it
    assert t.health() == {"GPU-b": Health.UNHEALTHY, "GPU-c": Health.UNHEALTHY}
    assert tracker_from(HealthFlags()).observe(xid(48, "GPU-a"))


def test_disabled_keeps_everything_healthy() -> None:
    t = tracker(disabled=True)
    assert not t.observe(xid(79))
    assert not t.observe(HealthEvent(GPU, HealthEventKind.PROBE_FAILED, detail="lost"))
    assert t.health() == {}
    assert t.due_probes() == []


def test_probe_failure_marks_unhealthy() -> None:
    t = tracker()
    assert t.observe(HealthEvent(GPU, HealthEventKind.PROBE_FAILED, detail="GPU is lost"))
    assert t.reason(GPU) == "probe failed: GPU is lost"


def test_heals_after_recovery_period_not_before() -> None:
    clock = Clock()
    t = tracker(clock, recovery_seconds=60)
    t.observe(xid(UNLISTED))
    clock.now += 59
    assert not t.observe(ok())
    assert t.health() == {GPU: Health.UNHEALTHY}
    clock.now += 1
    assert t.observe(ok())
    assert t.health() == {}
    assert t.reason(GPU) is None


def test_new_error_restarts_the_timer() -> None:
    clock = Clock()
    t = tracker(clock, recovery_seconds=60)
    t.observe(xid(79))
    clock.now += 50
    t.observe(HealthEvent(GPU, HealthEventKind.PROBE_FAILED, detail="again"))
    clock.now += 50  # 100 s after the first error, 50 s after the last
    assert not t.observe(ok())
    clock.now += 10
    assert t.observe(ok())


def test_recovery_zero_never_heals_but_heal_event_does() -> None:
    clock = Clock()
    t = tracker(clock, recovery_seconds=0)
    t.observe(xid(79))
    clock.now += 10**6
    assert not t.observe(ok())
    assert t.due_probes() == []
    assert t.observe(HealthEvent(GPU, HealthEventKind.HEALED))
    assert t.health() == {}


def test_healed_is_immediate() -> None:
    t = tracker(recovery_seconds=600)
    t.observe(xid(79))
    assert t.observe(HealthEvent(GPU, HealthEventKind.HEALED))
    assert not t.observe(HealthEvent(GPU, HealthEventKind.HEALED))


def test_probe_ok_for_healthy_device_changes_nothing() -> None:
    assert not tracker().observe(ok())


def test_mig_uuid_marked_on_its_own() -> None:
    t = tracker()
    assert t.observe(xid(95, MIG))
    assert t.health() == {MIG: Health.UNHEALTHY}


def test_xid_without_number_counts_as_critical() -> None:
    t = tracker()
    assert t.observe(HealthEvent(GPU, HealthEventKind.XID))
    assert t.reason(GPU) == "hardware error"


def test_due_probes_follow_the_probe_interval() -> None:
    clock = Clock()
    t = tracker(clock, probe_interval_seconds=5, recovery_seconds=60)
    t.observe(xid(79))
    t.observe(xid(48, "GPU-1"))
    assert t.due_probes() == []
    clock.now += 5
    assert t.due_probes() == [GPU, "GPU-1"]
    t.observe(ok())
    assert t.due_probes() == ["GPU-1"]


def test_describe_xid() -> None:
    assert describe_xid(48) == "Xid 48 (double-bit ECC error)"
    assert describe_xid(4242) == "Xid 4242"


# -- env ------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["all", "xids", "ALL", " all "])
def test_env_disable_all(value: str) -> None:
    flags = health_flags_from_env({"DP_DISABLE_HEALTHCHECKS": value}, HealthFlags())
    assert flags.disabled


def test_env_disable_adds_ignored_xids() -> None:
    flags = health_flags_from_env({"DP_DISABLE_HEALTHCHECKS": "79, 48,13"}, HealthFlags())
    assert not flags.disabled
    assert flags.ignored_xids == (13, 31, 43, 45, 68, 109, 79, 48)


def test_env_enable_makes_xids_critical() -> None:
    flags = health_flags_from_env({"DP_ENABLE_HEALTHCHECKS": "13,31"}, HealthFlags())
    assert flags.critical_xids == (13, 31)
    assert tracker_from(flags).observe(xid(13))


def test_env_enable_all_clears_ignore_list() -> None:
    flags = health_flags_from_env({"DP_ENABLE_HEALTHCHECKS": "all"}, HealthFlags())
    assert flags.ignored_xids == ()


def test_env_absent_or_empty_keeps_base() -> None:
    base = HealthFlags(recovery_seconds=5)
    assert health_flags_from_env({}, base) == base
    assert health_flags_from_env({"DP_DISABLE_HEALTHCHECKS": ""}, base) == base


@pytest.mark.parametrize(
    ("variable", "value", "token"),
    [
        ("DP_DISABLE_HEALTHCHECKS", "79,nope", "'nope'"),
        ("DP_DISABLE_HEALTHCHECKS", "-3", "'-3'"),
        ("DP_ENABLE_HEALTHCHECKS", "xids", "'xids'"),
    ],
)
def test_env_invalid_names_variable_and_token(variable: str, value: str, token: str) -> None:
    with pytest.raises(ConfigError, match=f"{variable}: {token} is not an Xid number"):
        health_flags_from_env({variable: value}, HealthFlags())


def tracker_from(flags: HealthFlags) -> HealthTracker:
    return HealthTracker(flags, Clock())


# -- monitor --------------------------------------------------------------------------------


class Recorder:
    """Follows the store the monitor writes: every health map and inventory it stored."""

    def __init__(self) -> None:
        self.store = NodeStore()
        self.maps: list[Mapping[str, Health]] = []
        self.reconfigured = 0
        self._changes = self.store.changes()

    async def until(self, predicate: Callable[[], object], timeout: float = WAIT) -> None:
        async def wait() -> None:
            while not predicate():
                before, after = await anext(self._changes)
                if after.health is not before.health:
                    self.maps.append(dict(after.health))
                if after.inventory is not before.inventory:
                    self.reconfigured += 1

        await asyncio.wait_for(wait(), timeout)


def test_the_monitor_says_when_an_unhealthy_devices_reason_changes() -> None:
    """A newer Xid on a device already unhealthy changes no health map; the monitor
    writes the new reason to the store (a DRA taint names the Xid), and nothing when the
    reason stays."""
    store = NodeStore()
    monitor = HealthMonitor(SimulatedBackend.load("t4-1"), HealthFlags(), store)
    monitor.handle(xid(61))  # unhealthy: the store says so
    version = store.state.version
    monitor.handle(xid(61))  # the same fault again
    assert store.state.version == version
    monitor.handle(xid(79))  # another Xid: the reason and the taint change
    assert store.state.version == version + 1
    assert store.state.faults == {GPU: Fault(79, describe_xid(79))}
    monitor.handle(xid(48))  # a reset-requiring fault keeps its reason: nothing new
    assert store.state.version == version + 1
    assert store.state.faults == {GPU: Fault(79, describe_xid(79))}


async def test_monitor_reports_injected_xid_and_heal(caplog: pytest.LogCaptureFixture) -> None:
    backend = SimulatedBackend.load("t4-1")
    uuid = backend.discover().gpus[0].uuid
    rec = Recorder()
    monitor = HealthMonitor(backend, HealthFlags(), rec.store)
    with caplog.at_level(logging.INFO, "kubegpu.health"):
        async with running(monitor):
            backend.inject_xid(0, 79)
            await rec.until(lambda: rec.maps and rec.maps[-1] == {uuid: Health.UNHEALTHY})
            backend.heal(0)
            await rec.until(lambda: rec.maps[-1] == {})
    assert f"{uuid} unhealthy: Xid 79 (GPU has fallen off the bus)" in caplog.text
    assert f"{uuid} healthy again" in caplog.text


async def test_monitor_ignores_ignored_xid_and_reports_reconfigure() -> None:
    backend = SimulatedBackend.load("h100-mig")
    rec = Recorder()
    monitor = HealthMonitor(backend, HealthFlags(), rec.store)
    async with running(monitor):
        backend.inject_xid(0, 13)
        backend.set_mig_layout(0, ["7g.80gb"])
        await rec.until(lambda: rec.reconfigured == 1)
    assert rec.maps == [], "Xid 13 is in the default ignore list"


async def test_monitor_probes_and_recovers() -> None:
    backend = SimulatedBackend.load("a10g-4")
    uuid = backend.discover().gpus[2].uuid
    rec = Recorder()
    settings = HealthFlags(recovery_seconds=0.05, probe_interval_seconds=0.02)
    monitor = HealthMonitor(backend, settings, rec.store)
    async with running(monitor) as task:
        backend.fail_probe(2, "GPU is lost")
        await rec.until(lambda: rec.maps and rec.maps[-1] == {uuid: Health.UNHEALTHY})
        assert monitor.tracker.reason(uuid) == "probe failed: GPU is lost"
        # Probes keep failing: still unhealthy; then the fault clears and probes heal it.
        backend.clear_fault(2)  # the fault goes away without an operator
        await rec.until(lambda: rec.maps[-1] == {})
        assert not task.done()


async def test_monitor_stops_the_watch_thread_on_cancel() -> None:
    backend = SimulatedBackend.load("t4-1")
    rec = Recorder()
    monitor = HealthMonitor(backend, HealthFlags(), rec.store)
    async with running(monitor):
        backend.inject_xid(0, 79)
        await rec.until(lambda: bool(rec.maps))
        assert "kubegpu-health-watch" in {t.name for t in threading.enumerate()}
    assert "kubegpu-health-watch" not in {t.name for t in threading.enumerate()}


async def test_monitor_keeps_a_new_mig_layout_out_of_the_store_when_it_cannot_serve(
    caplog: pytest.LogCaptureFixture,
) -> None:
    backend = SimulatedBackend.load("h100-mig")
    rec = Recorder()
    single = build_config({"version": "v1", "flags": {"migStrategy": "single"}}, {}, source="t")
    backend.set_mig_layout(0, ["7g.80gb"])
    rec.store.update(inventory=backend.discover(), config=single)
    monitor = HealthMonitor(backend, HealthFlags(), rec.store)
    kept = rec.store.state
    with caplog.at_level(logging.ERROR, "kubegpu.health"):
        async with running(monitor):
            backend.set_mig_layout(0, ["1g.10gb", "2g.20gb"])  # mixed: single refuses it
            # Events are consumed in order: once the Xid is stored, the layout was judged.
            backend.inject_xid(0, 79)
            await rec.until(lambda: bool(rec.maps))
    assert "does not fit the config; keeping the last" in caplog.text
    assert rec.store.state.inventory is kept.inventory
    assert rec.reconfigured == 1, "only the set-up stored an inventory"


def test_the_store_keeps_why_each_device_is_unhealthy_and_its_newest_xid() -> None:
    """The store holds why (`NodeState.faults`), written with the health map: a newer Xid
    on a device already unhealthy changes no health, but the DRA taint and health stream
    that read the store name it."""
    store = NodeStore()
    monitor = HealthMonitor(SimulatedBackend.load("t4-1"), HealthFlags(), store)
    monitor.handle(xid(61))
    assert store.state.health == {GPU: Health.UNHEALTHY}
    assert store.state.faults == {GPU: Fault(61, describe_xid(61))}
    version = store.state.version
    monitor.handle(xid(61))  # the same fault again: nothing new to tell
    assert store.state.version == version
    monitor.handle(xid(79))
    assert store.state.faults == {GPU: Fault(79, describe_xid(79))}
    monitor.handle(HealthEvent(GPU, HealthEventKind.HEALED))
    assert (store.state.health, store.state.faults) == ({}, {})
