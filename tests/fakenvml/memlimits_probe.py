"""Drive kubegpu's per-cgroup memory limits through real pynvml and print JSON.

Started by tests/fakenvml/test_memory_limits.py in a fresh interpreter whose
LD_LIBRARY_PATH holds the simulated libnvidia-ml.so.1 (which reads FAKENVML_CONFIG once
per process).

    memlimits_probe.py HOST_ROOT CGROUP
"""

from __future__ import annotations

import json
import sys

from kubegpu.devices.nvml import NvmlBackend
from kubegpu.devices.nvml.memlimits import MemoryLimitError


def main(host_root: str, cgroup: str) -> dict[str, object]:
    backend = NvmlBackend.open(host_root=host_root, dev_root=host_root)
    try:
        inventory = backend.discover()
        limiter = backend.memory_limiter()
        out: dict[str, object] = {"memory_limits": inventory.memory_limits}
        if limiter is None:
            return out
        uuid = inventory.gpus[0].uuid
        out["unset"] = limiter.read(uuid, cgroup)
        limiter.set_limit(uuid, cgroup, 10 << 30)
        out["set"] = limiter.read(uuid, cgroup)
        out["other_gpu"] = limiter.read(inventory.gpus[1].uuid, cgroup)
        limiter.clear(uuid, cgroup)
        out["cleared"] = limiter.read(uuid, cgroup)
        try:
            limiter.set_limit(uuid, "", 1 << 30)
        except MemoryLimitError as exc:
            out["refused"] = str(exc)
        return out
    finally:
        backend.close()


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2])))
