"""Placement quality and cost: `python -m benchmarks.placement` (also a `make bench` section).

- **Quality**: on each topology (the simulated-node presets, and the DGX-1 with two links
  down), every request size over the whole node, plus 200 seeded random "fragmented" offers
  (a random subset of GPUs free): kubegpu's pick against the brute-force optimum of the
  objective (docs/placement.md). `% optimal` counts picks that score the optimum;
  `worst` is the lowest pick/optimum ratio of summed bandwidth.
- **Does it matter**: a NCCL-style ring all-reduce model. The bus bandwidth of a ring is
  its slowest hop; for a set of GPUs, the best ring over it. Pair bandwidth: NVLink lanes x
  per-link GB/s; PCIe P2P through one switch 24, several 22, a host bridge 20, one NUMA
  node 16, across sockets 10 GB/s. kubegpu's picks against first-fit (lowest free index)
  on the same fragmented offers, sizes 2 to 8.
- **Cost**: `preferred_allocation` in-process, p50/p99 over 300 calls, at 8 GPUs, 16 GPUs
  (two boards), 64 GPUs (eight NVSwitch boards) and 64 GPUs x 48 replicas.
- **Random 16-GPU fabrics** (no symmetry, the hard case for an exact search): `FABRICS`
  seeded fabrics x request sizes 2 to 15 x `SWEEP_CALLS` offers each (a third the whole
  node, the rest a random subset of at least the size): p50/p99 per size over every call,
  the worst, and the same with each request's best of 3 calls (the CPU weather of a shared
  machine taken out); the first call per fabric builds its subset table, timed apart.
- **Over the socket** (`--socket` alone; also in `make bench`): `kubegpu serve` on a
  simulated node (h100-8; hgx-h100-2x8; a random 16-GPU fabric; 8 boards = 64 GPUs; 64
  GPUs x 48 replicas) answers GetPreferredAllocation of every device, in alternating
  blocks with two bare grpc.aio servers that get the same request bytes and answer the
  plugin's own reply: the typed floor (benchmarks/typed_reply_server.py: the same RPC,
  its protobuf types, a constant response; the target is judged against it) and the raw
  floor (benchmarks/reply_server.py: fixed bytes, no protobuf). p50/p99, ratios of p50s.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import math
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
import yaml
from kubegpu.topology import (
    DEFAULT_NVLINK_GBPS,
    NVLINK_GBPS,
    objective,
    preferred_allocation,
)

from benchmarks import harness
from benchmarks.harness import RESOURCE
from benchmarks.reply_server import METHOD as REPLY_METHOD
from kubegpu.api import device_plugin_stub, pb
from kubegpu.config import AllocationPolicy, parse_config
from kubegpu.devices import Inventory, LinkKind
from kubegpu.devices.simulated import SimulatedBackend, parse_node
from kubegpu.resources import ResourceSpec, build_resources

Figures = dict[str, Any]
SEED = 10
OFFERS = 200
CALLS = 300
FABRICS = 20
SWEEP_CALLS = 40
PCIE_GBPS = {
    LinkKind.SINGLE_SWITCH: 24,
    LinkKind.MULTI_SWITCH: 22,
    LinkKind.HOST_BRIDGE: 20,
    LinkKind.SAME_NUMA: 16,
    LinkKind.CROSS_NUMA: 10,
}


def _spec(inv: Inventory, config: str = "version: v1") -> ResourceSpec:
    return next(s for s in build_resources(inv, parse_config(config)) if s.name == "nvidia.com/gpu")


def dgx1_links_down() -> Inventory:
    """The DGX-1 with one lane of 0-3 and one of 4-7 down (both were doubled)."""
    inv = SimulatedBackend.load("dgx1-v100").discover()
    gone = {(0, 3), (3, 0), (4, 7), (7, 4)}
    gpus = []
    for g in inv.gpus:
        links = []
        for link in g.links:
            peer = next(p.index for p in inv.gpus if p.uuid == link.peer_uuid)
            if (g.index, peer) in gone:
                link = dataclasses.replace(link, count=link.count - 1)
            links.append(link)
        gpus.append(dataclasses.replace(g, links=tuple(links)))
    return dataclasses.replace(inv, gpus=tuple(gpus))


def topologies() -> dict[str, Inventory]:
    found = {
        p: SimulatedBackend.load(p).discover()
        for p in ("a10g-4", "h100-8", "dgx1-v100", "hgx-h100", "hgx-h100-2x8")
    }
    found["dgx1-v100 (2 links down)"] = dgx1_links_down()
    return found


def _gbps(a: Any, b: Any) -> float:
    link = a.gpu.link_to(b.gpu.uuid)
    if link is None:
        return 0.0
    if link.kind is LinkKind.NVLINK:
        return float(link.count * NVLINK_GBPS.get(link.nvlink_version, DEFAULT_NVLINK_GBPS))
    return float(PCIE_GBPS[link.kind])


def ring_busbw(units: Sequence[Any]) -> float:
    """The best ring's slowest hop over these GPUs (GB/s); one GPU: no traffic, inf."""
    if len(units) < 2:
        return float("inf")
    first, rest = units[0], units[1:]
    best = 0.0
    for order in itertools.permutations(rest):
        if len(order) > 1 and id(order[0]) > id(order[-1]):
            continue  # a ring and its reverse are the same ring
        ring = [first, *order]
        best = max(best, min(_gbps(ring[i - 1], ring[i]) for i in range(len(ring))))
    return best


def quality(name: str, inv: Inventory, rng: random.Random) -> Figures:
    spec = _spec(inv)
    ids: list[str] = [d.id for d in spec.devices]
    offers: list[tuple[list[str], int]] = [(ids, k) for k in range(1, len(ids) + 1)]
    for _ in range(OFFERS):
        free = sorted(rng.sample(ids, rng.randint(2, len(ids))), key=ids.index)
        offers.append((free, rng.randint(1, len(free))))
    optimal = 0
    worst = 1.0
    bus_kubegpu: list[float] = []
    bus_first: list[float] = []
    for free, size in offers:
        got = [spec.by_id[i].unit for i in preferred_allocation(spec, free, [], size)]
        pool = [spec.by_id[i].unit for i in free]
        best = max(objective(list(c)) for c in itertools.combinations(pool, size))
        mine = objective(got)
        optimal += mine == best
        if best[0]:
            worst = min(worst, mine[0] / best[0])
        if 2 <= size <= 8 and free is not ids:
            bus_kubegpu.append(ring_busbw(got))
            bus_first.append(ring_busbw(pool[:size]))
    mean_k = sum(bus_kubegpu) / len(bus_kubegpu) if bus_kubegpu else 0.0
    mean_f = sum(bus_first) / len(bus_first) if bus_first else 0.0
    return {
        "topology": name,
        "gpus": len(ids),
        "requests": len(offers),
        "optimal_pct": round(100 * optimal / len(offers), 1),
        "worst_ratio": round(worst, 3),
        "busbw_kubegpu_gbps": round(mean_k, 1),
        "busbw_first_fit_gbps": round(mean_f, 1),
    }


def boards_node(count: int) -> dict[str, Any]:
    """`count` HGX H100 boards of 8 GPUs, one NVSwitch domain and NUMA node per board, as a
    simulated-node description (docs/simulated-node.md)."""
    gpus = [{"numa_node": b % 8, "nvswitch": f"board{b}"} for b in range(count) for _ in range(8)]
    return {"gpus": gpus}


def boards(count: int) -> Inventory:
    return SimulatedBackend(parse_node(boards_node(count), f"{count}x8", "bench")).discover()


def random_node(count: int, seed: int) -> dict[str, Any]:
    """`count` GPUs with seeded random direct NVLinks (half the pairs, 1-4 lanes) and NUMA:
    no symmetry for a search to use, the hard case for branch and bound."""
    rng = random.Random(seed)
    gpus: list[dict[str, Any]] = []
    for i in range(count):
        lanes = {j: rng.randint(1, 4) for j in range(i + 1, count) if rng.random() < 0.5}
        gpus.append({"numa_node": rng.randint(0, 1), "nvlinks": lanes})
    return {"gpus": gpus}


def random_fabric(count: int, seed: int) -> Inventory:
    return SimulatedBackend(parse_node(random_node(count, seed), "random", "bench")).discover()


def _latency(
    spec: ResourceSpec, available: list[str], size: int, policy: AllocationPolicy
) -> Figures:
    samples = []
    for _ in range(CALLS):
        start = time.perf_counter_ns()
        preferred_allocation(spec, available, [], size, policy)
        samples.append(time.perf_counter_ns() - start)
    samples.sort()
    return {
        "p50_ms": round(samples[len(samples) // 2] / 1e6, 3),
        "p99_ms": round(samples[int(len(samples) * 0.99) - 1] / 1e6, 3),
    }


def cost() -> dict[str, Figures]:
    found: dict[str, Figures] = {}
    cases = [
        ("8 GPUs (hgx-h100), size 4", _spec(SimulatedBackend.load("hgx-h100").discover()), 4),
        ("16 GPUs (2 boards), size 12", _spec(boards(2)), 12),
        ("16 GPUs (2 boards), size 6", _spec(boards(2)), 6),
        ("16 GPUs (random NVLink fabric), size 8", _spec(random_fabric(16, SEED)), 8),
        ("64 GPUs (8 boards), size 32", _spec(boards(8)), 32),
    ]
    for name, spec, size in cases:
        found[name] = _latency(
            spec, [d.id for d in spec.devices], size, AllocationPolicy.DISTRIBUTED
        )
    shared = (
        "version: v1\nsharing:\n  timeSlicing:\n    resources:\n"
        "    - name: nvidia.com/gpu\n      replicas: 48\n"
    )
    spec = _spec(boards(8), shared)
    ids: list[str] = [d.id for d in spec.devices]
    for policy in AllocationPolicy:
        found[f"64 GPUs x 48 replicas ({len(ids)} IDs), size 8, {policy}"] = _latency(
            spec, ids, 8, policy
        )
    return found


def _pct(samples: list[int], q: float) -> float:
    """The q-th percentile of nanosecond samples, in ms (nearest rank)."""
    ordered = sorted(samples)
    return round(ordered[max(0, math.ceil(len(ordered) * q / 100) - 1)] / 1e6, 3)


def random_sweep(fabrics: int = FABRICS, calls: int = SWEEP_CALLS) -> Figures:
    """Every request size on many random 16-GPU fabrics (see the module docstring)."""
    rng = random.Random(SEED)
    single: dict[int, list[int]] = {k: [] for k in range(2, 16)}
    best3: dict[int, list[int]] = {k: [] for k in range(2, 16)}
    builds: list[int] = []
    for seed in range(fabrics):
        spec = _spec(random_fabric(16, 1000 + seed))
        ids: list[str] = [d.id for d in spec.devices]
        start = time.perf_counter_ns()
        preferred_allocation(spec, ids, [], 8)  # builds the pair terms and subset table
        builds.append(time.perf_counter_ns() - start)
        for size in range(2, 16):
            for call in range(calls):
                free = ids if call % 3 == 0 else rng.sample(ids, rng.randint(size, 16))
                took = []
                for _ in range(3):
                    start = time.perf_counter_ns()
                    preferred_allocation(spec, free, [], size)
                    took.append(time.perf_counter_ns() - start)
                single[size].append(took[0])
                best3[size].append(min(took))
    per_size = {
        size: {
            "p50_ms": _pct(single[size], 50),
            "p99_ms": _pct(single[size], 99),
            "best_of_3_p99_ms": _pct(best3[size], 99),
        }
        for size in single
    }
    every = [t for ts in single.values() for t in ts]
    every3 = [t for ts in best3.values() for t in ts]
    return {
        "fabrics": fabrics,
        "requests": len(every),
        "p50_ms": _pct(every, 50),
        "p99_ms": _pct(every, 99),
        "worst_size_p99_ms": max(f["p99_ms"] for f in per_size.values()),
        "best_of_3_p99_ms": _pct(every3, 99),
        "worst_size_best_of_3_p99_ms": max(f["best_of_3_p99_ms"] for f in per_size.values()),
        "max_ms": round(max(every) / 1e6, 3),
        "table_build_p50_ms": _pct(builds, 50),
        "table_build_max_ms": round(max(builds) / 1e6, 3),
        "per_size": per_size,
    }


#: Over the socket: warm-up calls, then rounds of alternating blocks (plugin, floor).
SOCKET_WARMUP = 100
SOCKET_ROUNDS = 4
SOCKET_BLOCK = 150
REPLICAS = 48


def socket_cases() -> list[tuple[str, str | dict[str, Any], int | None, int]]:
    """(label, preset or node description, time-slicing replicas, allocation size)."""
    return [
        ("8 GPUs (h100-8), 4", "h100-8", None, 4),
        ("16 GPUs (hgx-h100-2x8), 6", "hgx-h100-2x8", None, 6),
        ("16 GPUs (random NVLink fabric), 8", random_node(16, SEED), None, 8),
        ("64 GPUs (8 boards), 32", boards_node(8), None, 32),
        (f"64 GPUs x {REPLICAS} replicas, 8", boards_node(8), REPLICAS, 8),
    ]


#: The DevicePlugin method every server of the socket benchmark answers (the raw floor
#: answers its own generic method of the same shape).
PREFERRED_METHOD = "/v1beta1.DevicePlugin/GetPreferredAllocation"


async def _socket_case(
    work: Path, label: str, node: str | dict[str, Any], replicas: int | None, size: int
) -> Figures:
    """GetPreferredAllocation of `size` out of every device, on `kubegpu serve` over its
    socket, beside two floors answering the plugin's own answer (alternating blocks, so all
    three see the same CPU weather): the typed floor (`benchmarks.typed_reply_server`, the
    same RPC with its protobuf types, a constant response) and the raw floor
    (`benchmarks.reply_server`, fixed bytes, no protobuf at all).

    Every client sends the same pre-serialised request bytes and takes the reply as bytes,
    so the three differ only in what the server does."""
    slug = "".join(c if c.isalnum() else "-" for c in label)
    case = work / slug
    case.mkdir()
    if isinstance(node, dict):
        (case / "node.yaml").write_text(yaml.safe_dump(node))
        node = str(case / "node.yaml")
    extra: list[str] = []
    if replicas is not None:
        (case / "config.yaml").write_text(
            "version: v1\nsharing:\n  timeSlicing:\n    resources:\n"
            f"    - name: {RESOURCE}\n      replicas: {replicas}\n"
        )
        extra = ["--config-file", str(case / "config.yaml")]
    spec_ids = _spec(SimulatedBackend.load(node).discover()).devices
    count = len(spec_ids) * (replicas or 1)
    async with (
        harness.emulator(case / "dp") as kubelet,
        harness.serve(case / "dp", case / "serve.log", *extra, simulate=node) as plugin,
    ):
        await harness.wait_registered(kubelet, count, plugin, timeout=60)
        endpoint = kubelet.plugin_dir / kubelet.registrations[-1].endpoint
        request = pb.PreferredAllocationRequest(
            container_requests=[
                pb.ContainerPreferredAllocationRequest(
                    available_deviceIDs=sorted(kubelet.devices(RESOURCE)), allocation_size=size
                )
            ]
        )
        payload = request.SerializeToString()
        async with grpc.aio.insecure_channel(f"unix://{endpoint}") as channel:
            answer = await device_plugin_stub(channel).GetPreferredAllocation(request)
            picked = answer.container_responses[0].deviceIDs
            if len(picked) != size:
                raise RuntimeError(f"{label}: {len(picked)} IDs picked, asked for {size}")
            (case / "reply.bin").write_bytes(answer.SerializeToString())
            reply = str(case / "reply.bin")
            async with (
                harness.module_server(
                    "benchmarks.typed_reply_server", case / "typed.sock", case / "typed.log", reply
                ),
                harness.module_server(
                    "benchmarks.reply_server", case / "floor.sock", case / "floor.log", reply
                ),
                grpc.aio.insecure_channel(f"unix://{case / 'typed.sock'}") as typed_channel,
                grpc.aio.insecure_channel(f"unix://{case / 'floor.sock'}") as floor_channel,
            ):
                plugin_call = channel.unary_unary(PREFERRED_METHOD, None, None)
                typed = typed_channel.unary_unary(PREFERRED_METHOD, None, None)
                floor = floor_channel.unary_unary(REPLY_METHOD, None, None)
                if await typed(payload) != await plugin_call(payload):
                    raise RuntimeError(f"{label}: the typed floor answers other bytes")
                calls = {
                    "plugin": lambda: plugin_call(payload),
                    "typed": lambda: typed(payload),
                    "raw": lambda: floor(payload),
                }
                samples: dict[str, list[int]] = {name: [] for name in calls}
                for call in calls.values():
                    await harness.timed_calls(call, SOCKET_WARMUP)
                for _ in range(SOCKET_ROUNDS):
                    for name, call in calls.items():
                        samples[name] += await harness.timed_calls(call, SOCKET_BLOCK)
    p50 = harness.percentile(samples["plugin"], 50)
    typed_p50 = harness.percentile(samples["typed"], 50)
    raw_p50 = harness.percentile(samples["raw"], 50)
    return {
        "ids": count,
        "request_bytes": len(payload),
        "p50_ms": round(p50, 3),
        "p99_ms": round(harness.percentile(samples["plugin"], 99), 3),
        "typed_floor_p50_ms": round(typed_p50, 3),
        "typed_floor_p99_ms": round(harness.percentile(samples["typed"], 99), 3),
        "raw_floor_p50_ms": round(raw_p50, 3),
        "raw_floor_p99_ms": round(harness.percentile(samples["raw"], 99), 3),
        # The target is judged against the typed floor (docs/performance.md says why).
        "over_floor_p50": round(p50 / typed_p50, 2),
        "over_raw_floor_p50": round(p50 / raw_p50, 2),
    }


async def bench_preferred_socket() -> Figures:
    """Every `socket_cases` row over a real socket (see `_socket_case`)."""
    found: Figures = {}
    with harness.temp_dir("kgbpref-") as work:
        for label, node, replicas, size in socket_cases():
            found[label] = await _socket_case(work, label, node, replicas, size)
    return found


def run() -> Figures:
    rng = random.Random(SEED)
    return {
        "placement_quality": [quality(n, inv, rng) for n, inv in topologies().items()],
        "placement_latency": cost(),
        "placement_random_16": random_sweep(),
    }


async def bench_placement() -> Figures:
    """The `make bench` section (synchronous work; nothing else runs meanwhile)."""
    figures = run()
    quality_rows = figures["placement_quality"]
    socket = await bench_preferred_socket()
    return {
        **figures,
        "placement_min_optimal_pct": min(r["optimal_pct"] for r in quality_rows),
        "placement_random_16_worst_p99_ms": figures["placement_random_16"]["worst_size_p99_ms"],
        "placement_socket": socket,
        "placement_socket_worst_over_floor_p50": max(f["over_floor_p50"] for f in socket.values()),
        "placement_socket_worst_over_raw_floor_p50": max(
            f["over_raw_floor_p50"] for f in socket.values()
        ),
    }


def main() -> int:
    if sys.argv[1:] == ["--socket"]:
        for name, f in asyncio.run(bench_preferred_socket()).items():
            print(
                f"{name:34} {f['ids']:>5} IDs  p50 {f['p50_ms']:.3f} ms  p99 {f['p99_ms']:.3f} ms"
                f"  typed floor {f['typed_floor_p50_ms']:.3f} ms {f['over_floor_p50']:.2f}x"
                f"  raw floor {f['raw_floor_p50_ms']:.3f} ms {f['over_raw_floor_p50']:.2f}x"
            )
        return 0
    figures = run()
    head = ("topology", "gpus", "reqs", "%opt", "worst", "busbw", "first-fit")
    print(f"{head[0]:28} " + " ".join(f"{h:>6}" for h in head[1:]))
    for r in figures["placement_quality"]:
        print(
            f"{r['topology']:28} {r['gpus']:>6} {r['requests']:>6} {r['optimal_pct']:>6} "
            f"{r['worst_ratio']:>6} {r['busbw_kubegpu_gbps']:>6} {r['busbw_first_fit_gbps']:>6}"
        )
    print()
    for name, f in figures["placement_latency"].items():
        print(f"{name:55} p50 {f['p50_ms']:.3f} ms  p99 {f['p99_ms']:.3f} ms")
    sweep = figures["placement_random_16"]
    print(
        f"random 16-GPU fabrics: {sweep['fabrics']} fabrics x sizes 2-15, "
        f"{sweep['requests']} requests: p50 {sweep['p50_ms']:.3f} ms, p99 {sweep['p99_ms']:.3f} "
        f"ms (worst size {sweep['worst_size_p99_ms']:.3f}), best-of-3 p99 "
        f"{sweep['best_of_3_p99_ms']:.3f} ms (worst size {sweep['worst_size_best_of_3_p99_ms']:.3f}"
        f"), max {sweep['max_ms']:.3f} ms; table build p50 {sweep['table_build_p50_ms']:.1f} ms"
    )
    print(json.dumps(figures, separators=(", ", ": ")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
