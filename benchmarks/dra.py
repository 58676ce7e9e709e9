"""DRA prepare and unprepare latency, as the kubelet calls them, over the real unix socket.

The DRA kubelet plugin (`kubegpu.dra.DraDriver`) serves a simulated 8×H100 node; a grpc
client calls NodePrepareResources for one claim of one GPU, then NodeUnprepareResources,
CLAIMS times, each claim new (a fresh CDI spec file and one checkpoint write, each with
fsync, on prepare; one checkpoint write on unprepare). The claims are read from an
in-memory API (`FakeKube`, in a worker thread as a real client's GET would be), so the
figures are the plugin's own work plus the socket, without the API server's round trip.
"""

from __future__ import annotations

import asyncio
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc

from kubegpu.api import dra_pb2, dra_stub
from kubegpu.config import Config
from kubegpu.devices.simulated import SimulatedBackend
from kubegpu.dra.driver import DraDriver
from kubegpu.dra.service import ClaimPreparer
from kubegpu.kube import FakeKube
from kubegpu.state import NodeStore

#: Claims prepared and unprepared (one GPU each), after WARMUP uncounted ones.
CLAIMS = 200
WARMUP = 10
DRIVER = "gpu.nvidia.com"
NODE = "bench-node"


def _stats(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "median": statistics.median(ordered),
        "p90": ordered[int(0.9 * (len(ordered) - 1))],
        "max": ordered[-1],
    }


async def bench_dra(claims: int = CLAIMS, warmup: int = WARMUP) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="kgb-dra-", dir="/tmp"))
    try:
        backend = SimulatedBackend.load("h100-8")
        store = NodeStore()
        store.update(inventory=backend.discover(), config=Config())
        kube = FakeKube()
        preparer = ClaimPreparer(
            store, kube, data_dir=root / "plugins" / DRIVER, cdi_dir=root / "cdi", pool=NODE
        )
        driver = DraDriver(
            preparer, driver=DRIVER, registrar_dir=root / "reg", plugins_dir=root / "plugins"
        )
        await driver.start()
        try:
            async with grpc.aio.insecure_channel(f"unix://{driver.service.path}") as channel:
                stub = dra_stub(channel)
                prepare, unprepare = stub.NodePrepareResources, stub.NodeUnprepareResources
                prepared: list[float] = []
                unprepared: list[float] = []
                for n in range(warmup + claims):
                    stored = kube.put_resource_claim(_claim(f"c{n}", f"gpu-{n % 8}"))
                    claim = dra_pb2.Claim(
                        namespace="bench", name=f"c{n}", uid=stored["metadata"]["uid"]
                    )
                    start = time.perf_counter()
                    answer = await prepare(dra_pb2.NodePrepareResourcesRequest(claims=[claim]))
                    middle = time.perf_counter()
                    await unprepare(dra_pb2.NodeUnprepareResourcesRequest(claims=[claim]))
                    end = time.perf_counter()
                    if answer.claims[claim.uid].error:
                        raise RuntimeError(f"prepare failed: {answer.claims[claim.uid].error}")
                    if n >= warmup:
                        prepared.append((middle - start) * 1000)
                        unprepared.append((end - middle) * 1000)
        finally:
            await driver.stop()
        return {
            "dra": {
                "claims": claims,
                "prepare_ms": _stats(prepared),
                "unprepare_ms": _stats(unprepared),
            }
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _claim(name: str, device: str) -> dict[str, Any]:
    result = {"request": "gpu", "driver": DRIVER, "pool": NODE, "device": device}
    return {
        "metadata": {"namespace": "bench", "name": name},
        "spec": {},
        "status": {"allocation": {"devices": {"results": [result]}}},
    }


if __name__ == "__main__":
    print(asyncio.run(bench_dra()))
