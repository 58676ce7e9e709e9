"""A zero-gap upgrade as a node feels it: `serve` handing over to `serve --handover`, under
each kubelet the emulator models, with both processes real subprocesses and the kubelet
emulator in this process over real unix sockets.

    python -m benchmarks.handover [--trials 5]

Each trial starts `kubegpu serve --simulate a10g-4`, waits for its 4 devices, starts the
successor with `--handover`, waits until the old process logged that it handed over, and
sends the old one SIGTERM, as a DaemonSet rolled with `maxSurge: 1, maxUnavailable: 0`
does. The emulator's state changes are stamped inside the change (an `on_change`
subscriber), as the kubelet's device manager has them in memory.

Figures (the last line printed is one JSON object):
- `handover_1_36_gap_*_ms`: on a 1.36 kubelet the old process's stream ending makes the
  kubelet disconnect the successor (its stale `runClient`): from the devices turning
  unhealthy to the successor's new registration making them healthy again. A pod admitted
  on the node inside that window is refused.
- `handover_<version>_unhealthy_steps`: how many times any trial saw the resource's
  allocatable drop below its capacity (1.36: one per trial; 1.37+: none).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import harness
from benchmarks.harness import RESOURCE
from kubegpu.kubelet import KubeletEmulator

GPUS = 4
PRESET = "a10g-4"
#: `make bench`'s trials per kubelet version.
TRIALS = 5
VERSIONS = ("1.36", "1.37")
Figures = dict[str, Any]


async def _log_says(child: harness.Child, text: str, timeout: float = harness.DEADLINE_S) -> None:
    """Until `child`'s log holds `text` (the log file is the only thing that says it)."""
    deadline = time.monotonic() + timeout
    while text not in child.log.read_text(errors="replace"):
        if child.proc.returncode is not None or time.monotonic() > deadline:
            raise RuntimeError(f"no {text!r} in the log of serve:\n{child.tail()}")
        await asyncio.sleep(0.01)


async def _wait(kubelet: KubeletEmulator, child: harness.Child, predicate: Any) -> None:
    try:
        await kubelet.wait_for(predicate, timeout=harness.DEADLINE_S)
    except TimeoutError as exc:
        raise RuntimeError(f"{exc}\n--- kubegpu serve log:\n{child.tail()}") from None


async def one_handover(tmp: Path, version: str) -> list[tuple[float, int, int]]:
    """One handover under the kubelet `version`: every (perf_counter, capacity,
    allocatable) of the resource from the old process's SIGTERM on."""
    plugin_dir = tmp / "dp"
    kubelet = KubeletEmulator(plugin_dir, version=version)
    await kubelet.start()
    points: list[tuple[float, int, int]] = []

    def stamp(resource: str) -> None:
        if resource != RESOURCE:
            return
        point = (kubelet.capacity(RESOURCE), kubelet.allocatable(RESOURCE))
        if not points or points[-1][1:] != point:
            points.append((time.perf_counter(), *point))

    try:
        async with harness.serve(plugin_dir, tmp / "old.log", simulate=PRESET) as old:
            await _wait(
                kubelet,
                old,
                lambda: kubelet.allocatable(RESOURCE) == GPUS,
            )
            async with harness.serve(
                plugin_dir, tmp / "new.log", "--handover", simulate=PRESET
            ) as new:
                await _log_says(old, "handed registration over")
                unsubscribe = kubelet.on_change(stamp)
                stamp(RESOURCE)
                old.proc.send_signal(signal.SIGTERM)
                await old.proc.wait()
                newest = kubelet.registrations[-1].endpoint  # the successor's socket

                def settled() -> bool:
                    eps = kubelet.endpoints(RESOURCE)
                    return (
                        list(eps) == [newest]
                        and all(eps.values())
                        and (kubelet.allocatable(RESOURCE) == GPUS)
                    )

                await _wait(kubelet, new, settled)
                unsubscribe()
    finally:
        await kubelet.stop()
    return points


def _gaps_ms(points: list[tuple[float, int, int]]) -> tuple[list[float], int]:
    """Each unhealthy stretch's length in ms, and how many there were."""
    gaps: list[float] = []
    since: float | None = None
    for at, capacity, allocatable in points:
        if allocatable < capacity and since is None:
            since = at
        elif allocatable == capacity and since is not None:
            gaps.append((at - since) * 1e3)
            since = None
    return gaps, len(gaps) + (since is not None)


async def bench_handover(trials: int = TRIALS) -> Figures:
    figures: Figures = {"handover_trials": trials}
    for version in VERSIONS:
        key = f"handover_{version.replace('.', '_')}"
        gaps: list[float] = []
        steps = 0
        for _ in range(trials):
            with harness.temp_dir("kgb-ho-") as tmp:
                found, count = _gaps_ms(await one_handover(tmp, version))
            gaps += found
            steps += count
        figures[f"{key}_unhealthy_steps"] = steps
        if gaps:
            figures[f"{key}_gap_median_ms"] = round(harness.median(gaps), 2)
            figures[f"{key}_gap_max_ms"] = round(max(gaps), 2)
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=TRIALS)
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR, format="%(levelname)s %(name)s: %(message)s")
    pycache = harness.use_bytecode_cache()
    try:
        figures = asyncio.run(bench_handover(args.trials))
    finally:
        shutil.rmtree(pycache, ignore_errors=True)
    print(json.dumps({**harness.machine(), **figures}, separators=(", ", ": ")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
