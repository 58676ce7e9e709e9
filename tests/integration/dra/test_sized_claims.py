"""Claims sized by memory on MPS-shared GPUs, end to end against the kubelet emulator.

`serve --mode dra` on the simulated 8xH100 node (81559Mi per GPU) with every GPU shared
through MPS by 4 and sized by memory in 1Gi steps, the chart's `gpu-slice.nvidia.com`
DeviceClass, and the scheduler stand-in allocating from the published slices. Each claim
gets its own MPS control daemon: the stand-in control binary
(tests/fixtures/fake-mps-control) records the commands it received in its pipe directory,
and daemonises for real (FAKE_MPS_FORK), so a daemon outlives the plugin process as the
real one does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from kubegpu.daemon import Daemon
from kubegpu.dra.checkpoint import Checkpoint
from kubegpu.dra.claims import spec_file_name
from kubegpu.mps import CLAIMS_DIR
from tests.fronts import dra_driver
from tests.integration.dra.test_end_to_end import (
    DRIVER,
    NODE,
    Serve,
    World,
    claim_pod,
    device_classes,
    settings,
)
from tests.rig.dra import DRAKubelet, node_slice_wiper
from tests.rig.dra.scheduler import SchedulerStandIn, UnschedulableError
from tests.rig.kube import FakeKube
from tests.waiting import WAIT, Kubelet, eventually

FAKE_MPS = str(Path(__file__).parents[2] / "fixtures" / "fake-mps-control")
pytestmark = pytest.mark.usefixtures("python3_on_path")
GIB = 1 << 30


def config(mps_root: Path) -> str:
    return f"""version: v1
flags:
  mpsRoot: {mps_root}
sharing:
  mps:
    resources:
      - name: nvidia.com/gpu
        replicas: 4
        sizing: {{defaultMemory: 10Gi, memoryStep: 1Gi}}
"""


@pytest.fixture
def forking(monkeypatch: pytest.MonkeyPatch) -> None:
    """The stand-in daemon forks away from its starter, as nvidia-cuda-mps-control -d."""
    monkeypatch.setenv("FAKE_MPS_FORK", "1")


def pid_alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


class Node:
    """The world of test_end_to_end with sized MPS sharing, and the plugin restartable."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.mps = root / "mps"
        self.config = root / "config.yaml"
        self.config.write_text(config(self.mps))
        self.kube = FakeKube()
        device_classes(self.kube)
        self.dra = DRAKubelet(
            root / "kubelet", self.kube, retry_initial=0.05, wipe=node_slice_wiper(self.kube, NODE)
        )
        self.kubelet = Kubelet(root / "dp-kubelet", dra=self.dra)
        self.serve: Serve | None = None
        self.world: World | None = None

    async def start(self) -> World:
        if self.serve is None:
            await self.kubelet.start()
        base = settings(self.root, self.dra.registry_dir, self.dra.plugins_dir, self.config)
        daemon = Daemon(dataclasses.replace(base, mps_control_binary=FAKE_MPS), kube=self.kube)
        self.serve = Serve(daemon)
        await self.serve.start()
        scheduler = SchedulerStandIn(
            self.kube, NODE, device_plugin_allocatable=self.kubelet.allocatable
        )
        self.world = World(self.kubelet, self.dra, self.kube, scheduler, daemon, self.root)
        await self.kubelet.wait_for(lambda: DRIVER in self.dra.drivers, WAIT)
        await eventually(lambda: len(self.world.devices()) == 8 if self.world else False)
        return self.world

    async def stop_plugin(self) -> None:
        assert self.serve is not None
        await self.serve.close()

    async def close(self) -> None:
        if self.serve is not None:
            await self.serve.close()
        await self.kubelet.stop()
        # Daemons outlive the plugin by design: end any a failed test left behind.
        for pid_file in self.mps.glob(f"{CLAIMS_DIR}/*/pipe/daemon.pid"):
            with contextlib.suppress(OSError, ValueError):
                os.kill(int(pid_file.read_text()), signal.SIGTERM)

    def daemon_dir(self, uid: str) -> Path:
        return self.mps / CLAIMS_DIR / uid

    def commands(self, uid: str) -> list[str]:
        log = self.daemon_dir(uid) / "pipe" / "commands.log"
        return [c for c in log.read_text().splitlines() if not c.startswith("get_")]

    def daemon_pid(self, uid: str) -> int:
        return int((self.daemon_dir(uid) / "pipe" / "daemon.pid").read_text())


@pytest.fixture
def node(socket_dir: Path, forking: None) -> Iterator[Node]:
    yield Node(socket_dir)


@pytest.fixture
async def world(node: Node) -> AsyncIterator[World]:
    try:
        yield await node.start()
    finally:
        await node.close()


def put_slice_claim(kube: FakeKube, name: str, memory: str | None = None) -> None:
    """A claim for "a GPU slice of <memory>" through the chart's class: no CEL."""
    exactly: dict[str, Any] = {"deviceClassName": "gpu-slice.nvidia.com"}
    if memory is not None:
        exactly["capacity"] = {"requests": {"memory": memory}}
    kube.put_resource_claim(
        {
            "metadata": {"namespace": "default", "name": name},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}},
        }
    )


def result(world: World, name: str) -> dict[str, Any]:
    claim = world.kube.resource_claims[("default", name)]
    [only] = claim["status"]["allocation"]["devices"]["results"]
    return dict(only)


def uid_of(world: World, name: str) -> str:
    return str(world.kube.resource_claims[("default", name)]["metadata"]["uid"])


def spec_of(world: World, name: str) -> dict[str, Any]:
    spec: dict[str, Any] = json.loads(
        (world.cdi_dir / spec_file_name(uid_of(world, name))).read_text()
    )
    return spec


def gpu_uuid(world: World, device: str) -> str:
    return str(world.devices()[device]["attributes"]["uuid"]["string"])


async def test_two_30gi_claims_share_a_gpu_and_the_third_goes_to_another(
    world: World, node: Node
) -> None:
    for i in range(3):
        put_slice_claim(world.kube, f"c{i}", "30Gi")
    pods = [(await world.run(claim_pod(f"p{i}", f"c{i}")))[0] for i in range(3)]
    placed = [result(world, f"c{i}") for i in range(3)]
    assert [r["device"] for r in placed] == ["gpu-0", "gpu-0", "gpu-1"]
    assert all(r["consumedCapacity"] == {"memory": "30Gi", "shares": "1"} for r in placed)
    for i, r in enumerate(placed):
        uid = uid_of(world, f"c{i}")
        # The claim's limits, set in its own daemon before its spec could start a container.
        assert node.commands(uid) == [
            f"set_default_device_pinned_mem_limit {gpu_uuid(world, r['device'])} 30720M",
            "set_default_active_thread_percentage 25",
        ]
        env = json.loads((node.daemon_dir(uid) / "pipe" / "daemon.env").read_text())
        assert env["CUDA_VISIBLE_DEVICES"] == gpu_uuid(world, r["device"])
        edits = spec_of(world, f"c{i}")["containerEdits"]
        assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25" in edits["env"]
        assert "CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps" in edits["env"]
        mounts = {m["containerPath"]: m["hostPath"] for m in edits["mounts"]}
        assert mounts["/tmp/nvidia-mps"] == str(node.daemon_dir(uid) / "pipe")
        assert mounts["/dev/shm"] == str(node.mps / "shm")
    pids = [node.daemon_pid(uid_of(world, f"c{i}")) for i in range(3)]
    for p in pods:
        await world.delete(p)
    # Unprepare stopped every daemon and left nothing behind.
    assert world.specs() == []
    assert not any(pid_alive(pid) for pid in pids)
    assert list((node.mps / CLAIMS_DIR).iterdir()) == []
    assert dra_driver(world.daemon).preparer.state.checkpoint.claims == {}


async def test_an_unsized_claim_takes_the_default_and_cannot_take_the_whole_gpu(
    world: World, node: Node
) -> None:
    put_slice_claim(world.kube, "plain")
    await world.run(claim_pod("p", "plain"))
    assert result(world, "plain")["consumedCapacity"] == {"memory": "10Gi", "shares": "1"}
    assert node.commands(uid_of(world, "plain"))[0].endswith(" 10240M")


async def test_a_claim_larger_than_any_gpu_is_unschedulable(world: World) -> None:
    """kube-scheduler's DynamicResources filter answers "cannot allocate all claims" for a
    node that cannot hold the claim (pkg/scheduler/framework/plugins/dynamicresources/
    dynamicresources.go, Filter); 100Gi is more than the 79Gi of whole steps a GPU gives."""
    put_slice_claim(world.kube, "huge", "100Gi")
    with pytest.raises(UnschedulableError, match="cannot allocate all claims"):
        world.scheduler.schedule(claim_pod("p", "huge"))
    assert world.specs() == []


async def test_a_request_rounds_up_to_the_step_and_is_limited_to_what_it_took(
    world: World, node: Node
) -> None:
    put_slice_claim(world.kube, "odd", "1500Mi")
    await world.run(claim_pod("p", "odd"))
    assert result(world, "odd")["consumedCapacity"]["memory"] == "2Gi"
    assert node.commands(uid_of(world, "odd"))[0].endswith(" 2048M")


async def test_a_restart_keeps_the_recorded_daemons_and_stops_a_stray_one(node: Node) -> None:
    world = await node.start()
    try:
        for name in ("kept", "stray"):
            put_slice_claim(world.kube, name, "20Gi")
            await world.run(claim_pod(f"p-{name}", name))
        kept, stray = uid_of(world, "kept"), uid_of(world, "stray")
        kept_pid, stray_pid = node.daemon_pid(kept), node.daemon_pid(stray)
        await node.stop_plugin()
        # The daemons serve running containers: a plugin stop leaves them running.
        assert pid_alive(kept_pid) and pid_alive(stray_pid)
        # A stop between dropping a record and stopping its daemon: no record, a daemon.
        data_dir = node.dra.plugins_dir / DRIVER
        checkpoint = Checkpoint.load(data_dir)
        del checkpoint.claims[stray]
        checkpoint.save()
        (world.cdi_dir / spec_file_name(stray)).unlink()
        world = await node.start()
        await eventually(lambda: not pid_alive(stray_pid))
        assert not node.daemon_dir(stray).exists()
        # The recorded one is taken over, its limits set again, and still served.
        assert node.daemon_pid(kept) == kept_pid and pid_alive(kept_pid)
        assert node.commands(kept)[-2:] == node.commands(kept)[:2]
        assert kept in dra_driver(world.daemon).preparer.state.limiter.daemons
    finally:
        await node.close()
