"""The DRA node that benchmarks/dra.py calls over its socket, in a process of its own.

    python -m benchmarks.dra_node WORKDIR --claims N [--sized] [--metrics-port P] [--health-port Q]

`serve --mode dra`'s daemon (`kubegpu.daemon.Daemon`, every root task of it: the DRA
kubelet plugin, the ResourceSlice publisher, health, metrics and probes) on the simulated
`h100-8` node, its directories under WORKDIR. It is the daemon `kubegpu serve` runs, built
here rather than through the CLI for two things the CLI does not offer: a CDI directory
under WORKDIR (serve writes to /var/run/cdi) and an in-memory API (`FakeKube`) that already
holds N allocated claims, `bench/c<n>` of `gpu-<n mod 8>`, UIDs from `claim_uid`.

`--sized`: the GPUs are shared by MPS and sized by memory (`SIZED_CONFIG`), each claim takes
`SIZED_CLAIM` of its GPU as the scheduler writes it (`consumedCapacity`), and each prepare
starts the claim's own MPS control daemon with its limits: the repository's stand-in
binary (tests/fixtures/fake-mps-control, run by this interpreter without `site`), so the
figures are kubegpu's supervision and its process starts, not the driver's.

Prints `ready` once started; runs until its stdin closes (or SIGTERM), then prints one JSON
object: the requests the daemon sent its API, by verb and resource.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
import uuid
from pathlib import Path
from typing import Any

from kubegpu.daemon import Daemon, DaemonSettings
from kubegpu.mode import Mode
from tests.rig.kube import FakeKube

DRIVER = "gpu.nvidia.com"
NODE = "bench-node"
NAMESPACE = "bench"
PRESET = "h100-8"
GPUS = 8
REPO = Path(__file__).resolve().parents[1]
FAKE_MPS = REPO / "tests" / "fixtures" / "fake-mps-control"
SIZED_CONFIG = """version: v1
flags: {{mpsRoot: {mps_root}}}
sharing:
  mps:
    resources:
    - name: nvidia.com/gpu
      replicas: 4
      sizing: {{memoryStep: 1Gi}}
"""
#: What each sized claim took of its GPU: memory, shares.
SIZED_CLAIM = ("10Gi", "1")
_UIDS = uuid.UUID("6f1d2c1e-8a5b-4c43-9d0e-3b6f5a1c2d7e")


def claim_name(n: int) -> str:
    return f"c{n}"


def claim_uid(n: int) -> str:
    """The UID of claim `n`, the same in both processes (a UUID, as the API server's)."""
    return str(uuid.uuid5(_UIDS, claim_name(n)))


def claim(n: int, sized: bool = False) -> dict[str, Any]:
    """Claim `n` as the scheduler left it: allocated one GPU of this node's pool (sized:
    `SIZED_CLAIM` of it)."""
    result: dict[str, Any] = {
        "request": "gpu",
        "driver": DRIVER,
        "pool": NODE,
        "device": f"gpu-{n % GPUS}",
    }
    if sized:
        result["shareID"] = str(uuid.uuid5(_UIDS, f"share-{n}"))
        result["consumedCapacity"] = {"memory": SIZED_CLAIM[0], "shares": SIZED_CLAIM[1]}
    return {
        "metadata": {"namespace": NAMESPACE, "name": claim_name(n), "uid": claim_uid(n)},
        "spec": {},
        "status": {"allocation": {"devices": {"results": [result]}}},
    }


async def _serve(args: argparse.Namespace) -> dict[str, int]:
    work = Path(args.workdir)
    kube = FakeKube()
    for n in range(args.claims):
        kube.put_resource_claim(claim(n, args.sized))
    sized: dict[str, Any] = {}
    if args.sized:
        config = work / "config.yaml"
        config.write_text(SIZED_CONFIG.format(mps_root=work / "mps"))
        sized = {"config_file": config, "mps_control_binary": str(FAKE_MPS)}
        # The stand-in runs through `#!/usr/bin/env python3`, once per control command:
        # this interpreter without `site`, not whatever shim `python3` is on PATH.
        shim = work / "bin" / "python3"
        shim.parent.mkdir()
        shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -S "$@"\n')
        shim.chmod(0o755)
        os.environ["PATH"] = os.pathsep.join([str(shim.parent), os.environ.get("PATH", "")])
    settings = DaemonSettings(
        mode=Mode.DRA,
        simulate=PRESET,
        node_name=NODE,
        registrar_dir=work / "registry",
        kubelet_plugins_dir=work / "plugins",
        plugin_dir=work / "dp",
        cdi_dir=work / "cdi",
        metrics_port=args.metrics_port,
        metrics_address="127.0.0.1",
        health_port=args.health_port,
        health_address="127.0.0.1",
        **sized,
    )
    daemon = Daemon(settings, kube=kube)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    task = asyncio.create_task(daemon.run(stop))
    started = asyncio.create_task(daemon.started.wait())
    await asyncio.wait({task, started}, return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        started.cancel()
        task.result()  # start-up failed: its error, on stderr
        return {}
    print("ready", flush=True)
    # Until the benchmark closes our stdin (its way of saying "stop").
    closed = loop.run_in_executor(None, sys.stdin.read)
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait({closed, task, stopped}, return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    stop.set()
    await task
    return {f"{verb} {what}": n for (verb, what), n in sorted(kube.request_counts().items())}


def main() -> int:
    logging.basicConfig(level=logging.ERROR, format="%(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("workdir")
    parser.add_argument("--claims", type=int, required=True)
    parser.add_argument("--sized", action="store_true", help="MPS-shared GPUs sized by memory")
    parser.add_argument("--metrics-port", type=int, default=0)
    parser.add_argument("--health-port", type=int, default=0)
    requests = asyncio.run(_serve(parser.parse_args()))
    print(json.dumps(requests), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
