"""Which pod uses what, through real NVML (../shared/fakenvml): `kubegpu serve` on the
simulated library with a process table, the kubelet emulator allocating, a fake /proc tree
whose cgroups are the processes' own, a fake PodResources API; then /metrics and
`kubegpu top --once`.

The fakenvml config gives each process the cgroup path of its pod (the `cgroup` key NVML's
memory-limit calls count by); the fake /proc has the same path in `<pid>/cgroup`.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from kubegpu.cli.top import size
from kubegpu.testing import FakePodResources
from tests.fakenvml.conftest import fakenvml_env
from tests.usage_fixtures import ProcTree, pod_uid
from tests.waiting import WAIT, Kubelet

GPU = "nvidia.com/gpu"
MIG = "nvidia.com/mig-3g.20gb"
H100_0 = "GPU-d35a65db-f1df-bfab-ed51-c5032d8a68b9"
H100_1 = "GPU-5d8f3a42-0c7e-4b1d-9a6f-2e8c1b7d4f30"
A100 = "GPU-4f0cac3b-c11a-5097-b96a-6b845754ca32"
SLICE = "MIG-f6268203-0b1f-436c-c018-8654b8105b26"
TIME_SLICED = """version: v1
flags: {migStrategy: mixed}
sharing:
  timeSlicing:
    resources:
    - name: nvidia.com/gpu
      replicas: 2
"""


def cgroup(n: int) -> str:
    """The cgroup v2 path of pod `n`'s container (systemd driver, containerd)."""
    uid = pod_uid(n).replace("-", "_")
    return (
        f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{uid}.slice/"
        f"cri-containerd-{n:064x}.scope"
    )


def h100(uuid: str, minor: int, processes: list[dict[str, object]]) -> dict[str, object]:
    return {
        "name": "NVIDIA H100 80GB HBM3",
        "uuid": uuid,
        "minor": minor,
        "pci_bus_id": f"00000000:{0x18 + 0x10 * minor:02X}:00.0",
        "memory_total": "80GiB",
        "compute_capability": "9.0",
        "processes": processes,
    }


MACHINE = {
    "driver_version": "550.54.15",
    "gpus": [
        h100(
            H100_0,
            0,
            [
                {"pid": 4242, "used_memory": "6GiB", "sm_util": 40, "cgroup": cgroup(1)},
                {"pid": 4243, "used_memory": "1GiB", "sm_util": 5, "cgroup": cgroup(1)},
                {"pid": 4343, "used_memory": "2GiB", "sm_util": 20, "cgroup": cgroup(2)},
            ],
        ),
        h100(
            H100_1,
            1,
            [
                {"pid": 4444, "used_memory": "1GiB", "type": "graphics", "cgroup": cgroup(3)},
                {"pid": 4545, "used_memory": "512MiB", "cgroup": "/system.slice/tool.service"},
            ],
        ),
        {
            "name": "NVIDIA A100-SXM4-40GB",
            "uuid": A100,
            "minor": 2,
            "pci_bus_id": "00000000:07:00.0",
            "memory_total": 42949672960,
            "compute_capability": "8.0",
            "mig_mode": True,
            "mig_devices": [
                {
                    "profile": "3g.20gb",
                    "uuid": SLICE,
                    "placement_start": 4,
                    "processes": [{"pid": 4646, "used_memory": "3GiB", "cgroup": cgroup(4)}],
                },
                {"profile": "1g.5gb"},
            ],
        },
    ],
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(url: str) -> str:
    try:
        with urllib.request.urlopen(url, timeout=WAIT) as answer:
            return str(answer.read().decode())
    except OSError:
        return ""  # not listening yet


FAMILIES = {
    "used": "kubegpu_container_gpu_memory_used_bytes",
    "limit": "kubegpu_container_gpu_memory_limit_bytes",
    "sm": "kubegpu_container_gpu_sm_utilization_percent",
}


def sample(text: str, family: str, **wanted: str) -> float | None:
    """The one sample of the family whose labels include `wanted`; None when none."""
    found = [
        s
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == FAMILIES[family] and all(s.labels.get(k) == v for k, v in wanted.items())
    ]
    assert len(found) <= 1, found
    return found[0].value if found else None


async def test_serve_attributes_real_nvml_processes_and_top_shows_them(
    fakenvml_lib: Path, socket_dir: Path
) -> None:
    proc = ProcTree(socket_dir / "proc")
    for pid, n in ((4242, 1), (4243, 1), (4343, 2), (4444, 3), (4646, 4)):
        proc.put(pid, f"0::{cgroup(n)}\n")
    proc.put(4545, "0::/system.slice/tool.service\n")
    config = socket_dir / "config.yaml"
    config.write_text(TIME_SLICED)
    port = free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    env = fakenvml_env(fakenvml_lib, MACHINE)
    for name in ("CONFIG_FILE", "MIG_STRATEGY", "METRICS_PORT"):
        env.pop(name, None)
    log = socket_dir / "serve.log"
    with log.open("w") as out, FakePodResources(socket_dir / "pr.sock") as pod_resources:
        async with Kubelet(socket_dir / "dp", grace_period=0.5) as kubelet:
            serve = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "kubegpu.cli",
                "serve",
                "--backend=nvml",
                f"--device-plugin-path={kubelet.plugin_dir}",
                f"--config-file={config}",
                f"--metrics-port={port}",
                "--metrics-address=127.0.0.1",
                f"--proc-root={proc.root}",
                f"--pod-resources-socket={pod_resources.socket}",
                "--node-name=node-a",
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
            try:
                await kubelet.wait_for_resource(GPU, capacity=4, allocatable=4)
                await kubelet.wait_for_resource(MIG, capacity=1, allocatable=1)
                for n, pod, must in (
                    (1, "train-0", f"{H100_0}::0"),
                    (2, "infer-0", f"{H100_0}::1"),
                    (3, "render-0", f"{H100_1}::0"),
                ):
                    got = await kubelet.allocate(
                        GPU, 1, pod=pod_uid(n), container="main", must_include=[must]
                    )
                    pod_resources.add("ml", pod, "main", GPU, list(got.device_ids))
                got = await kubelet.allocate(MIG, 1, pod=pod_uid(4), container="main")
                pod_resources.add("ml", "tiny-0", "main", MIG, list(got.device_ids))
                # Scrapes until the kubelet's checkpoint and PodResources name every pod;
                # nothing signals that from the other process.
                async with asyncio.timeout(WAIT):
                    while 'pod="tiny-0"' not in (metrics := await asyncio.to_thread(scrape, url)):  # noqa: ASYNC110
                        await asyncio.sleep(0.05)
                top = await asyncio.to_thread(
                    subprocess.run,
                    [sys.executable, "-m", "kubegpu.cli", "top", "--once", "--url", url],
                    capture_output=True,
                    text=True,
                    timeout=WAIT,
                    check=False,
                    env={**os.environ, "PYTHONPATH": env["PYTHONPATH"]},
                )
            finally:
                serve.send_signal(signal.SIGTERM)
                await asyncio.wait_for(serve.wait(), WAIT)
    assert serve.returncode == 0, log.read_text()
    gib = 1024**3
    assert sample(metrics, "used", pod="train-0") == 7 * gib  # two processes, summed
    assert sample(metrics, "limit", pod="train-0") == 80 * gib
    assert sample(metrics, "sm", pod="train-0") == 45
    assert sample(metrics, "used", pod="infer-0") == 2 * gib
    assert sample(metrics, "used", pod="render-0") == 1 * gib
    assert sample(metrics, "used", pod="unattributed", gpu="1") == 512 * 1024**2
    tiny = {"pod": "tiny-0", "GPU_I_PROFILE": "3g.20gb", "UUID": A100}
    assert sample(metrics, "used", **tiny) == 3 * gib
    assert sample(metrics, "sm", **tiny) is None  # NVML keeps no per-process samples on MIG
    limit = sample(metrics, "limit", **tiny)
    # The slice's memory: 95 % of 4 of the 8 memory slices of 40 GiB, as the library reports.
    assert limit == 19 * gib
    gi = next(
        s.labels["GPU_I_ID"]
        for f in text_string_to_metric_families(metrics)
        for s in f.samples
        if s.labels.get("pod") == "tiny-0"
    )
    assert top.returncode == 0, top.stderr
    rows = [" ".join(line.split()) for line in top.stdout.splitlines()[2:]]
    assert rows == [
        "0 - ml/infer-0 main 2.0 GiB 80.0 GiB 2% 20",
        "0 - ml/train-0 main 7.0 GiB 80.0 GiB 9% 45",
        "1 - ml/render-0 main 1.0 GiB 80.0 GiB 1% 0",
        "1 - unattributed - 512 MiB - - 0",
        f"2 3g.20gb gi{gi} ml/tiny-0 main 3.0 GiB {size(limit)} {100 * 3 * gib / limit:.0f}% -",
    ]
