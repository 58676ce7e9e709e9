"""Per-cgroup device memory limits (the kernel path of a sized claim) through real pynvml
on the simulated libnvidia-ml (../shared/fakenvml, its README's *Processes* section:
`nvmlDeviceSetMemoryLimits_v1` / `nvmlDeviceGetMemoryLimits_v1` record soft and hard
limits per cgroup path and count the memory of that cgroup's processes; soft 0 with hard
`NVML_DEVICE_MEMORY_LIMIT_MAX` clears; an empty path is INVALID_ARGUMENT)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.fakenvml.conftest import fakenvml_env

PROBE = Path(__file__).with_name("memlimits_probe.py")
POD = "/sys/fs/cgroup/kubepods.slice/kubepods-pod0f8e8a52_5cf0_4a2b_9a4e_2f1d8b1e0c01.slice"
MACHINE = {
    "gpus": [
        {
            "name": "NVIDIA H100 80GB HBM3",
            "memory_total": "80GiB",
            "compute_capability": "9.0",
            "processes": [
                {"pid": 4242, "used_memory": "6GiB", "type": "mps", "cgroup": POD},
                {"pid": 4343, "used_memory": "2GiB", "cgroup": "/sys/fs/cgroup/other"},
            ],
        },
        {"name": "NVIDIA H100 80GB HBM3", "memory_total": "80GiB", "compute_capability": "9.0"},
    ]
}
UNLIMITED = 0xFFFFFFFFFFFFFFFF


def run(lib: Path, host_root: Path) -> Any:
    done = subprocess.run(
        [sys.executable, str(PROBE), str(host_root), POD],
        capture_output=True,
        text=True,
        env=fakenvml_env(lib, MACHINE),
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_cgroups_limit_is_set_read_and_cleared(fakenvml_lib: Path, tmp_path: Path) -> None:
    cgroup = tmp_path / "sys" / "fs" / "cgroup"
    cgroup.mkdir(parents=True)
    (cgroup / "cgroup.controllers").write_text("cpu memory dmem\n")
    got = run(fakenvml_lib, tmp_path)
    assert got["memory_limits"] is True
    assert got["unset"] == [0, UNLIMITED, 6 << 30]
    # Soft = hard: the scheduler reserved that much for the claim.
    assert got["set"] == [10 << 30, 10 << 30, 6 << 30]
    assert got["other_gpu"] == [0, UNLIMITED, 0]
    assert got["cleared"] == [0, UNLIMITED, 6 << 30]
    assert (
        got["refused"].startswith("GPU ") and "refused a memory limit for cgroup " in got["refused"]
    )


def test_without_cgroup_v2_the_node_has_no_kernel_limits(
    fakenvml_lib: Path, tmp_path: Path
) -> None:
    assert run(fakenvml_lib, tmp_path) == {"memory_limits": False}
