"""The node's ResourceSlices across a kubelet restart, with the emulator wiping them as the
real kubelet does (`wipeResourceSlices` when its DRA plugin manager starts)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from kubegpu.dra.publisher import SlicePublisher
from kubegpu.dra.slices import NVIDIA_DRIVER
from kubegpu.state import NodeState, NodeStore
from tests.builders import gpu, inventory
from tests.rig.dra import DRAKubelet, node_slice_wiper
from tests.rig.kube import FakeKube
from tests.waiting import WAIT, eventually

NODE = "node-1"


def names_of_devices(kube: FakeKube) -> list[str]:
    return sorted(
        d["name"]
        for s in kube.resource_slices.values()
        if s["spec"]["nodeName"] == NODE
        for d in s["spec"]["devices"]
    )


async def test_slices_come_back_after_a_kubelet_restart_wipes_them(socket_dir: Path) -> None:
    kube = FakeKube()
    store = NodeStore(NodeState(inventory=inventory(gpu(0), gpu(1)), version=1))
    publisher = SlicePublisher(kube, store, NODE, drivers=(NVIDIA_DRIVER,))
    kubelet = DRAKubelet(socket_dir, kube, wipe=node_slice_wiper(kube, NODE))
    task = asyncio.ensure_future(publisher.run())
    try:
        await eventually(lambda: names_of_devices(kube) == ["gpu-0", "gpu-1"])
        await kubelet.start()  # its start deletes every slice of the node
        assert kubelet.plugins.wiped == [None]
        await eventually(lambda: names_of_devices(kube) == ["gpu-0", "gpu-1"])
        await kubelet.restart()
        assert kubelet.plugins.wiped == [None, None]
        await eventually(lambda: names_of_devices(kube) == ["gpu-0", "gpu-1"])
        assert store.state.version == 1  # nothing on the node changed
        assert publisher.resync_s > WAIT  # not the periodic comparison either
    finally:
        await kubelet.stop()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
