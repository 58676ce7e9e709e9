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
from kubegpu.kubelet import KubeletEmulator

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
        sources = {n: n for n in names}
        if BIG in sources:
            (work / f"{BIG}.yaml").write_text(yaml.safe_dump(big_node()))
            sources[BIG] = str(work / f"{BIG}.yaml")
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
    parser.add_argument("nodes", nargs="*", help=f"presets or {BIG} (default: all)")
    args = parser.parse_args()
    prefix = harness.use_bytecode_cache()
    try:
        figures = asyncio.run(bench_fresh_processes(args.nodes or None, args.trials, args.warm))
    finally:
        shutil.rmtree(prefix, ignore_errors=True)
    for node, f in figures.items():
        print(
            f"{node:14} {f['gpus']:>3} GPUs  start {f['start_to_registered_s']}  "
            f"RSS {f['rss_mib']}  first pod {f['first_pod_ms']}  warm {f['warm_pod_ms']}",
            file=sys.stderr,
        )
    print(json.dumps(figures), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
