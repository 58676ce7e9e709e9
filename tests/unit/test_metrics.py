"""Metrics: names, labels and values as Prometheus will scrape them."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from kubegpu.metrics import Metrics


def samples(m: Metrics) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    out = {}
    for family in text_string_to_metric_families(m.render().decode()):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def test_registries_are_independent() -> None:
    a, b = Metrics(), Metrics()
    a.kubelet_restart()
    assert a.value("kubegpu_kubelet_restarts_total") == 1
    assert b.value("kubegpu_kubelet_restarts_total") == 0


def test_build_info_carries_version() -> None:
    m = Metrics(version="9.9.9")
    assert m.value("kubegpu_build_info", {"version": "9.9.9"}) == 1


def test_devices_gauges_follow_latest_value_and_can_be_removed() -> None:
    m = Metrics()
    m.set_devices("nvidia.com/gpu", 8, 8)
    m.set_devices("nvidia.com/gpu", 8, 7)
    assert m.value("kubegpu_devices", {"resource": "nvidia.com/gpu"}) == 8
    assert m.value("kubegpu_devices_healthy", {"resource": "nvidia.com/gpu"}) == 7
    m.remove_resource("nvidia.com/gpu")
    m.remove_resource("nvidia.com/gpu")  # idempotent
    assert m.value("kubegpu_devices", {"resource": "nvidia.com/gpu"}) is None


def test_allocate_success_and_errors_counted_apart() -> None:
    m = Metrics()
    r = "nvidia.com/gpu"
    m.observe_allocate(r, 0.0002)
    m.observe_allocate(r, 0.0003, "OK")
    m.observe_allocate(r, 0.2, "INVALID_ARGUMENT")
    assert m.value("kubegpu_allocations_total", {"resource": r}) == 2
    assert (
        m.value("kubegpu_allocate_errors_total", {"resource": r, "code": "INVALID_ARGUMENT"}) == 1
    )
    assert m.value("kubegpu_allocate_duration_seconds_count", {"resource": r}) == 3
    # sub-millisecond answers land in the fine buckets; 200 ms only in +Inf
    assert (
        m.value("kubegpu_allocate_duration_seconds_bucket", {"resource": r, "le": "0.00025"}) == 1
    )
    assert m.value("kubegpu_allocate_duration_seconds_bucket", {"resource": r, "le": "0.1"}) == 2
    assert m.value("kubegpu_allocate_duration_seconds_bucket", {"resource": r, "le": "+Inf"}) == 3


def test_event_counters() -> None:
    m = Metrics()
    m.xid("GPU-a", 79)
    m.xid("GPU-a", 79)
    m.xid("GPU-b", 48)
    m.registration("nvidia.com/gpu", True)
    m.registration("nvidia.com/gpu", False)
    m.config_reload(True)
    m.config_reload(False)
    m.config_reload(False)
    m.health_transition("nvidia.com/gpu", healthy=False)
    m.event_dropped("queue-full")
    got = samples(m)
    assert got[("kubegpu_xid_errors_total", frozenset({("uuid", "GPU-a"), ("xid", "79")}))] == 2
    assert got[("kubegpu_xid_errors_total", frozenset({("uuid", "GPU-b"), ("xid", "48")}))] == 1
    reg = "kubegpu_registrations_total"
    assert got[(reg, frozenset({("resource", "nvidia.com/gpu"), ("result", "ok")}))] == 1
    assert got[(reg, frozenset({("resource", "nvidia.com/gpu"), ("result", "failed")}))] == 1
    assert got[("kubegpu_config_reloads_total", frozenset({("result", "failed")}))] == 2
    ht = (
        "kubegpu_health_transitions_total",
        frozenset({("resource", "nvidia.com/gpu"), ("health", "Unhealthy")}),
    )
    assert got[ht] == 1
    assert got[("kubegpu_events_dropped_total", frozenset({("reason", "queue-full")}))] == 1


def test_every_metric_is_prefixed_and_documented() -> None:
    m = Metrics()
    m.set_devices("nvidia.com/gpu", 1, 1)
    for family in text_string_to_metric_families(m.render().decode()):
        assert family.name.startswith("kubegpu_"), family.name
        assert family.documentation
