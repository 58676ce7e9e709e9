"""Prometheus metrics for the device plugin, served on `/metrics` by `kubegpu.httpserver`.

Each `Metrics` owns its own `CollectorRegistry` instead of the process-global one, so
tests and several daemons in one process (the demo, the integration suite) never
collide on metric names.

The values are kept in plain dicts and turned into Prometheus families only when read
(`render`, `value`, `registry`), so the `Allocate` hot path pays a dict update instead of
a labelled child's locks. The exposition is the one `prometheus_client`'s own Counter,
Gauge and Histogram give: the same families, samples (`_total`, `_created`,
`_bucket`...), order and values.

The per-container GPU families (`kubegpu_container_gpu_*`) are collected when scraped, from
the source given to `follow_usage` (`kubegpu.usage.UsageCollector`): `render` calls it, so
`render` blocks on the driver and runs in a worker thread (`kubegpu.httpserver`), never on
the event loop. Their labels are dcgm-exporter's (`USAGE_LABELS`). So are those of
`kubegpu_gpu_healthy`, one series per GPU and MIG slice, read at each scrape from the source
given to `follow_devices` (the node's state, in memory: it never waits on the driver).
"""

from __future__ import annotations

import bisect
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.utils import floatToGoString

from kubegpu import __version__

#: The `Content-Type` of `Metrics.render()` output: prometheus_client's
#: `CONTENT_TYPE_LATEST` (tests/unit/metrics/test_metrics.py checks they agree).
CONTENT_TYPE = "text/plain; version=1.0.0; charset=utf-8"

#: Allocate latency buckets in seconds: the answer is pure computation (sub-millisecond)
#: unless something blocks the loop, which is what the upper buckets are there to show.
ALLOCATE_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
)

#: The gRPC status name recorded when Allocate succeeds.
OK = "OK"

log = logging.getLogger("kubegpu.metrics")

#: The labels of every per-container GPU series: dcgm-exporter's device labels (`gpu` index,
#: the GPU's `UUID`, `pci_bus_id`, `device` as `nvidia<minor>`, `modelName`, `Hostname`, and
#: on a MIG slice `GPU_I_PROFILE` and `GPU_I_ID`) and its Kubernetes ones (`namespace`,
#: `pod`, `container`, and `dra_claim_name` for a DRA claim), so that dashboards and alerts
#: written for dcgm-exporter find the same names. An empty value is an absent label.
USAGE_LABELS = (
    "gpu",
    "UUID",
    "pci_bus_id",
    "device",
    "modelName",
    "Hostname",
    "GPU_I_PROFILE",
    "GPU_I_ID",
    "namespace",
    "pod",
    "container",
    "dra_claim_name",
)
#: The `pod` of the series that sums, per device, the processes no container is known for;
#: its `namespace` is empty, which no real pod's is.
UNATTRIBUTED = "unattributed"


@dataclass(frozen=True)
class DeviceLabels:
    """A GPU or MIG slice as dcgm-exporter labels it (a slice carries its GPU's labels)."""

    gpu: str
    uuid: str
    pci_bus_id: str = ""
    device: str = ""
    model: str = ""
    hostname: str = ""
    gi_profile: str = ""
    gi_id: str = ""

    def device_labels(self) -> tuple[str, ...]:
        """The values of `DEVICE_LABELS`, in order."""
        return (
            self.gpu,
            self.uuid,
            self.pci_bus_id,
            self.device,
            self.model,
            self.hostname,
            self.gi_profile,
            self.gi_id,
        )


@dataclass(frozen=True)
class UsageRow(DeviceLabels):
    """One container's (or one claim's, or the unattributed) use of one GPU or MIG slice."""

    namespace: str = ""
    pod: str = ""
    container: str = ""
    claim: str = ""
    #: Device memory its processes hold.
    used_bytes: int = 0
    #: What it may use: the device's or slice's memory, or its share's (None: not known).
    limit_bytes: int | None = None
    #: SM utilization of its processes, summed (None where the driver keeps no samples).
    sm_percent: int | None = None
    processes: int = 0

    def labels(self) -> tuple[str, ...]:
        """The values of `USAGE_LABELS`, in order."""
        return (*self.device_labels(), self.namespace, self.pod, self.container, self.claim)


@dataclass(frozen=True)
class UsageSnapshot:
    """What one collection found."""

    rows: tuple[UsageRow, ...] = ()
    #: Each source read (`processes`, `pod-resources`, ...) -> whether it could be read.
    sources: Mapping[str, bool] = field(default_factory=dict)
    #: Rows left out because the snapshot was over its cap.
    dropped: int = 0
    #: How long the collection took.
    seconds: float = 0.0


UsageSource = Callable[[], UsageSnapshot]

#: The labels of `kubegpu_gpu_healthy`: the device part of `USAGE_LABELS`.
DEVICE_LABELS = USAGE_LABELS[:8]


@dataclass(frozen=True)
class DeviceHealthRow(DeviceLabels):
    """One GPU or MIG slice the node has, and whether the health checks pass it."""

    healthy: bool = True

    def labels(self) -> tuple[str, ...]:
        """The values of `DEVICE_LABELS`, in order."""
        return self.device_labels()


DeviceSource = Callable[[], Iterable[DeviceHealthRow]]

#: (name, help, label names) of the per-container families, in exposition order.
_USAGE_FAMILIES = (
    (
        "kubegpu_container_gpu_memory_used_bytes",
        "GPU memory held by the container's processes, per GPU or MIG slice.",
    ),
    (
        "kubegpu_container_gpu_memory_limit_bytes",
        "GPU memory the container may use on that GPU or MIG slice (its allocation's limit).",
    ),
    (
        "kubegpu_container_gpu_sm_utilization_percent",
        "Percent of the GPU's SMs the container's processes kept busy (latest sample).",
    ),
    (
        "kubegpu_container_gpu_processes",
        "Processes of the container running on that GPU or MIG slice.",
    ),
)


#: Labelled series: label values -> value.
_Series = dict[tuple[str, ...], float]

#: (name, help, type, label names) of every family, in exposition order.
_FAMILIES: tuple[tuple[str, str, str, tuple[str, ...]], ...] = (
    ("kubegpu_devices", "Devices advertised to the kubelet, per resource.", "gauge", ("resource",)),
    (
        "kubegpu_devices_healthy",
        "Advertised devices currently reported Healthy, per resource.",
        "gauge",
        ("resource",),
    ),
    (
        "kubegpu_allocations",
        "Container allocations answered successfully, per resource.",
        "counter",
        ("resource",),
    ),
    (
        "kubegpu_allocate_errors",
        "Allocate requests refused, per resource and gRPC status code.",
        "counter",
        ("resource", "code"),
    ),
    (
        "kubegpu_allocate_duration_seconds",
        "Time to answer one Allocate request, per resource.",
        "histogram",
        ("resource",),
    ),
    (
        "kubegpu_xid_errors",
        "Xid (or AMD RAS) events reported by the driver, per GPU and Xid code.",
        "counter",
        ("uuid", "xid"),
    ),
    (
        "kubegpu_registrations",
        "Registration attempts with the kubelet, per resource and result.",
        "counter",
        ("resource", "result"),
    ),
    (
        "kubegpu_kubelet_restarts",
        "Kubelet restarts detected (socket directory wiped), each forcing re-registration.",
        "counter",
        (),
    ),
    (
        "kubegpu_config_reloads",
        "Configuration reloads, by result (ok or failed).",
        "counter",
        ("result",),
    ),
    (
        "kubegpu_health_transitions",
        "Device health changes, per resource and the health entered.",
        "counter",
        ("resource", "health"),
    ),
    (
        "kubegpu_events_dropped",
        "Kubernetes Events not recorded (rate limited, queue full or API failure), by reason.",
        "counter",
        ("reason",),
    ),
    (
        "kubegpu_stale_node_resources",
        "DRA mode: 1 for each device-plugin resource the Node's status still shows, which "
        "the scheduler then serves to pods without a GPU (kubectl patch removes it).",
        "gauge",
        ("resource",),
    ),
    (
        "kubegpu_build_info",
        "Always 1; the version label says which kubegpu is running.",
        "gauge",
        ("version",),
    ),
)


class _Histogram:
    """One labelled histogram series: per-bucket counts (not cumulative), sum, creation."""

    __slots__ = ("counts", "created", "total")

    def __init__(self, buckets: int) -> None:
        self.counts = [0.0] * (buckets + 1)  # the last one is +Inf
        self.total = 0.0
        self.created = time.time()


class Metrics:
    """The plugin's metric families, exposed on a private registry."""

    def __init__(self, version: str = __version__) -> None:
        #: name -> series, for gauges and counters; counters also record each series'
        #: creation time in `_created` (Prometheus' `_created` samples).
        self._values: dict[str, _Series] = {name: {} for name, *_ in _FAMILIES}
        self._created: dict[str, _Series] = {name: {} for name, *_ in _FAMILIES}
        self._histograms: dict[tuple[str, ...], _Histogram] = {}
        # Increments come from the loop and from worker threads (Kubernetes events).
        self._lock = threading.Lock()
        self._registry: CollectorRegistry | None = None
        self._usage: UsageSource | None = None
        self._devices: DeviceSource | None = None
        # As prometheus_client's Counter without labels: exposed at 0 from the start.
        self._inc("kubegpu_kubelet_restarts", (), 0.0)
        self._values["kubegpu_build_info"][(version,)] = 1.0

    def _inc(self, name: str, labels: tuple[str, ...], amount: float = 1.0) -> None:
        with self._lock:
            series = self._values[name]
            if labels not in series:
                self._created[name][labels] = time.time()
                series[labels] = 0.0
            series[labels] += amount

    def set_devices(self, resource: str, total: int, healthy: int) -> None:
        """Record what is advertised now for `resource` (after every ListAndWatch send)."""
        # Under the lock: a scrape copies these dicts from its worker thread.
        with self._lock:
            self._values["kubegpu_devices"][(resource,)] = float(total)
            self._values["kubegpu_devices_healthy"][(resource,)] = float(healthy)

    def remove_resource(self, resource: str) -> None:
        """Forget a resource no longer served (after a config reload renames it)."""
        with self._lock:
            for name in ("kubegpu_devices", "kubegpu_devices_healthy"):
                self._values[name].pop((resource,), None)

    def follow_usage(self, source: UsageSource) -> None:
        """Collect the per-container GPU families from `source` at every scrape."""
        self._usage = source

    def follow_devices(self, source: DeviceSource) -> None:
        """Read `kubegpu_gpu_healthy` from `source` at every scrape."""
        self._devices = source

    def observe_allocate(self, resource: str, seconds: float, code: str | None = None) -> None:
        """Record one Allocate answer; `code` is the gRPC status name when it failed."""
        key = (resource,)
        histogram = self._histograms.get(key)
        if histogram is None:
            # The success counter's series exists from a resource's first answer on.
            self._inc("kubegpu_allocations", key, 0.0)
            with self._lock:
                histogram = self._histograms.setdefault(key, _Histogram(len(ALLOCATE_BUCKETS)))
        with self._lock:
            # The first bucket whose bound is >= seconds (Prometheus' `le`).
            histogram.counts[bisect.bisect_left(ALLOCATE_BUCKETS, seconds)] += 1.0
            histogram.total += seconds
        if code is None or code == OK:
            self._inc("kubegpu_allocations", key)
        else:
            self._inc("kubegpu_allocate_errors", (resource, code))

    def xid(self, uuid: str, code: int) -> None:
        self._inc("kubegpu_xid_errors", (uuid, str(code)))

    def registration(self, resource: str, ok: bool) -> None:
        self._inc("kubegpu_registrations", (resource, "ok" if ok else "failed"))

    def kubelet_restart(self) -> None:
        self._inc("kubegpu_kubelet_restarts", ())

    def config_reload(self, ok: bool) -> None:
        self._inc("kubegpu_config_reloads", ("ok" if ok else "failed",))

    def health_transition(self, resource: str, healthy: bool) -> None:
        """Count one device entering Healthy or Unhealthy under `resource`."""
        health = "Healthy" if healthy else "Unhealthy"
        self._inc("kubegpu_health_transitions", (resource, health))

    def event_dropped(self, reason: str) -> None:
        """Count a Kubernetes Event given up on (`rate-limited`, `queue-full`, `api-error`)."""
        self._inc("kubegpu_events_dropped", (reason,))

    def set_stale_resources(self, resources: Iterable[str]) -> None:
        """DRA mode: the device-plugin resources the Node's status shows now (the whole set)."""
        series: _Series = {(r,): 1.0 for r in resources}
        with self._lock:
            self._values["kubegpu_stale_node_resources"] = series

    @property
    def registry(self) -> CollectorRegistry:
        """The registry holding this object's families (built on first use)."""
        if self._registry is None:
            registry = CollectorRegistry(auto_describe=True)
            registry.register(_Collector(self))
            self._registry = registry
        return self._registry

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric in this registry."""
        return generate_latest(self.registry)

    def value(self, name: str, labels: dict[str, str] | None = None) -> float | None:
        """One sample's current value (for tests and the demo); None when absent."""
        return self.registry.get_sample_value(name, labels or {})

    def families(self) -> Iterator[Any]:
        """The families as prometheus_client metric objects, in exposition order."""
        # Read when scraped, as prometheus_client reads it at import.
        created = os.environ.get("PROMETHEUS_DISABLE_CREATED_SERIES", "False").lower() not in (
            "true",
            "1",
            "t",
        )
        bounds = [floatToGoString(b) for b in (*ALLOCATE_BUCKETS, math.inf)]  # type: ignore[no-untyped-call]
        with self._lock:
            values = {name: dict(series) for name, series in self._values.items()}
            stamps = {name: dict(series) for name, series in self._created.items()}
            histograms = {
                k: (list(h.counts), h.total, h.created) for k, h in self._histograms.items()
            }
        for name, text, kind, labelnames in _FAMILIES:
            family: Any
            if kind == "gauge":
                family = GaugeMetricFamily(name, text, labels=labelnames)
                for labels, value in values[name].items():
                    family.add_metric(labels, value)
            elif kind == "counter":
                family = CounterMetricFamily(name, text, labels=labelnames)
                for labels, value in values[name].items():
                    stamp = stamps[name][labels] if created else None
                    family.add_metric(labels, value, created=stamp)
            else:
                family = HistogramMetricFamily(name, text, labels=labelnames)
                for labels, (counts, total, stamp) in histograms.items():
                    cumulative = [sum(counts[: i + 1]) for i in range(len(counts))]
                    family.add_metric(labels, list(zip(bounds, cumulative, strict=True)), total)
                    if created:
                        family.add_sample(
                            f"{name}_created", dict(zip(labelnames, labels, strict=True)), stamp
                        )
            yield family
        if self._devices is not None:
            yield _device_family(self._devices)
        if self._usage is not None:
            yield from _usage_families(self._usage)


def _device_family(source: DeviceSource) -> Any:
    """`kubegpu_gpu_healthy`: a series per GPU and MIG slice, so that a GPU that goes away
    (off the bus, then not found again by the next discovery or after a restart) is seen as
    its series ending, which the per-resource counts cannot tell from a config change."""
    family = GaugeMetricFamily(
        "kubegpu_gpu_healthy",
        "1 while the GPU or MIG slice passes the health checks (Xid events, probes), 0 while "
        "it is unhealthy; one series per GPU and MIG slice the node has.",
        labels=DEVICE_LABELS,
    )
    try:
        rows = list(source())
    except Exception:  # a scrape must answer whatever the source does
        log.exception("reading the health of the node's GPUs failed")
        rows = []
    for row in rows:
        family.add_metric(row.labels(), 1.0 if row.healthy else 0.0)
    return family


def _usage_families(source: UsageSource) -> Iterator[Any]:
    """The per-container families of one collection; a failing source costs only them."""
    try:
        snapshot = source()
    except Exception:  # a scrape must answer whatever the source does
        log.exception("collecting the per-container GPU metrics failed")
        snapshot = UsageSnapshot(sources={"collector": False})
    families = [
        GaugeMetricFamily(name, text, labels=USAGE_LABELS) for name, text in _USAGE_FAMILIES
    ]
    used, limit, sm, processes = families
    for row in snapshot.rows:
        labels = row.labels()
        used.add_metric(labels, float(row.used_bytes))
        processes.add_metric(labels, float(row.processes))
        if row.limit_bytes is not None:
            limit.add_metric(labels, float(row.limit_bytes))
        if row.sm_percent is not None:
            sm.add_metric(labels, float(row.sm_percent))
    yield from families
    up = GaugeMetricFamily(
        "kubegpu_usage_source_up",
        "Whether each source of the per-container GPU metrics could be read at this scrape.",
        labels=("source",),
    )
    for name, ok in sorted(snapshot.sources.items()):
        up.add_metric((name,), 1.0 if ok else 0.0)
    yield up
    yield GaugeMetricFamily(
        "kubegpu_usage_rows_dropped",
        "Per-container rows left out of this scrape by the cap on rows (--usage-max-rows).",
        value=float(snapshot.dropped),
    )
    yield GaugeMetricFamily(
        "kubegpu_usage_collect_seconds",
        "How long collecting the per-container GPU metrics took at this scrape.",
        value=snapshot.seconds,
    )


class _Collector:
    """Hands a `Metrics` object's families to its registry at each collection."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Any]:
        return self._metrics.families()

    def describe(self) -> list[Any]:
        # Registering asks for the families (auto_describe); answering here keeps that from
        # calling the usage source, which blocks on the driver, wherever it happens.
        return []
