"""Device-plugin resources a Node's status still shows after the node moved to DRA."""

from __future__ import annotations

import json
import logging
import re
import shlex
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kubegpu.dra.stale import (
    StaleResource,
    StaleResourceCheck,
    fix_command,
    stale_resources,
    warning_text,
)
from kubegpu.events import EventType, FakeEventSink, NodeEvents, Reason
from kubegpu.kube import KubeError
from kubegpu.metrics import Metrics
from tests.rig.kube import FakeKube

REPO = Path(__file__).resolve().parents[3]
NODE = "gpu-node-1"
GPU = StaleResource("nvidia.com/gpu", "8", "8")


# -- the pure part ------------------------------------------------------------------------------


def test_only_the_served_names_the_status_shows_are_stale_whatever_their_quantity() -> None:
    status = {
        "capacity": {"cpu": "64", "nvidia.com/gpu": "8", "nvidia.com/mig-1g.10gb": "0"},
        "allocatable": {"cpu": "63", "nvidia.com/gpu": "8", "example.com/nic": "2"},
    }
    names = ["nvidia.com/mig-1g.10gb", "nvidia.com/gpu", "nvidia.com/gpu.shared", "nvidia.com/gpu"]
    assert stale_resources(status, names) == (
        GPU,
        StaleResource("nvidia.com/mig-1g.10gb", "0", None),
    )
    assert stale_resources({"capacity": {"cpu": "64"}, "allocatable": {}}, names) == ()
    assert stale_resources({}, names) == ()


def test_the_fix_removes_exactly_the_keys_present_from_the_status_subresource() -> None:
    command = fix_command(NODE, [GPU, StaleResource("nvidia.com/mig-1g.10gb", "0", None)])
    args = shlex.split(command)
    assert args[:7] == [
        "kubectl",
        "patch",
        "node",
        NODE,
        "--subresource=status",
        "--type=json",
        "-p",
    ]
    assert json.loads(args[7]) == [
        {"op": "remove", "path": "/status/capacity/nvidia.com~1gpu"},
        {"op": "remove", "path": "/status/allocatable/nvidia.com~1gpu"},
        {"op": "remove", "path": "/status/capacity/nvidia.com~1mig-1g.10gb"},
    ]
    assert len(args) == 8
    # As documented in docs/dra.md's switching procedure.
    assert command == (
        "kubectl patch node gpu-node-1 --subresource=status --type=json -p "
        '\'[{"op":"remove","path":"/status/capacity/nvidia.com~1gpu"},'
        '{"op":"remove","path":"/status/allocatable/nvidia.com~1gpu"},'
        '{"op":"remove","path":"/status/capacity/nvidia.com~1mig-1g.10gb"}]\''
    )


def test_the_warning_is_one_line_with_the_quantities_escaped() -> None:
    forged = StaleResource("nvidia.com/gpu", "8\nFORGED line", None)
    text = warning_text(NODE, (forged,))
    assert "\n" not in text
    assert "nvidia.com/gpu (capacity 8\\nFORGED line)" in text
    assert "runs with no claim and no GPU" in text
    assert text.endswith(fix_command(NODE, [forged]))


def test_docs_dra_md_switching_procedure_drains_and_patches_as_kubegpu_says() -> None:
    """The commands of docs/dra.md's switching procedure: a drain that a node running
    DaemonSets (kubegpu's own) allows, and the status patch `fix_command` gives."""
    text = (REPO / "docs" / "dra.md").read_text(encoding="utf-8")
    section = text[text.index("## Switching a node from the device plugin") :]
    section = section[: section.index("\n## ", 1)]
    lines = [
        shlex.split(line)
        for block in re.findall(r"```console\n(.*?)```", section, re.S)
        for line in block.strip().splitlines()
    ]
    drain = next(c for c in lines if c[:2] == ["kubectl", "drain"])
    assert {"--ignore-daemonsets", "--delete-emptydir-data"} <= set(drain)
    patch = next(c for c in lines if c[:2] == ["kubectl", "patch"])
    assert patch == shlex.split(fix_command("<node>", [GPU]))
    assert "`kubectl uncordon <node>`" in section


# -- reading the Node and saying so once -----------------------------------------------------------


@pytest.fixture
async def recorder() -> AsyncIterator[tuple[NodeEvents, FakeEventSink]]:
    sink = FakeEventSink()
    # No deduplication by the recorder: saying it once is the check's job.
    events = NodeEvents(NODE, sink, dedupe_seconds=0)
    events.start()
    yield events, sink
    await events.stop()


def check_of(kube: FakeKube, events: NodeEvents, metrics: Metrics) -> StaleResourceCheck:
    return StaleResourceCheck(
        kube, NODE, lambda: {"nvidia.com/gpu", "nvidia.com/gpu.shared"}, events=events,
        metrics=metrics,
    )  # fmt: skip


async def test_a_stale_resource_is_reported_once_until_it_is_removed(
    recorder: tuple[NodeEvents, FakeEventSink], caplog: pytest.LogCaptureFixture
) -> None:
    events, sink = recorder
    kube, metrics = FakeKube(), Metrics()
    kube.add_node(NODE)
    kube.set_node_status(NODE, {"cpu": "64", "nvidia.com/gpu": "8"})
    check = check_of(kube, events, metrics)
    caplog.set_level(logging.INFO, logger="kubegpu.dra.stale")
    for _ in range(3):
        assert await check.check()
    kube.set_node_status(NODE, {"cpu": "64", "nvidia.com/gpu": "0"})  # a kubelet restart
    assert await check.check()
    await events.drain()
    assert [(e.reason, e.type) for e in sink.events] == [
        (Reason.STALE_DEVICE_PLUGIN_RESOURCE, EventType.WARNING)
    ]
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert [r.getMessage() for r in errors] == [sink.events[0].message]
    assert fix_command(NODE, [GPU]) in sink.events[0].message
    assert metrics.value("kubegpu_stale_node_resources", {"resource": "nvidia.com/gpu"}) == 1
    assert check.detail() == (
        "Node status still shows device-plugin resource(s) nvidia.com/gpu: see the log"
    )
    # The operator runs the fix.
    kube.set_node_status(NODE, {"cpu": "64"})
    assert await check.check()
    assert check.found == () and check.detail() is None
    assert metrics.value("kubegpu_stale_node_resources", {"resource": "nvidia.com/gpu"}) is None
    assert "no longer shows device-plugin resource(s) nvidia.com/gpu" in caplog.records[-1].message
    # Back again (a device plugin registered): reported again, once.
    kube.set_node_status(NODE, {"nvidia.com/gpu.shared": "32"})
    assert await check.check() and await check.check()
    await events.drain()
    assert len(sink.events) == 2 and "nvidia.com/gpu.shared" in sink.events[1].message


async def test_a_node_that_cannot_be_read_is_logged_once_per_streak(
    recorder: tuple[NodeEvents, FakeEventSink], caplog: pytest.LogCaptureFixture
) -> None:
    events, sink = recorder
    kube, metrics = FakeKube(), Metrics()
    kube.add_node(NODE)
    check = check_of(kube, events, metrics)
    kube.fail_with = KubeError(f"get Node {NODE}: HTTP 403 Forbidden; check the RBAC")
    caplog.set_level(logging.INFO, logger="kubegpu.dra.stale")
    assert not await check.check()
    assert not await check.check()
    kube.fail_with = None
    assert await check.check()
    kube.fail_with = KubeError("get Node: cannot reach the API server")
    assert not await check.check()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and "HTTP 403" in warnings[0]
    assert check.checks == 4 and sink.events == []
