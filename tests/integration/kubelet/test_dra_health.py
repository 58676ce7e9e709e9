"""The kubelet emulator's side of the DRA health stream, against drivers on real sockets.

Each test follows pkg/kubelet/cm/dra (see tests.rig.dra.health): the stream opened
for every registered plugin and again after it ends, an unimplemented service reported as
the kubelet logs it, each device's health in the pod's allocatedResourcesStatus under the
claim's name with the device's CDI ID, pods notified of a change, health forgotten when the
stream ends.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from kubegpu.api import dra_health_pb2 as health_pb
from tests.integration.kubelet.dra_fakes import (
    DRIVER,
    FakeDriver,
    ScriptedHealth,
    allocated_claim,
    pod,
)
from tests.rig.dra import HEALTHY, UNHEALTHY, UNKNOWN, DRAKubelet
from tests.rig.kube import FakeKube
from tests.waiting import WAIT, eventually

POOL = "node-1"


@pytest.fixture
async def node(socket_dir: Path, kube: FakeKube) -> AsyncIterator[DRAKubelet]:
    emulator = DRAKubelet(socket_dir, kube, retry_initial=0.05, health_retry=0.05)
    await emulator.start()
    try:
        yield emulator
    finally:
        await emulator.stop()


@pytest.fixture
async def health(node: DRAKubelet, kube: FakeKube) -> AsyncIterator[ScriptedHealth]:
    scripted = ScriptedHealth()
    driver = await FakeDriver(
        node.registry_dir, node.plugins_dir, kube=kube, health=scripted
    ).start()
    await node.wait_for_driver(DRIVER, timeout=WAIT)
    try:
        yield scripted
    finally:
        await driver.stop()


def status_of(node: DRAKubelet, p: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """(status name, resourceID, health, message) of container "ctr"."""
    return [
        (s["name"], r["resourceID"], r["health"], r.get("message", ""))
        for s in node.allocated_resources_status(p).get("ctr", [])
        for r in s["resources"]
    ]


async def test_a_driver_without_the_health_service_is_an_error_each_try(
    node: DRAKubelet, kube: FakeKube
) -> None:
    """What the 1.36 kubelet logged every 5 s against a driver that lacks the service."""
    driver = await FakeDriver(node.registry_dir, node.plugins_dir, kube=kube).start()
    try:
        await node.wait_for(lambda: len(node.health_errors) >= 2, WAIT)
    finally:
        await driver.stop()
    assert node.health_errors[0] == (
        DRIVER,
        "rpc error: code = Unimplemented desc = Method not found!",
    )


async def test_device_health_reaches_the_pods_allocated_resources_status(
    node: DRAKubelet, kube: FakeKube, health: ScriptedHealth
) -> None:
    p = pod("p1", claims={"gpus": "claim-a"})
    claim = allocated_claim(
        kube, "claim-a", [(DRIVER, "gpu-0"), (DRIVER, "gpu-1")], reserved_for=[p]
    )
    await node.prepare(p)
    uid = claim["metadata"]["uid"]
    ids = [f"k8s.{DRIVER}/claim={uid}-gpu-0", f"k8s.{DRIVER}/claim={uid}-gpu-1"]
    # Nothing reported yet: Unknown, named after the pod's claim, by the devices' CDI IDs.
    assert status_of(node, p) == [("claim:gpus", i, UNKNOWN, "") for i in ids]

    health.send(
        (POOL, "gpu-0", health_pb.HEALTHY, ""),
        (POOL, "gpu-1", health_pb.HEALTHY, ""),
        (POOL, "gpu-7", health_pb.HEALTHY, ""),  # no pod holds it
    )
    await node.wait_for(lambda: {h for _, _, h, _ in status_of(node, p)} == {HEALTHY}, WAIT)
    health.send(
        (POOL, "gpu-0", health_pb.HEALTHY, ""),
        (POOL, "gpu-1", health_pb.UNHEALTHY, "Xid 79 (GPU has fallen off the bus)"),
        (POOL, "gpu-7", health_pb.HEALTHY, ""),
    )
    await node.wait_for(lambda: status_of(node, p)[1][2] == UNHEALTHY, WAIT)
    assert status_of(node, p) == [
        ("claim:gpus", ids[0], HEALTHY, ""),
        ("claim:gpus", ids[1], UNHEALTHY, "Xid 79 (GPU has fallen off the bus)"),
    ]
    # Each change that touched the pod's devices notified it; gpu-7's first report too
    # came with theirs, so every update names the pod.
    assert node.manager.health_updates == [{"uid-p1"}, {"uid-p1"}]

    health.responses.put_nowait(None)  # the stream ends: the driver's health is forgotten
    await node.wait_for(lambda: {h for _, _, h, _ in status_of(node, p)} == {UNKNOWN}, WAIT)
    await eventually(lambda: health.opened >= 2)  # and the kubelet opens it again


async def test_a_request_of_a_claim_shows_only_its_own_devices(
    node: DRAKubelet, kube: FakeKube, health: ScriptedHealth
) -> None:
    p = pod("p1", claims={"gpus": "claim-a"})
    p["spec"]["containers"][0]["resources"]["claims"] = [{"name": "gpus", "request": "other"}]
    allocated_claim(kube, "claim-a", [(DRIVER, "gpu-0")], reserved_for=[p])
    await node.prepare(p)
    # The fake driver answers request "gpu": nothing of request "other".
    assert node.allocated_resources_status(p) == {}
    p["spec"]["containers"][0]["resources"]["claims"] = [{"name": "gpus", "request": "gpu"}]
    assert [s["name"] for s in node.allocated_resources_status(p)["ctr"]] == ["claim:gpus/gpu"]
