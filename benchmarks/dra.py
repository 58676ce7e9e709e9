"""DRA prepare and unprepare as the kubelet sees them: over the plugin's unix socket, gRPC
included, from another process.

    python -m benchmarks.dra [--claims 300] [--sized]

The DRA node (`benchmarks/dra_node.py`: `serve --mode dra`'s daemon on the simulated
`h100-8` node, with /metrics and /healthz on loopback) runs in a process of its own; this
process is the kubelet's side: a grpc client on `<plugins>/gpu.nvidia.com/dra.sock` calls
NodePrepareResources for one claim of one GPU, then NodeUnprepareResources, each claim new
(a prepare reads the claim, writes its CDI spec and records it in the checkpoint, each
file fsync'd; an unprepare records the release and removes the spec). WARMUP uncounted
claims first, then `claims` timed ones idle, then `claims` more while a third process
(`benchmarks/http_load.py`) GETs /metrics and /healthz without pause. Beside the idle
latencies, the CPU the node's process used per claim (prepare and unprepare together,
utime+stime), which a loaded machine moves far less.

`bench_sized` does the same on GPUs shared by MPS and sized by memory (`dra_node --sized`):
each claim prepared cold (its MPS control daemon started and given its limits), prepared
again with its daemon already running (the kubelet repeats a prepare after a restart), and
unprepared (its daemon stopped), idle, one claim at a time.

The claims are read from the node's in-memory API (`FakeKube`, in a worker thread as a real
client's GET would be): the API server's round trip is not in these figures.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import logging
import os
import shutil
import socket
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from benchmarks import harness
from benchmarks.dra_node import DRIVER, NAMESPACE, claim_name, claim_uid
from kubegpu.api import dra_pb2, dra_stub

#: Timed claims per phase (idle, then under load), after WARMUP uncounted ones.
CLAIMS = 300
WARMUP = 20
#: Timed sized claims (each starts and stops an MPS control daemon), after SIZED_WARMUP.
SIZED_CLAIMS = 100
SIZED_WARMUP = 5
Figures = dict[str, Any]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def _finish(child: harness.Child) -> Figures:
    """Close the child's stdin (its signal to stop) and read the JSON line it ends with."""
    proc = child.proc
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.close()
    out = await asyncio.wait_for(proc.stdout.read(), harness.DEADLINE_S)
    await asyncio.wait_for(proc.wait(), harness.DEADLINE_S)
    lines = out.decode(errors="replace").strip().splitlines()
    try:
        found: Figures = json.loads(lines[-1])
    except (IndexError, ValueError):
        raise RuntimeError(f"{child.log.name}: no figures in {lines!r}\n{child.tail()}") from None
    return found


@contextlib.asynccontextmanager
async def _started(args: list[str], log: Path) -> AsyncIterator[harness.Child]:
    """`args` run until the block ends, once the process printed `ready`."""
    async with harness.child(args, log, stdin_pipe=True) as proc:
        assert proc.proc.stdout is not None
        line = await asyncio.wait_for(proc.proc.stdout.readline(), harness.DEADLINE_S)
        if line.strip() != b"ready":
            raise RuntimeError(f"{args[2]} did not start: {line!r}\n{proc.tail()}")
        yield proc


class Kubelet:
    """The kubelet's calls on the driver's socket (grpc, as the kubelet's grpc-go client)."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        stub = dra_stub(channel)
        self.prepare = stub.NodePrepareResources
        self.unprepare = stub.NodeUnprepareResources

    async def cycle(self, n: int) -> tuple[int, int]:
        """Prepare then unprepare claim `n`; each call's latency in ns."""
        claim = dra_pb2.Claim(namespace=NAMESPACE, name=claim_name(n), uid=claim_uid(n))
        clock = time.perf_counter_ns
        start = clock()
        prepared = await self.prepare(
            dra_pb2.NodePrepareResourcesRequest(claims=[claim]), timeout=harness.DEADLINE_S
        )
        middle = clock()
        released = await self.unprepare(
            dra_pb2.NodeUnprepareResourcesRequest(claims=[claim]), timeout=harness.DEADLINE_S
        )
        end = clock()
        error = prepared.claims[claim.uid].error or released.claims[claim.uid].error
        if error:
            raise RuntimeError(f"claim {claim.name}: {error}")
        return middle - start, end - middle

    async def sized_cycle(self, n: int) -> tuple[int, int, int]:
        """Prepare claim `n` cold, prepare it again (its daemon running), unprepare it;
        each call's latency in ns."""
        claim = dra_pb2.Claim(namespace=NAMESPACE, name=claim_name(n), uid=claim_uid(n))
        clock = time.perf_counter_ns
        times = [clock()]
        errors = []
        for _ in range(2):
            prepared = await self.prepare(
                dra_pb2.NodePrepareResourcesRequest(claims=[claim]), timeout=harness.DEADLINE_S
            )
            times.append(clock())
            errors.append(prepared.claims[claim.uid].error)
        released = await self.unprepare(
            dra_pb2.NodeUnprepareResourcesRequest(claims=[claim]), timeout=harness.DEADLINE_S
        )
        times.append(clock())
        errors.append(released.claims[claim.uid].error)
        if any(errors):
            raise RuntimeError(f"claim {claim.name}: {next(e for e in errors if e)}")
        cold, again, unprepare = (b - a for a, b in itertools.pairwise(times))
        return cold, again, unprepare


def _stats(samples_ns: list[int]) -> dict[str, float]:
    return {
        "median": round(harness.percentile(samples_ns, 50), 3),
        "p99": round(harness.percentile(samples_ns, 99), 3),
        "max": round(max(samples_ns) / 1e6, 3),
    }


@dataclass
class Phase:
    """One phase's latencies (ns), and the CPU the node's process used for them."""

    prepared: list[int]
    unprepared: list[int]
    node_cpu_s: float

    def figures(self, suffix: str = "") -> Figures:
        return {
            f"prepare{suffix}_ms": _stats(self.prepared),
            f"unprepare{suffix}_ms": _stats(self.unprepared),
        }

    def cpu_ms_per_claim(self) -> float:
        """utime+stime of the node per claim: what it spent, which a loaded machine moves
        far less than the wall-clock latencies (those wait for the CPU and for fsync)."""
        return round(1000 * self.node_cpu_s / len(self.prepared), 2)


async def _phase(kubelet: Kubelet, node: harness.Child, first: int, count: int) -> Phase:
    hz = os.sysconf("SC_CLK_TCK")
    ticks = harness.cpu_ticks(node.pid)
    phase = Phase([], [], 0.0)
    for n in range(first, first + count):
        p, u = await kubelet.cycle(n)
        phase.prepared.append(p)
        phase.unprepared.append(u)
    phase.node_cpu_s = (harness.cpu_ticks(node.pid) - ticks) / hz
    return phase


async def bench_dra(claims: int = CLAIMS, warmup: int = WARMUP) -> Figures:
    metrics, health = _free_port(), _free_port()
    node_args = [
        sys.executable,
        "-m",
        "benchmarks.dra_node",
        "",  # the work directory, below
        "--claims",
        str(warmup + 2 * claims),
        "--metrics-port",
        str(metrics),
        "--health-port",
        str(health),
    ]
    load_args = [
        sys.executable,
        "-m",
        "benchmarks.http_load",
        f"http://127.0.0.1:{metrics}/metrics",
        f"http://127.0.0.1:{health}/healthz",
    ]
    with harness.temp_dir("kgb-dra-") as work:
        node_args[3] = str(work)
        async with _started(node_args, work / "node.log") as node:
            sock = work / "plugins" / DRIVER / "dra.sock"
            async with grpc.aio.insecure_channel(f"unix://{sock}") as channel:
                kubelet = Kubelet(channel)
                await _phase(kubelet, node, 0, warmup)
                idle = await _phase(kubelet, node, warmup, claims)
                async with _started(load_args, work / "load.log") as load:
                    busy = await _phase(kubelet, node, warmup + claims, claims)
                    scraped = await _finish(load)
            requests = await _finish(node)
    gets = requests.get("get resourceclaim", 0)
    return {
        "dra": {
            "claims": claims,
            **idle.figures(),
            "node_cpu_ms_per_claim": idle.cpu_ms_per_claim(),
            **busy.figures("_loaded"),
            "load_requests_per_s": round(scraped["answered"] / scraped["seconds"], 1),
            "load_failures": scraped["failed"],
            "api_gets_per_prepare": round(gets / (warmup + 2 * claims), 2),
            "api_requests": requests,
        }
    }


async def bench_sized(claims: int = SIZED_CLAIMS, warmup: int = SIZED_WARMUP) -> Figures:
    """Sized prepare and unprepare, each claim with its own MPS control daemon (module doc)."""
    node_args = [sys.executable, "-m", "benchmarks.dra_node", "", "--sized"]
    node_args += ["--claims", str(warmup + claims)]
    samples: tuple[list[int], list[int], list[int]] = ([], [], [])
    with harness.temp_dir("kgb-sized-") as work:
        node_args[3] = str(work)
        async with _started(node_args, work / "node.log") as node:
            sock = work / "plugins" / DRIVER / "dra.sock"
            async with grpc.aio.insecure_channel(f"unix://{sock}") as channel:
                kubelet = Kubelet(channel)
                for n in range(warmup):
                    await kubelet.sized_cycle(n)
                hz = os.sysconf("SC_CLK_TCK")
                ticks = harness.cpu_ticks(node.pid)
                for n in range(warmup, warmup + claims):
                    for into, took in zip(samples, await kubelet.sized_cycle(n), strict=True):
                        into.append(took)
                node_cpu_s = (harness.cpu_ticks(node.pid) - ticks) / hz
            await _finish(node)
    cold, again, unprepared = samples
    return {
        "dra_sized": {
            "claims": claims,
            "prepare_cold_ms": _stats(cold),
            "prepare_running_ms": _stats(again),
            "unprepare_ms": _stats(unprepared),
            "node_cpu_ms_per_claim": round(1000 * node_cpu_s / claims, 2),
        }
    }


def main() -> int:
    logging.basicConfig(level=logging.ERROR, format="%(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--claims", type=int, default=CLAIMS)
    parser.add_argument("--sized", action="store_true", help="sized claims (bench_sized)")
    args = parser.parse_args()
    prefix = harness.use_bytecode_cache()
    try:
        run = bench_sized if args.sized else bench_dra
        figures = asyncio.run(run(args.claims))
    finally:
        shutil.rmtree(prefix, ignore_errors=True)
    print(json.dumps({**harness.machine(), **figures}, separators=(", ", ": ")), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
