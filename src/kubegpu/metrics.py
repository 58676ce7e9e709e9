"""Prometheus metrics for the device plugin, served on `/metrics` by `kubegpu.httpserver`.

Each `Metrics` owns its own `CollectorRegistry` instead of the process-global one, so
tests and several daemons in one process (the demo, the integration suite) never
collide on metric names. Methods take plain values; label children are cached so that
the `Allocate` hot path pays one dict lookup and one lock per observation.
"""

from __future__ import annotations

import contextlib

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from kubegpu import __version__

#: The `Content-Type` of `Metrics.render()` output.
CONTENT_TYPE = CONTENT_TYPE_LATEST

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


class Metrics:
    """The plugin's metric families, registered on a private registry."""

    def __init__(self, version: str = __version__) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self._devices = Gauge(
            "kubegpu_devices",
            "Devices advertised to the kubelet, per resource.",
            ["resource"],
            registry=r,
        )
        self._healthy = Gauge(
            "kubegpu_devices_healthy",
            "Advertised devices currently reported Healthy, per resource.",
            ["resource"],
            registry=r,
        )
        self._allocations = Counter(
            "kubegpu_allocations",
            "Container allocations answered successfully, per resource.",
            ["resource"],
            registry=r,
        )
        self._allocate_errors = Counter(
            "kubegpu_allocate_errors",
            "Allocate requests refused, per resource and gRPC status code.",
            ["resource", "code"],
            registry=r,
        )
        self._allocate_seconds = Histogram(
            "kubegpu_allocate_duration_seconds",
            "Time to answer one Allocate request, per resource.",
            ["resource"],
            buckets=ALLOCATE_BUCKETS,
            registry=r,
        )
        self._xid = Counter(
            "kubegpu_xid_errors",
            "Xid (or AMD RAS) events reported by the driver, per GPU and Xid code.",
            ["uuid", "xid"],
            registry=r,
        )
        self._registrations = Counter(
            "kubegpu_registrations",
            "Registration attempts with the kubelet, per resource and result.",
            ["resource", "result"],
            registry=r,
        )
        self._kubelet_restarts = Counter(
            "kubegpu_kubelet_restarts",
            "Kubelet restarts detected (socket directory wiped), each forcing re-registration.",
            registry=r,
        )
        self._config_reloads = Counter(
            "kubegpu_config_reloads",
            "Configuration reloads, by result (ok or failed).",
            ["result"],
            registry=r,
        )
        self._health_transitions = Counter(
            "kubegpu_health_transitions",
            "Device health changes, per resource and the health entered.",
            ["resource", "health"],
            registry=r,
        )
        self._events_dropped = Counter(
            "kubegpu_events_dropped",
            "Kubernetes Events not recorded (queue full or API failure), by reason.",
            ["reason"],
            registry=r,
        )
        build = Gauge(
            "kubegpu_build_info",
            "Always 1; the version label says which kubegpu is running.",
            ["version"],
            registry=r,
        )
        build.labels(version=version).set(1)
        # Cached label children: `labels()` parses and locks on every call.
        self._allocate_children: dict[str, tuple[Counter, Histogram]] = {}

    def set_devices(self, resource: str, total: int, healthy: int) -> None:
        """Record what is advertised now for `resource` (after every ListAndWatch send)."""
        self._devices.labels(resource=resource).set(total)
        self._healthy.labels(resource=resource).set(healthy)

    def remove_resource(self, resource: str) -> None:
        """Forget a resource no longer served (after a config reload renames it)."""
        for gauge in (self._devices, self._healthy):
            with contextlib.suppress(KeyError):
                gauge.remove(resource)

    def observe_allocate(self, resource: str, seconds: float, code: str | None = None) -> None:
        """Record one Allocate answer; `code` is the gRPC status name when it failed."""
        children = self._allocate_children.get(resource)
        if children is None:
            children = (
                self._allocations.labels(resource=resource),
                self._allocate_seconds.labels(resource=resource),
            )
            self._allocate_children[resource] = children
        allocations, latency = children
        latency.observe(seconds)
        if code is None or code == OK:
            allocations.inc()
        else:
            self._allocate_errors.labels(resource=resource, code=code).inc()

    def xid(self, uuid: str, code: int) -> None:
        self._xid.labels(uuid=uuid, xid=str(code)).inc()

    def registration(self, resource: str, ok: bool) -> None:
        self._registrations.labels(resource=resource, result="ok" if ok else "failed").inc()

    def kubelet_restart(self) -> None:
        self._kubelet_restarts.inc()

    def config_reload(self, ok: bool) -> None:
        self._config_reloads.labels(result="ok" if ok else "failed").inc()

    def health_transition(self, resource: str, healthy: bool) -> None:
        """Count one device entering Healthy or Unhealthy under `resource`."""
        health = "Healthy" if healthy else "Unhealthy"
        self._health_transitions.labels(resource=resource, health=health).inc()

    def event_dropped(self, reason: str) -> None:
        """Count a Kubernetes Event given up on (`queue-full`, `api-error`)."""
        self._events_dropped.labels(reason=reason).inc()

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric in this registry."""
        return generate_latest(self.registry)

    def value(self, name: str, labels: dict[str, str] | None = None) -> float | None:
        """One sample's current value (for tests and the demo); None when absent."""
        return self.registry.get_sample_value(name, labels or {})
