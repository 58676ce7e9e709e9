"""GFD's expected outputs against `kubegpu labels` reading the real `pynvml` on fakenvml.

`test_labels.py` feeds GFD's mocked devices to the pure label code; here the whole
labeller runs as on a node: NVML answers through the real bindings from the simulated
`libnvidia-ml.so.1` of `../shared/fakenvml` (built with gcc), and sysfs is the fake root
that `fakeroot.py` lays out for the same GPUs. The output must pass GFD's own checks
(`tests/expected-output*.txt`, NVIDIA/k8s-device-plugin v0.20.0).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import kubegpu
from tests.conformance.nvidia.test_labels import check_result, expected_output, label_map
from tests.conformance.origin import NVIDIA_DP
from tests.waiting import WAIT

FAKENVML = Path(__file__).resolve().parents[3].parent / "shared" / "fakenvml"
A100 = {
    "name": "NVIDIA A100-SXM4-40GB",
    "memory_total": "40GiB",
    "compute_capability": "8.0",
    "mig_mode": True,
}
NODES: dict[str, dict[str, Any]] = {
    "t4": {
        "driver_version": "535.161.08",
        "cuda_driver_version": "12.2",
        "gpus": [{"name": "Tesla T4", "memory_total": "15GiB", "compute_capability": "7.5"}],
    },
    "a100-one-profile": {
        "gpus": [A100 | {"mig_devices": [{"profile": "3g.20gb"}, {"profile": "3g.20gb"}]}],
    },
    "a100-mixed-profiles": {
        "gpus": [
            A100
            | {
                # 3g.20gb at slices 4-7 leaves room for the rest (A100 placements).
                "mig_devices": [
                    {"profile": "3g.20gb", "placement_start": 4},
                    {"profile": "1g.5gb"},
                    {"profile": "1g.5gb"},
                ]
            }
        ],
    },
    "a100-2g": {"gpus": [A100 | {"mig_devices": [{"profile": "2g.10gb"}]}]},
}


@pytest.fixture(scope="module")
def fakenvml_lib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not (FAKENVML / "build.sh").is_file():
        pytest.skip(f"no fakenvml at {FAKENVML} (../shared is absent)")
    if shutil.which(os.environ.get("CC", "gcc")) is None:
        pytest.skip("no C compiler to build fakenvml")
    out = tmp_path_factory.mktemp("fakenvml")
    subprocess.run(["bash", str(FAKENVML / "build.sh"), str(out)], check=True, capture_output=True)
    return out


def run_labels(lib: Path, tmp: Path, node: str, *flags: str) -> subprocess.CompletedProcess[str]:
    """`kubegpu labels --oneshot` in a fresh process: NVML reads its config once."""
    config = tmp / f"{node}.json"
    config.write_text(json.dumps(NODES[node]))
    root = tmp / "root"
    subprocess.run(
        [
            sys.executable,
            str(FAKENVML / "fakeroot.py"),
            *("--config", str(config)),
            *("--lib", str(lib)),
            *("--out", str(root)),
        ],
        check=True,
        capture_output=True,
    )
    machine = tmp / "product_name"
    machine.write_text("product-name\n")
    env = {
        **os.environ,
        "FAKENVML_CONFIG": str(config),
        "LD_LIBRARY_PATH": str(lib),
        "PYTHONPATH": str(Path(kubegpu.__file__).resolve().parents[1]),
    }
    argv = ["labels", "--oneshot", "-o", "-", "--backend", "nvml", "--sysfs-root", str(root)]
    argv += ["--machine-type-file", str(machine), *flags]
    code = "from kubegpu.cli import main; raise SystemExit(main())"
    return subprocess.run(
        [sys.executable, "-c", code, *argv], env=env, capture_output=True, text=True, timeout=WAIT
    )


@pytest.mark.parametrize(
    ("node", "strategy", "expected_file", "labels"),
    [
        pytest.param(
            "t4",
            "none",
            "expected-output.txt",
            {"nvidia.com/gpu.product": "Tesla-T4", "nvidia.com/gpu.family": "turing"},
            id=NVIDIA_DP.cite("tests/expected-output.txt"),
        ),
        pytest.param(
            "a100-one-profile",
            "none",
            "expected-output-mig-none.txt",
            {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-40GB", "nvidia.com/gpu.replicas": "0"},
            id=NVIDIA_DP.cite("tests/expected-output-mig-none.txt"),
        ),
        pytest.param(
            "a100-one-profile",
            "single",
            "expected-output-mig-single.txt",
            {
                "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-40GB-MIG-3g.20gb",
                "nvidia.com/gpu.count": "2",
                "nvidia.com/gpu.slices.gi": "3",
                "nvidia.com/mig.strategy": "single",
            },
            id=NVIDIA_DP.cite("tests/expected-output-mig-single.txt"),
        ),
        pytest.param(
            "a100-mixed-profiles",
            "mixed",
            "expected-output-mig-mixed.txt",
            {
                "nvidia.com/mig-1g.5gb.count": "2",
                "nvidia.com/mig-3g.20gb.product": "NVIDIA-A100-SXM4-40GB-MIG-3g.20gb",
                "nvidia.com/mig.strategy": "mixed",
            },
            id=NVIDIA_DP.cite("tests/expected-output-mig-mixed.txt"),
        ),
        pytest.param(
            "a100-2g",
            "mixed",
            "expected-output-mig-mixed.txt",
            {"nvidia.com/mig-2g.10gb.count": "1"},
            id=NVIDIA_DP.cite("tests/expected-output-mig-mixed.txt") + " 2g.10gb",
            # Profile id 14 is 2g.10gb on A100; read as an index it was 2g.10gb-me.
        ),
    ],
)
def test_labels_on_fakenvml_pass_gfds_expected_output(
    fakenvml_lib: Path,
    tmp_path: Path,
    node: str,
    strategy: str,
    expected_file: str,
    labels: dict[str, str],
) -> None:
    done = run_labels(fakenvml_lib, tmp_path, node, "--mig-strategy", strategy)
    assert done.returncode == 0, done.stderr
    assert check_result(done.stdout, expected_file, vgpu=False) == []
    assert check_result(done.stdout, "expected-output-vgpu.txt", vgpu=True) == []
    got = label_map(done.stdout)
    assert {k: got.get(k) for k in labels} == labels
    assert got["nvidia.com/gpu.machine"] == "product-name"
    assert got["nvidia.com/vgpu.present"] == "false"  # fakeroot's GPUs are bare metal


def test_a_t4_node_carries_every_label_gfd_expects(fakenvml_lib: Path, tmp_path: Path) -> None:
    """NVIDIA/k8s-device-plugin@v0.20.0:tests/expected-output.txt, read the other way: each
    of its label lines is matched by a line kubegpu writes for a T4."""
    import re

    done = run_labels(fakenvml_lib, tmp_path, "t4")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    text = expected_output("expected-output.txt").read_text()
    missing = [r for r in text.splitlines() if not any(re.search(r, line) for line in lines)]
    assert missing == []
