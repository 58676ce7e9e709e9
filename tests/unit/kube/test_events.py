"""Node events: best effort, never blocking, shaped like the kubelet's own node events."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from datetime import datetime

import pytest

from kubegpu.events import (
    COMPONENT,
    EventSink,
    EventType,
    FakeEventSink,
    KubernetesEventSink,
    NodeEvent,
    NodeEvents,
    Reason,
)
from kubegpu.kube import KubeError
from kubegpu.metrics import Metrics
from tests.rig.kube import FakeKube
from tests.waiting import WAIT


@pytest.fixture
async def recorder() -> AsyncIterator[tuple[NodeEvents, FakeEventSink]]:
    sink = FakeEventSink()
    events = NodeEvents("node-a", sink, metrics=Metrics(), maxsize=4)
    events.start()
    yield events, sink
    sink.gate.set()
    await events.stop()


async def test_emit_delivers_in_order(recorder: tuple[NodeEvents, FakeEventSink]) -> None:
    events, sink = recorder
    assert events.warning(Reason.GPU_UNHEALTHY, "GPU-1 Xid 79: fallen off the bus")
    assert events.emit(Reason.GPU_HEALTHY, "GPU-1 answers again")
    await asyncio.wait_for(events.drain(), WAIT)
    assert [(e.node, e.reason, e.type) for e in sink.events] == [
        ("node-a", "GPUUnhealthy", EventType.WARNING),
        ("node-a", "GPUHealthy", EventType.NORMAL),
    ]
    assert events.sent == 2


async def test_emit_never_blocks_and_drops_when_full(
    recorder: tuple[NodeEvents, FakeEventSink],
) -> None:
    events, sink = recorder
    sink.gate.clear()  # the API server hangs
    accepted = [events.emit("Test", f"event {i}") for i in range(10)]
    # emit never yields to the loop, so the worker has taken nothing yet: 4 fit
    assert accepted == [True] * 4 + [False] * 6
    assert events.dropped["queue-full"] == accepted.count(False)
    assert events.metrics is not None
    dropped = events.metrics.value("kubegpu_events_dropped_total", {"reason": "queue-full"})
    assert dropped == accepted.count(False)
    sink.gate.set()
    await asyncio.wait_for(events.drain(), WAIT)
    assert len(sink.events) == accepted.count(True)


async def test_api_failures_dropped_and_logged_once_per_kind(
    recorder: tuple[NodeEvents, FakeEventSink], caplog: pytest.LogCaptureFixture
) -> None:
    events, sink = recorder
    sink.fail = KubeError("create Event default/n: HTTP 403 Forbidden", status=403)
    with caplog.at_level(logging.DEBUG, logger="kubegpu.events"):
        for i in range(3):
            events.warning(Reason.GPU_UNHEALTHY, f"GPU-{i}")
        events.warning(Reason.CONFIG_REJECTED, "bad key")
        await asyncio.wait_for(events.drain(), WAIT)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2  # one per (reason, error kind)
    assert "403 Forbidden" in warnings[0].getMessage()
    assert events.dropped == {"api-error": 4}
    # the recorder keeps working once the API recovers
    sink.fail = None
    events.emit("Recovered", "ok")
    await asyncio.wait_for(events.drain(), WAIT)
    assert [e.reason for e in sink.events] == ["Recovered"]


async def test_identical_events_deduplicated_within_window() -> None:
    now = [100.0]
    sink = FakeEventSink()
    events = NodeEvents("n", sink, dedupe_seconds=60, clock=lambda: now[0])
    assert events.warning("GPUUnhealthy", "GPU-1 Xid 48")
    assert not events.warning("GPUUnhealthy", "GPU-1 Xid 48")
    assert events.warning("GPUUnhealthy", "GPU-2 Xid 48")  # different message
    now[0] += 61
    assert events.warning("GPUUnhealthy", "GPU-1 Xid 48")
    events.start()
    await asyncio.wait_for(events.drain(), WAIT)
    await events.stop()
    assert len(sink.events) == 3


def test_a_node_sends_a_burst_then_one_event_per_five_minutes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Eight GPUs flapping for an hour made 960 events (two per GPU a minute, every one a
    new message past the de-duplication window); client-go's recorders stop at 25 and then
    one every 5 minutes per source and object, and so does the node's recorder now."""
    now = [0.0]
    events = NodeEvents("n", FakeEventSink(), metrics=Metrics(), maxsize=100, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="kubegpu.events"):
        sent = [events.warning(Reason.GPU_UNHEALTHY, f"GPU-{i} is unhealthy") for i in range(30)]
    assert sent == [True] * 25 + [False] * 5
    assert events.dropped == {"rate-limited": 5}
    assert events.metrics is not None
    assert events.metrics.value("kubegpu_events_dropped_total", {"reason": "rate-limited"}) == 5
    (logged,) = caplog.records  # the first drop only
    assert "dropping events (GPUUnhealthy first)" in logged.getMessage()
    now[0] += 300
    assert events.emit(Reason.GPU_HEALTHY, "GPU-0 is healthy again")
    assert not events.emit(Reason.GPU_HEALTHY, "GPU-1 is healthy again")
    now[0] += 3600 * 24  # a quiet day refills the burst, and no more
    assert [events.emit("E", str(i)) for i in range(26)] == [True] * 25 + [False]


def test_repeats_do_not_spend_the_nodes_event_budget() -> None:
    now = [0.0]
    events = NodeEvents("n", FakeEventSink(), maxsize=100, clock=lambda: now[0])
    assert sum(events.warning(Reason.GPU_UNHEALTHY, "GPU-0 is unhealthy") for _ in range(100)) == 1
    assert all(events.emit("E", str(i)) for i in range(24))


async def test_stop_flushes_pending_events() -> None:
    sink = FakeEventSink()
    events = NodeEvents("n", sink)
    events.start()
    for i in range(3):
        events.emit("E", str(i))
    await events.stop(flush_timeout=WAIT)
    assert [e.message for e in sink.events] == ["0", "1", "2"]
    await events.stop()  # idempotent


async def test_stop_gives_up_on_a_hung_api() -> None:
    sink = FakeEventSink()
    sink.gate.clear()
    events = NodeEvents("n", sink)
    events.start()
    events.emit("E", "stuck")
    await asyncio.wait_for(events.stop(flush_timeout=0.05), WAIT)
    sink.gate.set()


def test_disabled_accepts_and_discards() -> None:
    events = NodeEvents.disabled()
    assert not events.enabled
    assert not events.warning(Reason.GPU_UNHEALTHY, "x")


def test_from_environment() -> None:
    sink = FakeEventSink()

    def connect() -> EventSink:
        return sink

    def unreachable() -> EventSink:
        raise KubeError("no Kubernetes credentials: no in-cluster config and no usable kubeconfig")

    assert not NodeEvents.from_environment({}, connect=connect).enabled
    assert not NodeEvents.from_environment({"NODE_NAME": " "}, connect=connect).enabled
    assert not NodeEvents.from_environment({"NODE_NAME": "n1"}, connect=unreachable).enabled
    events = NodeEvents.from_environment({"NODE_NAME": "n1"}, connect=connect)
    # The --node-name flag's value wins over the environment, and an empty one disables.
    assert NodeEvents.from_environment({}, node="n2", connect=connect).node == "n2"
    assert NodeEvents.from_environment({"NODE_NAME": "n1"}, node="n2", connect=connect).node == "n2"
    assert not NodeEvents.from_environment({"NODE_NAME": "n1"}, node="", connect=connect).enabled
    assert events.enabled
    assert events.node == "n1"
    assert events.sink is sink


def test_kubernetes_sink_builds_a_node_event() -> None:
    kube = FakeKube()
    KubernetesEventSink(kube, timeout=3).create(
        NodeEvent("node-a", "GPUUnhealthy", "GPU-1 Xid 79", EventType.WARNING)
    )
    ((namespace, body, timeout),) = kube.events
    assert (namespace, timeout) == ("default", 3)
    assert (body["apiVersion"], body["kind"]) == ("v1", "Event")
    assert body["metadata"]["namespace"] == "default"
    assert body["metadata"]["name"].startswith("node-a.")
    ref = body["involvedObject"]
    assert (ref["kind"], ref["name"], ref["uid"], ref["apiVersion"]) == (
        "Node",
        "node-a",
        "node-a",
        "v1",
    )
    assert (body["reason"], body["message"], body["type"]) == (
        "GPUUnhealthy",
        "GPU-1 Xid 79",
        "Warning",
    )
    assert (body["source"]["component"], body["source"]["host"]) == (COMPONENT, "node-a")
    assert (body["reportingComponent"], body["reportingInstance"]) == (COMPONENT, "node-a")
    assert body["firstTimestamp"] == body["lastTimestamp"]
    assert datetime.fromisoformat(body["firstTimestamp"]).tzinfo is not None
    assert body["count"] == 1


def test_kubernetes_sink_names_are_unique() -> None:
    kube = FakeKube()
    sink = KubernetesEventSink(kube)
    for _ in range(3):
        sink.create(NodeEvent("n", "R", "m"))
    assert len({body["metadata"]["name"] for _, body, _ in kube.events}) == 3


def test_kubernetes_sink_passes_the_adapters_error_on() -> None:
    kube = FakeKube()
    refused = KubeError("create Event default/n.1: HTTP 403 Forbidden", status=403)
    kube.fail_next("create event/default/", refused)
    sink = KubernetesEventSink(kube)
    with pytest.raises(KubeError) as info:
        sink.create(NodeEvent("n", "R", "m"))
    assert info.value is refused
    sink.create(NodeEvent("n", "R", "again"))  # only the next write was refused
    assert [body["message"] for _, body, _ in kube.events] == ["again"]


async def test_events_reach_the_kube_adapter_and_its_failures_are_dropped() -> None:
    kube = FakeKube()
    kube.fail_next("create event/", KubeError("create Event: cannot reach the API server"))
    events = NodeEvents("node-a", KubernetesEventSink(kube))
    events.start()
    assert events.warning(Reason.GPU_UNHEALTHY, "GPU-1 Xid 79")
    assert events.emit(Reason.GPU_HEALTHY, "GPU-1 answers again")
    await asyncio.wait_for(events.drain(), WAIT)
    await events.stop()
    assert events.dropped == {"api-error": 1}
    assert [body["reason"] for _, body, _ in kube.events] == ["GPUHealthy"]


async def test_lazy_sink_connects_on_first_event_only() -> None:
    from kubegpu.events import FakeEventSink, NodeEvents

    fake = FakeEventSink()
    connects: list[int] = []

    def connect() -> FakeEventSink:
        connects.append(1)
        return fake

    events = NodeEvents.from_environment({"NODE_NAME": "n1"}, connect=connect, lazy=True)
    assert events.enabled and connects == []
    events.start()
    assert events.emit("GPUUnhealthy", "GPU 3 is unhealthy")
    assert events.emit("GPUHealthy", "GPU 3 is healthy again")
    await events.drain()
    await events.stop()
    assert connects == [1]
    assert [e.reason for e in fake.events] == ["GPUUnhealthy", "GPUHealthy"]
