"""The kubelet emulator's DRA connections and ResourceSlice wiping, over real sockets.

From pkg/kubelet/cm/dra/plugin/dra_plugin_manager.go: the node's slices are deleted when
the kubelet starts and when a driver stays without a connected plugin for the wiping delay;
a plugin whose service socket stops answering stays registered and its calls fail.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.kubelet.dra_fakes import DRIVER, FakeDriver, allocated_claim, pod
from tests.rig.dra import DRAKubelet, PrepareError, node_slice_wiper
from tests.rig.kube import FakeKube
from tests.waiting import WAIT

NODE = "node-1"


def put_slice(kube: FakeKube, name: str, driver: str, node: str = NODE) -> None:
    kube.resource_slices[name] = {
        "metadata": {"name": name},
        "spec": {"driver": driver, "nodeName": node, "pool": {"name": node}, "devices": []},
    }


def emulator(socket_dir: Path, kube: FakeKube, **kwargs: Any) -> DRAKubelet:
    wipe = node_slice_wiper(kube, NODE)
    return DRAKubelet(socket_dir, kube, retry_initial=0.05, wipe=wipe, **kwargs)


@pytest.fixture
async def driver_stops(socket_dir: Path) -> AsyncIterator[list[FakeDriver]]:
    drivers: list[FakeDriver] = []
    try:
        yield drivers
    finally:
        for d in drivers:
            await d.stop()


async def test_the_kubelet_start_deletes_the_nodes_slices(socket_dir: Path, kube: FakeKube) -> None:
    put_slice(kube, "mine-a", DRIVER)
    put_slice(kube, "mine-b", "other.example.com")
    put_slice(kube, "theirs", DRIVER, node="node-2")
    async with emulator(socket_dir, kube) as node:
        assert sorted(kube.resource_slices) == ["theirs"]
        assert node.plugins.wiped == [None]


async def test_a_driver_gone_for_the_wiping_delay_loses_its_slices(
    socket_dir: Path, kube: FakeKube, driver_stops: list[FakeDriver]
) -> None:
    async with emulator(socket_dir, kube, wiping_delay=0.0) as node:
        driver = await FakeDriver(node.registry_dir, node.plugins_dir, kube=kube).start()
        driver_stops.append(driver)
        await node.wait_for(lambda: node.plugins.usable(DRIVER), WAIT)
        put_slice(kube, "gpus", DRIVER)
        put_slice(kube, "nics", "nic.example.com")
        await driver.stop()
        await node.wait_for(lambda: "gpus" not in kube.resource_slices, WAIT)
        assert sorted(kube.resource_slices) == ["nics"]
        assert node.plugins.wiped[-1] == DRIVER


async def test_a_lost_service_socket_fails_calls_and_a_reconnect_cancels_the_wipe(
    socket_dir: Path, kube: FakeKube, driver_stops: list[FakeDriver]
) -> None:
    async with emulator(socket_dir, kube, wiping_delay=WAIT * 10) as node:
        driver = await FakeDriver(node.registry_dir, node.plugins_dir, kube=kube).start()
        driver_stops.append(driver)
        await node.wait_for(lambda: node.plugins.usable(DRIVER), WAIT)
        put_slice(kube, "gpus", DRIVER)
        p = pod("p1", claims={"a": "claim-a"})
        allocated_claim(kube, "claim-a", [(DRIVER, "gpu-0")], reserved_for=[p])

        await driver.stop_service()
        await node.wait_for(lambda: not node.plugins.usable(DRIVER), WAIT)
        assert node.drivers == [DRIVER]  # still registered: its registration socket is there
        with pytest.raises(
            PrepareError, match="NodePrepareResources: rpc error: code = Unavailable"
        ):
            await node.prepare(p)

        await driver.start_service()
        await node.wait_for(lambda: node.plugins.usable(DRIVER), WAIT)
        await node.prepare(p)
        assert "gpus" in kube.resource_slices
        assert node.plugins.wiped == [None]
