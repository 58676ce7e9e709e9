"""`serve --mode dra` on a Node whose status still shows the device plugin's resources."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from kubegpu.daemon import Daemon
from kubegpu.dra.stale import StaleResource, fix_command
from kubegpu.events import KubernetesEventSink, NodeEvents, Reason
from kubegpu.metrics import Metrics
from tests.fronts import dra_driver, stale_check
from tests.integration.dra.test_serve_dra import NODE, settings
from tests.rig.kube import FakeKube
from tests.waiting import eventually

STALE_READY = "ok; Node status still shows device-plugin resource(s) nvidia.com/gpu: see the log"


async def test_a_stale_device_plugin_resource_is_reported_once(
    socket_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    kube = FakeKube()
    kube.add_node(NODE)
    # What the switch from the device plugin leaves: nvidia.com/gpu that nothing removes.
    kube.set_node_status(NODE, {"cpu": "64", "nvidia.com/gpu": "8"})
    metrics = Metrics()
    # The recorder does not deduplicate: reporting once is the daemon's doing.
    events = NodeEvents(NODE, KubernetesEventSink(kube), dedupe_seconds=0)
    running = Daemon(settings(socket_dir), kube=kube, events=events, metrics=metrics)
    caplog.set_level(logging.INFO, logger="kubegpu.dra.stale")
    stop = asyncio.Event()
    task = asyncio.create_task(running.run(stop))
    try:
        await running.started.wait()
        check = stale_check(running)
        assert check is not None
        await eventually(lambda: bool(kube.events))
        # More reads: the kubelet registering the driver again, and more.
        registered = dra_driver(running).registration.on_registered
        assert registered is not None

        async def registered_again() -> None:
            before = check.checks
            registered()
            await eventually(lambda: check.checks > before)

        for _ in range(3):
            await registered_again()
        await events.drain()
        stale = [
            body for _, body, _ in kube.events if body["reason"] == "StaleDevicePluginResource"
        ]
        assert len(stale) == 1 and stale[0]["type"] == "Warning"
        assert stale[0]["reason"] == Reason.STALE_DEVICE_PLUGIN_RESOURCE
        assert stale[0]["involvedObject"]["name"] == NODE
        fix = fix_command(NODE, [StaleResource("nvidia.com/gpu", "8", "8")])
        errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert len(errors) == 1 and errors[0].endswith(fix)
        assert errors[0] == stale[0]["message"]
        assert running.ready() == (True, STALE_READY)
        assert metrics.value("kubegpu_stale_node_resources", {"resource": "nvidia.com/gpu"}) == 1
        # The operator runs the fix: the next read (here the next registration) clears it.
        kube.set_node_status(NODE, {"cpu": "64"})
        await registered_again()
        assert not check.found
        assert running.ready() == (True, "ok")
        assert metrics.value("kubegpu_stale_node_resources", {"resource": "nvidia.com/gpu"}) is None
    finally:
        stop.set()
        await task


async def test_a_clean_node_reports_nothing(socket_dir: Path) -> None:
    kube = FakeKube()
    kube.add_node(NODE)
    kube.set_node_status(NODE, {"cpu": "64", "example.com/nic": "2"})
    events = NodeEvents(NODE, KubernetesEventSink(kube), dedupe_seconds=0)
    running = Daemon(settings(socket_dir), kube=kube, events=events)
    stop = asyncio.Event()
    task = asyncio.create_task(running.run(stop))
    try:
        await running.started.wait()
        await eventually(lambda: stale_check(running).checks >= 1)
        stale_check(running).poke()  # and once more, to be sure nothing is queued late
        await eventually(lambda: stale_check(running).checks >= 2)
        await events.drain()
        assert kube.events == [] and running.ready() == (True, "ok")
        assert f"get node/{NODE}/status" in kube.calls
    finally:
        stop.set()
        await task
