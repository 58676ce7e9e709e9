"""Run kubegpu's NVML backend through real pynvml in this process and print JSON.

Started by the tests in a fresh interpreter per machine layout: pynvml binds
`libnvidia-ml.so.1` by name (LD_LIBRARY_PATH points at the simulated one) and the
simulated library reads FAKENVML_CONFIG once per process.

    probe.py discover [HOST_ROOT]        inventory + resources for each MIG strategy
    probe.py place SIZE...               links (kind, lanes, NVLink version) by GPU index and
                                         the preferred allocation of SIZE whole GPUs out of all
    probe.py watch EXPECTED LINE...      append LINEs to FAKENVML_EVENTS once every GPU is
                                         registered, print what the health tracker makes of
                                         the first EXPECTED events
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import types
from pathlib import Path
from typing import Any

import pynvml

from kubegpu.config import HealthFlags, parse_config
from kubegpu.devices.model import HealthEvent, Inventory
from kubegpu.devices.nvml import NvmlBackend
from kubegpu.devices.stop import Stop
from kubegpu.errors import ConfigError
from kubegpu.health import HealthTracker
from kubegpu.placement import preferred_allocation
from kubegpu.resources import build_resources

# As generous as tests/waiting.py WAIT (this runs in its own interpreter, without it).
_WAIT_S = 60.0


def _inventory_json(inventory: Inventory) -> dict[str, Any]:
    return {
        "driver": inventory.driver_version,
        "gpus": [
            {
                "index": g.index,
                "uuid": g.uuid,
                "mig_enabled": g.mig_enabled,
                "links": {link.peer_uuid: [str(link.kind), link.count] for link in g.links},
                "migs": [
                    {
                        "uuid": m.uuid,
                        "profile": m.profile,
                        "index": m.index,
                        "gi": m.gi_id,
                        "ci": m.ci_id,
                        "memory_mib": m.memory_mib,
                        "device_paths": list(m.device_paths),
                    }
                    for m in g.mig_devices
                ],
            }
            for g in inventory.gpus
        ],
    }


def _resources(inventory: Inventory, strategy: str) -> dict[str, Any]:
    try:
        specs = build_resources(
            inventory, parse_config(f"version: v1\nflags: {{migStrategy: {strategy}}}")
        )
    except ConfigError as err:
        return {"error": str(err)}
    return {s.name: [[d.unit.uuid, d.unit.index] for d in s.devices] for s in specs}


def discover(host_root: str) -> dict[str, Any]:
    backend = NvmlBackend.open(host_root=host_root, dev_root=host_root)
    try:
        inventory = backend.discover()
    finally:
        backend.close()
    out = _inventory_json(inventory)
    out["resources"] = {s: _resources(inventory, s) for s in ("none", "single", "mixed")}
    return out


def place(sizes: list[int]) -> dict[str, Any]:
    backend = NvmlBackend.open()
    try:
        inventory = backend.discover()
    finally:
        backend.close()
    return links_and_placement(inventory, sizes)


def links_and_placement(inventory: Inventory, sizes: list[int]) -> dict[str, Any]:
    """Links by GPU index and the preferred whole-GPU picks: what `place` prints, and what
    the tests compute for a simulated-node preset to compare the two backends."""
    index = {g.uuid: g.index for g in inventory.gpus}
    (spec,) = build_resources(inventory, parse_config("version: v1"))
    ids = [d.id for d in spec.devices]
    return {
        "links": [
            {
                str(index[link.peer_uuid]): [str(link.kind), link.count, link.nvlink_version]
                for link in g.links
            }
            for g in inventory.gpus
        ],
        "place": {
            str(size): sorted(
                spec.by_id[i].unit.gpu.index for i in preferred_allocation(spec, ids, [], size)
            )
            for size in sizes
        },
    }


class Counting(types.ModuleType):
    """pynvml, counting nvmlDeviceRegisterEvents so events are written after registration."""

    def __init__(self) -> None:
        super().__init__("pynvml")
        self.registered = threading.Semaphore(0)

    def __getattr__(self, name: str) -> Any:
        return getattr(pynvml, name)

    def nvmlDeviceRegisterEvents(self, handle: Any, types_: int, event_set: Any) -> None:
        pynvml.nvmlDeviceRegisterEvents(handle, types_, event_set)
        self.registered.release()


def watch(expected: int, lines: list[str], events_file: str) -> dict[str, Any]:
    nvml = Counting()
    backend = NvmlBackend.open(nvml=nvml, wait_timeout_ms=50)
    inventory = backend.discover()
    seen: list[HealthEvent] = []
    changed = threading.Condition()
    tracker = HealthTracker(HealthFlags(), time.monotonic)

    def emit(event: HealthEvent) -> None:
        with changed:
            seen.append(event)
            tracker.observe(event)
            changed.notify_all()

    stop = Stop()
    thread = threading.Thread(target=backend.watch, args=(stop, emit), daemon=True)
    thread.start()
    for _ in inventory.gpus:
        if not nvml.registered.acquire(timeout=_WAIT_S):
            raise SystemExit("timed out waiting for the GPUs to be registered for events")
    with Path(events_file).open("a") as out:
        out.write("".join(f"{line}\n" for line in lines))
    with changed:
        done = changed.wait_for(lambda: len(seen) >= expected, timeout=_WAIT_S)
    stop.set()
    thread.join(timeout=_WAIT_S)
    backend.close()
    health = inventory.with_health(tracker.health())
    return {
        "complete": done,
        "events": [[e.uuid, str(e.kind), e.xid] for e in seen],
        "unhealthy": sorted(
            [g.uuid for g in health.gpus if g.health != "Healthy"]
            + [m.uuid for m in health.mig_devices() if m.health != "Healthy"]
        ),
    }


def main(argv: list[str]) -> int:
    if argv[0] == "discover":
        result = discover(argv[1] if len(argv) > 1 else "/")
    elif argv[0] == "place":
        result = place([int(a) for a in argv[1:]])
    else:
        result = watch(int(argv[1]), argv[2:], os.environ["FAKENVML_EVENTS"])
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
