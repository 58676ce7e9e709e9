"""Where `serve`'s start-up goes: CPU time and RSS of each group of imports, in its order.

Run alone as `python -m benchmarks.startup` or as a section of `make bench`. Each trial is
a fresh interpreter that imports the groups one after the other and reports the CPU time
(`time.process_time`, so other jobs on the machine count less than in wall time) and the
`VmRSS` after each group; the figure of a group is its median over the trials. Bytecode
is cached as on a node (`harness.use_bytecode_cache`; one uncounted trial writes it).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import statistics
import subprocess
import sys
from typing import Any

from benchmarks import harness

TRIALS = 7

#: (name, statements) in the order `kubegpu serve` first needs them. The simulated
#: backend (PyYAML for its presets) is shown apart from what a real node loads. (Until
#: the schema left pydantic, pydantic's two groups came before the config package.)
GROUPS: tuple[tuple[str, str], ...] = (
    ("asyncio (with ssl)", "import asyncio"),
    ("grpc, protobuf, kubegpu.api", "import grpc, grpc.aio, kubegpu.api"),
    ("config package (kubegpu.config)", "import kubegpu.config"),
    ("kubegpu.cli (click)", "import kubegpu.cli, kubegpu.cli.serve"),
    ("daemon, plugin, events", "import kubegpu.daemon, kubegpu.events"),
    ("simulated backend (PyYAML)", "import kubegpu.devices.simulated"),
)


_PROBE = """
import json, re, sys, time
def rss():
    return int(re.search(r"VmRSS:\\s+(\\d+)", open("/proc/self/status").read()).group(1)) / 1024
out = [("interpreter", time.process_time(), rss())]
for name, code in json.loads(sys.argv[1]):
    exec(code)
    out.append((name, time.process_time(), rss()))
print(json.dumps(out))
"""


def _trial() -> list[tuple[str, float, float]]:
    run = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(GROUPS)],
        check=True,
        capture_output=True,
        text=True,
    )
    return [(str(n), float(c), float(r)) for n, c, r in json.loads(run.stdout)]


def measure(trials: int = TRIALS) -> list[dict[str, Any]]:
    """Per group: median CPU ms and RSS MiB added (the interpreter row: its own totals)."""
    _trial()  # writes the bytecode cache
    runs = [_trial() for _ in range(trials)]
    rows = []
    for i, (name, _, _) in enumerate(runs[0]):
        cpu = [r[i][1] - (r[i - 1][1] if i else 0.0) for r in runs]
        rss = [r[i][2] - (r[i - 1][2] if i else 0.0) for r in runs]
        rows.append(
            {
                "group": name,
                "cpu_ms": round(statistics.median(cpu) * 1000, 1),
                "rss_mib": round(statistics.median(rss), 1),
            }
        )
    return rows


async def bench_startup_imports() -> dict[str, Any]:
    rows = await asyncio.to_thread(measure)
    imports = rows[1:]
    return {
        "startup_imports": rows,
        "startup_imports_cpu_ms": round(sum(r["cpu_ms"] for r in imports), 1),
        "startup_imports_rss_mib": round(sum(r["rss_mib"] for r in imports), 1),
    }


def main() -> int:
    prefix = harness.use_bytecode_cache()
    try:
        rows = measure()
    finally:
        shutil.rmtree(prefix, ignore_errors=True)
    width = max(len(r["group"]) for r in rows)
    print(f"{'group'.ljust(width)}  CPU ms  RSS MiB")
    for r in rows:
        print(f"{r['group'].ljust(width)}  {r['cpu_ms']:6.1f}  {r['rss_mib']:7.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
