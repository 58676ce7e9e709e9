"""What a node feels once per start: fresh `kubegpu serve --simulate <node>` processes.

    python -m benchmarks.startup [--trials 10] [--warm 20] [node ...]

Each node is a preset (every file of src/kubegpu/devices/presets) or the 64-GPU node
written here (`gpus-64`: eight HGX H100 boards of 8 GPUs, one NVSwitch domain each, boards
0-3 on NUMA node 0 and 4-7 on node 1). Every trial is a fresh `serve` process and a fresh
kubelet emulator (its topology manager on) over real unix sockets in a temp dir; trials
take the nodes in turn, so every node sees the same CPU weather. Per process:

- **start → registered**: spawn → the emulator holds the plugin's first ListAndWatch list
  (registration, dial, first list), stamped inside the emulator's state change; beside
  it, the CPU `serve` used to get there (utime+stime), which a busy machine moves less;
- **RSS**: `VmRSS` of `serve` right then, before any pod (and after the last pod);
- **first pod (cold)**: a 2-GPU pod (1 GPU where the node has one) admitted through
  `KubeletEmulator.allocate` as soon as the list is held: the emulator's admission path,
  topology hint + GetPreferredAllocation + Allocate, timed from the call to the
  emulator's record of Allocate's answer (`..._preferred_answered_ms`: of
  GetPreferredAllocation's, where the emulator asked it). The whole call (`..._with_checkpoint_ms`,
  `time.perf_counter()` around it) adds the emulator's checkpoint write after Allocate,
  which is the emulator's cost, not the plugin's (~1-3 ms in Python here);
- **warm pods**: the next WARM pods in the same process, each timed alike; pods are held
  and the oldest released (untimed) until two pods' worth of GPUs is free, so offers are
  fragmented as on a busy node and still leave a choice. Like the kubelet, the emulator
  asks GetPreferredAllocation only when the NUMA-aligned devices outnumber the request;
  `warm_pods_asked_preferred` counts the warm pods where it did.

One uncounted warm-up process runs first: it writes the bytecode cache a node's image has
(`harness.use_bytecode_cache`) and warms this process's emulator, as a kubelet is long
running. The last line printed when run alone is one JSON object with every figure.

`--mode dra` (`bench_fresh_dra`): fresh `kubegpu serve --mode dra --simulate <node>`
processes instead, each registering with a fresh DRA kubelet (the test rig's
`tests.rig.dra.DRAKubelet`: the kubelet's plugin watcher and DRA plugin manager over a real
`plugins_registry` directory), on `DRA_NODES`, one uncounted warm-up first. Per process:

- **start → registered**: spawn → the kubelet's plugin watcher has finished a successful
  registration of the driver (dialled the registration socket, GetInfo answered, the DRA
  plugin manager holds the driver, NotifyRegistrationStatus(registered) delivered): from
  then on the kubelet routes NodePrepareResources to it. Stamped by the first waiter the
  kubelet's change wakes, with the CPU `serve` used to get there beside it;
- **RSS**: `VmRSS` of `serve` right then, and `SETTLED_S` later (context, not judged):
  by then the daemon has made its first API requests, and the HTTP client has loaded its
  connection stack (httpx2 imports httpcore2, h11 and h2 on a client's first use) and
  opened its TLS context, as on a node.

No claim is prepared (benchmarks/dra.py times prepare and unprepare). The API server is
unreachable (a kubeconfig that names a port nothing listens on): start-up and registration
never wait on it, and the ResourceSlice publisher retries in the background, so these
figures leave out what a node's watches and first published slices hold in memory (on a
real 1.36 cluster, a settled DRA `serve` held ~4 MiB more than at registration).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

import kubegpu.devices
from benchmarks import harness
from benchmarks.harness import RESOURCE
from kubegpu.devices.simulated import SimulatedBackend
from kubegpu.kubelet import KubeletEmulator
from tests.rig.dra import DRAKubelet
from tests.rig.kube import FakeKube

PRESETS = Path(kubegpu.devices.__file__).parent / "presets"
BIG = "gpus-64"
WARM_UP = "h100-8"
TRIALS = 10
WARM = 20
POD_GPUS = 2
#: Before each warm pod, the oldest pods are released until this many pods' worth of
#: GPUs is free: the offers stay fragmented, and still leave the plugin a choice.
KEEP_FREE = 2

Figures = dict[str, Any]
#: DRA mode: the 8×H100 node, and the 64-GPU one.
DRA_NODES = (WARM_UP, BIG)
#: The driver a simulated NVIDIA node registers.
DRA_DRIVER = "gpu.nvidia.com"


def presets() -> list[str]:
    return sorted(p.stem for p in PRESETS.glob("*.yaml"))


def big_node(boards: int = 8) -> dict[str, Any]:
    """`boards` HGX H100 boards in one node (docs/simulated-node.md's format)."""
    return {
        "name": f"hgx-h100-{boards}x8",
        "driver_version": "550.54.15",
        "cuda_version": "12.4",
        "defaults": {
            "product": "NVIDIA H100 80GB HBM3",
            "memory_mib": 81559,
            "compute_capability": "9.0",
            "multiprocessors": 132,
            "brand": "NVIDIA",
            "mig_capable": True,
            "nvswitch_links": 18,
        },
        "gpus": [
            {"count": 8, "numa_node": b * 2 // boards, "nvswitch": f"board{b}"}
            for b in range(boards)
        ],
    }


@dataclass
class Admission:
    """One pod's admission, ms from the emulator's `allocate` call."""

    preferred_ms: float | None  # to GetPreferredAllocation's answer (None: not asked)
    allocate_ms: float  # to Allocate's answer: the judged figure
    whole_ms: float  # the whole call, the emulator's checkpoint write included


@dataclass
class Runs:
    """Every trial's figures for one node (pods: first of each process, and warm ones)."""

    start_s: list[float] = field(default_factory=list)
    start_cpu_s: list[float] = field(default_factory=list)
    rss_mib: list[float] = field(default_factory=list)
    rss_after_pods_mib: list[float] = field(default_factory=list)
    cold: list[Admission] = field(default_factory=list)
    warm: list[Admission] = field(default_factory=list)
    gpus: int = 0
    pod_gpus: int = 0


async def _admit(kubelet: KubeletEmulator, pod: str, count: int) -> Admission:
    """Admit one pod of `count` GPUs, timed (see `Admission`).

    The emulator stamps its RPC records with time.monotonic(), hence that clock for the
    times to each answer (the same clock as perf_counter on Linux: CLOCK_MONOTONIC)."""
    calls = len(kubelet.rpcs)
    mono = time.monotonic()
    start = time.perf_counter()
    allocation = await kubelet.allocate(RESOURCE, count, pod=pod, start=False)
    whole = (time.perf_counter() - start) * 1000
    if len(allocation.device_ids) != count:
        raise RuntimeError(f"{pod}: got {allocation.device_ids}, asked for {count}")
    made = kubelet.rpcs[calls:]
    if any(r.error is not None for r in made) or made[-1:] == []:
        raise RuntimeError(f"{pod}: an RPC failed or none was recorded: {made}")
    at = {r.method: (r.time - mono) * 1000 for r in made}
    if "Allocate" not in at:
        raise RuntimeError(f"{pod}: no Allocate recorded: {made}")
    return Admission(at.get("GetPreferredAllocation"), at["Allocate"], whole)


async def one_process(work: Path, node: str, name: str, warm: int, runs: Runs) -> None:
    """A fresh `serve` + kubelet: start → registered, RSS, the first pod, `warm` more."""
    plugin_dir = work / f"dp-{name}"
    hz = os.sysconf("SC_CLK_TCK")
    async with harness.emulator(plugin_dir, topology_manager=True) as kubelet:
        with harness.Stamp(kubelet) as listed:
            async with harness.serve(plugin_dir, work / f"{name}.log", simulate=node) as plugin:
                await harness.wait_registered(kubelet, None, plugin)
                runs.start_s.append(listed.ms_since(plugin.spawned) / 1000)
                runs.start_cpu_s.append(harness.cpu_ticks(plugin.pid) / hz)
                runs.rss_mib.append(harness.proc_status(plugin.pid)["VmRSS"])
                gpus = kubelet.capacity(RESOURCE)
                count = min(POD_GPUS, gpus)
                runs.gpus, runs.pod_gpus = gpus, count
                runs.cold.append(await _admit(kubelet, f"{name}-0", count))
                held = [f"{name}-0"]
                for i in range(1, warm + 1):
                    while held and gpus - count * len(held) < KEEP_FREE * count:
                        kubelet.release(held.pop(0))
                    runs.warm.append(await _admit(kubelet, f"{name}-{i}", count))
                    held.append(f"{name}-{i}")
                runs.rss_after_pods_mib.append(harness.proc_status(plugin.pid)["VmRSS"])


def _med_max(values: list[float], digits: int = 2) -> dict[str, float]:
    return {"median": round(harness.median(values), digits), "max": round(max(values), digits)}


def _pods(key: str, pods: list[Admission]) -> Figures:
    preferred = [p.preferred_ms for p in pods if p.preferred_ms is not None]
    return {
        f"{key}_ms": _med_max([p.allocate_ms for p in pods]),
        f"{key}_with_checkpoint_ms": _med_max([p.whole_ms for p in pods]),
        f"{key}_preferred_answered_ms": _med_max(preferred) if preferred else None,
    }


def summary(runs: Runs) -> Figures:
    return {
        "gpus": runs.gpus,
        "pod_gpus": runs.pod_gpus,
        "processes": len(runs.cold),
        "start_to_registered_s": _med_max(runs.start_s, 3),
        "cpu_to_registered_s": _med_max(runs.start_cpu_s, 2),
        "rss_mib": _med_max(runs.rss_mib, 1),
        "rss_after_pods_mib": _med_max(runs.rss_after_pods_mib, 1),
        **_pods("first_pod", runs.cold),
        "warm_pods": len(runs.warm),
        "warm_pods_asked_preferred": sum(p.preferred_ms is not None for p in runs.warm),
        **_pods("warm_pod", runs.warm),
    }


@dataclass
class DraRuns:
    """Every DRA trial's figures for one node."""

    start_s: list[float] = field(default_factory=list)
    start_cpu_s: list[float] = field(default_factory=list)
    rss_mib: list[float] = field(default_factory=list)
    rss_settled_mib: list[float] = field(default_factory=list)


#: How long after registration the settled RSS is read: the daemon's first API requests
#: (and their retries against the unreachable server) have been made by then. A time, not
#: a wait for a condition: the figure is defined as what the process holds that long after.
SETTLED_S = 5.0


def _unreachable_kubeconfig(path: Path) -> Path:
    """A kubeconfig whose API server does not listen (nothing answers on port 1)."""
    cluster = {"server": "https://127.0.0.1:1"}
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "c", "cluster": cluster}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "x",
    }
    path.write_text(json.dumps(config))
    return path


async def _registered(kubelet: DRAKubelet, child: harness.Child) -> float:
    """The perf_counter at which the kubelet's plugin watcher has registered the driver
    (see the module's docstring); fails fast, with the log's tail, if `serve` exits."""
    at: list[float] = []

    def done() -> bool:
        if not at and any(a.ok and a.name == DRA_DRIVER for a in kubelet.attempts):
            at.append(time.perf_counter())
        return bool(at)

    try:
        await harness.unless_exited(
            kubelet.wait_for(done, timeout=harness.DEADLINE_S), child, "registering"
        )
    except TimeoutError as exc:
        raise RuntimeError(f"{exc}\n--- kubegpu serve log:\n{child.tail()}") from None
    return at[0]


async def one_dra_process(work: Path, node: str, name: str, runs: DraRuns) -> None:
    """A fresh `serve --mode dra` + DRA kubelet: start → registered, RSS."""
    root = work / f"k-{name}"
    hz = os.sysconf("SC_CLK_TCK")
    args = [
        *harness.kubegpu_command(),
        "serve",
        "--mode",
        "dra",
        "--simulate",
        node,
        "--node-name",
        "n1",
        "--kubelet-registrar-directory-path",
        str(root / "plugins_registry"),
        "--kubelet-plugins-directory-path",
        str(root / "plugins"),
        "--device-plugin-path",
        str(root / "dp"),
    ]
    env = {**os.environ, "KUBECONFIG": str(work / "kubeconfig")}
    for variable in ("KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT", "CONFIG_FILE"):
        env.pop(variable, None)
    async with (
        DRAKubelet(root, FakeKube()) as kubelet,
        harness.child(args, work / f"{name}.log", env=env) as plugin,
    ):
        at = await _registered(kubelet, plugin)
        runs.start_s.append(at - plugin.spawned)
        runs.start_cpu_s.append(harness.cpu_ticks(plugin.pid) / hz)
        runs.rss_mib.append(harness.proc_status(plugin.pid)["VmRSS"])
        await asyncio.sleep(SETTLED_S)
        runs.rss_settled_mib.append(harness.proc_status(plugin.pid)["VmRSS"])


def dra_summary(runs: DraRuns) -> Figures:
    return {
        "processes": len(runs.start_s),
        "start_to_registered_s": _med_max(runs.start_s, 3),
        "cpu_to_registered_s": _med_max(runs.start_cpu_s, 2),
        "rss_mib": _med_max(runs.rss_mib, 1),
        "rss_settled_mib": _med_max(runs.rss_settled_mib, 1),
    }


async def bench_fresh_dra(nodes: list[str] | None = None, trials: int = TRIALS) -> Figures:
    """Per node, `trials` fresh `serve --mode dra` processes; figures by node."""
    names = nodes if nodes is not None else list(DRA_NODES)
    with harness.temp_dir("kgbd-") as work:
        _unreachable_kubeconfig(work / "kubeconfig")
        sources = _node_sources(work, names)
        gpus = {n: _gpus(sources[n]) for n in names}
        await one_dra_process(work, WARM_UP, "warm-up", DraRuns())
        runs = {n: DraRuns() for n in names}
        for trial in range(trials):
            for n in names:
                await one_dra_process(work, sources[n], f"{n}-{trial}", runs[n])
    return {n: {"gpus": gpus[n], **dra_summary(r)} for n, r in runs.items()}


def _node_sources(work: Path, names: list[str]) -> dict[str, str]:
    """What `--simulate` is given for each node: the preset, or the big node's file."""
    sources = {n: n for n in names}
    if BIG in sources:
        (work / f"{BIG}.yaml").write_text(yaml.safe_dump(big_node()))
        sources[BIG] = str(work / f"{BIG}.yaml")
    return sources


def _gpus(source: str) -> int:
    return len(SimulatedBackend.load(source).discover().gpus)


async def bench_fresh_processes(
    nodes: list[str] | None = None, trials: int = TRIALS, warm: int = WARM
) -> Figures:
    """Per node, `trials` fresh processes (see the module's docstring); figures by node."""
    names = nodes if nodes is not None else [*presets(), BIG]
    # The emulator stands in for the kubelet, whose Go collector runs concurrently: keep a
    # collection of this process's own heap from landing inside a timed admission.
    gc.collect()
    gc.freeze()
    with harness.temp_dir("kgbs-") as work:
        sources = _node_sources(work, names)
        # h100-8 asks GetPreferredAllocation (so placement's bytecode is written too);
        # a node of one or two GPUs may not.
        await one_process(work, WARM_UP, "warm-up", warm, Runs())
        runs = {n: Runs() for n in names}
        for trial in range(trials):
            for n in names:
                await one_process(work, sources[n], f"{n}-{trial}", warm, runs[n])
    return {n: summary(r) for n, r in runs.items()}


def main() -> int:
    logging.basicConfig(level=logging.ERROR, format="%(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--trials", type=int, default=TRIALS)
    parser.add_argument("--warm", type=int, default=WARM)
    parser.add_argument(
        "--mode", choices=["plugin", "dra"], default="plugin", help="serve's mode (--mode)"
    )
    parser.add_argument("nodes", nargs="*", help=f"presets or {BIG} (default: all)")
    args = parser.parse_args()
    prefix = harness.use_bytecode_cache()
    try:
        if args.mode == "dra":
            figures = asyncio.run(bench_fresh_dra(args.nodes or None, args.trials))
        else:
            figures = asyncio.run(bench_fresh_processes(args.nodes or None, args.trials, args.warm))
    finally:
        shutil.rmtree(prefix, ignore_errors=True)
    for node, f in figures.items():
        pods = (
            ""
            if args.mode == "dra"
            else f"  first pod {f['first_pod_ms']}  warm {f['warm_pod_ms']}"
        )
        print(
            f"{node:14} {f['gpus']:>3} GPUs  start {f['start_to_registered_s']}  "
            f"RSS {f['rss_mib']}{pods}",
            file=sys.stderr,
        )
    print(json.dumps(figures), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
