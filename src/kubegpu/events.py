"""Kubernetes Events on the Node object, so `kubectl describe node` tells what happened.

Events are a courtesy to the operator, never a dependency: `NodeEvents.emit` only puts
the event on a bounded queue and returns; a background task sends it through the
Kubernetes client in a worker thread. When the API is slow the queue fills and new
events are dropped (and counted); when it fails, the first failure of each kind is
logged as a warning and the event is dropped. Identical events repeated within
`dedupe_seconds` are sent once, and the events that remain share one token bucket per
node, as client-go's event recorder limits each source and object (`EventCorrelator`'s
spam filter: a burst of 25, then one event every 5 minutes), so a node whose GPUs keep
flapping sends at most 12 events an hour once its burst is spent, not two per GPU a minute.

The Kubernetes API sits behind the small `EventSink` protocol: `KubernetesEventSink`
writes through the one Kubernetes adapter (`kubegpu.kube`: `KubeClient` for a real
cluster, `FakeKube` in memory), `FakeEventSink` records events themselves, for tests and
for anyone embedding kubegpu.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, Protocol

from kubegpu.kube import Kube, KubeError, default_client
from kubegpu.metrics import Metrics
from kubegpu.supervisor import spawn

log = logging.getLogger(__name__)

#: `source.component` / `reportingComponent` of every event we record.
COMPONENT = "kubegpu-device-plugin"
#: Node events live in `default`, where the kubelet records its own node events.
NAMESPACE = "default"


class EventType(StrEnum):
    NORMAL = "Normal"
    WARNING = "Warning"


class Reason(StrEnum):
    """The reasons kubegpu uses (CamelCase, as Kubernetes reasons are)."""

    GPU_UNHEALTHY = "GPUUnhealthy"
    GPU_HEALTHY = "GPUHealthy"
    CONFIG_REJECTED = "ConfigRejected"
    CONFIG_APPLIED = "ConfigApplied"
    REGISTRATION_FAILED = "RegistrationFailed"
    MPS_DAEMON_FAILED = "MPSDaemonFailed"
    #: DRA mode: the Node's status still shows a device plugin's resource (kubegpu.dra.stale).
    STALE_DEVICE_PLUGIN_RESOURCE = "StaleDevicePluginResource"


#: The name events' failures had before `kubegpu.kube`: every API failure is a `KubeError`.
EventError = KubeError

#: Events a node may send at once, and the seconds that earn it one more: client-go's
#: `defaultSpamBurst` and `defaultSpamQPS` (1/300), which every Kubernetes component's
#: event recorder applies per source and object (ours: this node's plugin, the Node).
SPAM_BURST = 25
SPAM_REFILL_SECONDS = 300.0


@dataclass(frozen=True)
class NodeEvent:
    """One event about the node, before it becomes a Kubernetes `Event` object."""

    node: str
    reason: str
    message: str
    type: EventType = EventType.NORMAL
    #: When it happened (UTC).
    time: datetime = field(default_factory=lambda: datetime.now(UTC))


class EventSink(Protocol):
    """Writes one event; blocking (it runs in a worker thread). Raises `KubeError`."""

    def create(self, event: NodeEvent) -> None: ...


class KubernetesEventSink:
    """Writes core/v1 Events through the `kubegpu.kube` adapter."""

    def __init__(self, kube: Kube, *, namespace: str = NAMESPACE, timeout: float = 5.0) -> None:
        self.kube = kube
        self.namespace = namespace
        #: Seconds one event write may take: events must never hold up their queue for long.
        self.timeout = timeout

    @classmethod
    def connect(cls) -> KubernetesEventSink:
        """On the process's one client, its credentials loaded now (raises `KubeError`)."""
        return cls(default_client().connect())

    def body(self, event: NodeEvent) -> dict[str, Any]:
        """The Event object in API spelling, as the kubelet records its own node events."""
        # client-go names events `<object>.<hex nanoseconds>`; the kubelet uses the node
        # name as the UID of the node reference, which `kubectl describe node` matches.
        name = f"{event.node}.{time.time_ns():x}"
        stamp = event.time.isoformat()
        return {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": name, "namespace": self.namespace},
            "involvedObject": {
                "kind": "Node",
                "name": event.node,
                "uid": event.node,
                "apiVersion": "v1",
            },
            "reason": event.reason,
            "message": event.message,
            "type": str(event.type),
            "source": {"component": COMPONENT, "host": event.node},
            "firstTimestamp": stamp,
            "lastTimestamp": stamp,
            "count": 1,
            "reportingComponent": COMPONENT,
            "reportingInstance": event.node,
        }

    def create(self, event: NodeEvent) -> None:
        self.kube.create_event(self.namespace, self.body(event), timeout=self.timeout)


class LazySink:
    """Connects on the first event, in the delivery thread: start-up never waits on
    loading credentials, and most nodes never post an event."""

    def __init__(self, connect: Callable[[], EventSink]) -> None:
        self._connect = connect
        self._sink: EventSink | None = None
        self._lock = threading.Lock()

    def create(self, event: NodeEvent) -> None:
        with self._lock:
            if self._sink is None:
                self._sink = self._connect()  # KubeError: logged once, event dropped
        self._sink.create(event)


class FakeEventSink:
    """Records events in memory; `fail` makes the next writes raise; `block` holds them."""

    def __init__(self) -> None:
        self.events: list[NodeEvent] = []
        self.fail: Exception | None = None
        #: Cleared: writes wait until it is set (to simulate a slow API server).
        self.gate = threading.Event()
        self.gate.set()
        self.attempts = 0

    def create(self, event: NodeEvent) -> None:
        self.attempts += 1
        self.gate.wait()
        if self.fail is not None:
            raise self.fail
        self.events.append(event)


class TokenBucket:
    """`burst` tokens, one more every `refill_seconds` (client-go's token bucket rate
    limiter, read passively: `take` answers at once). Ten lines of arithmetic on an
    injected clock, which the tests and benchmarks move; not worth a dependency."""

    def __init__(self, burst: int, refill_seconds: float, now: float) -> None:
        self.burst = burst
        self.refill_seconds = refill_seconds
        self._tokens = float(burst)
        self._at = now

    def take(self, now: float) -> bool:
        """Spend a token if one is there (refilled up to `burst` since the last call)."""
        earned = (now - self._at) / self.refill_seconds if self.refill_seconds > 0 else self.burst
        self._tokens = min(float(self.burst), self._tokens + max(0.0, earned))
        self._at = now
        if self._tokens < 1:
            return False
        self._tokens -= 1
        return True


class NodeEvents:
    """Best-effort recorder of events on one Node.

    Call `emit` from the event loop thread; run `run()` as a task (or use
    `start`/`stop`) to deliver.
    """

    def __init__(
        self,
        node: str,
        sink: EventSink | None,
        *,
        metrics: Metrics | None = None,
        maxsize: int = 64,
        dedupe_seconds: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        spam_burst: int = SPAM_BURST,
        spam_refill_seconds: float = SPAM_REFILL_SECONDS,
    ) -> None:
        self.node = node
        self.sink = sink
        self.metrics = metrics
        self.dedupe_seconds = dedupe_seconds
        self._clock = clock
        #: Every event of this node that is not a repeat spends a token (see the module doc).
        self._bucket = TokenBucket(spam_burst, spam_refill_seconds, clock())
        self._limit_logged = False
        self._queue: asyncio.Queue[NodeEvent] = asyncio.Queue(maxsize)
        self._last_sent: dict[tuple[str, str, str], float] = {}
        self._failures_logged: set[tuple[str, str]] = set()
        self._task: asyncio.Task[None] | None = None
        #: Events given up on, by cause: `rate-limited`, `queue-full`, `api-error`.
        self.dropped: dict[str, int] = {}
        #: Events delivered to the sink.
        self.sent = 0

    @classmethod
    def disabled(cls) -> NodeEvents:
        """A recorder that accepts and discards everything (no node name or no cluster)."""
        return cls("", None)

    @classmethod
    def from_environment(
        cls,
        env: Mapping[str, str] | None = None,
        *,
        node: str | None = None,
        metrics: Metrics | None = None,
        connect: Callable[[], EventSink] = KubernetesEventSink.connect,
        lazy: bool = False,
    ) -> NodeEvents:
        """Enabled when the node's name is known and a cluster is reachable.

        The name is `node` (the `--node-name` flag, which `NODE_NAME` also sets) when
        given, else `NODE_NAME` (downward API). `lazy` defers connecting to the first
        event; a cluster that turns out unreachable then shows as one logged delivery
        failure.
        """
        if node is None:
            node = (os.environ if env is None else env).get("NODE_NAME", "")
        node = node.strip()
        if not node:
            log.info("NODE_NAME is not set: not recording Kubernetes events")
            return cls.disabled()
        if lazy:
            return cls(node, LazySink(connect), metrics=metrics)
        try:
            sink = connect()
        except KubeError as e:
            log.warning("not recording Kubernetes events: %s", e)
            return cls.disabled()
        return cls(node, sink, metrics=metrics)

    @property
    def enabled(self) -> bool:
        return self.sink is not None

    def emit(self, reason: str, message: str, type: EventType = EventType.NORMAL) -> bool:
        """Queue an event; returns at once. False when disabled, deduplicated or dropped."""
        if self.sink is None:
            return False
        key = (reason, message, str(type))
        now = self._clock()
        last = self._last_sent.get(key)
        if last is not None and now - last < self.dedupe_seconds:
            return False
        # A repeat costs nothing above; anything else spends the node's budget.
        if not self._bucket.take(now):
            self._rate_limited(reason)
            return False
        try:
            self._queue.put_nowait(NodeEvent(self.node, reason, message, type))
        except asyncio.QueueFull:
            self._drop("queue-full")
            return False
        self._last_sent[key] = now
        return True

    def _rate_limited(self, reason: str) -> None:
        if not self._limit_logged:
            self._limit_logged = True
            log.warning(
                "node %s: more than %d events at once; dropping events (%s first) until the "
                "budget refills, one every %.0f s (further drops are counted in "
                "kubegpu_events_dropped_total, not logged)",
                self.node,
                self._bucket.burst,
                reason,
                self._bucket.refill_seconds,
            )
        self._drop("rate-limited")

    def warning(self, reason: str, message: str) -> bool:
        return self.emit(reason, message, EventType.WARNING)

    async def run(self) -> None:
        """Deliver queued events until cancelled."""
        while True:
            event = await self._queue.get()
            try:
                await self._deliver(event)
            finally:
                self._queue.task_done()

    async def _deliver(self, event: NodeEvent) -> None:
        assert self.sink is not None
        try:
            await asyncio.to_thread(self.sink.create, event)
        except Exception as e:
            kind = (event.reason, type(e).__name__)
            if kind not in self._failures_logged:
                self._failures_logged.add(kind)
                log.warning(
                    "could not record event %s on node %s (further such failures are "
                    "logged at debug level): %s",
                    event.reason,
                    event.node,
                    e,
                )
            else:
                log.debug("could not record event %s: %s", event.reason, e)
            self._drop("api-error")
        else:
            self.sent += 1

    async def drain(self) -> None:
        """Wait until every queued event has been delivered or dropped."""
        await self._queue.join()

    def start(self) -> None:
        if self.sink is not None and self._task is None:
            self._task = spawn("node events", self.run())

    async def stop(self, flush_timeout: float = 2.0) -> None:
        """Give queued events `flush_timeout` seconds to go out, then stop."""
        task, self._task = self._task, None
        if task is None:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.drain(), flush_timeout)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    def _drop(self, reason: str) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1
        if self.metrics is not None:
            self.metrics.event_dropped(reason)
