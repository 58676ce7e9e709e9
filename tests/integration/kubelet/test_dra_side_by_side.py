"""One kubelet emulator serving a device plugin and a DRA driver side by side.

A pod asking for the device plugin's resource gets it through Allocate; a pod whose
extended resource the scheduler mapped to DRA (`status.extendedResourceClaimStatus`) gets
it through NodePrepareResources instead; both see their devices as CDI names.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from kubegpu.kubelet import KubeletEmulator
from tests.integration.kubelet.dra_fakes import DRIVER, FakeDriver, allocated_claim, pod
from tests.integration.kubelet.fakes import GPU, MakePlugin, dev
from tests.rig.dra import DRAKubelet
from tests.rig.kube import FakeKube
from tests.waiting import WAIT, Kubelet


@pytest.fixture
async def both(socket_dir: Path) -> AsyncIterator[tuple[KubeletEmulator, FakeKube]]:
    kube = FakeKube()
    dra = DRAKubelet(socket_dir / "kubelet", kube, retry_initial=0.05)
    emulator = Kubelet(socket_dir, grace_period=0.2, dial_timeout=2.0, dra=dra)
    await emulator.start()
    try:
        yield emulator, kube
    finally:
        await emulator.stop()


def gpu_pod(name: str, count: int) -> dict[str, Any]:
    p = pod(name)
    p["spec"]["containers"][0]["resources"] = {"limits": {GPU: str(count)}}
    return p


async def test_device_plugin_and_dra_pods_on_one_node(
    both: tuple[KubeletEmulator, FakeKube], make_plugin: MakePlugin
) -> None:
    kubelet, kube = both
    dra = kubelet.dra
    assert isinstance(dra, DRAKubelet)
    plugin = make_plugin([dev("gpu-a"), dev("gpu-b")])
    await plugin.serve_and_register()
    driver = await FakeDriver(dra.registry_dir, dra.plugins_dir, kube=kube).start()
    try:
        await kubelet.wait_for_resource(GPU, capacity=2, allocatable=2)
        await kubelet.wait_for(lambda: DRIVER in dra.drivers, WAIT)

        by_plugin = gpu_pod("by-plugin", 1)
        devices = await kubelet.run_pod(by_plugin)
        [allocation] = kubelet.allocations("uid-by-plugin")
        assert devices == {"ctr": [f"{GPU}={allocation.device_ids[0]}"]}
        assert driver.prepares == []

        by_dra = gpu_pod("by-dra", 1)
        claim = allocated_claim(
            kube, "by-dra-extended-resources-x1", [(DRIVER, "gpu-7")], reserved_for=[by_dra]
        )
        by_dra["status"]["extendedResourceClaimStatus"] = {
            "resourceClaimName": claim["metadata"]["name"],
            "requestMappings": [
                {"containerName": "ctr", "resourceName": GPU, "requestName": "gpu"}
            ],
        }
        devices = await kubelet.run_pod(by_dra)
        assert devices == {"ctr": [f"k8s.{DRIVER}/claim={claim['metadata']['uid']}-gpu-7"]}
        assert kubelet.allocations("uid-by-dra") == []
        assert len(driver.prepares) == 1

        await kubelet.delete_pod(by_dra)
        await kubelet.delete_pod(by_plugin)
        assert len(driver.unprepares) == 1
        assert kubelet.allocations() == []
    finally:
        await driver.stop()


async def test_a_kubelet_restart_restarts_the_dra_side(
    both: tuple[KubeletEmulator, FakeKube],
) -> None:
    kubelet, kube = both
    dra = kubelet.dra
    assert isinstance(dra, DRAKubelet)
    driver = await FakeDriver(dra.registry_dir, dra.plugins_dir, kube=kube).start()
    try:
        await kubelet.wait_for(lambda: len(driver.statuses) == 1, WAIT)
        await kubelet.restart()
        await kubelet.wait_for(lambda: len(driver.statuses) == 2, WAIT)
        assert driver.statuses == [(True, ""), (True, "")]
    finally:
        await driver.stop()
