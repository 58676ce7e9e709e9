"""Node trees for the AMD backend, built around ROCm's checked-in KFD topologies.

ROCm's test data holds only `/sys/class/kfd/kfd/topology`. The device IDs, NUMA nodes and
partition modes its tests use come from elsewhere in its code (`GetAMDGPUs` reads
`/sys/module/amdgpu/drivers/pci:amdgpu/<BDF>` and `/sys/devices/platform/amdgpu_xcp_<n>`;
the allocator test derives NUMA from the GPU index). `build_node` writes those files, with
the values ROCm's tests state, next to an unmodified copy of the KFD tree, which comes from
ROCm's `testdata/` in ../shared/peer-data (tests that build a node skip where it is absent).
"""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import tarfile
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tests.conformance.origin import peer_file

KFD = "sys/class/kfd/kfd/topology"


def kfd_tree(name: str, scratch: Path) -> Path:
    """The directory holding `nodes/` of ROCm's tree `name` (unpacked when archived).

    An archived tree is a private copy under `scratch`, hard-linked to the one unpacking
    this process makes (4,000 files: xz and tarfile cost ~2 s a time, links ~50 ms). The
    trees are read-only inputs; a test may delete files from its copy, never write them.
    """
    testdata = rocm_testdata()
    packed = testdata / f"{name}.tar.xz"
    if packed.exists():
        base = scratch / "unpacked" / name
        shutil.copytree(_unpacked(packed) / name, base, copy_function=_link_or_copy)
    else:
        base = testdata / name
    return base / "topology" if (base / "topology").is_dir() else base


def rocm_testdata() -> Path:
    """ROCm's `testdata/` (peer-data); skips the calling test where peer-data is absent."""
    return peer_file("rocm", "testdata")


@functools.cache
def _unpacked(packed: Path) -> Path:
    where = Path(tempfile.mkdtemp(prefix="kg-rocm-"))
    atexit.register(shutil.rmtree, where, ignore_errors=True)
    with tarfile.open(packed) as tar:
        tar.extractall(where, filter="data")
    return where


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another filesystem
        shutil.copy2(src, dst)


def _props(path: Path) -> dict[str, int]:
    out = {}
    for line in path.read_text().splitlines():
        key, _, value = line.partition(" ")
        if value.strip().lstrip("-").isdigit():
            out[key] = int(value)
    return out


@dataclass
class Node:
    """A built node: its root, and ROCm's test ID -> the ID kubegpu should advertise."""

    root: Path
    ids: dict[str, str] = field(default_factory=dict)


def build_node(
    name: str,
    scratch: Path,
    *,
    numa: Callable[[int], int] = lambda gpu: 0,
    partition_mode: tuple[str, str] | None = None,
    product_name: str | None = None,
    with_drm: bool = True,
) -> Node:
    """Root of a node whose KFD topology is ROCm's `name`.

    GPU `i` (the i-th physical GPU in KFD node order) is named `test<i+1>` and its
    partition `j > 0` `amdgpu_xcp_<8i+j>`, as ROCm's allocator test names them.
    """
    root = scratch / "root"
    tree = kfd_tree(name, scratch)
    (root / KFD).parent.mkdir(parents=True)
    if tree.is_relative_to(scratch):
        tree.rename(root / KFD)  # unpacked just now: move, not copy (4,000 files)
    else:
        shutil.copytree(tree, root / KFD)
    if not (root / KFD / "nodes").is_dir():
        raise AssertionError(f"{name}: no nodes/ directory")
    node = Node(root)
    if not with_drm:
        return node
    gpus: dict[tuple[int, int, int], list[int]] = {}
    for entry in sorted((root / KFD / "nodes").iterdir(), key=lambda p: int(p.name)):
        props = _props(entry / "properties")
        if props.get("drm_render_minor", 0) > 0:
            loc = props["location_id"]
            key = (props.get("domain", 0), (loc >> 8) & 0xFF, (loc >> 3) & 0x1F)
            gpus.setdefault(key, []).append(props["drm_render_minor"])
    for i, ((domain, bus, dev), renders) in enumerate(gpus.items()):
        address = f"{domain:04x}:{bus:02x}:{dev:02x}.0"
        pci = root / "sys/module/amdgpu/drivers/pci:amdgpu" / address
        _device(pci, renders[0])
        (pci / "vendor").write_text("0x1002\n")
        (pci / "numa_node").write_text(f"{numa(i)}\n")
        if product_name is not None:
            (pci / "product_name").write_text(product_name + "\n")
        if partition_mode is not None:
            (pci / "current_compute_partition").write_text(partition_mode[0].upper() + "\n")
            (pci / "current_memory_partition").write_text(partition_mode[1].upper() + "\n")
            (pci / "available_compute_partition").write_text("SPX, DPX, QPX, CPX\n")
            (pci / "available_memory_partition").write_text("NPS1, NPS4\n")
        node.ids[f"test{i + 1}"] = address
        for j, render in enumerate(renders[1:], start=1):
            xcp = f"amdgpu_xcp_{8 * i + j}"
            _device(root / "sys/devices/platform" / xcp, render)
            node.ids[xcp] = xcp
    (root / "sys/module/amdgpu/version").write_text("6.10.5\n")
    return node


def _device(path: Path, render: int) -> None:
    (path / "drm" / f"card{render - 128}").mkdir(parents=True)
    (path / "drm" / f"renderD{render}").mkdir(parents=True)
