"""Run kubegpu's HealthMonitor on the simulated libnvidia-ml through real pynvml; print JSON.

Started by tests/fakenvml/test_health_policy.py in a fresh interpreter (pynvml binds
`libnvidia-ml.so.1` by name; the simulated library reads FAKENVML_CONFIG once per process).

    health_probe.py LINE...   once every GPU is registered for events, append the LINEs to
                              FAKENVML_EVENTS ({mig0}, {mig1}... name the MIG slices); print
                              every device the monitor marked, and those still unhealthy once
                              each has been probed for several recovery periods
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from kubegpu.config.v1 import HealthFlags
from kubegpu.devices.model import HealthEvent, HealthEventKind
from kubegpu.devices.nvml import NvmlBackend
from kubegpu.health import HealthMonitor
from kubegpu.state import NodeStore
from kubegpu.supervisor import spawn
from tests.fakenvml.probe import Counting

_WAIT_S = 30.0
#: Probes per device to wait for: at 20 ms a round, several 0.2 s recovery periods.
_PROBES = 40


async def monitor(lines: list[str], events_file: str) -> dict[str, Any]:
    nvml = Counting()
    backend = NvmlBackend.open(nvml=nvml, wait_timeout_ms=50, layout_check_seconds=3600)
    inventory = backend.discover()
    store = NodeStore()
    store.update(inventory=inventory)
    settings = HealthFlags(recovery_seconds=0.2, probe_interval_seconds=0.02)
    health = HealthMonitor(backend, settings, store)
    changed = asyncio.Event()
    xids: list[HealthEvent] = []
    marked: set[str] = set()
    probes: Counter[str] = Counter()
    handle = health.handle

    def handled(event: HealthEvent) -> None:
        handle(event)
        if event.kind is HealthEventKind.XID:
            xids.append(event)
        elif event.kind is HealthEventKind.PROBE_OK:
            probes[event.uuid] += 1
        marked.update(store.state.health)
        changed.set()

    health.handle = handled  # type: ignore[method-assign]

    async def until(predicate: Any) -> None:
        async def wait() -> None:
            while not predicate():
                changed.clear()
                await changed.wait()

        await asyncio.wait_for(wait(), _WAIT_S)

    task = spawn("health monitor", health.run())
    try:
        for _ in inventory.gpus:
            if not await asyncio.to_thread(nvml.registered.acquire, timeout=_WAIT_S):
                raise SystemExit("timed out waiting for the GPUs to be registered for events")
        names = {f"mig{i}": m.uuid for i, m in enumerate(inventory.mig_devices())}
        text = "".join(f"{line.format(**names)}\n" for line in lines)
        await asyncio.to_thread(_append, Path(events_file), text)
        await until(lambda: len(xids) >= len(lines))
        # Every marked device healed, or probed (and passing) over several recovery periods.
        await until(
            lambda: all(u not in store.state.health or probes[u] >= _PROBES for u in marked)
        )
        remaining = sorted(store.state.health)
        return {
            "gpus": [g.uuid for g in inventory.gpus],
            "migs": [m.uuid for m in inventory.mig_devices()],
            "xids": [[e.uuid, e.xid] for e in xids],
            "marked": sorted(marked),
            "remaining": remaining,
            "awaiting_reset": [u for u in remaining if health.tracker.awaiting_reset(u)],
            "probes_passed": {u: probes[u] for u in sorted(marked)},
        }
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        backend.close()


def _append(path: Path, text: str) -> None:
    with path.open("a") as out:
        out.write(text)


def main(argv: list[str]) -> int:
    result = asyncio.run(monitor(argv, os.environ["FAKENVML_EVENTS"]))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
