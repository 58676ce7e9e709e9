"""A kubelet restart: sockets wiped, allocations restored from kubelet_internal_checkpoint.

(kubelet/checkpoint.py, `registration.remove_stale_sockets`.)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kubegpu.api import KUBELET_SOCKET
from kubegpu.kubelet import (
    CHECKPOINT_FILE,
    AdmissionError,
    CheckpointError,
    KubeletEmulator,
)
from tests.integration.kubelet.fakes import GPU, MakePlugin, dev, gpus
from tests.waiting import Kubelet

# ------------------------------------------------------------------------ kubelet restart


async def test_kubelet_restart(
    kubelet: KubeletEmulator, make_plugin: MakePlugin, socket_dir: Path
) -> None:
    plugin = make_plugin(gpus(4))
    await plugin.serve_and_register()
    await kubelet.wait_for_resource(GPU, capacity=4, allocatable=4)
    first = await kubelet.allocate(GPU, 2, pod="p1")
    assert plugin.calls["Allocate"] == 1

    await kubelet.restart()
    assert not (socket_dir / "fake.sock").exists()
    assert (socket_dir / KUBELET_SOCKET).exists()
    assert (socket_dir / CHECKPOINT_FILE).exists()
    assert GPU in kubelet.resources
    assert (kubelet.capacity(GPU), kubelet.allocatable(GPU)) == (0, 0)
    [restored] = kubelet.allocations("p1")
    assert restored.device_ids == first.device_ids
    assert restored.envs == first.envs

    # The plugin notices, serves again and re-registers: capacity comes back.
    await plugin.stop()
    await plugin.serve_and_register()
    await kubelet.wait_for_resource(GPU, capacity=4, allocatable=4)
    assert kubelet.history(GPU) == [(4, 4), (0, 0), (4, 4)]
    # The running pod keeps its devices; a restart of its container makes no RPC.
    again = await kubelet.allocate(GPU, 2, pod="p1")
    assert again.cached and again.device_ids == first.device_ids
    assert plugin.calls["Allocate"] == 1
    # The surviving allocation is still in use.
    with pytest.raises(AdmissionError, match=f"Insufficient {GPU}"):
        await kubelet.allocate(GPU, 3, pod="p2")


async def test_restored_resource_disappears_without_plugin(
    kubelet: KubeletEmulator, make_plugin: MakePlugin
) -> None:
    plugin = make_plugin(gpus(1))
    await plugin.serve_and_register()
    await kubelet.wait_for_resource(GPU, capacity=1)
    await plugin.stop()
    await kubelet.restart()
    assert GPU in kubelet.resources
    await kubelet.wait_for(lambda: GPU not in kubelet.resources)


async def test_checkpoint_is_kubelet_json(
    kubelet: KubeletEmulator, make_plugin: MakePlugin, socket_dir: Path
) -> None:
    plugin = make_plugin([dev("gpu-0", numa=[1]), dev("gpu-1")])
    await plugin.serve_and_register()
    await kubelet.wait_for_resource(GPU, capacity=2)
    await kubelet.allocate(GPU, 2, pod="uid-1", container="main")
    doc = json.loads((socket_dir / CHECKPOINT_FILE).read_text())
    assert set(doc) == {"Data", "Checksum"}
    [entry] = doc["Data"]["PodDeviceEntries"]
    assert (entry["PodUID"], entry["ContainerName"], entry["ResourceName"]) == (
        "uid-1",
        "main",
        GPU,
    )
    assert entry["DeviceIDs"] == {"1": ["gpu-0"], "-1": ["gpu-1"]}
    assert doc["Data"]["RegisteredDevices"] == {GPU: ["gpu-0", "gpu-1"]}
    assert kubelet.release("uid-1") == ["gpu-0", "gpu-1"]
    assert json.loads((socket_dir / CHECKPOINT_FILE).read_text())["Data"]["PodDeviceEntries"] == []


async def test_corrupt_checkpoint_refuses_start(socket_dir: Path) -> None:
    (socket_dir / CHECKPOINT_FILE).write_text('{"Data": {"PodDeviceEntries": []}, "Checksum": 1}')
    with pytest.raises(CheckpointError, match="corrupted"):
        await Kubelet(socket_dir).start()
