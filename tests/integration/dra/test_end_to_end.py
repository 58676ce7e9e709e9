"""`serve --mode dra` on a simulated 8×H100 node, end to end against the kubelet emulator.

The daemon runs in-process (the same `Daemon.run` as `kubegpu serve --mode dra --simulate
h100-8`) with the API in memory (`FakeKube`, shared with the emulator): it publishes the
node's ResourceSlices, registers its DRA plugin through the emulated kubelet's plugin
watcher, and prepares the claims the scheduler stand-in allocates from those slices. The
emulated kubelet hands each container the CDI device IDs the plugin answered, and the
CDI spec files behind them are read back from disk. The same world with every GPU shared
through MPS and sized by memory runs the sized claims (`TestClaimsSizedByMemory`).

The DRA plugin's focused tests sit beside this file: its RPCs over the sockets
(test_driver.py), hostile calls (test_fuzz.py), sized prepares (test_sized_prepare.py), and
`serve --mode dra`'s start-up and stop (test_serve_dra.py, test_serve_dra_stale.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import signal
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, cast

import pytest
import yaml

from kubegpu.allocation import SIMULATED_DEVICE_NODE
from kubegpu.cli.options import parse
from kubegpu.cli.serve import serve
from kubegpu.daemon import Daemon, DaemonSettings
from kubegpu.devices.simulated import SimulatedBackend
from kubegpu.dra.checkpoint import Checkpoint
from kubegpu.dra.claims import CLAIM_CDI_KIND, spec_file_name
from kubegpu.kube import Kube
from kubegpu.kubelet import KubeletEmulator
from kubegpu.mode import Mode
from kubegpu.mps import CLAIMS_DIR
from tests.fronts import dra_driver
from tests.rig.dra import DRAKubelet, node_slice_wiper
from tests.rig.dra.manager import PrepareError
from tests.rig.dra.scheduler import SchedulerStandIn, UnschedulableError
from tests.rig.kube import FakeKube
from tests.unit.cdi.conftest import runtime_device_nodes
from tests.waiting import WAIT, Kubelet, eventually

CHART = Path(__file__).resolve().parents[3] / "deployments" / "helm" / "kubegpu"
NODE = "node-1"
DRIVER = "gpu.nvidia.com"
H100 = "NVIDIA H100 80GB HBM3"


@dataclass
class World:
    kubelet: KubeletEmulator
    dra: DRAKubelet
    kube: FakeKube
    scheduler: SchedulerStandIn
    daemon: Daemon
    root: Path

    @property
    def cdi_dir(self) -> Path:
        return self.root / "cdi"

    @property
    def backend(self) -> SimulatedBackend:
        backend = self.daemon.backend
        assert isinstance(backend, SimulatedBackend)
        return backend

    def slices(self) -> list[dict[str, Any]]:
        return self.kube.list_resource_slices(DRIVER, NODE)

    def devices(self) -> dict[str, dict[str, Any]]:
        return {d["name"]: d for s in self.slices() for d in s["spec"]["devices"]}

    async def run(self, pod: dict[str, Any]) -> tuple[dict[str, Any], dict[str, list[str]]]:
        scheduled = self.scheduler.schedule(pod)
        return scheduled, await self.kubelet.run_pod(scheduled)

    async def delete(self, pod: dict[str, Any]) -> None:
        await self.kubelet.delete_pod(pod)
        self.scheduler.release(pod)

    def specs(self) -> list[str]:
        return sorted(p.name for p in self.cdi_dir.iterdir()) if self.cdi_dir.exists() else []


@functools.cache
def chart() -> tuple[dict[str, Any], ...]:
    """The chart's objects in `mode: dra` (its `ci/dra-values.yaml`: a simulated 8×H100
    node, time-slicing from the config map), rendered by the real Helm engine."""
    helm_python = pytest.importorskip("helm_python")
    values = yaml.safe_load((CHART / "ci" / "dra-values.yaml").read_text())
    with helm_python.Chart.load(str(CHART)) as loaded:
        out = loaded.render(values, name="kubegpu", namespace="kube-system", is_install=True)
    return tuple(
        doc
        for name, text in sorted(out.items())
        if name.endswith(".yaml")
        for doc in yaml.safe_load_all(text)
        if doc
    )


def chart_objects(kind: str) -> list[dict[str, Any]]:
    return [d for d in chart() if d["kind"] == kind]


def device_classes(kube: FakeKube) -> None:
    """The DeviceClasses the chart installs in `mode: dra`."""
    for body in chart_objects("DeviceClass"):
        kube.put_device_class(body)


def settings(root: Path, registry: Path, plugins: Path, config: Path | None) -> DaemonSettings:
    return DaemonSettings(
        mode=Mode.DRA,
        simulate="h100-8",
        registrar_dir=registry,
        kubelet_plugins_dir=plugins,
        plugin_dir=root / "dp",
        cdi_dir=root / "cdi",
        node_name=NODE,
        config_file=config,
        overrides={"flags.health.recoverySeconds": 0},
    )


class Serve:
    """One `serve --mode dra` daemon running in this process, stopped like SIGTERM."""

    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon
        self.stop = asyncio.Event()
        self.task: asyncio.Task[None] | None = None

    async def start(self) -> Daemon:
        self.task = asyncio.create_task(self.daemon.run(self.stop))
        started = asyncio.create_task(self.daemon.started.wait())
        await asyncio.wait([self.task, started], return_when=asyncio.FIRST_COMPLETED)
        if self.task.done():
            started.cancel()
            self.task.result()
        return self.daemon

    async def close(self) -> None:
        self.stop.set()
        if self.task is not None:
            await self.task


def pod(name: str, containers: list[dict[str, Any]], **spec: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": "default", "uid": f"uid-{name}"},
        "spec": {"containers": containers, **spec},
    }


def gpu_pod(name: str, count: int) -> dict[str, Any]:
    """An unmodified device-plugin pod: `limits: nvidia.com/gpu: <count>`, no claim."""
    return pod(name, [{"name": "ctr", "resources": {"limits": {"nvidia.com/gpu": str(count)}}}])


def claim_pod(name: str, claim: str) -> dict[str, Any]:
    return pod(
        name,
        [{"name": "ctr", "resources": {"claims": [{"name": "gpu"}]}}],
        resourceClaims=[{"name": "gpu", "resourceClaimName": claim}],
    )


def put_claim(kube: FakeKube, name: str, selector: str | None = None) -> None:
    request: dict[str, Any] = {"deviceClassName": "gpu.nvidia.com"}
    if selector is not None:
        request["selectors"] = [{"cel": {"expression": selector}}]
    kube.put_resource_claim(
        {
            "metadata": {"namespace": "default", "name": name},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": request}]}},
        }
    )


@pytest.fixture
def time_sliced(socket_dir: Path) -> Iterator[Path]:
    """The chart's default config in `ci/dra-values.yaml`: every GPU time-sliced by 4."""
    [config_map] = [c for c in chart_objects("ConfigMap") if "default" in c.get("data", {})]
    path = socket_dir / "config.yaml"
    path.write_text(config_map["data"]["default"])
    yield path


async def make_world(root: Path, config: Path | None = None) -> tuple[World, Serve]:
    kube = FakeKube()
    device_classes(kube)
    dra = DRAKubelet(root / "kubelet", kube, retry_initial=0.05, wipe=node_slice_wiper(kube, NODE))
    kubelet = Kubelet(root / "dp-kubelet", dra=dra)
    await kubelet.start()
    daemon = Daemon(settings(root, dra.registry_dir, dra.plugins_dir, config), kube=kube)
    serve = Serve(daemon)
    await serve.start()
    scheduler = SchedulerStandIn(kube, NODE, device_plugin_allocatable=kubelet.allocatable)
    world = World(kubelet, dra, kube, scheduler, daemon, root)
    await kubelet.wait_for(lambda: DRIVER in dra.drivers, WAIT)
    await eventually(lambda: len(world.devices()) == 8)
    return world, serve


@pytest.fixture
async def world(socket_dir: Path) -> AsyncIterator[World]:
    made, serve = await make_world(socket_dir)
    try:
        yield made
    finally:
        await serve.close()
        await made.kubelet.stop()


async def test_the_slices_show_eight_gpus_with_their_attributes(world: World) -> None:
    [one] = world.slices()
    assert one["spec"]["pool"]["name"] == NODE
    devices = world.devices()
    assert sorted(devices) == [f"gpu-{i}" for i in range(8)]
    attributes = devices["gpu-3"]["attributes"]
    assert attributes["productName"] == {"string": H100}
    assert attributes["type"] == {"string": "gpu"}
    for name in ("uuid", "architecture", "cudaComputeCapability", "driverVersion"):
        assert name in attributes, name
    assert "resource.kubernetes.io/pciBusID" in attributes


async def test_a_claim_selecting_by_product_name_runs_with_its_gpus_cdi_ids(
    world: World,
) -> None:
    put_claim(
        world.kube,
        "h100",
        f'device.attributes["gpu.nvidia.com"].productName == "{H100}"',
    )
    _, devices = await world.run(claim_pod("trainer", "h100"))
    claim = world.kube.resource_claims[("default", "h100")]
    uid = claim["metadata"]["uid"]
    [result] = claim["status"]["allocation"]["devices"]["results"]
    assert devices == {"ctr": [f"{CLAIM_CDI_KIND}={uid}-{result['device']}"]}
    spec = json.loads((world.cdi_dir / spec_file_name(uid)).read_text())
    minor = int(result["device"].removeprefix("gpu-"))
    [device] = spec["devices"]
    assert device["name"] == f"{uid}-{result['device']}"
    # A simulated node has no /dev/nvidia*: the runtime binds its stand-in under that name.
    assert device["containerEdits"]["deviceNodes"] == [
        {"path": f"/dev/nvidia{minor}", "hostPath": SIMULATED_DEVICE_NODE}
    ]
    assert "hooks" not in spec.get("containerEdits", {})


async def test_an_unmodified_two_gpu_pod_gets_two_gpus(world: World) -> None:
    scheduled, devices = await world.run(gpu_pod("legacy", 2))
    name = scheduled["status"]["extendedResourceClaimStatus"]["resourceClaimName"]
    uid = world.kube.resource_claims[("default", name)]["metadata"]["uid"]
    assert len(devices["ctr"]) == 2
    assert all(i.startswith(f"{CLAIM_CDI_KIND}={uid}-gpu-") for i in devices["ctr"])
    assert world.specs() == [spec_file_name(uid)]


async def test_every_device_node_of_a_claim_is_one_a_cdi_runtime_finds(world: World) -> None:
    """A CDI runtime stats each device node's host path: on the simulated node the chart
    offers (no GPUs, no `nvidiaDevRoot`) every claim pod and every unmodified
    `nvidia.com/gpu` pod failed at container creation. Both now get character devices
    that exist on any host, under the GPUs' usual container paths."""
    put_claim(world.kube, "one")
    await world.run(claim_pod("with-claim", "one"))
    await world.run(gpu_pod("legacy", 2))
    specs = [json.loads((world.cdi_dir / name).read_text()) for name in world.specs()]
    assert len(specs) == 2
    for spec in specs:
        nodes = runtime_device_nodes(spec)  # raises where a runtime would refuse
        paths = {path for path, _ in nodes}
        gpus = {p for p in paths if p.removeprefix("/dev/nvidia").isdigit()}
        assert len(gpus) == len(spec["devices"])
        assert {"/dev/nvidiactl", "/dev/nvidia-uvm"} <= paths


async def test_the_per_container_metrics_read_the_drivers_prepared_claims(world: World) -> None:
    """A DRA `serve` attributes GPU use from its driver's prepared claims, not from the
    kubelet's device-plugin checkpoint: a prepared claim has its row on its GPU."""
    put_claim(world.kube, "one")
    await world.run(claim_pod("with-claim", "one"))
    [result] = world.kube.resource_claims[("default", "one")]["status"]["allocation"]["devices"][
        "results"
    ]
    snapshot = world.daemon.usage.collect()
    assert snapshot.sources.get("dra-checkpoint") is True
    assert "kubelet-checkpoint" not in snapshot.sources
    [row] = [r for r in snapshot.rows if r.claim == "one"]
    assert (row.namespace, row.device) == (
        "default",
        f"nvidia{result['device'].removeprefix('gpu-')}",
    )


async def test_deleting_the_pods_unprepares_their_claims(world: World) -> None:
    pods = [(await world.run(gpu_pod(f"p{i}", 1)))[0] for i in range(3)]
    assert len(world.specs()) == 3
    for p in pods:
        await world.delete(p)
    assert world.specs() == []
    assert dra_driver(world.daemon).preparer.state.checkpoint.claims == {}


async def test_eight_pods_share_two_time_sliced_gpus(socket_dir: Path, time_sliced: Path) -> None:
    made, serve = await make_world(socket_dir, time_sliced)
    try:
        two = 'device.attributes["kubegpu.io"].index in ["0", "1"]'
        for i in range(8):
            put_claim(made.kube, f"c{i}", two)
        pods = [(await made.run(claim_pod(f"p{i}", f"c{i}")))[0] for i in range(8)]
        used = sorted(
            r["device"]
            for c in made.kube.resource_claims.values()
            for r in c["status"]["allocation"]["devices"]["results"]
        )
        assert used == ["gpu-0"] * 4 + ["gpu-1"] * 4
        assert len(made.specs()) == 8
        for p in pods:
            await made.delete(p)
        assert made.specs() == []
    finally:
        await serve.close()
        await made.kubelet.stop()


async def test_an_xid_taints_the_device_and_recovery_lifts_the_taint(world: World) -> None:
    def taints(name: str) -> list[dict[str, Any]]:
        return list(world.devices().get(name, {}).get("taints", []))

    world.backend.inject_xid(2, 79)
    await eventually(lambda: bool(taints("gpu-2")))
    [taint] = taints("gpu-2")
    assert (taint["key"], taint.get("value")) == ("gpu.nvidia.com/xid", "79")
    assert all(not taints(f"gpu-{i}") for i in range(8) if i != 2)
    # The scheduler no longer gives it to a claim that asks for that very GPU...
    put_claim(world.kube, "two", 'device.attributes["kubegpu.io"].index == "2"')
    with pytest.raises(UnschedulableError):
        world.scheduler.schedule(claim_pod("wants-2", "two"))
    world.backend.heal(2)
    await eventually(lambda: not taints("gpu-2"))
    # ...until the GPU has recovered.
    _, devices = await world.run(claim_pod("wants-2", "two"))
    assert devices["ctr"][0].endswith("-gpu-2")


async def test_a_pods_device_health_follows_an_xid_and_its_recovery(world: World) -> None:
    put_claim(world.kube, "three", 'device.attributes["kubegpu.io"].index == "3"')
    pod, devices = await world.run(claim_pod("holds-3", "three"))
    [cdi_id] = devices["ctr"]

    def health() -> list[tuple[str, str]]:
        statuses = world.dra.allocated_resources_status(pod).get("ctr", [])
        return [(r["resourceID"], r["health"]) for s in statuses for r in s["resources"]]

    # The kubelet reads the daemon's health stream (NodeWatchResources) into the pod.
    await eventually(lambda: health() == [(cdi_id, "Healthy")])
    world.backend.inject_xid(3, 79)
    await eventually(lambda: health() == [(cdi_id, "Unhealthy")])
    world.backend.heal(3)
    await eventually(lambda: health() == [(cdi_id, "Healthy")])
    assert world.dra.health_errors == []


class SlowClaims:
    """The plugin's view of the API, whose claim reads wait for `release` (the kubelet
    emulator reads the same FakeKube directly, undelayed)."""

    def __init__(self, kube: FakeKube, loop: asyncio.AbstractEventLoop) -> None:
        self.kube = kube
        self.loop = loop
        self.reading = asyncio.Event()
        self.release = asyncio.Event()

    def get_resource_claim(self, namespace: str, name: str) -> dict[str, Any]:
        self.loop.call_soon_threadsafe(self.reading.set)
        asyncio.run_coroutine_threadsafe(self.release.wait(), self.loop).result()
        return self.kube.get_resource_claim(namespace, name)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.kube, name)


async def test_a_plugin_restart_mid_prepare_leaves_nothing_behind(socket_dir: Path) -> None:
    made, serve = await make_world(socket_dir)
    await serve.close()
    slow = SlowClaims(made.kube, asyncio.get_running_loop())
    plugin_settings = settings(socket_dir, made.dra.registry_dir, made.dra.plugins_dir, None)
    serve = Serve(Daemon(plugin_settings, kube=cast(Kube, slow)))
    try:
        made.daemon = await serve.start()
        await made.kubelet.wait_for(lambda: DRIVER in made.dra.drivers, WAIT)
        scheduled = made.scheduler.schedule(gpu_pod("interrupted", 1))
        prepare = asyncio.create_task(made.kubelet.run_pod(scheduled))
        await slow.reading.wait()
        # SIGTERM while the claim is being read: the server's grace runs out, the call is
        # cut off, and only then does the API answer (to a process that is gone).
        await serve.close()
        slow.release.set()
        # The emulator closes the connection of a deregistered plugin, which cuts the call
        # off on its side; it surfaces that as a cancellation rather than PrepareError.
        with pytest.raises((PrepareError, asyncio.CancelledError)):
            await prepare
        assert made.specs() == []
        # A new plugin process: nothing was left behind, and the kubelet's retry succeeds.
        serve = Serve(Daemon(plugin_settings, kube=made.kube))
        made.daemon = await serve.start()
        await made.kubelet.wait_for(lambda: DRIVER in made.dra.drivers, WAIT)
        devices = await made.kubelet.run_pod(scheduled)
        assert len(devices["ctr"]) == 1 and len(made.specs()) == 1
        await made.delete(scheduled)
        assert made.specs() == []
        assert dra_driver(made.daemon).preparer.state.checkpoint.claims == {}
    finally:
        slow.release.set()
        await serve.close()
        await made.kubelet.stop()


async def test_a_kubelet_restart_finds_the_plugin_again(world: World) -> None:
    attempts = len(world.dra.attempts)
    await world.dra.restart()
    await world.kubelet.wait_for(
        lambda: DRIVER in world.dra.drivers and len(world.dra.attempts) > attempts, WAIT
    )
    # The restarted kubelet wiped the node's slices; the plugin publishes them again.
    await eventually(lambda: len(world.devices()) == 8)
    _, devices = await world.run(gpu_pod("after-restart", 1))
    assert len(devices["ctr"]) == 1


def test_the_chart_runs_serve_in_dra_mode_with_the_kubelets_directories() -> None:
    [daemonset] = chart_objects("DaemonSet")
    [ctr] = daemonset["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in ctr.get("env", [])}
    args = [a for a in ctr.get("args", []) if a.startswith("--")]
    values = parse(serve, args, {k: v for k, v in env.items() if v is not None})
    assert values["mode"] == "dra"
    assert values["kubelet_registrar_directory_path"] == "/var/lib/kubelet/plugins_registry"
    assert values["kubelet_plugins_directory_path"] == "/var/lib/kubelet/plugins"
    assert [c["metadata"]["name"] for c in chart_objects("DeviceClass")] == [
        "gpu.nvidia.com",
        "mig.nvidia.com",
        "gpu-slice.nvidia.com",
    ]


# -- claims sized by memory on MPS-shared GPUs -------------------------------------------


FAKE_MPS = str(Path(__file__).parents[2] / "fixtures" / "fake-mps-control")
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
    """The world above with sized MPS sharing, and the plugin restartable."""

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
        daemon = Daemon(replace(base, mps_control_binary=FAKE_MPS), kube=self.kube)
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


class TestClaimsSizedByMemory:
    """Claims sized by memory on MPS-shared GPUs.

    `serve --mode dra` on the simulated 8xH100 node (81559Mi per GPU) with every GPU shared
    through MPS by 4 and sized by memory in 1Gi steps, the chart's `gpu-slice.nvidia.com`
    DeviceClass, and the scheduler stand-in allocating from the published slices. Each claim
    gets its own MPS control daemon: the stand-in control binary
    (tests/fixtures/fake-mps-control) records the commands it received in its pipe directory,
    and daemonises for real (FAKE_MPS_FORK), so a daemon outlives the plugin process as the
    real one does.
    """

    pytestmark = pytest.mark.usefixtures("python3_on_path")

    @pytest.fixture
    async def world(self, node: Node) -> AsyncIterator[World]:
        try:
            yield await node.start()
        finally:
            await node.close()

    async def test_two_30gi_claims_share_a_gpu_and_the_third_goes_to_another(
        self, world: World, node: Node
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
        self, world: World, node: Node
    ) -> None:
        put_slice_claim(world.kube, "plain")
        await world.run(claim_pod("p", "plain"))
        assert result(world, "plain")["consumedCapacity"] == {"memory": "10Gi", "shares": "1"}
        assert node.commands(uid_of(world, "plain"))[0].endswith(" 10240M")

    async def test_a_claim_larger_than_any_gpu_is_unschedulable(self, world: World) -> None:
        """kube-scheduler's DynamicResources filter answers "cannot allocate all claims" for a
        node that cannot hold the claim (pkg/scheduler/framework/plugins/dynamicresources/
        dynamicresources.go, Filter); 100Gi is more than the 79Gi of whole steps a GPU gives."""
        put_slice_claim(world.kube, "huge", "100Gi")
        with pytest.raises(UnschedulableError, match="cannot allocate all claims"):
            world.scheduler.schedule(claim_pod("p", "huge"))
        assert world.specs() == []

    async def test_a_request_rounds_up_to_the_step_and_is_limited_to_what_it_took(
        self, world: World, node: Node
    ) -> None:
        put_slice_claim(world.kube, "odd", "1500Mi")
        await world.run(claim_pod("p", "odd"))
        assert result(world, "odd")["consumedCapacity"]["memory"] == "2Gi"
        assert node.commands(uid_of(world, "odd"))[0].endswith(" 2048M")

    async def test_a_restart_keeps_the_recorded_daemons_and_stops_a_stray_one(
        self, node: Node
    ) -> None:
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
