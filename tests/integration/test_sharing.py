"""Sharing, CDI, probes and metrics through the real daemon and the kubelet emulator."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from kubegpu.cdi import DEFAULT_NAME, cdi_device_name
from tests.integration.test_plugin import GPU, running_node
from tests.waiting import eventually

FAKE_MPS = str(Path(__file__).parent.parent / "fixtures" / "fake-mps-control")

SEED_003 = """
version: v1
sharing:
  timeSlicing:
    resources:
    - name: nvidia.com/gpu
      replicas: 20
"""


async def test_seed_003_one_gpu_shared_by_20_pods(socket_dir: Path) -> None:
    config = socket_dir / "config.yaml"
    config.write_text(SEED_003)
    async with running_node(socket_dir, "t4-1", config_file=config) as node:
        k = node.kubelet
        await k.wait_for_resource(GPU, capacity=20, allocatable=20)
        uuid = node.uuids[0]
        allocations = [await k.allocate(GPU, 1, pod=f"pod-{i}") for i in range(20)]
        assert {a.envs["NVIDIA_VISIBLE_DEVICES"] for a in allocations} == {uuid}
        assert len({a.device_ids[0] for a in allocations}) == 20


async def test_shared_and_whole_gpus_side_by_side_with_distributed_policy(
    socket_dir: Path,
) -> None:
    config = socket_dir / "config.yaml"
    config.write_text(
        """
version: v1
sharing:
  timeSlicing:
    renameByDefault: true
    resources:
    - name: nvidia.com/gpu
      replicas: 4
      devices: [0, 1]
"""
    )
    async with running_node(socket_dir, "a10g-4", config_file=config) as node:
        k = node.kubelet
        await k.wait_for_resource(GPU, capacity=2, allocatable=2)
        await k.wait_for_resource("nvidia.com/gpu.shared", capacity=8, allocatable=8)
        a = await k.allocate("nvidia.com/gpu.shared", 2, pod="spread")
        # distributed: two replicas on two different GPUs, both named to the runtime.
        assert sorted(a.envs["NVIDIA_VISIBLE_DEVICES"].split(",")) == sorted(node.uuids[:2])
        whole = await k.allocate(GPU, 1, pod="whole")
        assert whole.device_ids[0] in node.uuids[2:]


async def test_xid_marks_every_replica_and_healing_restores_them(socket_dir: Path) -> None:
    config = socket_dir / "config.yaml"
    config.write_text(SEED_003.replace("replicas: 20", "replicas: 5"))
    overrides = {"flags.health.recoverySeconds": 0}
    async with running_node(socket_dir, "a10g-4", overrides, config_file=config) as node:
        k = node.kubelet
        await k.wait_for_resource(GPU, capacity=20, allocatable=20)
        node.backend.inject_xid(2, 79)
        await k.wait_for_resource(GPU, capacity=20, allocatable=15)
        bad = {i for i, d in k.devices(GPU).items() if not d.healthy}
        assert bad == {f"{node.uuids[2]}::{n}" for n in range(5)}
        node.backend.heal(2)
        await k.wait_for_resource(GPU, capacity=20, allocatable=20)


async def test_fail_requests_greater_than_one_rejects_admission(socket_dir: Path) -> None:
    config = socket_dir / "config.yaml"
    config.write_text(
        SEED_003.replace("timeSlicing:", "timeSlicing:\n    failRequestsGreaterThanOne: true")
    )
    async with running_node(socket_dir, "t4-1", config_file=config) as node:
        k = node.kubelet
        await k.wait_for_resource(GPU, capacity=20)
        from kubegpu.kubelet import AdmissionError

        try:
            await k.allocate(GPU, 2, pod="greedy")
        except AdmissionError as exc:
            assert "too large" in str(exc)
        else:
            raise AssertionError("a 2-replica request should be refused")
        assert (await k.allocate(GPU, 1, pod="modest")).device_ids


@pytest.mark.usefixtures("python3_on_path")  # fake-mps-control starts once per command
async def test_mps_resource_waits_for_its_daemon_and_allocates_pipes(socket_dir: Path) -> None:
    config = socket_dir / "config.yaml"
    mps_root = socket_dir / "mps"
    config.write_text(
        f"""
version: v1
flags: {{mpsRoot: {mps_root}}}
sharing:
  mps:
    resources:
    - name: nvidia.com/gpu
      replicas: 4
"""
    )
    async with running_node(
        socket_dir, "a10g-4", config_file=config, mps_control_binary=FAKE_MPS
    ) as node:
        k = node.kubelet
        await k.wait_for_resource(GPU, capacity=16, allocatable=16)
        daemon = node.daemon.mps.daemons[GPU]
        assert daemon.ready
        commands = (daemon.pipe_dir / "commands.log").read_text()
        assert "set_default_active_thread_percentage 25" in commands
        a = await k.allocate(GPU, 1, pod="mps-client")
        assert a.envs["CUDA_MPS_PIPE_DIRECTORY"] == "/tmp/nvidia-mps"
        mounts = {m.container_path: m.host_path for m in a.mounts}
        assert mounts["/tmp/nvidia-mps"] == str(daemon.host_pipe_dir)
        assert "/dev/shm" in mounts
    # Shutting the plugin down asks the control daemon to quit.
    assert "quit" in (daemon.pipe_dir / "commands.log").read_text().splitlines()


async def test_cdi_cri_writes_spec_and_answers_with_its_names(socket_dir: Path) -> None:
    cdi_dir = socket_dir / "cdi"
    overrides = {"flags.plugin.deviceListStrategy": ["cdi-cri", "cdi-annotations"]}
    async with running_node(socket_dir, "a10g-4", overrides, cdi_dir=cdi_dir) as node:
        k = node.kubelet
        await k.wait_for_resource(GPU, allocatable=4)
        (spec_file,) = cdi_dir.iterdir()
        spec = json.loads(spec_file.read_text())
        assert spec["kind"] == "k8s.device-plugin.nvidia.com/gpu"
        a = await k.allocate(GPU, 1)
        name = cdi_device_name(a.device_ids[0])
        assert list(a.cdi_devices) == [name]
        assert name.split("=", 1)[1] in {d["name"] for d in spec["devices"]}
        # CDI only: no env list at all, as NVIDIA answers (the CDI spec sets "void").
        assert "NVIDIA_VISIBLE_DEVICES" not in a.envs
        (annotation,) = a.annotations.values()
        assert annotation == name


async def test_a_cdi_directory_that_refused_the_start_up_write_gets_the_spec_later(
    socket_dir: Path,
) -> None:
    """The spec directory cannot be written when `serve` starts (here its parent is a
    file); once it can, the spec lands without a restart and Allocate's names resolve."""
    blocker = socket_dir / "cdi-parent"
    blocker.touch()
    cdi_dir = blocker / "cdi"
    overrides = {"flags.plugin.deviceListStrategy": ["cdi-cri"]}
    async with running_node(socket_dir, "a10g-4", overrides, cdi_dir=cdi_dir) as node:
        k = node.kubelet
        await k.wait_for_resource(GPU, allocatable=4)
        assert not cdi_dir.exists()
        blocker.unlink()
        spec_file = cdi_dir / DEFAULT_NAME
        await eventually(spec_file.exists)
        a = await k.allocate(GPU, 1)
        names = {d["name"] for d in json.loads(spec_file.read_text())["devices"]}
        assert [n.split("=", 1)[1] for n in a.cdi_devices] == [a.device_ids[0]]
        assert a.device_ids[0] in names


async def _get(port: int, path: str) -> tuple[int, str]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    await writer.drain()
    data = await reader.read()
    writer.close()
    head, _, body = data.decode().partition("\r\n\r\n")
    return int(head.split()[1]), body.strip()


async def test_probes_and_metrics(socket_dir: Path) -> None:
    import socket

    def free_port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])

    health, metrics = free_port(), free_port()
    async with running_node(
        socket_dir,
        "a10g-4",
        health_port=health,
        health_address="127.0.0.1",
        metrics_port=metrics,
    ) as node:
        await node.kubelet.wait_for_resource(GPU, allocatable=4)
        await eventually(lambda: node.daemon.ready()[0])
        assert await _get(health, "/healthz") == (200, "ok")
        status, _ = await _get(health, "/readyz")
        assert status == 200
        await node.kubelet.allocate(GPU, 1)
        status, text = await _get(metrics, "/metrics")
        assert status == 200
        assert 'kubegpu_devices{resource="nvidia.com/gpu"} 4.0' in text
        assert 'kubegpu_allocations_total{resource="nvidia.com/gpu"} 1.0' in text
        assert 'kubegpu_registrations_total{resource="nvidia.com/gpu",result="ok"} 1.0' in text
        assert (await _get(health, "/metrics"))[0] == 404
        node.backend.inject_xid(1, 79)
        node.backend.inject_xid(0, 13)  # ignored for health, still counted
        await node.kubelet.wait_for_resource(GPU, allocatable=3)
        _, text = await _get(metrics, "/metrics")
        xid_line = f'kubegpu_xid_errors_total{{uuid="{node.uuids[1]}",xid="79"}} 1.0'
        assert xid_line in text
        assert f'kubegpu_xid_errors_total{{uuid="{node.uuids[0]}",xid="13"}} 1.0' in text
        assert (
            'kubegpu_health_transitions_total{health="Unhealthy",resource="nvidia.com/gpu"} 1.0'
            in text
        )


async def test_serve_with_labels_writes_gfd_labels_from_its_own_view(socket_dir: Path) -> None:
    features = socket_dir / "features.d" / "gfd"
    overrides = {"flags.gfd.outputFile": str(features), "flags.gfd.noTimestamp": True}
    async with running_node(socket_dir, "a10g-4", overrides, with_labels=True) as node:
        await node.kubelet.wait_for_resource(GPU, allocatable=4)
        await eventually(features.exists)
        labels = dict(line.split("=", 1) for line in features.read_text().splitlines())
        assert labels["nvidia.com/gpu.product"] == "NVIDIA-A10G"
        assert labels["nvidia.com/gpu.count"] == "4"
        assert "nvidia.com/gfd.timestamp" not in labels


async def test_serve_with_labels_relabels_as_soon_as_the_config_changes(
    socket_dir: Path,
) -> None:
    """The labeller follows the store: a new config is labelled at once, not after the
    sleep interval (an hour here)."""
    features = socket_dir / "features.d" / "gfd"
    config = socket_dir / "config.yaml"
    config.write_text("version: v1\n")
    overrides = {
        "flags.gfd.outputFile": str(features),
        "flags.gfd.noTimestamp": True,
        "flags.gfd.sleepInterval": "1h",
    }

    def labels() -> dict[str, str]:
        text = features.read_text() if features.exists() else ""
        return dict(line.split("=", 1) for line in text.splitlines())

    async with running_node(
        socket_dir, "a10g-4", overrides, config_file=config, with_labels=True
    ) as node:
        await node.kubelet.wait_for_resource(GPU, capacity=4)
        await eventually(lambda: labels().get("nvidia.com/gpu.count") == "4")
        assert labels().get("nvidia.com/gpu.replicas") == "1"
        config.write_text(SEED_003.replace("replicas: 20", "replicas: 3"))
        await node.kubelet.wait_for_resource(GPU, capacity=12)
        await eventually(lambda: labels().get("nvidia.com/gpu.replicas") == "3")


async def test_node_label_switches_named_config_live(socket_dir: Path) -> None:
    from kubegpu.config.source import FakeNodeLabels, NamedConfigs

    configs = socket_dir / "configs"
    configs.mkdir()
    (configs / "whole.yaml").write_text("version: v1\n")
    (configs / "shared").write_text(SEED_003.replace("replicas: 20", "replicas: 3"))
    labels = FakeNodeLabels("whole")
    named = NamedConfigs(directory=configs, default="whole", node_name="node-1", labels=labels)
    async with running_node(socket_dir, "a10g-4", named=named) as node:
        k = node.kubelet
        await k.wait_for_resource(GPU, capacity=4, allocatable=4)
        held = await k.allocate(GPU, 1, pod="before-switch")
        labels.set("shared")
        await k.wait_for_resource(GPU, capacity=12)
        labels.set("missing-config")  # refused: the last good config keeps serving
        await eventually(
            lambda: (
                node.daemon.metrics.value("kubegpu_config_reloads_total", {"result": "failed"})
                == 1.0
            )
        )
        assert k.capacity(GPU) == 12
        (kept,) = k.allocations("before-switch")
        assert kept.device_ids == held.device_ids


async def test_an_enabled_mode_gets_its_cdi_spec_and_is_named_until_switched_off(
    socket_dir: Path,
) -> None:
    """gdrcopyEnabled writes NVIDIA's `gdrcopy` CDI spec (the node has /dev/gdrdrv), and
    Allocate names `gdrcopy=all` beside the GPU; turning it off removes both."""
    dev_root = socket_dir / "host"
    (dev_root / "dev").mkdir(parents=True)
    (dev_root / "dev" / "gdrdrv").touch()
    cdi_dir = socket_dir / "cdi"
    config = socket_dir / "config.yaml"

    def write(gdrcopy: bool) -> None:
        flags = {
            "nvidiaDevRoot": str(dev_root),
            "gdrcopyEnabled": gdrcopy,
            "plugin": {"deviceListStrategy": ["cdi-cri"]},
        }
        tmp = config.with_suffix(".tmp")
        tmp.write_text(json.dumps({"version": "v1", "flags": flags}))
        tmp.replace(config)  # atomic, as a ConfigMap update is

    write(True)
    gdrcopy_spec = cdi_dir / "k8s.device-plugin.nvidia.com-gdrcopy.json"
    async with running_node(socket_dir, "a10g-4", config_file=config, cdi_dir=cdi_dir) as node:
        k = node.kubelet
        await k.wait_for_resource(GPU, allocatable=4)
        spec = json.loads(gdrcopy_spec.read_text())
        assert spec["kind"] == "k8s.device-plugin.nvidia.com/gdrcopy"
        assert spec["devices"][0]["containerEdits"]["deviceNodes"][0]["path"] == "/dev/gdrdrv"
        a = await k.allocate(GPU, 1, pod="with-gdrcopy")
        assert "k8s.device-plugin.nvidia.com/gdrcopy=all" in a.cdi_devices

        write(False)
        await eventually(lambda: not gdrcopy_spec.exists())
        b = await k.allocate(GPU, 1, pod="without-gdrcopy")
        assert list(b.cdi_devices) == [cdi_device_name(b.device_ids[0])]


async def test_a_reload_that_changes_nothing_cdi_leaves_the_spec_files_alone(
    socket_dir: Path,
) -> None:
    """Replicas 2 -> 3 rewrite the advertised list, not the CDI spec (same bytes)."""
    cdi_dir = socket_dir / "cdi"
    config = socket_dir / "config.yaml"

    def write(replicas: int) -> None:
        flags = {"plugin": {"deviceListStrategy": ["cdi-cri"]}}
        sharing = {"timeSlicing": {"resources": [{"name": GPU, "replicas": replicas}]}}
        tmp = config.with_suffix(".tmp")
        tmp.write_text(json.dumps({"version": "v1", "flags": flags, "sharing": sharing}))
        tmp.replace(config)

    write(2)
    async with running_node(socket_dir, "a10g-4", config_file=config, cdi_dir=cdi_dir) as node:
        k = node.kubelet
        await k.wait_for_resource(GPU, allocatable=8)
        (spec_file,) = cdi_dir.iterdir()
        before = spec_file.stat()
        write(3)
        await k.wait_for_resource(GPU, allocatable=12)
        # The CDI writer follows the store beside the plugins: wait until it has seen 3.
        await eventually(lambda: node.daemon.cdi.config is node.daemon.store.state.config)
        after = spec_file.stat()
        assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
        a = await k.allocate(GPU, 1)  # a replica is named by its GPU's CDI device
        assert list(a.cdi_devices) == [cdi_device_name(a.device_ids[0].split("::")[0])]
