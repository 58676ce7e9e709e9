"""`kubegpu demo`: the whole flow of a GPU pod, on a simulated node, over real sockets.

A simulated node (any preset), the real plugin daemon and the kubelet emulator run in one
process and talk gRPC over unix sockets in a temp directory, exactly as on a node:
registration -> capacity -> a pod asking for 2 GPUs -> an Xid makes a GPU unhealthy ->
its checks pass again and it heals -> the kubelet restarts -> the plugin re-registers.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
import time
from pathlib import Path

from kubegpu.daemon import Daemon, DaemonSettings
from kubegpu.devices.simulated import SimulatedBackend
from kubegpu.health import describe_xid
from kubegpu.kubelet import KubeletEmulator
from kubegpu.supervisor import spawn

RESOURCE = "nvidia.com/gpu"
#: The pod asks for this many GPUs, or for every GPU on a smaller node (t4-1, h100-mig).
POD_GPUS = 2
#: Short recovery window so the demo shows a reset GPU healing in about a second.
RECOVERY_SECONDS = 1.0
FAULTY_GPU = 3
#: Fallen off the bus: the Xid catalog's RESTART_BM, unhealthy until the GPU is reset.
XID = 79


class _Clock:
    def __init__(self) -> None:
        self.t0 = time.monotonic()

    def say(self, text: str) -> None:
        print(f"[{time.monotonic() - self.t0:7.3f}s] {text}", flush=True)

    @staticmethod
    def detail(text: str) -> None:
        print(f"            {text}", flush=True)


async def _demo(preset: str, workdir: Path) -> None:
    out = _Clock()
    plugin_dir = workdir / "device-plugins"
    backend = SimulatedBackend.load(preset)
    inventory = backend.discover()
    total = len(inventory.gpus)
    want = min(POD_GPUS, total)
    faulty = min(FAULTY_GPU, total - 1)  # one of the node's GPUs, whatever its size
    print(f"kubegpu demo: simulated node '{preset}' with {len(inventory.gpus)} GPUs")
    print(f"plugin and kubelet emulator talk gRPC over unix sockets in {plugin_dir}\n")

    kubelet = KubeletEmulator(plugin_dir)
    await kubelet.start()
    out.say(f"kubelet emulator serving {kubelet.socket_path.name}")

    settings = DaemonSettings(
        plugin_dir=plugin_dir,
        backend="simulated",
        overrides={
            "flags.plugin.passDeviceSpecs": True,
            "flags.health.recoverySeconds": RECOVERY_SECONDS,
            "flags.health.probeIntervalSeconds": 0.1,
        },
    )
    daemon = Daemon(settings, backend=backend)
    stop = asyncio.Event()
    started = time.monotonic()
    serving = spawn("demo daemon", daemon.run(stop))
    try:
        await kubelet.wait_for_resource(RESOURCE, capacity=total, timeout=10)
        took = time.monotonic() - started
        out.say(f"plugin registered {RESOURCE} and sent its device list ({took * 1000:.0f} ms)")
        out.say(
            f"node capacity {RESOURCE}: {kubelet.capacity(RESOURCE)}, "
            f"allocatable: {kubelet.allocatable(RESOURCE)}"
        )

        out.say(f"pod 'cuda-job' asks for {want} GPU(s) (resources.limits nvidia.com/gpu: {want})")
        allocation = await kubelet.allocate(RESOURCE, want, pod="cuda-job", container="main")
        by_uuid = {g.uuid: g for g in inventory.gpus}
        picked = [by_uuid[i] for i in allocation.device_ids]
        out.detail(
            "GetPreferredAllocation -> "
            + ", ".join(f"GPU {g.index} (NUMA {g.numa_node})" for g in picked)
        )
        link = picked[0].link_to(picked[1].uuid) if len(picked) == 2 else None
        if link is not None:
            out.detail(f"  they share {link.kind.name} x{link.count}")
        out.detail("Allocate -> container gets:")
        for key, value in sorted(allocation.envs.items()):
            out.detail(f"  env    {key}={value}")
        for spec in allocation.device_specs:
            out.detail(f"  device {spec.host_path} -> {spec.container_path} ({spec.permissions})")
        in_use = sum(len(a.device_ids) for a in kubelet.allocations())
        out.say(
            f"capacity {kubelet.capacity(RESOURCE)}, allocatable {kubelet.allocatable(RESOURCE)}, "
            f"{in_use} in use by cuda-job"
        )

        gpu = inventory.gpus[faulty]
        out.say(f"inject {describe_xid(XID)} on GPU {faulty}")
        hit = time.monotonic()
        backend.inject_xid(faulty, XID)
        await kubelet.wait_for_resource(RESOURCE, capacity=total, allocatable=total - 1)
        out.say(
            f"kubelet sees GPU {faulty} Unhealthy: allocatable {total - 1}/{total} "
            f"({(time.monotonic() - hit) * 1000:.1f} ms after the Xid)"
        )
        # Passing probes alone do not heal a reset-requiring Xid: the GPU is reset, which
        # the plugin sees as the GPU dropping out of NVML and then answering again.
        out.say(f"GPU {faulty} is reset: it drops out of NVML and answers again")
        backend.fail_probe(faulty, "GPU is lost (being reset)")
        backend.clear_fault(faulty)
        await kubelet.wait_for_resource(RESOURCE, allocatable=total, timeout=RECOVERY_SECONDS + 10)
        state = kubelet.devices(RESOURCE)[gpu.uuid].health
        out.say(
            f"GPU {faulty} passed its checks for {RECOVERY_SECONDS:.0f} s after the reset and is "
            f"{state} again: allocatable {kubelet.allocatable(RESOURCE)}/{total}"
        )

        out.say("kubelet restarts: it wipes the device-plugin directory and serves a new socket")
        restarted = time.monotonic()
        await kubelet.restart()
        await kubelet.wait_for_resource(RESOURCE, capacity=total, allocatable=total, timeout=10)
        took = time.monotonic() - restarted
        out.say(f"plugin noticed, re-registered and re-sent its list in {took * 1000:.0f} ms")
        kept = kubelet.allocations("cuda-job")
        ids = [d for a in kept for d in a.device_ids]
        out.say(f"pod 'cuda-job' keeps its GPUs across the restart: {', '.join(ids)}")
    finally:
        stop.set()
        await serving
        await kubelet.stop()
    socket = plugin_dir / "kubegpu-nvidia.com-gpu.sock"
    out.say(
        f"plugin stopped cleanly; its socket {'is still there!' if socket.exists() else 'is gone'}"
    )
    print("\ndemo finished: every step above went over the real device plugin API.")


def run_demo(preset: str = "h100-8", keep: bool = False) -> int:
    # The demo narrates; logs would only repeat it (errors still show).
    logging.basicConfig(level=logging.ERROR, format="%(levelname)s %(name)s: %(message)s")
    workdir = Path(tempfile.mkdtemp(prefix="kubegpu-demo-", dir="/tmp"))
    try:
        asyncio.run(_demo(preset, workdir))
    finally:
        if not keep:
            shutil.rmtree(workdir, ignore_errors=True)
    return 0
