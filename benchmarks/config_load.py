"""Worst-case config loads: `python -m benchmarks.config_load` prints ms and peak memory.

Each input is at or just past one of the loader's limits (kubegpu.config.yamlsafe), the
shapes that cost the most to read; the figures back the "within 100 ms" claim of issue 8.
"""

from __future__ import annotations

import time
import tracemalloc

from kubegpu.config import parse_config, yamlsafe
from kubegpu.errors import ConfigError

SHARED = "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n"
N = yamlsafe.MAX_NODES


def cases() -> dict[str, bytes]:
    bomb = "".join(
        f"l{n}: &l{n} [{', '.join([f'*l{n - 1}'] * 9) if n else ', '.join(['lol'] * 9)}]\n"
        for n in range(9)
    )
    return {
        "1 MiB of comments": b"version: v1\n#" + b"x" * (yamlsafe.MAX_BYTES - 14) + b"\n",
        "1 MiB over the limit": b"#" * (yamlsafe.MAX_BYTES + 1),
        "alias bomb (9^9)": bomb.encode(),
        "nesting 3000": b"flags: " + b"[" * 3000 + b"]" * 3000,
        f"{N - 20} devices": (
            SHARED
            + "      replicas: 2\n      devices: ["
            + ", ".join(map(str, range(N - 20)))
            + "]\n"
        ).encode(),
        "900 unknown keys of 1 KiB": (
            "version: v1\nflags:\n" + "".join(f"  k{i:05d}{'x' * 1000}: 1\n" for i in range(900))
        ).encode(),
        "250 scalars of 4 KiB": (
            "version: v1\nx: [" + ", ".join(["y" * 4090] * 250) + "]\n"
        ).encode(),
        "memoryLimit 1e999999999": (
            b"version: v1\nflags: {mpsRoot: /m}\nsharing:\n  mps:\n    resources:\n"
            b'    - {name: nvidia.com/gpu, replicas: 2, memoryLimit: "1e999999999"}\n'
        ),
    }


def _load(data: bytes) -> str:
    try:
        parse_config(data, "bench")
    except ConfigError as exc:
        return str(exc)[:60]
    return "ok"


def main() -> None:
    for name, data in cases().items():
        start = time.perf_counter()
        outcome = _load(data)
        elapsed = (time.perf_counter() - start) * 1000
        tracemalloc.start()  # a second pass: tracing slows the first several times over
        _load(data)
        peak = tracemalloc.get_traced_memory()[1] / 2**20
        tracemalloc.stop()
        print(f"{name:28} {len(data):>8} B {elapsed:7.1f} ms peak {peak:5.1f} MiB  {outcome}")


if __name__ == "__main__":
    main()
