"""Preparing claims on memory-sized GPUs: the limits hold before a container can start,
or the claim fails with one line; the MPS daemons are supervised; the kernel path.

The DRA plugin runs in-process (`DraDriver`) over a NodeStore, with claims allocated the
way the scheduler writes them (`consumedCapacity`), the stand-in MPS control binary
(tests/fixtures/fake-mps-control) and, for the kernel path, a recording memory limiter
over a fixture tree of the kubelet's pod cgroups.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kubegpu.api import dra_pb2
from kubegpu.config.loader import parse_config
from kubegpu.devices.nvml.memlimits import pod_cgroup
from kubegpu.dra.claims import spec_file_name
from kubegpu.dra.driver import DraDriver
from kubegpu.dra.limits import ClaimLimiter
from kubegpu.dra.service import ClaimPreparer
from kubegpu.dra.state import DeviceState
from kubegpu.errors import DeviceError
from kubegpu.mps import CLAIMS_DIR
from kubegpu.state import NodeStore
from tests.builders import gpu, inventory
from tests.rig.kube import FakeKube
from tests.waiting import eventually

FAKE_MPS = str(Path(__file__).parents[2] / "fixtures" / "fake-mps-control")
pytestmark = pytest.mark.usefixtures("python3_on_path")
DRIVER = "gpu.nvidia.com"
NODE = "node-a"
POD = "0f8e8a52-5cf0-4a2b-9a4e-2f1d8b1e0c01"
FAST = {"probe_interval": 0.01, "health_interval": 0.05, "backoff": (0.01, 0.05)}


def config(mps_root: Path, strategy: str = "mps") -> Any:
    return parse_config(
        f"version: v1\nflags: {{mpsRoot: {mps_root}}}\nsharing:\n  {strategy}:\n"
        "    resources:\n    - name: nvidia.com/gpu\n      replicas: 4\n"
        "      sizing: {memoryStep: 1Gi}\n"
    )


class RecordingLimits:
    """A per-cgroup memory limiter that records what it is told (the kernel path)."""

    def __init__(self, host_root: Path, refuse: bool = False) -> None:
        self.host_root = host_root
        self.refuse = refuse
        self.limits: dict[tuple[str, str], int] = {}

    def set_limit(self, uuid: str, cgroup: str, limit_bytes: int) -> None:
        if self.refuse:
            raise DeviceError(f"GPU {uuid}: the driver refused a memory limit (Not Supported)")
        self.limits[(uuid, cgroup)] = limit_bytes

    def clear(self, uuid: str, cgroup: str) -> None:
        self.limits.pop((uuid, cgroup), None)

    def pod_cgroup(self, pod_uid: str) -> str | None:
        return pod_cgroup(self.host_root, pod_uid)


@dataclass
class Plugin:
    driver: DraDriver
    kube: FakeKube
    store: NodeStore
    root: Path
    limiter: ClaimLimiter

    @property
    def mps(self) -> Path:
        return self.root / "mps"

    @property
    def cdi_dir(self) -> Path:
        return self.root / "cdi"

    def daemon_dir(self, claim: dra_pb2.Claim) -> Path:
        return self.mps / CLAIMS_DIR / claim.uid

    def commands(self, claim: dra_pb2.Claim) -> list[str]:
        log = self.daemon_dir(claim) / "pipe" / "commands.log"
        return [c for c in log.read_text().splitlines() if not c.startswith("get_")]

    def spec(self, claim: dra_pb2.Claim) -> dict[str, Any]:
        spec: dict[str, Any] = json.loads((self.cdi_dir / spec_file_name(claim.uid)).read_text())
        return spec

    async def prepare(self, claim: dra_pb2.Claim) -> str:
        answers = await self.driver.preparer.prepare([claim])
        return answers[claim.uid][1]


def put_claim(
    kube: FakeKube,
    name: str,
    *devices: tuple[str, str, str],
    pods: tuple[str, ...] = (POD,),
) -> dra_pb2.Claim:
    """A claim allocated `(device, memory, shares)` of sized devices, reserved for `pods`."""
    stored = kube.put_resource_claim(
        {
            "metadata": {"namespace": "ns", "name": name},
            "spec": {},
            "status": {
                "allocation": {
                    "devices": {
                        "results": [
                            {
                                "request": "gpu",
                                "driver": DRIVER,
                                "pool": NODE,
                                "device": device,
                                "shareID": "1f2e3d4c-0000-4000-8000-00000000000a",
                                "consumedCapacity": {"memory": memory, "shares": shares},
                            }
                            for device, memory, shares in devices
                        ]
                    }
                },
                "reservedFor": [{"resource": "pods", "name": "p", "uid": u} for u in pods],
            },
        }
    )
    return dra_pb2.Claim(namespace="ns", name=name, uid=stored["metadata"]["uid"])


async def start(
    root: Path, store: NodeStore, kube: FakeKube, memory: RecordingLimits | None = None
) -> Plugin:
    limiter = ClaimLimiter(control_binary=FAKE_MPS, memory=memory, daemon_options=FAST)
    preparer = ClaimPreparer(
        DeviceState(
            store,
            data_dir=root / "plugins" / DRIVER,
            cdi_dir=root / "cdi",
            pool=NODE,
            limiter=limiter,
        ),
        kube,
    )
    driver = DraDriver(
        preparer, driver=DRIVER, registrar_dir=root / "registry", plugins_dir=root / "plugins"
    )
    await driver.start()
    return Plugin(driver, kube, store, root, limiter)


@pytest.fixture
async def plugin(socket_dir: Path) -> AsyncIterator[Plugin]:
    store = NodeStore()
    store.update(inventory=inventory(gpu(0), gpu(1)), config=config(socket_dir / "mps"))
    made = await start(socket_dir, store, FakeKube())
    try:
        yield made
    finally:
        await made.driver.stop()
        for claim_dir in (made.mps / CLAIMS_DIR).glob("*"):
            await made.limiter.release(claim_dir.name, _bare(claim_dir))


def _bare(directory: Path) -> Any:
    from kubegpu.dra.sizing import ClaimLimits, ComputeLimit, DeviceLimit, MemoryLimit

    device = DeviceLimit("gpu-0", gpu(0).uuid, 1 << 30, 1, 4)
    return ClaimLimits((device,), MemoryLimit.MPS_PINNED, ComputeLimit.MPS_THREADS, str(directory))


async def test_a_claim_on_two_sized_gpus_gets_one_daemon_with_each_gpus_limit(
    plugin: Plugin,
) -> None:
    claim = put_claim(plugin.kube, "c", ("gpu-0", "30Gi", "1"), ("gpu-1", "20Gi", "2"))
    assert await plugin.prepare(claim) == ""
    assert plugin.commands(claim) == [
        f"set_default_device_pinned_mem_limit {gpu(0).uuid} 30720M",
        f"set_default_device_pinned_mem_limit {gpu(1).uuid} 20480M",
        # One percentage per daemon: the smaller share (1 of 4; 2 of 4 is 50).
        "set_default_active_thread_percentage 25",
    ]
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25" in plugin.spec(claim)["containerEdits"]["env"]
    record = plugin.driver.preparer.state.checkpoint.claims[claim.uid]
    assert record.limits is not None and record.limits.daemon_dir == str(plugin.daemon_dir(claim))
    # The pod it was prepared for: the usage metrics tell neighbour claims apart by it.
    assert record.pods == (POD,)


async def test_a_claim_whose_daemon_cannot_start_fails_with_one_line_and_no_spec(
    plugin: Plugin, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_MPS_FAIL_START", "3")
    claim = put_claim(plugin.kube, "c", ("gpu-0", "10Gi", "1"))
    error = await plugin.prepare(claim)
    assert error.startswith(f"claim ns/c ({claim.uid}): its limits cannot be applied: ")
    assert "MPS control daemon did not start" in error and "\n" not in error
    # No container can start without its limits: no spec, no record, no daemon directory.
    assert not (plugin.cdi_dir / spec_file_name(claim.uid)).exists()
    assert claim.uid not in plugin.driver.preparer.state.checkpoint.claims
    assert not plugin.daemon_dir(claim).exists()
    # The kubelet's retry succeeds once the daemon can start.
    monkeypatch.delenv("FAKE_MPS_FAIL_START")
    assert await plugin.prepare(claim) == ""


async def test_a_claim_on_sized_and_resource_wide_mps_gpus_is_refused(socket_dir: Path) -> None:
    store = NodeStore()
    mixed = parse_config(
        f"version: v1\nflags: {{mpsRoot: {socket_dir / 'mps'}}}\n"
        "resources: {gpus: [{pattern: '*A100*', name: a100}]}\nsharing:\n  mps:\n"
        "    resources:\n    - {name: nvidia.com/gpu, replicas: 4, sizing: {}}\n"
        "    - {name: nvidia.com/a100, replicas: 4}\n"
    )
    store.update(inventory=inventory(gpu(0), gpu(1, product="NVIDIA A100-SXM4-80GB")), config=mixed)
    made = await start(socket_dir, store, FakeKube())
    try:
        claim = put_claim(made.kube, "c", ("gpu-0", "10Gi", "1"), ("gpu-1", "0", "1"))
        error = await made.prepare(claim)
        assert "a container reaches one MPS daemon: ask for them in separate claims" in error
        assert not made.daemon_dir(claim).exists()
    finally:
        await made.driver.stop()


async def test_a_dead_daemon_is_restarted_with_its_limits(plugin: Plugin) -> None:
    claim = put_claim(plugin.kube, "c", ("gpu-0", "8Gi", "1"))
    assert await plugin.prepare(claim) == ""
    daemon = plugin.limiter.daemons[claim.uid]
    pid = int((plugin.daemon_dir(claim) / "pipe" / "daemon.pid").read_text())
    os.kill(pid, signal.SIGKILL)
    await eventually(lambda: daemon.restarts == 1 and daemon.ready)
    assert plugin.commands(claim)[-2:] == [
        f"set_default_device_pinned_mem_limit {gpu(0).uuid} 8192M",
        "set_default_active_thread_percentage 25",
    ]
    assert await plugin.driver.preparer.unprepare([claim]) == {claim.uid: ""}
    assert not plugin.daemon_dir(claim).exists()


async def test_a_restart_writes_a_sized_claims_missing_spec_again_with_its_limits(
    socket_dir: Path,
) -> None:
    store = NodeStore()
    store.update(inventory=inventory(gpu(0)), config=config(socket_dir / "mps"))
    made = await start(socket_dir, store, FakeKube())
    claim = put_claim(made.kube, "c", ("gpu-0", "12Gi", "2"))
    assert await made.prepare(claim) == ""
    written = (made.cdi_dir / spec_file_name(claim.uid)).read_text()
    await made.driver.stop()
    (made.cdi_dir / spec_file_name(claim.uid)).unlink()
    again = await start(socket_dir, store, FakeKube())  # the claim is gone from the API
    try:
        assert (again.cdi_dir / spec_file_name(claim.uid)).read_text() == written
        assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50" in again.spec(claim)["containerEdits"]["env"]
        assert claim.uid in again.limiter.daemons
        assert await again.driver.preparer.unprepare([claim]) == {claim.uid: ""}
        assert not again.daemon_dir(claim).exists()
    finally:
        await again.driver.stop()


def kubepods(root: Path, pod: str) -> str:
    """The kubelet's cgroup of a burstable pod under the systemd driver, in `root`."""
    relative = (
        "sys/fs/cgroup/kubepods.slice/kubepods-burstable.slice/"
        f"kubepods-burstable-pod{pod.replace('-', '_')}.slice"
    )
    (root / relative).mkdir(parents=True)
    return "/" + relative


@pytest.mark.parametrize("strategy", ["timeSlicing", "mps"])
async def test_the_kernel_path_limits_the_pods_cgroup_and_unprepare_clears_it(
    socket_dir: Path, strategy: str
) -> None:
    host = socket_dir / "host"
    cgroup = kubepods(host, POD)
    store = NodeStore()
    nodes = dataclasses.replace(inventory(gpu(0)), memory_limits=True)
    store.update(inventory=nodes, config=config(socket_dir / "mps", strategy))
    memory = RecordingLimits(host)
    made = await start(socket_dir, store, FakeKube(), memory)
    try:
        claim = put_claim(made.kube, "c", ("gpu-0", "16Gi", "1"))
        assert await made.prepare(claim) == ""
        assert memory.limits == {(gpu(0).uuid, cgroup): 16 << 30}
        record = made.driver.preparer.state.checkpoint.claims[claim.uid]
        assert record.limits is not None and record.limits.cgroups == (cgroup,)
        assert made.daemon_dir(claim).exists() is (strategy == "mps")
        assert await made.driver.preparer.unprepare([claim]) == {claim.uid: ""}
        assert memory.limits == {}
    finally:
        await made.driver.stop()


@pytest.mark.parametrize(
    ("make_cgroup", "refuse", "line"),
    [
        (False, False, f"the cgroup of pod {POD} is not under /sys/fs/cgroup/kubepods"),
        (True, True, "the driver refused a memory limit (Not Supported)"),
    ],
)
async def test_a_kernel_limit_that_cannot_be_set_fails_the_claim(
    socket_dir: Path, make_cgroup: bool, refuse: bool, line: str
) -> None:
    host = socket_dir / "host"
    if make_cgroup:
        kubepods(host, POD)
    store = NodeStore()
    nodes = dataclasses.replace(inventory(gpu(0)), memory_limits=True)
    store.update(inventory=nodes, config=config(socket_dir / "mps", "timeSlicing"))
    memory = RecordingLimits(host, refuse=refuse)
    made = await start(socket_dir, store, FakeKube(), memory)
    try:
        claim = put_claim(made.kube, "c", ("gpu-0", "16Gi", "1"))
        error = await made.prepare(claim)
        assert error.startswith(f"claim ns/c ({claim.uid}): its limits cannot be applied: ")
        assert line in error
        assert memory.limits == {}
        assert not (made.cdi_dir / spec_file_name(claim.uid)).exists()
    finally:
        await made.driver.stop()


async def test_a_concurrent_prepare_and_unprepare_leave_no_daemon(plugin: Plugin) -> None:
    claims = [put_claim(plugin.kube, f"c{i}", ("gpu-0", "4Gi", "1")) for i in range(4)]
    answers = await asyncio.gather(*(plugin.prepare(c) for c in claims))
    assert answers == [""] * 4
    assert await plugin.driver.preparer.unprepare(claims) == dict.fromkeys(
        (c.uid for c in claims), ""
    )
    assert list((plugin.mps / CLAIMS_DIR).iterdir()) == []
    assert plugin.limiter.daemons == {}


async def test_the_shared_memory_directory_the_containers_mount_exists_and_a_mismatch_is_said(
    plugin: Plugin, caplog: pytest.LogCaptureFixture
) -> None:
    """Each container of a sized claim mounts `<mps root>/shm` as its /dev/shm; a runtime
    refuses a missing mount source, and servers on another /dev/shm cannot be reached."""
    shm = plugin.mps / "shm"
    assert not shm.exists()
    first, second = (put_claim(plugin.kube, n, ("gpu-0", "10Gi", "1")) for n in ("a", "b"))
    assert await plugin.prepare(first) == ""
    assert await plugin.prepare(second) == ""
    mounts = {
        m["containerPath"]: m["hostPath"] for m in plugin.spec(first)["containerEdits"]["mounts"]
    }
    assert mounts["/dev/shm"] == str(shm) and shm.is_dir()
    # This test process's /dev/shm is not the temporary root's: said once, with the fix.
    said = [r.getMessage() for r in caplog.records if "/dev/shm" in r.getMessage()]
    assert len(said) == 1 and f"mount {shm} at /dev/shm" in said[0]
