"""The per-container GPU metrics: what a scrape costs, and whether scrapes slow Allocate.

A `kubegpu serve` on a simulated 8×H100 node, time-sliced 8 ways (64 devices), with 64
processes (8 per GPU) in its process table; the kubelet emulator admits 64 pods, one replica
each, writing its device checkpoint; a fake PodResources API (in this process) names them;
a fake /proc gives each process its pod's cgroup. Every process is attributed before
anything is timed (the section fails otherwise).

- **scrape**: SCRAPES sequential `GET /metrics` over HTTP (the whole exposition, the usage
  families collected in serve's metrics thread: the process table, 64 cgroup reads, one
  PodResources `List`, the checkpoint's stat), and the collection alone as serve reports it
  (`kubegpu_usage_collect_seconds`).
- **Allocate under scrapes**: `Allocate` on the plugin's socket, back to back for WINDOW_S,
  with no scraper, then with one scraping every second, ROUNDS times each, alternating;
  median, p99 and max of every call of each kind.
"""

from __future__ import annotations

import asyncio
import socket
import statistics
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import yaml

from benchmarks import harness
from kubegpu.api import device_plugin_stub, pb
from kubegpu.devices.simulated import SimulatedBackend
from kubegpu.testing import FakePodResources

GPUS = 8
PER_GPU = 8
SCRAPES = 100
WINDOW_S = 5.0
ROUNDS = 2
NODE = "bench-usage"

Figures = dict[str, Any]


def _uid(n: int) -> str:
    return f"{n:08x}-0000-4000-8000-{n:012x}"


def _cgroup(uid: str, n: int) -> str:
    return (
        f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod"
        f"{uid.replace('-', '_')}.slice/cri-containerd-{n:064x}.scope\n"
    )


def _stats(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "median": round(statistics.median(ordered), 3),
        "p99": round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 3),
        "max": round(ordered[-1], 3),
        "count": len(ordered),
    }


def _scrape(url: str) -> tuple[float, str]:
    start = time.perf_counter()
    with urllib.request.urlopen(url, timeout=60) as answer:
        text = answer.read().decode()
    return (time.perf_counter() - start) * 1000, text


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _allocate_for(plugin_socket: Path, device: str, seconds: float) -> list[float]:
    request = pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest()])
    request.container_requests[0].devices_ids.append(device)
    out: list[float] = []
    async with grpc.aio.insecure_channel(f"unix://{plugin_socket}") as channel:
        stub = device_plugin_stub(channel)
        await stub.Allocate(request, timeout=30)  # the connection, not counted
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            start = time.perf_counter_ns()
            await stub.Allocate(request, timeout=30)
            out.append((time.perf_counter_ns() - start) / 1e6)
    return out


class Scraper:
    """Scrapes `url` every second in a thread of its own (as Prometheus would)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.stop = threading.Event()
        self.times: list[float] = []
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            self.times.append(_scrape(self.url)[0])
            self.stop.wait(1.0)  # the scrape interval being measured under

    def __enter__(self) -> Scraper:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self._thread.join(60)


def _node_file(path: Path) -> list[str]:
    """The node (8 H100s, 8 processes each); the GPU UUIDs serve will have."""
    gpus = [
        {
            "processes": [
                {"pid": 10_000 + g * PER_GPU + k, "memory_mib": 1024 + k, "sm_util": 10 + k}
                for k in range(PER_GPU)
            ]
        }
        for g in range(GPUS)
    ]
    path.write_text(yaml.safe_dump({"name": NODE, "gpus": gpus}))
    return [g.uuid for g in SimulatedBackend.load(str(path)).discover().gpus]


async def bench_usage() -> Figures:
    figures: Figures = {}
    with harness.temp_dir("kgb-use-") as root:
        uuids = _node_file(root / "node.yaml")
        (root / "config.yaml").write_text(harness.timeslicing_config(PER_GPU))
        proc = root / "proc"
        port = _free_port()
        url = f"http://127.0.0.1:{port}/metrics"
        with FakePodResources(root / "pr.sock") as pod_resources:
            async with (
                harness.emulator(root / "dp") as kubelet,
                harness.serve(
                    root / "dp",
                    root / "serve.log",
                    f"--config-file={root / 'config.yaml'}",
                    f"--metrics-port={port}",
                    "--metrics-address=127.0.0.1",
                    f"--proc-root={proc}",
                    f"--pod-resources-socket={pod_resources.socket}",
                    f"--node-name={NODE}",
                    simulate=str(root / "node.yaml"),
                ) as child,
            ):
                await harness.wait_registered(kubelet, GPUS * PER_GPU, child)
                placed = dict.fromkeys(uuids, 0)
                for n in range(GPUS * PER_GPU):
                    got = await kubelet.allocate(harness.RESOURCE, 1, pod=_uid(n), container="main")
                    gpu = got.device_ids[0].split("::")[0]
                    pod_resources.add(
                        "bench", f"pod-{n}", "main", harness.RESOURCE, list(got.device_ids)
                    )
                    pid = 10_000 + uuids.index(gpu) * PER_GPU + placed[gpu]
                    placed[gpu] += 1
                    (proc / str(pid)).mkdir(parents=True)
                    (proc / str(pid) / "cgroup").write_text(_cgroup(_uid(n), n))
                _, text = await asyncio.to_thread(_scrape, url)
                attributed = text.count("kubegpu_container_gpu_processes{") - text.count(
                    'pod="unattributed"'
                )
                if attributed != GPUS * PER_GPU or 'pod="unattributed"' in text:
                    raise RuntimeError(
                        f"only {attributed} of {GPUS * PER_GPU} containers attributed\n"
                        f"{child.tail()}"
                    )
                scrapes, collects = [], []
                for _ in range(SCRAPES):
                    ms, text = await asyncio.to_thread(_scrape, url)
                    scrapes.append(ms)
                    line = next(
                        x
                        for x in text.splitlines()
                        if x.startswith("kubegpu_usage_collect_seconds ")
                    )
                    collects.append(float(line.split()[1]) * 1000)
                figures["usage_scrape_ms"] = _stats(scrapes)
                figures["usage_collect_ms"] = _stats(collects)
                figures["usage_scrape_bytes"] = len(text.encode())
                plugin_socket = root / "dp" / "kubegpu-nvidia.com-gpu.sock"
                quiet: list[float] = []
                busy: list[float] = []
                during: list[float] = []
                for _ in range(ROUNDS):
                    quiet += await _allocate_for(plugin_socket, f"{uuids[0]}::0", WINDOW_S)
                    with Scraper(url) as scraper:
                        busy += await _allocate_for(plugin_socket, f"{uuids[0]}::0", WINDOW_S)
                    during += scraper.times
                figures["usage_allocate_ms"] = _stats(quiet)
                figures["usage_allocate_scraped_ms"] = _stats(busy)
                figures["usage_scrapes_during_allocate"] = _stats(during)
    return figures


def report(figures: Figures) -> list[tuple[str, str, str, str, bool | None]]:
    """(figure, median, max, target, met) rows for benchmarks/run.py's table."""
    rows: list[tuple[str, str, str, str, bool | None]] = []
    scrape = figures.get("usage_scrape_ms")
    if scrape is not None:
        rows.append(
            (
                f"GET /metrics, {GPUS} GPUs, {GPUS * PER_GPU} processes and containers",
                f"{scrape['median']:.2f} ms",
                f"{scrape['max']:.2f} ms",
                "",
                None,
            )
        )
        collect = figures["usage_collect_ms"]
        rows.append(
            (
                "  of which the per-container collection",
                f"{collect['median']:.2f} ms",
                f"{collect['max']:.2f} ms",
                "",
                None,
            )
        )
    quiet, busy = figures.get("usage_allocate_ms"), figures.get("usage_allocate_scraped_ms")
    if quiet is not None and busy is not None:
        for title, f in (
            ("Allocate, no scrapes", quiet),
            ("Allocate, a scrape every second", busy),
        ):
            rows.append(
                (
                    f"{title} (p99 {f['p99']:.2f} ms, {f['count']} calls)",
                    f"{f['median']:.2f} ms",
                    f"{f['max']:.2f} ms",
                    "",
                    None,
                )
            )
    return rows
