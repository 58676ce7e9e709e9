"""Metrics: names, labels and values as Prometheus will scrape them."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families

from kubegpu.metrics import (
    ALLOCATE_BUCKETS,
    CONTENT_TYPE,
    DEVICE_LABELS,
    DeviceHealthRow,
    Metrics,
)


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


def test_gpu_health_is_read_at_each_scrape_and_a_failing_source_costs_it_only() -> None:
    rows = [
        DeviceHealthRow("0", "GPU-a", "0000:17:00.0", "nvidia0", "H100", "node-a"),
        DeviceHealthRow("1", "GPU-b", hostname="node-a", gi_profile="1g.10gb", gi_id="9"),
    ]
    m = Metrics()
    m.follow_devices(lambda: rows)
    got = samples(m)
    # Empty values are absent labels to Prometheus, as on the per-container families.
    a, b = (frozenset(zip(DEVICE_LABELS, row.labels(), strict=True)) for row in rows)
    assert dict(a)["modelName"] == "H100" and dict(b)["GPU_I_ID"] == "9"
    assert got[("kubegpu_gpu_healthy", a)] == 1
    assert got[("kubegpu_gpu_healthy", b)] == 1
    rows[0] = dataclasses.replace(rows[0], healthy=False)
    assert samples(m)[("kubegpu_gpu_healthy", a)] == 0

    def broken() -> list[DeviceHealthRow]:
        raise RuntimeError("a bug")

    m.follow_devices(broken)
    m.set_devices("nvidia.com/gpu", 2, 2)
    text = m.render().decode()
    assert "# TYPE kubegpu_gpu_healthy gauge" in text
    assert "kubegpu_gpu_healthy{" not in text
    assert 'kubegpu_devices{resource="nvidia.com/gpu"} 2.0' in text


def _reference(version: str) -> tuple[CollectorRegistry, dict[str, Any]]:
    """The same families built with prometheus_client's own Counter, Gauge and Histogram
    (what `Metrics` used before it kept its values in plain dicts)."""
    r = CollectorRegistry(auto_describe=True)
    fams: dict[str, Any] = {
        "devices": Gauge(
            "kubegpu_devices",
            "Devices advertised to the kubelet, per resource.",
            ["resource"],
            registry=r,
        ),
        "healthy": Gauge(
            "kubegpu_devices_healthy",
            "Advertised devices currently reported Healthy, per resource.",
            ["resource"],
            registry=r,
        ),
        "allocations": Counter(
            "kubegpu_allocations",
            "Container allocations answered successfully, per resource.",
            ["resource"],
            registry=r,
        ),
        "errors": Counter(
            "kubegpu_allocate_errors",
            "Allocate requests refused, per resource and gRPC status code.",
            ["resource", "code"],
            registry=r,
        ),
        "seconds": Histogram(
            "kubegpu_allocate_duration_seconds",
            "Time to answer one Allocate request, per resource.",
            ["resource"],
            buckets=ALLOCATE_BUCKETS,
            registry=r,
        ),
        "xid": Counter(
            "kubegpu_xid_errors",
            "Xid (or AMD RAS) events reported by the driver, per GPU and Xid code.",
            ["uuid", "xid"],
            registry=r,
        ),
        "registrations": Counter(
            "kubegpu_registrations",
            "Registration attempts with the kubelet, per resource and result.",
            ["resource", "result"],
            registry=r,
        ),
        "restarts": Counter(
            "kubegpu_kubelet_restarts",
            "Kubelet restarts detected (socket directory wiped), each forcing re-registration.",
            registry=r,
        ),
        "reloads": Counter(
            "kubegpu_config_reloads",
            "Configuration reloads, by result (ok or failed).",
            ["result"],
            registry=r,
        ),
        "transitions": Counter(
            "kubegpu_health_transitions",
            "Device health changes, per resource and the health entered.",
            ["resource", "health"],
            registry=r,
        ),
        "dropped": Counter(
            "kubegpu_events_dropped",
            "Kubernetes Events not recorded (rate limited, queue full or API failure), by reason.",
            ["reason"],
            registry=r,
        ),
        "stale": Gauge(
            "kubegpu_stale_node_resources",
            "DRA mode: 1 for each device-plugin resource the Node's status still shows, which "
            "the scheduler then serves to pods without a GPU (kubectl patch removes it).",
            ["resource"],
            registry=r,
        ),
    }
    Gauge(
        "kubegpu_build_info",
        "Always 1; the version label says which kubegpu is running.",
        ["version"],
        registry=r,
    ).labels(version=version).set(1)
    return r, fams


_CREATED = re.compile(r"^(\w+_created(?:\{[^}]*\})?) [0-9.e+]+$", re.MULTILINE)


def test_exposition_is_the_one_prometheus_client_metrics_give() -> None:
    """Same families, samples, order and values as prometheus_client's own metric classes,
    for every method (creation timestamps aside)."""
    m = Metrics(version="1.2.3")
    ref, f = _reference("1.2.3")
    gpu, shared, mig = "nvidia.com/gpu", "nvidia.com/gpu.shared", "nvidia.com/mig-1g.5gb"
    m.set_devices(gpu, 8, 8)
    m.set_devices(shared, 16, 15)
    m.set_devices(gpu, 8, 7)
    m.remove_resource(shared)
    for name, total, healthy in ((gpu, 8, 8), (shared, 16, 15), (gpu, 8, 7)):
        f["devices"].labels(resource=name).set(total)
        f["healthy"].labels(resource=name).set(healthy)
    f["devices"].remove(shared)
    f["healthy"].remove(shared)
    answers: list[tuple[str, float, str | None]] = [
        (gpu, s, None) for s in (0.00005, 0.0001, 0.0003, 0.2, 5.0)
    ]
    answers += [(gpu, 0.001, "OK"), (gpu, 0.002, "INVALID_ARGUMENT"), (mig, 0.002, "INTERNAL")]
    for resource, seconds, code in answers:
        m.observe_allocate(resource, seconds, code)
        f["seconds"].labels(resource=resource).observe(seconds)
        if code in (None, "OK"):
            f["allocations"].labels(resource=resource).inc()
        else:
            f["allocations"].labels(resource=resource)  # the series exists from then on
            f["errors"].labels(resource=resource, code=code).inc()
    for uuid, xid in (("GPU-1", 79), ("GPU-1", 79), ("GPU-2", 13)):
        m.xid(uuid, xid)
        f["xid"].labels(uuid=uuid, xid=str(xid)).inc()
    for ok in (True, False):
        m.registration(gpu, ok)
        f["registrations"].labels(resource=gpu, result="ok" if ok else "failed").inc()
        m.config_reload(ok)
        f["reloads"].labels(result="ok" if ok else "failed").inc()
        m.health_transition(gpu, healthy=ok)
        f["transitions"].labels(resource=gpu, health="Healthy" if ok else "Unhealthy").inc()
    m.kubelet_restart()
    f["restarts"].inc()
    m.event_dropped("queue-full")
    f["dropped"].labels(reason="queue-full").inc()
    m.set_stale_resources([gpu, shared])
    m.set_stale_resources([shared])  # the whole set: gpu's series goes
    f["stale"].labels(resource=shared).set(1)

    def masked(text: bytes) -> str:
        return _CREATED.sub(r"\1 <created>", text.decode())

    assert masked(m.render()) == masked(generate_latest(ref))
    assert "_created" in masked(m.render())


def test_created_series_follow_prometheus_client_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PROMETHEUS_DISABLE_CREATED_SERIES", "true")
    m = Metrics()
    m.observe_allocate("nvidia.com/gpu", 0.001)
    m.kubelet_restart()
    assert "_created" not in m.render().decode()


def test_content_type_is_prometheus_clients_latest() -> None:
    assert CONTENT_TYPE == CONTENT_TYPE_LATEST
