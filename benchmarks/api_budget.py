"""The API budget: what one node's `serve` sends the Kubernetes API server, per hour in a
steady state and per event, in each mode.

    python -m benchmarks.api_budget [--storm 1000]

`serve`'s daemon (`kubegpu.daemon.Daemon`) runs in this process on the simulated `h100-8`
node, against the project's in-memory API server (`tests.rig.kube.FakeKube`), which logs
every request (`FakeKube.request_counts`: by verb and resource). Each mode is set up as a
cluster runs it:

- **plugin**: the device plugin, with the kubelet emulator; its config chosen by the
  Node's label (a directory of named configs, so the Node is watched), and Node events on.
- **dra**: `--mode dra`, with the kubelet's DRA side (`tests.rig.dra.DRAKubelet`),
  which deletes the node's ResourceSlices when it starts, as the kubelet does; the same
  named configs and Node events. Requests the emulated kubelet sends are not counted.

Each scenario runs on a fresh daemon and counts the requests from the moment the daemon
settled after its start (no request for a second, the event queue empty) until it settled
again after the scenario:

- `start`: the daemon's own start, to settled.
- `steady_hour`: one hour of the daemon's timers with nothing happening; the event loop's
  clock is moved on an hour (`benchmarks.clock.LoopClock`), so every periodic task (the
  slices' resync, health probes, config polls) runs as often as in a real hour.
- `kubelet_restart`: the kubelet restarts (and, in DRA mode, deletes the node's slices).
- `health_flap`: one GPU fails its probes, then heals.
- `reload`: the Node's config label changes to a config with time-slicing.
- `xid_storm`: STORM Xids over the 8 GPUs in one burst, faults and application errors
  (`STORM_XIDS`) in turn.
- `flap_storm`: STORM health events on one GPU, Xid and heal in turn, each taken into the
  node's state before the next (nothing lost to batching in one loop turn).
- `flapping_hour`: every GPU fails and heals every FLAP_PERIOD_S for an hour of the loop's
  clock (the event recorder's clock too): a sick node left flapping.

A real API server ends each watch after KubeClient's `timeoutSeconds` and the client
lists again; the in-memory server's watches do not end, so those requests are not in
these figures (docs/performance.md adds them from the client's settings).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks import harness
from benchmarks.clock import LoopClock
from kubegpu.config.names import DEFAULT_NODE_LABEL
from kubegpu.config.source import KubernetesNodeLabels, NamedConfigs
from kubegpu.daemon import Daemon, DaemonSettings
from kubegpu.devices import Health
from kubegpu.devices.simulated import SimulatedBackend
from kubegpu.events import KubernetesEventSink, NodeEvents
from kubegpu.kubelet import KubeletEmulator
from kubegpu.mode import Mode
from tests.rig.dra import DRAKubelet, SliceWiper
from tests.rig.kube import FakeKube

NODE = "bench-node"
PRESET = "h100-8"
GPUS = 8
DRIVER = "gpu.nvidia.com"
RESOURCE = harness.RESOURCE
#: Health events in each storm.
STORM = 1000
#: The flapping hour: each GPU fails, then heals, this often (loop-clock seconds).
FLAP_PERIOD_S = 10.0
#: Settled: no request for this long (real seconds) and the event queue empty.
QUIET_S = 1.0
#: The Xids of the storm, in turn (a count prime to the GPUs', so every GPU gets each):
#: application errors the catalog ignores (13, 31, 43) among faults (48, 79, 95, 61).
STORM_XIDS = (13, 31, 48, 43, 79, 95, 61)
#: The flap storm's faults, in turn: each marks a GPU unhealthy.
FAULT_XIDS = (48, 79, 95, 61)
MODES = tuple(Mode)

Figures = dict[str, Any]

#: The named configs: `a` (the default) and `b`, two time-slicing replicas per GPU.
CONFIGS = {
    "a.yaml": "version: v1\n",
    "b.yaml": harness.timeslicing_config(2),
}


@dataclass
class Node:
    """One node: the daemon under test, its API server, its kubelet, its GPUs."""

    mode: Mode
    daemon: Daemon
    kube: FakeKube
    backend: SimulatedBackend
    events: NodeEvents
    #: Requests the emulated kubelet sent (its slice wipes): not the daemon's.
    kubelet_requests: Counter[tuple[str, str]] = field(default_factory=Counter)
    restart_kubelet: Callable[[], Awaitable[None]] | None = None

    def requests(self) -> Counter[tuple[str, str]]:
        """The daemon's requests so far (the kubelet's taken out)."""
        return self.kube.request_counts() - self.kubelet_requests

    def unhealthy(self) -> int:
        return sum(h is Health.UNHEALTHY for h in self.daemon.health.values())

    def published_health(self) -> bool:
        """Whether every device in the API's slices is tainted exactly when unhealthy."""
        sick = {uuid for uuid, h in self.daemon.health.items() if h is Health.UNHEALTHY}
        for body in list(self.kube.resource_slices.values()):
            for device in body["spec"].get("devices") or []:
                uuid = device.get("attributes", {}).get("uuid", {}).get("string")
                if bool(device.get("taints")) != (uuid in sick):
                    return False
        return True

    async def settled(self) -> None:
        """Until every queued event went out and no request was sent for QUIET_S; in DRA
        mode first until the slices show every device's health (the publisher paces its
        writes in a storm: a quiet second may come before its last write)."""
        if self.mode == "dra":
            await self.until("the slices show the node's health", self.published_health)
        deadline = time.monotonic() + harness.DEADLINE_S
        while True:
            await asyncio.wait_for(self.events.drain(), harness.DEADLINE_S)
            last, since = self.kube.request_counts(), time.monotonic()
            while time.monotonic() - since < QUIET_S:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{self.mode} node never settled: {self.requests()}")
                await asyncio.sleep(0.05)  # a quiet period is the condition: nothing signals it
                now = self.kube.request_counts()
                if now != last:
                    last, since = now, time.monotonic()
            await asyncio.wait_for(self.events.drain(), harness.DEADLINE_S)
            if self.kube.request_counts() == last:
                return

    async def until(self, what: str, holds: Callable[[], bool]) -> None:
        deadline = time.monotonic() + harness.DEADLINE_S
        while not holds():
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.mode} node: {what} never held")
            await asyncio.sleep(0.005)  # the daemon's state has no change signal to await


def _counting_wiper(kube: FakeKube, counted: Counter[tuple[str, str]]) -> SliceWiper:
    """The kubelet's slice wipe (`node_slice_wiper`), its deletes counted as the kubelet's."""

    def wipe(driver: str | None) -> None:
        for name, body in list(kube.resource_slices.items()):
            spec = body.get("spec") or {}
            if spec.get("nodeName") == NODE and driver in (None, spec.get("driver")):
                counted[("delete", "resourceslice")] += 1
                kube.delete_resource_slice(name)

    return wipe


@contextlib.asynccontextmanager
async def node(mode: Mode, work: Path) -> AsyncIterator[Node]:
    """A started, settled node in `mode`."""
    configs = work / "configs"
    configs.mkdir(parents=True, exist_ok=True)
    for name, text in CONFIGS.items():
        (configs / name).write_text(text)
    kube = FakeKube()
    kube.add_node(NODE, {DEFAULT_NODE_LABEL: "a"})
    backend = SimulatedBackend.load(PRESET)
    # The event recorder on the loop's clock (the real one, until `LoopClock` moves it):
    # its repeats are spaced in the same time as the daemon's timers.
    loop = asyncio.get_running_loop()
    events = NodeEvents(NODE, KubernetesEventSink(kube), clock=lambda: loop.time())
    named = NamedConfigs(
        directory=configs,
        default="a",
        node_name=NODE,
        label=DEFAULT_NODE_LABEL,
        labels=KubernetesNodeLabels(kube),
    )
    settings = DaemonSettings(
        mode=mode,
        simulate=PRESET,
        node_name=NODE,
        plugin_dir=work / "dp",
        registrar_dir=work / "kubelet" / "plugins_registry",
        kubelet_plugins_dir=work / "kubelet" / "plugins",
        cdi_dir=work / "cdi",
        named=named,
    )
    daemon = Daemon(settings, backend=backend, kube=kube, events=events)
    state = Node(mode, daemon, kube, backend, events)
    stop = asyncio.Event()
    async with contextlib.AsyncExitStack() as stack:
        if mode == "dra":
            dra = DRAKubelet(
                work / "kubelet", kube, wipe=_counting_wiper(kube, state.kubelet_requests)
            )
            await dra.start()
            stack.push_async_callback(dra.stop)
            state.restart_kubelet = dra.restart
        else:
            kubelet = KubeletEmulator(settings.plugin_dir)
            await kubelet.start()
            stack.push_async_callback(kubelet.stop)
            state.restart_kubelet = kubelet.restart
        task = asyncio.ensure_future(daemon.run(stop))
        try:
            started = asyncio.ensure_future(daemon.started.wait())
            await asyncio.wait({task, started}, return_when=asyncio.FIRST_COMPLETED)
            if task.done():
                started.cancel()
                task.result()
            if mode == "dra":
                await state.until("the node's slices published", lambda: _devices(kube) == GPUS)
                await dra.wait_for_driver(DRIVER, timeout=harness.DEADLINE_S)
            else:
                await kubelet.wait_for_resource(
                    RESOURCE, capacity=GPUS, allocatable=GPUS, timeout=harness.DEADLINE_S
                )
            await state.settled()
            yield state
        finally:
            stop.set()
            await asyncio.wait_for(task, harness.DEADLINE_S)


def _devices(kube: FakeKube) -> int:
    return sum(len(s["spec"].get("devices") or []) for s in kube.resource_slices.values())


def _flat(counts: Counter[tuple[str, str]]) -> dict[str, int]:
    return {f"{verb} {what}": n for (verb, what), n in sorted(counts.items()) if n}


# -- scenarios ------------------------------------------------------------------------


async def _start(n: Node) -> None:
    """Nothing more: `node()` already counted the start (see `_measure`)."""


async def steady_hour(n: Node) -> None:
    with LoopClock() as clock:
        await clock.advance(3600.0, step=10.0, settle=0.005)
        await n.settled()


async def _kubelet_restart(n: Node) -> None:
    assert n.restart_kubelet is not None
    await n.restart_kubelet()
    if n.mode == "dra":
        await n.until("slices back", lambda: _devices(n.kube) == GPUS)
    await n.settled()


async def health_flap(n: Node) -> None:
    n.backend.fail_probe(0, "benchmark: probe failed")
    await n.until("GPU 0 unhealthy", lambda: n.unhealthy() == 1)
    n.backend.heal(0)
    await n.until("GPU 0 healthy", lambda: n.unhealthy() == 0)
    await n.settled()


async def _reload(n: Node) -> None:
    before = n.daemon.config
    n.kube.set_node_label(NODE, DEFAULT_NODE_LABEL, "b")  # the operator's write: not counted
    await n.until("config b applied", lambda: n.daemon.config != before)
    await n.settled()


def _xid_storm(storm: int) -> Callable[[Node], Awaitable[None]]:
    async def run(n: Node) -> None:
        for i in range(storm):
            n.backend.inject_xid(i % GPUS, STORM_XIDS[i % len(STORM_XIDS)])
        await n.until("every GPU unhealthy", lambda: n.unhealthy() == GPUS)
        await n.settled()

    return run


def flap_storm(storm: int) -> Callable[[Node], Awaitable[None]]:
    async def run(n: Node) -> None:
        for i in range(storm):
            if i % 2 == 0:
                n.backend.inject_xid(0, FAULT_XIDS[(i // 2) % len(FAULT_XIDS)])
                await n.until("GPU 0 unhealthy", lambda: n.unhealthy() == 1)
            else:
                n.backend.heal(0)
                await n.until("GPU 0 healthy", lambda: n.unhealthy() == 0)
        await n.settled()

    return run


async def _flapping_hour(n: Node) -> None:
    """Every GPU fails and heals every FLAP_PERIOD_S of the loop's clock, for an hour."""
    with LoopClock() as clock:
        flaps = int(3600 / FLAP_PERIOD_S)
        for _ in range(flaps):
            for gpu in range(GPUS):
                n.backend.fail_probe(gpu, "benchmark: probe failed")
            await n.until("every GPU unhealthy", lambda: n.unhealthy() == GPUS)
            await clock.advance(FLAP_PERIOD_S / 2, step=FLAP_PERIOD_S / 2, settle=0.001)
            for gpu in range(GPUS):
                n.backend.heal(gpu)
            await n.until("every GPU healthy", lambda: n.unhealthy() == 0)
            await clock.advance(FLAP_PERIOD_S / 2, step=FLAP_PERIOD_S / 2, settle=0.001)
        await n.settled()


async def measure(
    mode: Mode, name: str, scenario: Callable[[Node], Awaitable[None]]
) -> dict[str, int]:
    with harness.temp_dir("kgb-api-") as work:
        async with node(mode, work) as n:
            if scenario is _start:
                return _flat(n.requests())
            before = n.requests()
            await scenario(n)
            return _flat(n.requests() - before)


async def bench_api_budget(storm: int = STORM) -> Figures:
    scenarios: dict[str, Callable[[Node], Awaitable[None]]] = {
        "start": _start,
        "steady_hour": steady_hour,
        "kubelet_restart": _kubelet_restart,
        "health_flap": health_flap,
        "reload": _reload,
        "xid_storm": _xid_storm(storm),
        "flap_storm": flap_storm(storm),
        "flapping_hour": _flapping_hour,
    }
    figures: Figures = {"storm": storm, "flap_period_s": FLAP_PERIOD_S}
    for mode in MODES:
        figures[mode] = {name: await measure(mode, name, run) for name, run in scenarios.items()}
    return {"api": figures}


def main() -> int:
    logging.basicConfig(level=logging.ERROR, format="%(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--storm", type=int, default=STORM)
    args = parser.parse_args()
    figures = asyncio.run(bench_api_budget(args.storm))
    print(json.dumps(figures, indent=1), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
