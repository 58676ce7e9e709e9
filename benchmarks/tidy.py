"""`python -m benchmarks.tidy`: two small figures of the issue 9 leftovers.

- **SIGHUP window**: spawn of `python -m kubegpu.cli serve` → its SIGHUP disposition reads
  ignored (bit 0 of `SigIgn` in `/proc/PID/status`), against a bare interpreter whose
  first statement ignores it (the floor no Python program can beat), alternated. Another
  tree (say main's `src`) is measured beside it with `--against PATH`.
- **CDI classes per Allocate**: `cdi.available_classes` (a directory listing) against
  `cdi.ClassCache.get` (a `stat` while the directory is unchanged), four spec files.

The last line printed is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import timeit
from pathlib import Path
from typing import Any

import kubegpu
from kubegpu import cdi

SRC = str(Path(kubegpu.__file__).parent.parent)
FLOOR = "import signal; signal.signal(signal.SIGHUP, signal.SIG_IGN); import time; time.sleep(5)"


def hup_ignored(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = next(line.split()[1] for line in status.splitlines() if line.startswith("SigIgn:"))
    return bool(int(mask, 16) & 1)


def spawn_to_ignored_ms(argv: list[str], env: dict[str, str]) -> float | None:
    """Milliseconds from spawn until HUP is ignored (spinning on /proc); None if never."""
    started = time.perf_counter()
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    seen = None
    while proc.poll() is None:
        if hup_ignored(proc.pid):
            seen = (time.perf_counter() - started) * 1000
            break
    proc.kill()
    proc.wait()
    return seen


def bench_hup_window(trials: int, against: str | None) -> dict[str, Any]:
    serve = [sys.executable, "-m", "kubegpu.cli", "serve", "--device-plugin-path", "/nonexistent"]
    variants = {"this tree": (serve, dict(os.environ, PYTHONPATH=SRC))}
    if against:
        variants["against"] = (serve, dict(os.environ, PYTHONPATH=against))
    variants["floor"] = ([sys.executable, "-c", FLOOR], dict(os.environ))
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(trials):  # alternated, so all see the same load
        for name, (argv, env) in variants.items():
            ms = spawn_to_ignored_ms(argv, env)
            if ms is not None:
                times[name].append(ms)
    return {
        f"hup_ignored_{name.replace(' ', '_')}_ms": {
            "n": len(v),
            "median": round(statistics.median(v), 1) if v else None,
            "min": round(min(v), 1) if v else None,
        }
        for name, v in times.items()
    }


def bench_cdi_classes() -> dict[str, Any]:
    directory = Path(tempfile.mkdtemp(prefix="kubegpu-cdi-"))
    for cdi_class in ("gpu", "gds", "gdrcopy", "imex-channel"):
        (directory / cdi.spec_name(cdi_class)).write_text("{}")
    os.utime(directory, ns=(0, 0))  # long settled, as between spec rewrites
    cache = cdi.ClassCache(directory)
    number = 2000

    def per_call_us(call: Any) -> float:
        return min(timeit.repeat(call, number=number, repeat=5)) / number * 1e6

    listing = per_call_us(lambda: cdi.available_classes(directory))
    cached = per_call_us(cache.get)
    return {
        "cdi_classes_listing_us": round(listing, 2),
        "cdi_classes_cached_us": round(cached, 2),
        "cdi_classes_cached_over_listing": round(cached / listing, 2),
        "cdi_classes_listings": cache.listings,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--trials", type=int, default=25)
    parser.add_argument("--against", help="another tree's src directory to measure beside")
    args = parser.parse_args()
    figures = {
        "load_average": os.getloadavg(),
        **bench_hup_window(args.trials, args.against),
        **bench_cdi_classes(),
    }
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
