"""Every label kind ROCm's node labeller writes, on ROCm's own trees, with ROCm's values.

ROCm's labeller (`cmd/k8s-node-labeller/main.go`) has twelve kinds. Six are counted per
device and written by its `createLabels`: `beta.amd.com/gpu.<kind>.<value>=<count>` for each
value and, when the node has one value, `beta.amd.com/gpu.<kind>=<value>` and
`amd.com/gpu.<kind>=<value>`; with several values, `amd.com/gpu.<kind>.<value>=<count>`
instead (family, device-id, product-name, vram, simd-count, cu-count). `firmware` is written
under `beta.amd.com` only, a count per `<fw>.feat.<n>` and `<fw>.fw.<n>`. The five node-wide
kinds (driver-version, driver-src-version, compute-memory-partition and the two
`*-partitioning-supported`) are written under `amd.com` only: `beta.amd.com/gpu.<kind>` is
on ROCm's list of keys only so that it removes stale ones.

The nodes are ROCm's KFD trees with the files ROCm's trees lack next to them:
`tests/fixtures/amd-vega10-drm` (ours, see its README) for the one-GPU `topology-parsing`
capture, and ROCm's `testdata/debugfs-parsing/amdgpu_firmware_info` for the firmware.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path

import pytest

from kubegpu.devices.amd import AmdBackend
from kubegpu.labels_amd import BETA_PREFIX, KINDS, PREFIX, amd_labels
from tests.conformance.origin import PEER_DATA, needs_peer_data
from tests.conformance.rocm import sysfs
from tests.conformance.rocm.cases import cites

TESTDATA = PEER_DATA / "rocm" / "testdata"
FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "amd-vega10-drm"
KFD = "sys/class/kfd/kfd/topology"
FIRMWARE_FILE = "debugfs-parsing/amdgpu_firmware_info"

pytestmark = [needs_peer_data]

#: ROCm's debugfs-parsing capture as `internal/pkg/amdgpu/amdgpu_test.go`
#: TestParseDebugFSFirmwareInfo expects it: name -> (feature version, firmware version), for
#: the ten names `GetFirmwareVersions` asks the driver for (MEC2, SOS, ASD and SDMA1 are not
#: among them).
FIRMWARE: Mapping[str, tuple[int, int]] = {
    "VCE": (0, 0x352D0400),
    "UVD": (0, 0x01571100),
    "MC": (0, 0x00000000),
    "ME": (35, 0x00000094),
    "PFP": (35, 0x000000A4),
    "CE": (35, 0x0000004A),
    "RLC": (0, 0x00000058),
    "MEC": (33, 0x00000160),
    "SMC": (0, 0x001C2800),
    "SDMA0": (40, 0x00000197),
}


def firmware_labels(count: int) -> dict[str, str]:
    """main.go's firmware generator: `%s.feat.%d` and `%s.fw.%d`, counted per GPU."""
    labels = {}
    for name, (feature, version) in FIRMWARE.items():
        labels[f"{BETA_PREFIX}/gpu.firmware.{name}.feat.{feature}"] = str(count)
        labels[f"{BETA_PREFIX}/gpu.firmware.{name}.fw.{version}"] = str(count)
    return labels


def counted(kind: str, value: str, count: int = 1) -> dict[str, str]:
    """createLabels for a kind with one value on the node."""
    return {
        f"{PREFIX}/gpu.{kind}": value,
        f"{BETA_PREFIX}/gpu.{kind}": value,
        f"{BETA_PREFIX}/gpu.{kind}.{value}": str(count),
    }


#: The labels of the one-GPU node of `topology-parsing`. Values: ROCm's labeller README
#: "Example result" (cu-count 64, device-id 6860, family AI, simd-count 256, vram 16G); libdrm's
#: `amdgpu.ids` for 6860 rev 00, which ROCm asks when the card has no `product_name`; the
#: fixture's driver files; ROCm's debugfs capture; no partition files, so no partition mode
#: and partitioning unsupported.
VEGA10_LABELS = {
    **counted("family", "AI"),
    **counted("device-id", "6860"),
    **counted("product-name", "AMD_Radeon_Instinct_MI25"),
    **counted("vram", "16G"),
    **counted("simd-count", "256"),
    **counted("cu-count", "64"),
    **firmware_labels(1),
    f"{PREFIX}/gpu.driver-version": "6.10.5",
    f"{PREFIX}/gpu.driver-src-version": "5C2D6A0E93B7F41D8A6E0C2",
    f"{PREFIX}/gpu.compute-partitioning-supported": "false",
    f"{PREFIX}/gpu.memory-partitioning-supported": "false",
}
#: The kinds ROCm writes under `beta.amd.com` (createLabels' six, and firmware).
BETA_KINDS = {"family", "device-id", "product-name", "vram", "simd-count", "cu-count", "firmware"}


def _writable(tree: Path) -> None:
    """The peer data is read-only and copytree keeps modes; the copy is ours to change."""
    for path in (tree, *tree.rglob("*")):
        if not path.is_symlink():
            path.chmod(path.stat().st_mode | 0o200)


def vega10_node(scratch: Path) -> Path:
    """The node of ROCm's `topology-parsing` capture with the files its labeller also reads.

    Node 2 is a copy of node 1 (the capture's README: it simulates a second GPU, at the same
    PCI address, which no DRM tree can hold); dropped, as for the README's one-GPU example.
    The capture predates KFD's `gfx_target_version` (kernels from 5.x write it), which is
    how kubegpu knows the family without libdrm: the line a current kernel writes for this
    gfx900 GPU is added to the copy.
    """
    root = scratch / "root"
    shutil.copytree(FIXTURE, root, symlinks=True)
    shutil.copytree(TESTDATA / "topology-parsing" / "topology", root / KFD)
    _writable(root / KFD)
    shutil.rmtree(root / KFD / "nodes" / "2")
    with (root / KFD / "nodes" / "1" / "properties").open("a") as properties:
        properties.write("gfx_target_version 90000\n")
    debugfs = root / "sys/kernel/debug/dri/0"
    debugfs.mkdir(parents=True)
    shutil.copyfile(TESTDATA / FIRMWARE_FILE, debugfs / "amdgpu_firmware_info")
    return root


def written_kinds(labels: Mapping[str, str], prefix: str) -> set[str]:
    """The kinds that have a label under `prefix` (`<prefix>/gpu.<kind>[.<value>]`)."""
    kinds = set()
    for key in labels:
        rest = key.removeprefix(f"{prefix}/gpu.")
        if rest != key:
            kinds |= {k for k in KINDS if rest == k or rest.startswith(f"{k}.")}
    return kinds


@pytest.fixture
def rocm_testdata() -> Path:
    """ROCm's trees in the peer data, where `sysfs.build_node` reads them too."""
    return sysfs.rocm_testdata()


@cites("cmd/k8s-node-labeller/main.go")
def test_vega10_node_has_rocms_labels(tmp_path: Path) -> None:
    """Every label of the one-GPU node, and no other."""
    labels = amd_labels(AmdBackend(str(vega10_node(tmp_path))).discover())
    assert labels == VEGA10_LABELS


@cites("cmd/k8s-node-labeller/main.go")
def test_driver_files_are_read_through_the_card(tmp_path: Path) -> None:
    """ROCm reads the versions at `/sys/class/drm/card<N>/device/driver/module/`; the
    fixture has no `/sys/module/amdgpu/version`, so only that path gives them."""
    root = vega10_node(tmp_path)
    assert not (root / "sys/module/amdgpu/version").exists()
    inventory = AmdBackend(str(root)).discover()
    assert inventory.driver_version == "6.10.5"
    assert inventory.amd is not None
    assert inventory.amd.driver_src_version == "5C2D6A0E93B7F41D8A6E0C2"


@cites("cmd/k8s-node-labeller/main.go")
def test_device_id_is_the_pci_functions(tmp_path: Path) -> None:
    """ROCm's device-id label is the card's `device` file (not KFD's copy of it)."""
    root = vega10_node(tmp_path)
    (root / "sys/class/drm/card0/device/device").write_text("0x6861\n")
    labels = amd_labels(AmdBackend(str(root)).discover())
    assert labels[f"{PREFIX}/gpu.device-id"] == "6861"
    assert labels[f"{BETA_PREFIX}/gpu.device-id.6861"] == "1"


@cites("cmd/k8s-node-labeller/main.go")
def test_node_wide_kinds_have_no_beta_form(tmp_path: Path) -> None:
    """main.go's driver-version, driver-src-version and *-partitioning-supported
    generators write `amd.com/gpu.<kind>` only; firmware writes `beta.amd.com` only."""
    labels = amd_labels(AmdBackend(str(vega10_node(tmp_path))).discover())
    assert written_kinds(labels, BETA_PREFIX) == BETA_KINDS
    assert written_kinds(labels, PREFIX) == set(KINDS) - {"firmware", "compute-memory-partition"}


@cites("cmd/k8s-node-labeller/main.go")
def test_kubegpu_labels_writes_them(tmp_path: Path) -> None:
    """`kubegpu labels --oneshot` with BACKEND=amd writes the same labels to its file."""
    from kubegpu.cli.labels import labels_main

    root = vega10_node(tmp_path)
    out = tmp_path / "features"
    argv = ["--oneshot", "-o", str(out), "--no-timestamp", "--sysfs-root", str(root)]
    env = {"BACKEND": "amd", "GFD_MACHINE_TYPE_FILE": str(tmp_path / "none")}
    assert labels_main(argv, environ=env) == 0
    written = dict(line.split("=", 1) for line in out.read_text().splitlines())
    assert {k: v for k, v in written.items() if "amd.com/gpu." in k} == VEGA10_LABELS


@cites("internal/pkg/amdgpu/amdgpu.go")
def test_mi300x_cpx_node_has_every_kind(tmp_path: Path, rocm_testdata: Path) -> None:
    """MI300X in CPX/NPS1 (ROCm's topo-mi300-cpx, eight GPUs, 64 partitions) with firmware:
    the partition kinds, firmware counted per GPU, and no vram (the tree has no mem_banks,
    so ROCm's vram generator finds no size). With the Vega10 node, all twelve kinds."""
    node = sysfs.build_node("topo-mi300-cpx", tmp_path, partition_mode=("CPX", "NPS1"))
    cards = sorted((node.root / "sys/module/amdgpu/drivers/pci:amdgpu").glob("*/drm/card*"))
    assert len(cards) == 8
    for card in cards:
        debugfs = node.root / "sys/kernel/debug/dri" / card.name.removeprefix("card")
        debugfs.mkdir(parents=True)
        shutil.copyfile(rocm_testdata / FIRMWARE_FILE, debugfs / "amdgpu_firmware_info")
    labels = amd_labels(AmdBackend(str(node.root)).discover())
    assert labels[f"{PREFIX}/gpu.compute-memory-partition"] == "cpx_nps1"
    assert f"{BETA_PREFIX}/gpu.compute-memory-partition" not in labels
    assert labels[f"{PREFIX}/gpu.compute-partitioning-supported"] == "true"
    assert labels[f"{PREFIX}/gpu.memory-partitioning-supported"] == "true"
    assert {k: v for k, v in labels.items() if ".firmware." in k} == firmware_labels(8)
    assert written_kinds(labels, PREFIX) == set(KINDS) - {"firmware", "vram"}
    assert written_kinds(labels, BETA_PREFIX) == BETA_KINDS - {"vram"}
    vega10 = amd_labels(AmdBackend(str(vega10_node(tmp_path / "vega10"))).discover())
    both = {**labels, **vega10}
    assert written_kinds(both, PREFIX) | written_kinds(both, BETA_PREFIX) == set(KINDS)
