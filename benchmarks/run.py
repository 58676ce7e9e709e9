"""`make bench`: the device plugin's latencies, start-up and memory, over real sockets.

Layout of the run (see docs/performance.md for results and what dominates each figure):

- **subprocess plugin** — `kubegpu serve --simulate h100-8` runs in its own process, as
  on a node; the kubelet emulator and the raw gRPC client run in this process. Measured:
  start → registered (3 fresh starts), RSS, Allocate round trips against a bare
  `grpc.aio` echo server that also runs in a subprocess (calls interleaved in blocks so
  both see the same CPU contention).
- **subprocess plugin on the NVML backend** — the same start on `../shared/fakenvml` (the
  simulated libnvidia-ml, through the real `pynvml`), as a node starts: no PyYAML or
  simulated backend, pynvml and NVML's calls instead. Skipped without the shared checkout.
- **subprocess plugin, 1,024 devices** — the same with 8 GPUs × 128 time-slicing
  replicas from a config file: Allocate round trips and RSS.
- **subprocess plugin, 8,192 devices** — 8 GPUs × 1,024 replicas: the first ListAndWatch
  message (stream opened → whole list received) against the echo server sending the same
  bytes on a bare server stream, in alternating trials.
- **in-process daemon** — `Daemon` with a `SimulatedBackend` and the emulator share this
  event loop (fault injection needs the backend object): Xid → new ListAndWatch list,
  the same with 1,024 devices, and config reload of 8 × 48 replicas.
- **start-up imports** — CPU time and RSS of each group of `serve`'s imports in fresh
  interpreters (`benchmarks/startup.py`).
- **watches** — `benchmarks/watch.py` (issue 9): 200 kubelet restarts → re-registered
  (sockets wiped, and the whole directory wiped), 50 config changes → new list at the
  kubelet (by rename and by ConfigMap `..data` swap, no SIGHUP), and idle CPU over 60 s.

The last line printed is one JSON object with every figure.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import subprocess
import sys
import time
import traceback
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc

from benchmarks import harness
from benchmarks.echo_server import LIST_METHOD, METHOD
from benchmarks.harness import RESOURCE
from benchmarks.placement import bench_placement
from benchmarks.startup import bench_startup_imports
from benchmarks.watch import bench_reload_and_idle, bench_reregister
from kubegpu.api import device_plugin_stub, pb
from kubegpu.daemon import Daemon, DaemonSettings
from kubegpu.devices.simulated import SimulatedBackend
from kubegpu.kubelet import KubeletEmulator

GPUS = 8
#: Allocate/echo: warm-up calls, then ROUNDS alternating blocks of BLOCK calls each.
WARMUP = 200
ROUNDS = 4
BLOCK = 500
ROUNDS_1K = 2
START_TRIALS = 3
HEALTH_TRIALS = 10
LIST_1K_TRIALS = 5
RELOAD_TRIALS = 5
REPLICAS_1K = 128
#: First ListAndWatch at 8,192 IDs (8 GPUs x 1,024 replicas): streams opened per server.
REPLICAS_8K = 1024
LIST_8K_TRIALS = 15
#: The in-process daemon's config poll interval: only used where inotify is unavailable
#: (the watch is inotify's otherwise), so the reload figures do not depend on it.
CONFIG_POLL = 0.05
#: benchmarks/watch.py as a section: restarts and reloads per kind, idle window (s).
WATCH_RESTARTS = 200
WATCH_RELOADS = 50
WATCH_IDLE_S = 60.0
XID = 79

Figures = dict[str, Any]


# -- helpers ----------------------------------------------------------------------------


def _write_config(path: Path, replicas: int) -> None:
    """Write atomically (rename), as a ConfigMap update does: never a half-written file."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(harness.timeslicing_config(replicas))
    tmp.replace(path)


def _allocate_request(device_id: str) -> pb.AllocateRequest:
    return pb.AllocateRequest(
        container_requests=[pb.ContainerAllocateRequest(devices_ids=[device_id])]
    )


async def _round_trips(
    calls: dict[str, Callable[[], Awaitable[object]]], rounds: int
) -> dict[str, list[int]]:
    """Warm each call up, then time them in alternating blocks (same CPU contention)."""
    for call in calls.values():
        await harness.timed_calls(call, WARMUP)
    samples: dict[str, list[int]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            samples[name] += await harness.timed_calls(call, BLOCK)
    return samples


def _phases(count: int) -> list[float]:
    """`count` phases spread evenly over a poll cycle, as fractions of it."""
    return [(i + 0.5) / count for i in range(count)]


def _plugin_socket(kubelet: KubeletEmulator) -> Path:
    return kubelet.plugin_dir / kubelet.registrations[-1].endpoint


# -- subprocess plugin, 8 GPUs --------------------------------------------------------


def _import_times() -> Figures:
    """Interpreter start-up, and what importing `serve`'s modules adds to it."""

    def wall(code: str) -> float:
        runs = []
        for _ in range(3):
            start = time.perf_counter()
            subprocess.run([sys.executable, "-c", code], check=True)
            runs.append(time.perf_counter() - start)
        return harness.median(runs)

    bare = wall("pass")
    imports = wall(
        "import kubegpu.cli, kubegpu.daemon, kubegpu.devices.simulated, kubegpu.plugin, grpc"
    )
    return {"python_startup_s": round(bare, 3), "import_s": round(imports - bare, 3)}


async def _start_once(work: Path, name: str, env: dict[str, str] | None = None) -> float:
    """One fresh kubelet + `serve`: seconds from spawning to 8 devices listed."""
    plugin_dir = work / f"dp-{name}"
    async with (
        harness.emulator(plugin_dir) as kubelet,
        harness.serve(plugin_dir, work / f"serve-{name}.log", env=env) as plugin,
    ):
        await harness.wait_registered(kubelet, GPUS, plugin)
        return time.perf_counter() - plugin.spawned


async def bench_subprocess_8() -> Figures:
    figures: Figures = {}
    starts: list[float] = []
    with harness.temp_dir("kgb-") as work:
        # Compiling kubegpu's sources (no bytecode: PYTHONDONTWRITEBYTECODE in a dev
        # shell) is not what a node pays; shown apart, for comparison with older runs.
        figures["start_to_registered_uncompiled_s"] = round(
            await _start_once(work, "uncompiled", harness.uncompiled_env()), 3
        )
        # Writes the bytecode cache (harness.use_bytecode_cache) that the timed starts read.
        await _start_once(work, "warm-up")
        # Fresh kubelet + plugin per start: a stopped plugin's devices stay in the
        # kubelet's capacity (grace period), so a reused kubelet would read 8 at once.
        for trial in range(START_TRIALS):
            plugin_dir = work / f"dp{trial}"
            async with (
                harness.emulator(plugin_dir) as kubelet,
                harness.serve(plugin_dir, work / f"serve{trial}.log") as plugin,
            ):
                await harness.wait_registered(kubelet, GPUS, plugin)
                starts.append(time.perf_counter() - plugin.spawned)
                if trial < START_TRIALS - 1:
                    continue
                # The last one stays up for the rest of this section.
                mem = harness.proc_status(plugin.pid)
                figures["rss_mb"] = round(mem["VmRSS"], 1)
                figures.update(await _allocate_vs_echo(kubelet, work))
                mem = harness.proc_status(plugin.pid)
                figures["rss_after_allocate_mb"] = round(mem["VmRSS"], 1)
                figures["rss_peak_mb"] = round(mem["VmHWM"], 1)
                figures["register_after_up_ms"] = round(plugin.registrations_s()[0] * 1000, 1)
    figures["start_to_registered_s"] = round(harness.median(starts), 3)
    figures["start_to_registered_runs_s"] = [round(s, 3) for s in starts]
    figures.update(_import_times())
    return figures


async def _allocate_vs_echo(kubelet: KubeletEmulator, work: Path) -> Figures:
    """Allocate on `kubegpu serve` vs the bare echo floor vs the servicer alone.

    All three servers are subprocesses; the client is a raw grpc.aio channel in this
    process; the three loops run in alternating blocks so they share the CPU weather.
    """
    device = sorted(kubelet.devices(RESOURCE))[0]
    request = _allocate_request(device)
    payload = request.SerializeToString()
    echo_socket, servicer_socket = work / "echo.sock", work / "servicer.sock"
    async with (
        harness.module_server("benchmarks.echo_server", echo_socket, work / "echo.log"),
        harness.module_server("benchmarks.servicer_server", servicer_socket, work / "servicer.log"),
        grpc.aio.insecure_channel(f"unix://{_plugin_socket(kubelet)}") as plugin_channel,
        grpc.aio.insecure_channel(f"unix://{echo_socket}") as echo_channel,
        grpc.aio.insecure_channel(f"unix://{servicer_socket}") as servicer_channel,
    ):
        stub = device_plugin_stub(plugin_channel)
        bare = device_plugin_stub(servicer_channel)
        echo = echo_channel.unary_unary(METHOD, None, None)  # bytes in, bytes out
        answer = await stub.Allocate(request)
        response_bytes = answer.ByteSize()
        preferred = pb.PreferredAllocationRequest(
            container_requests=[
                pb.ContainerPreferredAllocationRequest(
                    available_deviceIDs=sorted(kubelet.devices(RESOURCE)), allocation_size=4
                )
            ]
        )
        samples = await _round_trips(
            {
                "allocate": lambda: stub.Allocate(request),
                "echo": lambda: echo(payload),
                "servicer": lambda: bare.Allocate(request),
                # A typed RPC with a trivial handler, on the same plugin socket.
                "options": lambda: stub.GetDevicePluginOptions(pb.Empty()),
                # Placement of 4 of the 8 GPUs, over the same socket.
                "preferred": lambda: stub.GetPreferredAllocation(preferred),
            },
            ROUNDS,
        )
    alloc, floor, servicer = samples["allocate"], samples["echo"], samples["servicer"]
    p50, echo_p50 = harness.percentile(alloc, 50), harness.percentile(floor, 50)
    return {
        "allocate_p50_ms": round(p50, 3),
        "allocate_p99_ms": round(harness.percentile(alloc, 99), 3),
        "echo_p50_ms": round(echo_p50, 3),
        "echo_p99_ms": round(harness.percentile(floor, 99), 3),
        "allocate_over_echo_p50": round(p50 / echo_p50, 2),
        "servicer_only_p50_ms": round(harness.percentile(servicer, 50), 3),
        "servicer_only_p99_ms": round(harness.percentile(servicer, 99), 3),
        "options_p50_ms": round(harness.percentile(samples["options"], 50), 3),
        "preferred_8_p50_ms": round(harness.percentile(samples["preferred"], 50), 3),
        "preferred_8_p99_ms": round(harness.percentile(samples["preferred"], 99), 3),
        "preferred_8_over_echo_p50": round(
            harness.percentile(samples["preferred"], 50) / echo_p50, 2
        ),
        "allocate_calls": len(alloc),
        "allocate_response_bytes": response_bytes,
    }


# -- subprocess plugin as deployed ----------------------------------------------------


async def bench_deployed() -> Figures:
    """`serve` with the DaemonSet's env: NODE_NAME (events on) and the HTTP endpoints.

    No cluster is reachable here, so events end up disabled, but only after the
    kubernetes client was imported, which is what costs memory and start-up time.
    """
    health_port, metrics_port = harness.free_port(), harness.free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_SERVICE")}
    env.update(
        NODE_NAME="bench-node",
        KUBECONFIG="/nonexistent/kubeconfig",
        HEALTH_PORT=str(health_port),
        METRICS_PORT=str(metrics_port),
        HEALTH_ADDRESS="127.0.0.1",
        METRICS_ADDRESS="127.0.0.1",
    )
    with harness.temp_dir("kgbd-") as work:
        plugin_dir = work / "dp"
        async with (
            harness.emulator(plugin_dir) as kubelet,
            harness.serve(plugin_dir, work / "serve.log", env=env) as plugin,
        ):
            await harness.wait_registered(kubelet, GPUS, plugin)
            start_s = time.perf_counter() - plugin.spawned
            rss = harness.proc_status(plugin.pid)["VmRSS"]
    return {"start_to_registered_deployed_s": round(start_s, 3), "rss_deployed_mb": round(rss, 1)}


# -- subprocess plugin on the NVML backend ---------------------------------------------

#: The simulated libnvidia-ml.so.1 of the shared checkout beside this repository.
FAKENVML = Path(__file__).resolve().parents[2] / "shared" / "fakenvml"


async def bench_nvml_start() -> Figures:
    """start -> registered with `serve --backend nvml` on the simulated libnvidia-ml (8 H100s,
    `examples/h100x8.json`): what a node runs instead of `--simulate`. Median of
    START_TRIALS fresh starts after one uncounted start that writes pynvml's bytecode."""
    if not (FAKENVML / "build.sh").is_file():
        print(f"    skipped: {FAKENVML} is absent (no shared checkout)", file=sys.stderr)
        return {}
    starts: list[float] = []
    with harness.temp_dir("kgbn-") as work:
        built = await asyncio.to_thread(
            subprocess.run,
            ["bash", str(FAKENVML / "build.sh"), str(work / "lib")],
            capture_output=True,
            text=True,
            check=False,
        )
        if built.returncode != 0:
            raise RuntimeError(f"building {FAKENVML} failed (gcc needed):\n{built.stderr}")
        env = dict(
            os.environ,
            LD_LIBRARY_PATH=str(work / "lib"),
            FAKENVML_CONFIG=str(FAKENVML / "examples" / "h100x8.json"),
        )
        for trial in range(START_TRIALS + 1):
            plugin_dir = work / f"dp{trial}"
            args = [
                *harness.kubegpu_command(),
                "serve",
                "--backend",
                "nvml",
                "--device-plugin-path",
                str(plugin_dir),
            ]
            async with (
                harness.emulator(plugin_dir) as kubelet,
                harness.child(args, work / f"serve{trial}.log", env=env) as plugin,
            ):
                await harness.wait_registered(kubelet, GPUS, plugin)
                if trial:
                    starts.append(time.perf_counter() - plugin.spawned)
    return {
        "start_to_registered_nvml_s": round(harness.median(starts), 3),
        "start_to_registered_nvml_runs_s": [round(s, 3) for s in starts],
    }


# -- subprocess plugin, 1,024 devices -------------------------------------------------


async def bench_subprocess_1k() -> Figures:
    devices = GPUS * REPLICAS_1K
    with harness.temp_dir("kgb1k-") as work:
        config = work / "config.yaml"
        _write_config(config, REPLICAS_1K)
        plugin_dir = work / "dp"
        async with (
            harness.emulator(plugin_dir) as kubelet,
            harness.serve(plugin_dir, work / "serve.log", "--config-file", str(config)) as plugin,
        ):
            await harness.wait_registered(kubelet, devices, plugin)
            start_s = time.perf_counter() - plugin.spawned
            rss = harness.proc_status(plugin.pid)["VmRSS"]
            device = sorted(kubelet.devices(RESOURCE))[-1]
            request = _allocate_request(device)
            async with grpc.aio.insecure_channel(f"unix://{_plugin_socket(kubelet)}") as channel:
                stub = device_plugin_stub(channel)
                samples = (
                    await _round_trips({"allocate": lambda: stub.Allocate(request)}, ROUNDS_1K)
                )["allocate"]
    return {
        "devices_1k": devices,
        "allocate_1k_p50_ms": round(harness.percentile(samples, 50), 3),
        "allocate_1k_p99_ms": round(harness.percentile(samples, 99), 3),
        "start_to_registered_1k_s": round(start_s, 3),
        "rss_1k_mb": round(rss, 1),
    }


# -- subprocess plugin, 8,192 devices: the first ListAndWatch ---------------------------


async def _first_message(channel: grpc.aio.Channel, method: str) -> tuple[int, int]:
    """Open a server stream, read its first message as raw bytes, close it: (ns, bytes)."""
    stream = channel.unary_stream(method, None, None)  # bytes in, bytes out
    start = time.perf_counter_ns()
    call = stream(b"")  # an empty message: what pb.Empty serializes to
    first = await call.read()
    took = time.perf_counter_ns() - start
    call.cancel()
    if not isinstance(first, bytes):
        raise RuntimeError(f"{method}: the stream ended before its first message")
    return took, len(first)


async def bench_list_8k() -> Figures:
    """The first ListAndWatch of `kubegpu serve` at 8,192 IDs beside its floor: a bare
    grpc.aio server stream sending the very same bytes (no protobuf, no servicer)."""
    devices = GPUS * REPLICAS_8K
    method = "/v1beta1.DevicePlugin/ListAndWatch"
    with harness.temp_dir("kgb8k-") as work:
        config = work / "config.yaml"
        _write_config(config, REPLICAS_8K)
        plugin_dir = work / "dp"
        async with (
            harness.emulator(plugin_dir) as kubelet,
            harness.serve(plugin_dir, work / "serve.log", "--config-file", str(config)) as plugin,
        ):
            await harness.wait_registered(kubelet, devices, plugin)
            async with grpc.aio.insecure_channel(f"unix://{_plugin_socket(kubelet)}") as channel:
                listed = channel.unary_stream(method, None, None)(b"")
                payload = await listed.read()
                listed.cancel()
                assert isinstance(payload, bytes)
                assert len(pb.ListAndWatchResponse.FromString(payload).devices) == devices
                (work / "list.bin").write_bytes(payload)
                async with (
                    harness.module_server(
                        "benchmarks.echo_server",
                        work / "echo.sock",
                        work / "echo.log",
                        str(work / "list.bin"),
                    ),
                    grpc.aio.insecure_channel(f"unix://{work / 'echo.sock'}") as floor_channel,
                ):
                    plugin_ns: list[int] = []
                    floor_ns: list[int] = []
                    await _first_message(channel, method)  # warm both up once
                    await _first_message(floor_channel, LIST_METHOD)
                    for _ in range(LIST_8K_TRIALS):  # alternating: same CPU weather
                        took, size = await _first_message(channel, method)
                        plugin_ns.append(took)
                        took, floor_size = await _first_message(floor_channel, LIST_METHOD)
                        floor_ns.append(took)
                        if size != floor_size:
                            raise RuntimeError(f"list sizes differ: {size} vs {floor_size}")
    p50, floor_p50 = harness.percentile(plugin_ns, 50), harness.percentile(floor_ns, 50)
    return {
        "list_8k_devices": devices,
        "list_8k_bytes": len(payload),
        "list_8k_first_p50_ms": round(p50, 2),
        "list_8k_first_max_ms": round(max(plugin_ns) / 1e6, 2),
        "list_8k_floor_p50_ms": round(floor_p50, 2),
        "list_8k_over_floor_p50": round(p50 / floor_p50, 2),
    }


# -- in-process daemon ----------------------------------------------------------------


class _InProcess:
    """An emulator and a `Daemon` on a simulated h100-8 node, in this event loop."""

    def __init__(
        self, work: Path, config_file: Path | None = None, poll: float = CONFIG_POLL
    ) -> None:
        self.backend = SimulatedBackend.load("h100-8")
        self.kubelet = KubeletEmulator(work / "dp")
        self.daemon = Daemon(
            DaemonSettings(
                plugin_dir=work / "dp",
                backend="simulated",
                config_file=config_file,
                config_poll_interval=poll,
            ),
            backend=self.backend,
        )
        self.poll = poll
        #: Seconds the emulator spent handling each ListAndWatch update (parse, checkpoint).
        self.kubelet_update_s: list[float] = []
        self._time_kubelet_updates()
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def _time_kubelet_updates(self) -> None:
        # Wrap the emulator's per-update handler on this instance only, to split the
        # end-to-end figures into plugin + transport and the kubelet (emulator) side.
        handler = self.kubelet._on_update
        spent = self.kubelet_update_s

        async def timed(*args: Any) -> None:
            start = time.perf_counter()
            try:
                await handler(*args)
            finally:
                spent.append(time.perf_counter() - start)

        self.kubelet._on_update = timed  # type: ignore[method-assign, assignment]

    async def __aenter__(self) -> _InProcess:
        await self.kubelet.start()
        self._task = asyncio.create_task(self.daemon.run(self._stop))
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stop.set()
        if self._task is not None:
            await self._task
        await self.kubelet.stop()

    async def wait(self, capacity: int, allocatable: int) -> None:
        await self.kubelet.wait_for_resource(
            RESOURCE, capacity=capacity, allocatable=allocatable, timeout=30
        )

    async def xid_round_trip(self, capacity: int, per_gpu: int, gpu: int) -> tuple[float, float]:
        """Xid on one GPU → the kubelet reads it unhealthy; then heal it.

        Returns (end-to-end ms, of which the emulator handling the new list, ms).
        """
        self.kubelet_update_s.clear()
        start = time.perf_counter()
        self.backend.inject_xid(gpu, XID)
        await self.wait(capacity, capacity - per_gpu)
        took = (time.perf_counter() - start) * 1000
        kubelet_ms = sum(self.kubelet_update_s) * 1000
        self.backend.heal(gpu)
        await self.wait(capacity, capacity)
        return took, kubelet_ms


async def _xid_trials(node: _InProcess, capacity: int, per_gpu: int, trials: int) -> Figures:
    runs = [await node.xid_round_trip(capacity, per_gpu, t % GPUS) for t in range(trials)]
    return {
        "ms": round(harness.median([r[0] for r in runs]), 2),
        "max_ms": round(max(r[0] for r in runs), 2),
        "kubelet_ms": round(harness.median([r[1] for r in runs]), 2),
    }


async def bench_in_process() -> Figures:
    figures: Figures = {}
    with harness.temp_dir("kgbh-") as work:
        async with _InProcess(work) as node:
            await node.wait(GPUS, GPUS)
            xid = await _xid_trials(node, GPUS, 1, HEALTH_TRIALS)
            figures["allocate_handler_us"] = await _handler_cost(node.daemon)
            figures["preferred_8_handler_us"] = await _preferred_handler_cost(node.daemon)
        figures.update({f"health_to_list_{k}": v for k, v in xid.items()})

    with harness.temp_dir("kgbr-") as work:
        config = work / "config.yaml"
        _write_config(config, REPLICAS_1K)
        devices = GPUS * REPLICAS_1K
        async with _InProcess(work, config) as node:
            await node.wait(devices, devices)
            xid = await _xid_trials(node, devices, REPLICAS_1K, LIST_1K_TRIALS)
            figures.update({f"list_1k_{k}": v for k, v in xid.items()})
            figures.update(_pure_costs(node.daemon))
            figures["allocate_handler_1k_us"] = await _handler_cost(node.daemon)
            figures.update(await _reload(node, config, "reload_8x48"))
            figures["config_poll_s"] = node.poll

    with harness.temp_dir("kgbd-") as work:
        # The same reload with the daemon's default poll interval (what a node runs).
        config = work / "config.yaml"
        _write_config(config, 24)
        default_poll = DaemonSettings().config_poll_interval
        async with _InProcess(work, config, poll=default_poll) as node:
            await node.wait(GPUS * 24, GPUS * 24)
            figures.update(await _reload(node, config, "reload_8x48_default_poll", poke=False))
            figures["default_config_poll_s"] = node.poll
    return figures


async def _handler_cost(daemon: Daemon, calls: int = 2000) -> float:
    """The servicer's Allocate body alone (no gRPC, no protobuf bytes), in µs per call."""
    servicer = daemon.manager.servers[RESOURCE].servicer
    request = _allocate_request(servicer.spec.devices[-1].id)
    context: Any = None  # only read on the error path
    for _ in range(WARMUP):
        await servicer.Allocate(request, context)
    start = time.perf_counter()
    for _ in range(calls):
        await servicer.Allocate(request, context)
    return round((time.perf_counter() - start) / calls * 1e6, 1)


async def _preferred_handler_cost(daemon: Daemon, calls: int = 2000) -> float:
    """The servicer's GetPreferredAllocation body alone (4 of the 8 GPUs, as over the
    socket), in µs per call: what placement adds to the round trip."""
    servicer = daemon.manager.servers[RESOURCE].servicer
    request = pb.PreferredAllocationRequest(
        container_requests=[
            pb.ContainerPreferredAllocationRequest(
                available_deviceIDs=sorted(d.id for d in servicer.spec.devices),
                allocation_size=4,
            )
        ]
    )
    context: Any = None  # only read on the error path
    for _ in range(WARMUP):
        await servicer.GetPreferredAllocation(request, context)
    start = time.perf_counter()
    for _ in range(calls):
        await servicer.GetPreferredAllocation(request, context)
    return round((time.perf_counter() - start) / calls * 1e6, 1)


def _pure_costs(daemon: Daemon) -> Figures:
    """Plugin-side CPU cost of one 1,024-device list: specs, and the protobuf message."""
    from kubegpu.plugin.server import device_list
    from kubegpu.resources import build_resources

    inventory = daemon.inventory.with_health(daemon.health)

    def best_ms(fn: Callable[[], object], repeat: int = 5) -> float:
        times = []
        for _ in range(repeat):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1000)
        return round(min(times), 2)

    specs = build_resources(inventory, daemon.config)
    spec = next(s for s in specs if s.name == RESOURCE)
    return {
        "build_resources_1k_ms": best_ms(lambda: build_resources(inventory, daemon.config)),
        "device_list_1k_ms": best_ms(lambda: device_list(spec).SerializeToString()),
        "device_list_1k_bytes": device_list(spec).ByteSize(),
    }


async def _reload(node: _InProcess, config: Path, key: str, *, poke: bool = True) -> Figures:
    """Config reload 24 → 48 replicas: file write → the kubelet sees 8 × 48 devices.

    The config file is watched with inotify, so the poll interval only matters where
    inotify is unavailable; the phase offsets before each write (from the polling days)
    no longer change the figure. With `poke`, also time the same reload with SIGHUP's
    `poke_config()` right after the write.
    """

    async def once(poked: bool, phase: float) -> float:
        _write_config(config, 24)
        node.daemon.poke_config()  # restarts the poll cycle: a known phase
        await node.wait(GPUS * 24, GPUS * 24)
        await asyncio.sleep(phase * node.poll)  # sets the phase; not a wait for state
        start = time.perf_counter()
        _write_config(config, 48)
        if poked:
            node.daemon.poke_config()
        await node.wait(GPUS * 48, GPUS * 48)
        return (time.perf_counter() - start) * 1000

    polled = [await once(False, phase) for phase in _phases(RELOAD_TRIALS)]
    figures = {
        f"{key}_ms": round(harness.median(polled), 1),
        f"{key}_max_ms": round(max(polled), 1),
    }
    if poke:
        poked = [await once(True, phase) for phase in _phases(RELOAD_TRIALS)]
        figures[f"{key}_poked_ms"] = round(harness.median(poked), 1)
    return figures


# -- watches (benchmarks/watch.py) ------------------------------------------------------


async def _bench_watch() -> Figures:
    figures = await bench_reregister(WATCH_RESTARTS)
    figures.update(await bench_reload_and_idle(WATCH_RELOADS, WATCH_IDLE_S))
    return figures


# -- report ---------------------------------------------------------------------------

#: (key, unit, target text, test) — a test of None means "no target, context only".
TARGETS: list[tuple[str, str, str, Callable[[Figures], bool] | None]] = [
    ("echo_p50_ms", "ms", "floor", None),
    ("echo_p99_ms", "ms", "floor", None),
    (
        "allocate_p50_ms",
        "ms",
        "≤ 1.2 × echo p50",
        lambda f: f["allocate_p50_ms"] <= 1.2 * f["echo_p50_ms"],
    ),
    ("allocate_over_echo_p50", "×", "≤ 1.2", lambda f: f["allocate_over_echo_p50"] <= 1.2),
    ("allocate_p99_ms", "ms", "< 2 ms", lambda f: f["allocate_p99_ms"] < 2.0),
    ("servicer_only_p50_ms", "ms", "", None),
    ("servicer_only_p99_ms", "ms", "", None),
    ("options_p50_ms", "ms", "", None),
    ("allocate_handler_us", "µs", "", None),
    ("start_to_registered_s", "s", "≤ 0.15 s", lambda f: f["start_to_registered_s"] <= 0.15),
    ("start_to_registered_uncompiled_s", "s", "", None),
    ("start_to_registered_nvml_s", "s", "(≤ 0.15 s)", None),
    ("python_startup_s", "s", "", None),
    ("startup_imports_cpu_ms", "ms", "", None),
    ("startup_imports_rss_mib", "MiB", "", None),
    ("import_s", "s", "", None),
    ("register_after_up_ms", "ms", "", None),
    ("health_to_list_ms", "ms", "", None),
    ("health_to_list_kubelet_ms", "ms", "", None),
    ("rss_mb", "MiB", "≤ 50 MiB", lambda f: f["rss_mb"] <= 50),
    ("rss_after_allocate_mb", "MiB", "", None),
    ("rss_deployed_mb", "MiB", "(< 60 MiB)", None),
    ("start_to_registered_deployed_s", "s", "(≤ 1.5 s)", None),
    ("list_1k_ms", "ms", "", None),
    ("list_1k_kubelet_ms", "ms", "", None),
    ("build_resources_1k_ms", "ms", "", None),
    ("device_list_1k_ms", "ms", "", None),
    ("allocate_1k_p50_ms", "ms", "", None),
    ("allocate_1k_p99_ms", "ms", "", None),
    ("allocate_handler_1k_us", "µs", "", None),
    ("rss_1k_mb", "MiB", "", None),
    ("reload_8x48_ms", "ms", "< 300 ms", lambda f: f["reload_8x48_ms"] < 300),
    ("reload_8x48_max_ms", "ms", "< 300 ms", lambda f: f["reload_8x48_max_ms"] < 300),
    ("reload_8x48_poked_ms", "ms", "", None),
    (
        "reload_8x48_default_poll_ms",
        "ms",
        "< 300 ms",
        lambda f: f["reload_8x48_default_poll_ms"] < 300,
    ),
    (
        "reload_8x48_default_poll_max_ms",
        "ms",
        "< 300 ms",
        lambda f: f["reload_8x48_default_poll_max_ms"] < 300,
    ),
    ("preferred_8_p50_ms", "ms", "", None),
    ("preferred_8_p99_ms", "ms", "", None),
    ("preferred_8_handler_us", "µs", "", None),
    (
        "preferred_8_over_echo_p50",
        "×",
        "≤ 1.5 × echo",
        lambda f: f["preferred_8_over_echo_p50"] <= 1.5,
    ),
    ("list_8k_first_p50_ms", "ms", "", None),
    ("list_8k_floor_p50_ms", "ms", "", None),
    (
        "list_8k_over_floor_p50",
        "×",
        "≤ 3 × floor",
        lambda f: f["list_8k_over_floor_p50"] <= 3,
    ),
    (
        "placement_min_optimal_pct",
        "%",
        "100 % on every topology ≤ 16 GPUs",
        lambda f: f["placement_min_optimal_pct"] == 100,
    ),
    (
        "placement_random_16_worst_p99_ms",
        "ms",
        "≤ 1 ms, every size (in-process)",
        lambda f: f["placement_random_16_worst_p99_ms"] <= 1,
    ),
    (
        "placement_socket_worst_over_floor_p50",
        "×",
        "≤ 1.5 × typed floor at 8/16/64 GPUs, 64×48",
        lambda f: f["placement_socket_worst_over_floor_p50"] <= 1.5,
    ),
    # The stricter floor (no protobuf at all), shown beside the judged one.
    ("placement_socket_worst_over_raw_floor_p50", "×", "", None),
    # Issue 9, from benchmarks/watch.py: kubelet restart -> re-registered over 200 restarts
    # (sockets wiped; whole directory wiped), config change -> new list at the kubelet.
    ("reregister_median_ms", "ms", "≤ 6 ms", lambda f: f["reregister_median_ms"] <= 6),
    ("reregister_max_ms", "ms", "≤ 20 ms", lambda f: f["reregister_max_ms"] <= 20),
    (
        "reregister_rmdir_median_ms",
        "ms",
        "≤ 6 ms",
        lambda f: f["reregister_rmdir_median_ms"] <= 6,
    ),
    ("reregister_rmdir_max_ms", "ms", "≤ 20 ms", lambda f: f["reregister_rmdir_max_ms"] <= 20),
    ("reregister_kubelet_start_median_ms", "ms", "", None),
    ("reregister_seen_to_registered_median_ms", "ms", "", None),
    ("reload_write_median_ms", "ms", "≤ 30 ms", lambda f: f["reload_write_median_ms"] <= 30),
    ("reload_write_max_ms", "ms", "≤ 30 ms", lambda f: f["reload_write_max_ms"] <= 30),
    (
        "reload_configmap_median_ms",
        "ms",
        "≤ 30 ms",
        lambda f: f["reload_configmap_median_ms"] <= 30,
    ),
    (
        "reload_configmap_max_ms",
        "ms",
        "≤ 30 ms",
        lambda f: f["reload_configmap_max_ms"] <= 30,
    ),
    ("idle_cpu_pct", "%", "≤ 0.1 % (60 s)", lambda f: f["idle_cpu_pct"] <= 0.1),
]


def _table(figures: Figures) -> str:
    rows = [("figure", "value", "target", "")]
    for key, unit, target, test in TARGETS:
        value = figures.get(key)
        if value is None:
            rows.append((key, "n/a", target, "FAILED TO MEASURE" if test else ""))
            continue
        try:
            verdict = "" if test is None else ("met" if test(figures) else "NOT MET")
        except (KeyError, TypeError):
            verdict = "?"
        rows.append((key, f"{value} {unit}", target, verdict))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows)


async def _main() -> int:
    pycache = harness.use_bytecode_cache()
    try:
        return await _sections()
    finally:
        shutil.rmtree(pycache, ignore_errors=True)


async def _sections() -> int:
    figures: Figures = {
        **harness.machine(),
        "date": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "loadavg_1m": os.getloadavg()[0],
    }
    failed = []
    sections = [
        ("subprocess plugin, 8 GPUs", bench_subprocess_8),
        ("subprocess plugin with the DaemonSet's env", bench_deployed),
        ("subprocess plugin on the NVML backend (../shared/fakenvml)", bench_nvml_start),
        ("subprocess plugin, 1,024 devices", bench_subprocess_1k),
        ("subprocess plugin, 8,192 devices: first ListAndWatch", bench_list_8k),
        ("in-process daemon", bench_in_process),
        ("placement quality and cost (in-process)", bench_placement),
        ("start-up imports by group", bench_startup_imports),
        ("kubelet restarts, config changes, idle CPU (benchmarks/watch.py)", _bench_watch),
    ]
    for title, section in sections:
        print(f"... {title}", file=sys.stderr, flush=True)
        start = time.perf_counter()
        try:
            figures.update(await section())
        except Exception:
            failed.append(title)
            traceback.print_exc()
        print(f"    {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    print()
    print(_table(figures))
    print()
    if failed:
        figures["failed_sections"] = failed
    print(json.dumps(figures, separators=(", ", ": ")), flush=True)
    return 1 if failed else 0


def main() -> int:
    # The emulator and daemon log every step (and each injected Xid); only errors matter
    # here (gRPC core is quietened in benchmarks/__init__.py).
    logging.basicConfig(level=logging.ERROR, format="%(levelname)s %(name)s: %(message)s")
    return asyncio.run(_main())


if __name__ == "__main__":
    sys.exit(main())
