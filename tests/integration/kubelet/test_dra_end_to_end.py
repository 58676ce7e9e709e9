"""Scheduler stand-in + kubelet emulator + a DRA driver: pods from spec to CDI devices.

The scheduler stand-in allocates from ResourceSlices in FakeKube; the emulated kubelet
prepares the claims through the driver over real sockets and hands each container its CDI
devices; deleting the pods unprepares and frees everything.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from kubegpu.kubelet import KubeletEmulator
from tests.integration.kubelet.dra_fakes import DRIVER, FakeDriver
from tests.rig.dra import DRAKubelet
from tests.rig.dra.scheduler import SchedulerStandIn, UnschedulableError
from tests.rig.kube import FakeKube
from tests.waiting import WAIT, Kubelet

NODE = "node-1"


def slice_with(*devices: dict[str, Any]) -> dict[str, Any]:
    return {
        "metadata": {"name": f"{NODE}-{DRIVER}"},
        "spec": {
            "driver": DRIVER,
            "nodeName": NODE,
            "pool": {"name": NODE, "generation": 1, "resourceSliceCount": 1},
            "devices": list(devices),
        },
    }


@pytest.fixture
async def world(
    socket_dir: Path,
) -> AsyncIterator[tuple[KubeletEmulator, FakeKube, SchedulerStandIn, FakeDriver]]:
    kube = FakeKube()
    kube.put_device_class(
        {
            "metadata": {"name": DRIVER},
            "spec": {
                "extendedResourceName": "example.com/gpu",
                "selectors": [{"cel": {"expression": f'device.driver == "{DRIVER}"'}}],
            },
        }
    )
    dra = DRAKubelet(socket_dir / "kubelet", kube, retry_initial=0.05)
    kubelet = Kubelet(socket_dir, dra=dra)
    await kubelet.start()
    driver = await FakeDriver(dra.registry_dir, dra.plugins_dir, kube=kube).start()
    scheduler = SchedulerStandIn(kube, NODE, device_plugin_allocatable=kubelet.allocatable)
    try:
        await kubelet.wait_for(lambda: DRIVER in dra.drivers, WAIT)
        yield kubelet, kube, scheduler, driver
    finally:
        await driver.stop()
        await kubelet.stop()


def gpu_pod(name: str, count: int) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": "default", "uid": f"uid-{name}"},
        "spec": {
            "containers": [
                {"name": "ctr", "resources": {"limits": {"example.com/gpu": str(count)}}}
            ]
        },
    }


async def test_an_unmodified_gpu_pod_runs_through_dra(
    world: tuple[KubeletEmulator, FakeKube, SchedulerStandIn, FakeDriver],
) -> None:
    kubelet, kube, scheduler, driver = world
    kube.resource_slices["s"] = slice_with(*({"name": f"gpu-{i}"} for i in range(4)))
    pod = scheduler.schedule(gpu_pod("trainer", 2))
    claim_name = pod["status"]["extendedResourceClaimStatus"]["resourceClaimName"]
    uid = kube.resource_claims[("default", claim_name)]["metadata"]["uid"]
    devices = await kubelet.run_pod(pod)
    assert devices == {
        "ctr": [f"k8s.{DRIVER}/claim={uid}-gpu-0", f"k8s.{DRIVER}/claim={uid}-gpu-1"]
    }
    assert [[c[1] for c in call] for call in driver.prepares] == [[claim_name]]
    await kubelet.delete_pod(pod)
    scheduler.release(pod)
    assert [[c[1] for c in call] for call in driver.unprepares] == [[claim_name]]
    assert kube.resource_claims == {}


async def test_eight_pods_share_two_gpus_by_capacity(
    world: tuple[KubeletEmulator, FakeKube, SchedulerStandIn, FakeDriver],
) -> None:
    kubelet, kube, scheduler, driver = world
    shared = {
        "allowMultipleAllocations": True,
        "capacity": {"slots": {"value": "4", "requestPolicy": {"default": "1"}}},
    }
    kube.resource_slices["s"] = slice_with({"name": "gpu-0", **shared}, {"name": "gpu-1", **shared})
    pods = [scheduler.schedule(gpu_pod(f"p{i}", 1)) for i in range(8)]
    for pod in pods:
        await kubelet.run_pod(pod)
    assert len(driver.prepares) == 8
    used = [
        r["device"]
        for c in kube.resource_claims.values()
        for r in c["status"]["allocation"]["devices"]["results"]
    ]
    assert sorted(used) == ["gpu-0"] * 4 + ["gpu-1"] * 4
    with pytest.raises(UnschedulableError, match="cannot allocate"):
        scheduler.schedule(gpu_pod("ninth", 1))
    for pod in pods:
        await kubelet.delete_pod(pod)
        scheduler.release(pod)
    assert len(driver.unprepares) == 8 and kube.resource_claims == {}
