"""The per-container GPU metrics end to end on the project's fakes: a simulated node or FakeNvml,
a fake /proc, the kubelet's checkpoint and a fake PodResources API; and `kubegpu top`."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import os
import shutil
import threading
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stdout
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from kubegpu import cli
from kubegpu.config import Config, parse_config
from kubegpu.devices import DeviceBackend, Health, ProcessTable
from kubegpu.devices.nvml import NvmlBackend
from kubegpu.devices.simulated import SimulatedBackend, parse_node
from kubegpu.dra.checkpoint import Checkpoint, ClaimRecord, ClaimState
from kubegpu.dra.claims import PreparedDevice
from kubegpu.dra.usage import dra_view
from kubegpu.errors import KubegpuError
from kubegpu.httpserver import HttpServer
from kubegpu.metrics import UNATTRIBUTED, Metrics
from kubegpu.state import NodeStore
from kubegpu.testing import FakeNvml, FakePodResources
from kubegpu.usage import UsageCollector, UsageSettings
from kubegpu.usage.cgroup import MAX_CGROUP_BYTES
from kubegpu.usage.kubelet import MAX_CHECKPOINT_BYTES, SourceError, checkpoint_pod_uids
from tests.usage_fixtures import MIB, KubeletCheckpoint, ProcTree, pod_uid

GPU = "nvidia.com/gpu"
USED = "kubegpu_container_gpu_memory_used_bytes"
LIMIT = "kubegpu_container_gpu_memory_limit_bytes"
SM = "kubegpu_container_gpu_sm_utilization_percent"
UP = "kubegpu_usage_source_up"
TIME_SLICED = (
    "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n"
    "      replicas: 4\n"
)
H100 = 81559 * MIB


@dataclass
class Node:
    backend: DeviceBackend
    store: NodeStore
    proc: ProcTree
    checkpoint: KubeletCheckpoint
    kubelet: FakePodResources
    root: Path

    @property
    def uuids(self) -> list[str]:
        return [g.uuid for g in self.store.state.inventory.gpus]

    def collector(self, **settings: object) -> UsageCollector:
        usage = UsageSettings(
            proc_root=self.proc.root,
            pod_resources_socket=self.kubelet.socket,
            kubelet_checkpoint=self.checkpoint.path,
            hostname="node-a",
            **settings,  # type: ignore[arg-type]
        )
        return UsageCollector(usage, backend=lambda: self.backend, state=lambda: self.store.state)

    def give(self, ns: str, pod: str, container: str, uid: str, ids: list[str]) -> None:
        """What the kubelet does for a container: allocate, record, report."""
        self.checkpoint.add(uid, container, GPU, ids)
        self.kubelet.add(ns, pod, container, GPU, ids)


@contextmanager
def make_node(root: Path, backend: DeviceBackend, config: Config) -> Iterator[Node]:
    store = NodeStore()
    store.update(inventory=backend.discover(), config=config)
    (root / "proc").mkdir()
    with FakePodResources(root / "pr.sock") as kubelet:
        yield Node(
            backend,
            store,
            ProcTree(root / "proc"),
            KubeletCheckpoint(root / "kubelet_internal_checkpoint"),
            kubelet,
            root,
        )


@pytest.fixture
def node(socket_dir: Path) -> Iterator[Node]:
    """Two simulated H100s, time-sliced in 4 replicas each."""
    backend = SimulatedBackend(parse_node({"gpus": [{"count": 2}]}, "n", "n"))
    with make_node(socket_dir, backend, parse_config(TIME_SLICED)) as node:
        yield node


def labels(ns: str, pod: str, container: str, gpu: str = "0") -> dict[str, str]:
    return {"namespace": ns, "pod": pod, "container": container, "gpu": gpu}


def value(metrics: Metrics, name: str, **wanted: str) -> float | None:
    """The one sample of `name` whose labels include `wanted` (None when there is none)."""
    for family in metrics.registry.collect():
        found = [
            s.value
            for s in family.samples
            if s.name == name and all(s.labels.get(k) == v for k, v in wanted.items())
        ]
        if found:
            assert len(found) == 1, found
            return found[0]
    return None


def shared_gpu(node: Node) -> SimulatedBackend:
    """Two pods time-sharing GPU 0, one pod alone on GPU 1, a host process on GPU 1."""
    backend = node.backend
    assert isinstance(backend, SimulatedBackend)
    g0, g1 = node.uuids
    node.give("ml", "train-0", "main", pod_uid(1), [f"{g0}::0"])
    node.give("ml", "infer-0", "server", pod_uid(2), [f"{g0}::2"])
    node.give("web", "render-0", "gpu", pod_uid(3), [f"{g1}::1", f"{g1}::3"])
    backend.start_process(0, 101, 20 * 1024, sm_util=30)
    backend.start_process(0, 102, 1024, sm_util=10)
    backend.start_process(0, 201, 10 * 1024, sm_util=45)
    backend.start_process(1, 301, 512, kind="graphics", sm_util=5)
    backend.start_process(1, 900, 300)  # nvidia-persistenced's kin: outside every pod
    node.proc.in_pod(101, pod_uid(1))
    node.proc.in_pod(102, pod_uid(1))
    node.proc.in_pod(201, pod_uid(2))
    node.proc.in_pod(301, pod_uid(3))
    node.proc.put(900, "0::/system.slice/host-tool.service\n")
    return backend


def test_each_container_shows_its_use_and_limit(node: Node) -> None:
    shared_gpu(node)
    metrics = Metrics()
    collector = node.collector()
    metrics.follow_usage(collector)
    train = labels("ml", "train-0", "main")
    assert value(metrics, USED, **train) == 21 * 1024 * MIB
    assert value(metrics, LIMIT, **train) == H100  # time-slicing does not split memory
    assert value(metrics, SM, **train) == 40
    infer = labels("ml", "infer-0", "server")
    assert value(metrics, USED, **infer) == 10 * 1024 * MIB
    assert value(metrics, SM, **infer) == 45
    render = labels("web", "render-0", "gpu", gpu="1")
    assert value(metrics, USED, **render) == 512 * MIB
    assert value(metrics, LIMIT, **render) == H100
    host = labels("", UNATTRIBUTED, "", gpu="1")
    assert value(metrics, USED, **host) == 300 * MIB
    assert value(metrics, LIMIT, **host) is None
    # The device labels of dcgm-exporter, on every row.
    assert value(metrics, USED, UUID=node.uuids[0], device="nvidia0", Hostname="node-a", **train)
    for source in ("processes", "pod-resources", "kubelet-checkpoint"):
        assert value(metrics, UP, source=source) == 1
    collector.close()


def test_mps_replicas_have_nvidias_fixed_limit(socket_dir: Path) -> None:
    config = parse_config(
        "version: v1\nflags: {mpsRoot: /run/nvidia/mps}\nsharing:\n  mps:\n    resources:\n"
        "    - name: nvidia.com/gpu\n      replicas: 4\n"
    )
    backend = SimulatedBackend(parse_node({"gpus": [{}]}, "n", "n"))
    with make_node(socket_dir, backend, config) as node:
        (g0,) = node.uuids
        node.give("ml", "a", "main", pod_uid(1), [f"{g0}::0"])
        backend.start_process(0, 10, 4096, kind="mps", sm_util=20)
        node.proc.in_pod(10, pod_uid(1))
        metrics = Metrics()
        metrics.follow_usage(node.collector())
        assert value(metrics, LIMIT, **labels("ml", "a", "main")) == (81559 // 4) * MIB
        assert value(metrics, USED, **labels("ml", "a", "main")) == 4096 * MIB


def test_on_fake_nvml_with_mig(socket_dir: Path) -> None:
    """The same through the NVML backend (FakeNvml): a MIG slice, and a whole GPU."""
    fake = FakeNvml()
    whole = fake.add_gpu()
    parted = fake.add_gpu("NVIDIA A100-SXM4-40GB", memory_mib=40536, mig_capable=True)
    slice_ = parted.add_mig("3g.20gb")
    whole.add_process(11, 2048, sm_util=33)
    slice_.add_process(12, 1024)
    config = parse_config("version: v1\nflags: {migStrategy: mixed}")
    backend = NvmlBackend.open(nvml=fake, exists=lambda path: True)
    with make_node(socket_dir, backend, config) as node:
        node.give("ml", "a", "main", pod_uid(1), [whole.uuid])
        node.checkpoint.add(pod_uid(2), "main", "nvidia.com/mig-3g.20gb", [slice_.uuid])
        node.kubelet.add("ml", "b", "main", "nvidia.com/mig-3g.20gb", [slice_.uuid])
        node.proc.in_pod(11, pod_uid(1))
        node.proc.in_pod(12, pod_uid(2))
        metrics = Metrics()
        metrics.follow_usage(node.collector())
        assert value(metrics, USED, **labels("ml", "a", "main")) == 2048 * MIB
        assert value(metrics, SM, **labels("ml", "a", "main")) == 33
        b = labels("ml", "b", "main", gpu="1")
        assert value(metrics, USED, **b) == 1024 * MIB
        assert value(metrics, LIMIT, **b) == slice_.memory_mib * MIB
        assert value(metrics, USED, GPU_I_PROFILE="3g.20gb", GPU_I_ID=str(slice_.gi_id), **b)
        assert value(metrics, SM, **b) is None  # no per-process samples on MIG
    backend.close()


HEALTHY = "kubegpu_gpu_healthy"


def test_every_gpu_and_slice_has_a_health_series_that_follows_the_node(socket_dir: Path) -> None:
    """One series per GPU and MIG slice, from the node's state: 0 while unhealthy (a slice
    with its GPU), and gone with a GPU the next discovery does not find."""
    fake = FakeNvml()
    whole = fake.add_gpu()
    parted = fake.add_gpu("NVIDIA A100-SXM4-40GB", memory_mib=40536, mig_capable=True)
    big, small = parted.add_mig("3g.20gb"), parted.add_mig("2g.10gb")
    config = parse_config("version: v1\nflags: {migStrategy: mixed}")
    backend = NvmlBackend.open(nvml=fake, exists=lambda path: True)
    with make_node(socket_dir, backend, config) as node:
        metrics = Metrics()
        metrics.follow_devices(node.collector().devices)

        def health() -> dict[tuple[str, str, str], float]:
            return {
                (s.labels["UUID"], s.labels.get("GPU_I_PROFILE", ""), s.labels["Hostname"]): s.value
                for family in metrics.registry.collect()
                for s in family.samples
                if s.name == HEALTHY
            }

        gpu, gi = (whole.uuid, "", "node-a"), (parted.uuid, "", "node-a")
        a, b = (parted.uuid, "3g.20gb", "node-a"), (parted.uuid, "2g.10gb", "node-a")
        assert health() == {gpu: 1, gi: 1, a: 1, b: 1}
        assert value(metrics, HEALTHY, GPU_I_ID=str(big.gi_id), gpu="1", device="nvidia1") == 1
        node.store.update(health={small.uuid: Health.UNHEALTHY})
        assert health() == {gpu: 1, gi: 1, a: 1, b: 0}
        node.store.update(health={whole.uuid: Health.UNHEALTHY, parted.uuid: Health.UNHEALTHY})
        assert health() == {gpu: 0, gi: 0, a: 0, b: 0}
        inventory = node.store.state.inventory
        node.store.update(inventory=dataclasses.replace(inventory, gpus=inventory.gpus[1:]))
        assert set(health()) == {gi, a, b}
    backend.close()


def test_the_daemon_serves_the_health_of_its_gpus(tmp_path: Path) -> None:
    from kubegpu.daemon import Daemon, DaemonSettings

    daemon = Daemon(DaemonSettings(plugin_dir=tmp_path, node_name="node-a"))
    backend = SimulatedBackend(parse_node({"gpus": [{"count": 2}]}, "n", "n"))
    daemon.store.update(inventory=backend.discover(), config=Config())
    uuids = [g.uuid for g in daemon.store.state.inventory.gpus]
    daemon.store.update(health={uuids[1]: Health.UNHEALTHY})
    got = [value(daemon.metrics, HEALTHY, UUID=u, Hostname="node-a") for u in uuids]
    assert got == [1, 0]
    daemon.usage.close()


def test_garbage_in_proc_never_breaks_a_scrape(node: Node) -> None:
    backend = shared_gpu(node)
    # Each of these processes' cgroup is unusable; their use goes to `unattributed`.
    for pid in (401, 402, 403, 404, 405):
        backend.start_process(1, pid, 1)
    node.proc.put(401, b"0::/kubepods/pod" + b"f" * (MAX_CGROUP_BYTES + 1))  # huge
    node.proc.put(402, b"\xff\xfe" * 100)  # not UTF-8, not a cgroup file
    node.proc.fifo(403)  # would block a plain read
    (node.proc.root / "404" / "cgroup").mkdir(parents=True)  # not a file
    # 405: no /proc entry at all, as for a process that ended
    metrics = Metrics()
    metrics.follow_usage(node.collector())
    text = metrics.render().decode()
    assert f'pod="{UNATTRIBUTED}"' in text
    host = labels("", UNATTRIBUTED, "", gpu="1")
    assert value(metrics, USED, **host) == (300 + 5) * MIB
    assert value(metrics, USED, **labels("web", "render-0", "gpu", gpu="1")) == 512 * MIB


class Vanishing:
    """A backend whose processes end right after the driver listed them."""

    def __init__(self, inner: SimulatedBackend, proc: ProcTree) -> None:
        self.inner, self.proc = inner, proc

    def processes(self) -> ProcessTable:
        table = self.inner.processes()
        for p in table.processes:
            shutil.rmtree(self.proc.root / str(p.pid), ignore_errors=True)
        return table


def test_pids_that_vanish_between_listing_and_reading(node: Node) -> None:
    backend = shared_gpu(node)
    vanishing = Vanishing(backend, node.proc)
    collector = UsageCollector(
        UsageSettings(proc_root=node.proc.root, pod_resources_socket=node.kubelet.socket),
        backend=lambda: vanishing,
        state=lambda: node.store.state,
    )
    snapshot = collector.collect()
    # All their use is still counted, under `unattributed`; the allocations keep their rows.
    assert sum(r.used_bytes for r in snapshot.rows) == (20 * 1024 + 1024 + 10 * 1024 + 812) * MIB
    assert {r.pod for r in snapshot.rows if r.used_bytes} == {UNATTRIBUTED}
    assert {r.pod for r in snapshot.rows} >= {"train-0", "infer-0", "render-0"}
    collector.close()


def test_sources_down_cost_attribution_not_the_scrape(node: Node) -> None:
    shared_gpu(node)
    node.kubelet.fail = grpc.StatusCode.UNAVAILABLE
    node.checkpoint.path.write_text("{ not json")
    metrics = Metrics()
    metrics.follow_usage(node.collector())
    assert value(metrics, UP, source="pod-resources") == 0
    assert value(metrics, UP, source="kubelet-checkpoint") == 0
    assert value(metrics, USED, **labels("", UNATTRIBUTED, "")) == (31 * 1024) * MIB
    # The kubelet answers again, its checkpoint is whole: attribution is back.
    node.kubelet.fail = None
    node.checkpoint.save()
    assert value(metrics, USED, **labels("ml", "train-0", "main")) == 21 * 1024 * MIB


def test_a_checkpoint_that_is_no_regular_file_or_too_big_is_not_read(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # would block a plain read until some writer came
    link = tmp_path / "link"
    link.symlink_to("/dev/urandom")  # would never end
    big = tmp_path / "big"
    big.write_bytes(b" " * (MAX_CHECKPOINT_BYTES + 1))
    with pytest.raises(SourceError, match=r"fifo is a FIFO, not a regular file: not read$"):
        checkpoint_pod_uids(fifo)
    with pytest.raises(SourceError, match=r"link is a symbolic link, not a regular file"):
        checkpoint_pod_uids(link)
    with pytest.raises(SourceError, match=rf"big is over {MAX_CHECKPOINT_BYTES} bytes"):
        checkpoint_pod_uids(big)
    with pytest.raises(SourceError, match=r"absent \(No such file or directory\)$"):
        checkpoint_pod_uids(tmp_path / "absent")


def test_without_the_checkpoint_a_gpu_held_by_one_container_is_still_its(node: Node) -> None:
    shared_gpu(node)
    node.checkpoint.path.unlink()
    metrics = Metrics()
    metrics.follow_usage(node.collector())
    # GPU 1 has one holder: its pod's processes are its own. GPU 0 has two: not guessed.
    assert value(metrics, USED, **labels("web", "render-0", "gpu", gpu="1")) == 512 * MIB
    assert value(metrics, USED, **labels("ml", "train-0", "main")) == 0
    assert value(metrics, USED, **labels("", UNATTRIBUTED, "")) == 31 * 1024 * MIB


def test_dra_mode_attributes_to_the_claim_or_the_containers_using_it(socket_dir: Path) -> None:
    backend = SimulatedBackend(parse_node({"gpus": [{"count": 2}]}, "n", "n"))
    with make_node(socket_dir, backend, Config()) as node:
        data_dir = socket_dir / "gpu.nvidia.com"
        checkpoint = Checkpoint(data_dir)
        for uid, name, device in (("u1", "train", "gpu-0"), ("u2", "infer", "gpu-1")):
            prepared = PreparedDevice(
                ("gpu",), "node-a", device, (f"k8s.gpu.nvidia.com/claim={uid}",)
            )
            checkpoint.claims[uid] = ClaimRecord(uid, ClaimState.PREPARED, "ml", name, (prepared,))
        checkpoint.save()
        node.kubelet.add_claim(
            "ml", "train-0", "main", "train", "gpu.nvidia.com", "node-a", "gpu-0"
        )
        backend.start_process(0, 10, 100)
        backend.start_process(1, 11, 200)
        node.proc.in_pod(10, pod_uid(1))
        node.proc.in_pod(11, pod_uid(2))
        collector = UsageCollector(
            UsageSettings(proc_root=node.proc.root, pod_resources_socket=node.kubelet.socket),
            backend=lambda: backend,
            state=lambda: node.store.state,
            dra=lambda: dra_view("gpu.nvidia.com", data_dir, "node-a"),
        )
        metrics = Metrics()
        metrics.follow_usage(collector)
        assert value(metrics, USED, dra_claim_name="train", **labels("ml", "train-0", "main")) == (
            100 * MIB
        )
        # The kubelet does not report the claim's containers: the claim stands for them.
        infer = labels("ml", "", "", gpu="1")
        assert value(metrics, USED, dra_claim_name="infer", **infer) == 200 * MIB
        assert value(metrics, LIMIT, dra_claim_name="infer", **infer) == H100
        assert value(metrics, UP, source="dra-checkpoint") == 1


def test_dra_claims_sharing_a_gpu_are_told_apart_by_their_recorded_pods(
    socket_dir: Path,
) -> None:
    """Two sized claims on one GPU, the kubelet naming each claim's container: without the
    pods each claim was prepared for, every process on the GPU went to `unattributed`."""
    backend = SimulatedBackend(parse_node({"gpus": [{"count": 1}]}, "n", "n"))
    with make_node(socket_dir, backend, Config()) as node:
        data_dir = socket_dir / "gpu.nvidia.com"
        checkpoint = Checkpoint(data_dir)
        for n, name in ((1, "small"), (2, "large")):
            uid = f"u{n}"
            prepared = PreparedDevice(("gpu",), "node-a", "gpu-0", (f"k8s.gpu.nvidia.com/c={uid}",))
            checkpoint.claims[uid] = ClaimRecord(
                uid, ClaimState.PREPARED, "ml", name, (prepared,), pods=(pod_uid(n),)
            )
            node.kubelet.add_claim(
                "ml", f"{name}-0", "main", name, "gpu.nvidia.com", "node-a", "gpu-0"
            )
        checkpoint.save()
        backend.start_process(0, 10, 100)
        backend.start_process(0, 11, 300)
        node.proc.in_pod(10, pod_uid(1))
        node.proc.in_pod(11, pod_uid(2))
        collector = UsageCollector(
            UsageSettings(proc_root=node.proc.root, pod_resources_socket=node.kubelet.socket),
            backend=lambda: backend,
            state=lambda: node.store.state,
            dra=lambda: dra_view("gpu.nvidia.com", data_dir, "node-a"),
        )
        metrics = Metrics()
        metrics.follow_usage(collector)
        small = labels("ml", "small-0", "main", gpu="0")
        large = labels("ml", "large-0", "main", gpu="0")
        assert value(metrics, USED, dra_claim_name="small", **small) == 100 * MIB
        assert value(metrics, USED, dra_claim_name="large", **large) == 300 * MIB
        assert not value(metrics, USED, **labels("", UNATTRIBUTED, "", gpu="0"))  # none left


def test_the_cap_on_rows_is_reported(node: Node) -> None:
    shared_gpu(node)
    metrics = Metrics()
    metrics.follow_usage(node.collector(max_rows=2))
    assert value(metrics, "kubegpu_usage_rows_dropped") == 2
    assert value(metrics, USED, **labels("ml", "train-0", "main")) == 21 * 1024 * MIB


def test_a_failing_backend_costs_the_usage_families_only(node: Node) -> None:
    class Broken:
        def processes(self) -> ProcessTable:
            raise RuntimeError("a bug in a backend")

    metrics = Metrics()
    metrics.set_devices(GPU, 8, 8)
    metrics.follow_usage(
        UsageCollector(UsageSettings(), backend=lambda: Broken(), state=lambda: node.store.state)
    )
    text = metrics.render().decode()
    assert 'kubegpu_devices{resource="nvidia.com/gpu"} 8.0' in text
    assert 'kubegpu_usage_source_up{source="collector"} 0.0' in text


def test_collections_do_not_overlap(node: Node) -> None:
    """A scrape arriving while a collection is stuck in the driver answers the last one."""
    release = threading.Event()
    entered = threading.Event()
    backend = shared_gpu(node)

    class Stuck:
        def processes(self) -> ProcessTable:
            entered.set()
            release.wait()
            return backend.processes()

    collector = UsageCollector(
        UsageSettings(proc_root=node.proc.root, pod_resources_socket=None, wait_seconds=0),
        backend=lambda: Stuck(),
        state=lambda: node.store.state,
    )
    first = threading.Thread(target=collector.collect)
    first.start()
    assert entered.wait(60)
    assert collector.collect().rows == ()  # the last snapshot (none yet), without waiting
    release.set()
    first.join(60)
    assert collector.collect().rows


def run_top(*args: str) -> tuple[int, str]:
    out = io.StringIO()
    with redirect_stdout(out):
        code = cli.main(["top", *args])
    return code, out.getvalue()


async def test_kubegpu_top_once_prints_the_table(node: Node) -> None:
    shared_gpu(node)
    metrics = Metrics()
    metrics.follow_usage(node.collector())
    server = HttpServer("127.0.0.1", 0, metrics=metrics, ready=lambda: (True, ""))
    await server.start()
    try:
        url = f"http://127.0.0.1:{server.port}/metrics"
        code, out = await asyncio.to_thread(run_top, "--once", "--url", url)
    finally:
        await server.stop()
    assert code == 0, out
    lines = [" ".join(line.split()) for line in out.splitlines()]
    assert lines[0] == "node node-a: 4 row(s)"
    assert lines[1] == "GPU SLICE POD CONTAINER USED LIMIT USED% SM%"
    assert lines[2:] == [
        "0 - ml/infer-0 server 10.0 GiB 79.6 GiB 13% 45",
        "0 - ml/train-0 main 21.0 GiB 79.6 GiB 26% 40",
        "1 - web/render-0 gpu 512 MiB 79.6 GiB 1% 5",
        "1 - unattributed - 300 MiB - - 0",
    ]


def test_top_reads_where_the_daemons_environment_says(monkeypatch: pytest.MonkeyPatch) -> None:
    from kubegpu.cli.top import default_url

    assert default_url({"METRICS_PORT": "9400", "POD_IP": "10.0.0.7"}) == (
        "http://10.0.0.7:9400/metrics"
    )
    assert default_url({"METRICS_PORT": "9400", "METRICS_ADDRESS": "::1"}) == (
        "http://[::1]:9400/metrics"
    )
    assert default_url({"METRICS_PORT": "9400", "METRICS_ADDRESS": "0.0.0.0"}) == (
        "http://127.0.0.1:9400/metrics"
    )
    assert default_url({"METRICS_PORT": "0"}) is None
    monkeypatch.delenv("METRICS_PORT", raising=False)
    monkeypatch.delenv("KUBEGPU_METRICS_URL", raising=False)
    code, _ = run_top("--once")
    assert code == 2


def test_serve_hands_its_usage_settings_to_the_daemons_collector(tmp_path: Path) -> None:
    from kubegpu.cli.options import parse
    from kubegpu.cli.serve import serve
    from kubegpu.daemon import Daemon, DaemonSettings

    values = parse(
        serve,
        ["--pod-resources-socket", "/run/pr.sock", "--usage-max-rows", "7"],
        {"PROC_ROOT": "/host/proc"},
    )
    assert (values["proc_root"], values["pod_resources_socket"]) == ("/host/proc", "/run/pr.sock")
    assert values["usage_max_rows"] == 7
    daemon = Daemon(
        DaemonSettings(
            plugin_dir=tmp_path,
            node_name="node-a",
            proc_root=Path(values["proc_root"]),
            pod_resources_socket=Path(values["pod_resources_socket"]),
            usage_max_rows=values["usage_max_rows"],
        )
    )
    settings = daemon.usage.settings
    assert settings.proc_root == Path("/host/proc") and settings.max_rows == 7
    assert settings.kubelet_checkpoint == tmp_path / "kubelet_internal_checkpoint"
    assert settings.hostname == "node-a"
    # Before start-up there is no backend: the scrape answers, with nothing to show.
    assert daemon.metrics.value("kubegpu_usage_rows_dropped") == 0
    daemon.usage.close()


def test_names_kubernetes_refuses_never_become_labels_or_raw_log_lines(
    node: Node, caplog: pytest.LogCaptureFixture
) -> None:
    backend = node.backend
    assert isinstance(backend, SimulatedBackend)
    g0, _ = node.uuids
    hostile = 'evil"} 1\nkubegpu_fake{pod="x'
    node.give("ml", hostile, "main", pod_uid(1), [f"{g0}::0"])
    backend.start_process(0, 101, 1024)
    node.proc.in_pod(101, pod_uid(1))
    metrics = Metrics()
    collector = node.collector()
    metrics.follow_usage(collector)
    text = metrics.render().decode()
    assert "evil" not in text and "kubegpu_fake" not in text
    # Its process is counted, as nobody's.
    assert value(metrics, USED, **labels("", UNATTRIBUTED, "")) == 1024 * MIB
    warned = [r.getMessage() for r in caplog.records if "not valid Kubernetes" in r.getMessage()]
    assert len(warned) == 1 and "\n" not in warned[0] and "\\n" in warned[0]
    metrics.render()  # warned once, not at every scrape
    assert len([r for r in caplog.records if "not valid Kubernetes" in r.getMessage()]) == 1
    collector.close()


def test_top_refreshes_until_interrupted_and_rides_out_a_daemon_away(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without --once: a table per interval; a read that fails shows its line and the loop
    goes on (the daemon may be restarting); Ctrl-C ends it with status 0."""
    from kubegpu.cli import top

    answers: Iterator[str | Exception] = iter([KubegpuError("cannot read it"), "", ""])
    waits: list[float] = []

    def fetch(url: str, timeout: float) -> str:
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    def sleep(seconds: float) -> None:
        waits.append(seconds)
        if len(waits) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(top, "fetch", fetch)
    monkeypatch.setattr(top, "pause", sleep)
    code, out = run_top("--url", "http://127.0.0.1:1/metrics", "--interval", "3")
    assert code == 0 and waits == [3.0, 3.0]
    assert "kubegpu: cannot read it" in out
    assert "(no GPU allocations or processes)" in out
