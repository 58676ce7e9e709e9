"""NVIDIA's orders of control device nodes and library directories, pinned.

`kubegpu.nvidia_paths` defines them once for discovery, Allocate, CDI and MPS. The order
reaches the kubelet (device specs of Allocate, control nodes first, as NVIDIA's
`GetDevicePaths`) and decides which `libnvidia-ml.so.1` is loaded under a driver root (the
first match, as NVIDIA's `tryResolveLibrary`); the cases are in `data/nvidia/paths.yaml`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from kubegpu import cdi
from kubegpu.devices.model import Inventory
from kubegpu.devices.nvml import NvmlBackend, find_library
from kubegpu.nvidia_paths import (
    CONTROL_DEVICES,
    LIBRARY_DIRS,
    NVML_LIBRARY,
    OPTIONAL_CONTROL_DEVICES,
    REQUIRED_CONTROL_DEVICES,
)
from kubegpu.testing import FakeNvml
from tests.conformance.origin import DATA, NVIDIA_DP

PATHS: dict[str, Any] = yaml.safe_load((DATA / "nvidia" / "paths.yaml").read_text())


def test_control_devices_in_nvidias_order() -> None:
    assert list(CONTROL_DEVICES) == PATHS["control_devices"], NVIDIA_DP.cite(
        "internal/rm/nvml_manager.go"
    )
    # The CDI spec's split: required first, then the optional ones, same order overall.
    assert REQUIRED_CONTROL_DEVICES + OPTIONAL_CONTROL_DEVICES == CONTROL_DEVICES


def test_library_dirs_begin_with_nvidias_search_paths() -> None:
    nvidia = [p.lstrip("/") for p in PATHS["library_search_paths"]]
    assert list(LIBRARY_DIRS[: len(nvidia)]) == nvidia, NVIDIA_DP.cite(
        "cmd/nvidia-device-plugin/root.go"
    )
    assert LIBRARY_DIRS[len(nvidia) :] == ("usr/lib", "lib")


def test_discovery_reports_control_nodes_in_nvidias_order(tmp_path: Path) -> None:
    (tmp_path / "dev").mkdir()
    for path in reversed(CONTROL_DEVICES):  # creation order must not matter
        (tmp_path / path.lstrip("/")).touch()
    fake = FakeNvml()
    fake.add_gpu()
    backend = NvmlBackend.open(nvml=fake, dev_root=str(tmp_path))
    assert list(backend.discover().control_device_paths) == PATHS["control_devices"]


@pytest.mark.parametrize(
    "dirs",
    [
        ["usr/lib", "lib64"],  # NVIDIA looks in lib64 before the plain usr/lib
        ["lib/x86_64-linux-gnu", "usr/lib/aarch64-linux-gnu", "usr/lib64"],
    ],
)
def test_find_library_takes_the_first_dir_in_nvidias_order(tmp_path: Path, dirs: list[str]) -> None:
    for directory in dirs:
        (tmp_path / directory).mkdir(parents=True)
        (tmp_path / directory / NVML_LIBRARY).touch()
    first = min(dirs, key=LIBRARY_DIRS.index)
    assert find_library(str(tmp_path)) == tmp_path / first / NVML_LIBRARY


def test_cdi_spec_writes_required_then_present_optional_control_nodes(tmp_path: Path) -> None:
    (tmp_path / "dev").mkdir()
    (tmp_path / "dev/nvidia-modeset").touch()
    spec = cdi.generate_spec(Inventory(gpus=()), dev_root=str(tmp_path))
    nodes = [n["path"] for n in spec["containerEdits"]["deviceNodes"]]
    assert nodes == PATHS["control_devices"]
