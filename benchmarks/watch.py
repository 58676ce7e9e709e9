"""What an operator feels while `serve` runs: kubelet restart -> re-registered, config
edit -> new list at the kubelet, and idle CPU, with `kubegpu serve --simulate h100-8` in a
subprocess and the kubelet emulator in this process over real unix sockets.

    python -m benchmarks.watch [--restarts 50] [--reloads 20] [--idle-seconds 10]

Figures (the last line printed is one JSON object):
- `reregister_*`: the emulator restarts as a kubelet does (stop, wipe the plugin sockets,
  serve a new kubelet.sock); timed from just before the new kubelet starts to the moment
  the emulator's state holds all 8 devices again (`..._kubelet_start_*`: the emulator's
  own start, inside that; `..._seen_to_registered_*`: the plugin's log, restart seen ->
  Register answered). `..._rmdir_*`: the same with the whole device-plugin directory
  removed and re-created between stop and start.
- `socket_deleted_*`: the plugin's own socket deleted while the kubelet runs; timed from
  the unlink to the emulator holding all 8 devices healthy from a new registration.
  `socket_deleted_busy_*`: the same while ALLOCATE_CLIENTS clients of this process call
  Allocate on the plugin's socket without pause (reconnecting after each deletion), as a
  busy kubelet would.
- `reload_*`: 8 GPUs x 24 -> 48 (and back) time-slicing replicas, from the write to the
  kubelet holding the new capacity (a new ListAndWatch list); `write` rewrites config.yaml
  by rename, `configmap` swaps a ConfigMap volume's `..data` symlink as the kubelet's
  atomic writer does. No SIGHUP.
- `idle_cpu_pct`: user+system CPU of the registered, idle `serve` process over the
  window, as a percentage of one core (utime+stime of /proc/<pid>/stat), with a config
  file watched.

"Holds" is stamped inside the emulator's state change (`harness.Stamp`), as the kubelet's
device manager has the new devices in memory: not after the emulator's checkpoint write,
nor when this benchmark's waiting task next gets the loop.

Run it against another tree with `PYTHONPATH=<tree>/src`: the subprocess inherits it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import logging
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import grpc

from benchmarks import harness
from benchmarks.harness import RESOURCE
from kubegpu.api import device_plugin_stub, pb
from kubegpu.kubelet import KubeletEmulator

GPUS = 8
#: Clients calling Allocate throughout the `socket_deleted_busy` runs.
ALLOCATE_CLIENTS = 8
#: `make bench`'s counts: kubelet restarts and config changes per kind, idle window (s).
RESTARTS = 50
RELOADS = 20
IDLE_S = 10.0
Figures = dict[str, Any]


def _write_by_rename(path: Path, replicas: int, _: int) -> None:
    staged = path.with_name(".config.yaml.tmp")
    staged.write_text(harness.timeslicing_config(replicas))
    staged.replace(path)


def _configmap_publish(mount: Path, replicas: int, version: int) -> None:
    """The kubelet's atomic writer: a new `..<timestamp>` dir, `..data` renamed over to it."""
    data = mount / f"..2026_11_23_{version:08d}"
    data.mkdir()
    (data / "config.yaml").write_text(harness.timeslicing_config(replicas))
    staged = mount / "..data_tmp"
    staged.symlink_to(data.name)
    staged.replace(mount / "..data")


def _registered_endpoint(kubelet: KubeletEmulator) -> str:
    """The socket name of the plugin's last successful registration of `RESOURCE`."""
    for record in reversed(kubelet.registrations):
        if record.ok and record.resource == RESOURCE:
            return record.endpoint
    raise RuntimeError(f"no successful registration of {RESOURCE}: {kubelet.registrations}")


async def _wait(kubelet: KubeletEmulator, capacity: int, plugin: harness.Child) -> None:
    try:
        await kubelet.wait_for_resource(
            RESOURCE, capacity=capacity, allocatable=capacity, timeout=harness.DEADLINE_S
        )
    except TimeoutError as exc:
        raise RuntimeError(f"{exc}\n--- kubegpu serve log:\n{plugin.tail()}") from None


def _summary(key: str, runs_ms: list[float]) -> Figures:
    ordered = sorted(runs_ms)
    return {
        f"{key}_median_ms": round(harness.median(runs_ms), 2),
        f"{key}_p90_ms": round(ordered[int(0.9 * (len(ordered) - 1))], 2),
        f"{key}_max_ms": round(max(runs_ms), 2),
        f"{key}_n": len(runs_ms),
    }


def _freeze_heap() -> None:
    """Move this process's objects to the permanent generation before timing.

    The emulator stands in for the kubelet, whose Go collector runs concurrently; a full
    collection of this process's Python heap (~25 ms, the benchmark's own objects) landing
    inside a restart would be charged to the plugin. `kubegpu serve` freezes its own heap
    after start-up (cli/serve.py), so the plugin side is measured as it runs on a node.
    """
    gc.collect()
    gc.freeze()


async def bench_reregister(restarts: int) -> Figures:
    figures: Figures = {}
    _freeze_heap()
    with harness.temp_dir("kgw-") as work:
        plugin_dir = work / "dp"
        async with (
            harness.emulator(plugin_dir) as kubelet,
            harness.serve(plugin_dir, work / "serve.log") as plugin,
        ):
            await _wait(kubelet, GPUS, plugin)
            for key, wipe_dir in (("reregister", False), ("reregister_rmdir", True)):
                runs, starts = [], []
                for _ in range(restarts):
                    await kubelet.stop()
                    if wipe_dir:
                        shutil.rmtree(plugin_dir)
                    with harness.Stamp(kubelet, GPUS) as held:
                        start = time.perf_counter()
                        await kubelet.start()  # mkdir, wipe sockets, serve a new kubelet.sock
                        starts.append((time.perf_counter() - start) * 1000)
                        await _wait(kubelet, GPUS, plugin)
                    runs.append(held.ms_since(start))
                figures.update(_summary(key, runs))
                # Context: the emulator's own start (in this process) is inside each run,
                # and the plugin's log gives restart seen -> Register answered.
                figures[f"{key}_kubelet_start_median_ms"] = round(harness.median(starts), 2)
                logged = plugin.registrations_s()[-restarts:]
                figures[f"{key}_seen_to_registered_median_ms"] = round(
                    harness.median(logged) * 1000, 2
                )
    return figures


async def _allocate_forever(socket: Path, ids: list[str], stop: asyncio.Event) -> None:
    """Call Allocate on `socket` until `stop`; a new connection after each failure (the
    socket was deleted), and a moment's pause while it is missing."""
    request = pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest()])
    request.container_requests[0].devices_ids.append(ids[0])
    while not stop.is_set():
        async with grpc.aio.insecure_channel(f"unix://{socket}") as channel:
            stub = device_plugin_stub(channel)
            with contextlib.suppress(grpc.aio.AioRpcError):
                while not stop.is_set():
                    await stub.Allocate(request, timeout=harness.DEADLINE_S)
        if not stop.is_set():
            await asyncio.sleep(0.001)  # a client's retry pause, not a wait for state


async def bench_socket_deleted(deletions: int) -> Figures:
    """The plugin's own socket deleted, the kubelet running: idle, then busy."""
    figures: Figures = {}
    _freeze_heap()
    with harness.temp_dir("kgw-") as work:
        plugin_dir = work / "dp"
        async with (
            harness.emulator(plugin_dir) as kubelet,
            harness.serve(plugin_dir, work / "serve.log") as plugin,
        ):
            await _wait(kubelet, GPUS, plugin)
            # The socket the plugin registered, by the kubelet's record: the directory holds
            # other `kubegpu-*` entries too (the `kubegpu-handover` lock directory).
            socket = plugin_dir / _registered_endpoint(kubelet)
            ids = list(kubelet.devices(RESOURCE))
            for key, clients in (("socket_deleted", 0), ("socket_deleted_busy", ALLOCATE_CLIENTS)):
                stop = asyncio.Event()
                callers = [
                    asyncio.ensure_future(_allocate_forever(socket, ids, stop))
                    for _ in range(clients)
                ]
                runs = []
                try:
                    for _ in range(deletions):
                        before = sum(r.ok for r in kubelet.registrations)

                        def back(before: int = before) -> bool:
                            return sum(r.ok for r in kubelet.registrations) > before

                        with harness.Stamp(kubelet, GPUS) as held:
                            start = time.perf_counter()
                            socket.unlink()
                            await kubelet.wait_for(
                                lambda: held.at is not None and back(),
                                timeout=harness.DEADLINE_S,
                            )
                        runs.append(held.ms_since(start))
                finally:
                    stop.set()
                    await asyncio.gather(*callers)
                figures.update(_summary(key, runs))
    return figures


async def bench_reload_and_idle(reloads: int, idle_seconds: float) -> Figures:
    figures: Figures = {}
    _freeze_heap()
    with harness.temp_dir("kgw-") as work:
        for key, configmap in (("reload_write", False), ("reload_configmap", True)):
            plugin_dir = work / f"dp-{key}"
            mount = work / f"cm-{key}"
            mount.mkdir()
            config = mount / "config.yaml"
            publish = _configmap_publish if configmap else _write_by_rename
            target = mount if configmap else config
            publish(target, 24, 0)
            if configmap:
                config.symlink_to("..data/config.yaml")
            async with (
                harness.emulator(plugin_dir) as kubelet,
                harness.serve(
                    plugin_dir, work / f"{key}.log", "--config-file", str(config)
                ) as plugin,
            ):
                await _wait(kubelet, GPUS * 24, plugin)
                runs = []
                for trial in range(1, reloads + 1):
                    replicas = 48 if trial % 2 else 24
                    with harness.Stamp(kubelet, GPUS * replicas) as held:
                        start = time.perf_counter()
                        publish(target, replicas, trial)
                        await _wait(kubelet, GPUS * replicas, plugin)
                    runs.append(held.ms_since(start))
                figures.update(_summary(key, runs))
                if not configmap:
                    figures.update(await _idle_cpu(plugin, idle_seconds))
    return figures


async def _idle_cpu(plugin: harness.Child, seconds: float) -> Figures:
    """CPU of the registered, idle plugin over `seconds` (a window, not a wait for state)."""
    hz = os.sysconf("SC_CLK_TCK")
    before, start = harness.cpu_ticks(plugin.pid), time.perf_counter()
    await asyncio.sleep(seconds)
    used = (harness.cpu_ticks(plugin.pid) - before) / hz
    wall = time.perf_counter() - start
    return {
        "idle_cpu_pct": round(100 * used / wall, 3),
        "idle_cpu_s": round(used, 3),
        "idle_window_s": round(wall, 1),
    }


async def _main(args: argparse.Namespace) -> Figures:
    figures: Figures = {**harness.machine(), "loadavg_1m": os.getloadavg()[0]}
    figures.update(await bench_reregister(args.restarts))
    figures.update(await bench_socket_deleted(args.restarts))
    figures.update(await bench_reload_and_idle(args.reloads, args.idle_seconds))
    figures["loadavg_1m_after"] = os.getloadavg()[0]
    return figures


def main() -> int:
    logging.basicConfig(level=logging.ERROR, format="%(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--restarts", type=int, default=RESTARTS)
    parser.add_argument("--reloads", type=int, default=RELOADS)
    parser.add_argument("--idle-seconds", type=float, default=IDLE_S)
    figures = asyncio.run(_main(parser.parse_args()))
    for key, value in figures.items():
        print(f"{key:32} {value}", file=sys.stderr)
    print(json.dumps(figures), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
