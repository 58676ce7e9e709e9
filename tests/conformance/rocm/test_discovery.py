"""AMD discovery on ROCm's own KFD topology trees: which KFD nodes are GPUs, which PCI
function a render node belongs to, partitions as devices, the values read from KFD, and
the resource names ROCm's naming strategies give them."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from kubegpu.config import parse_config
from kubegpu.devices.amd import AmdBackend, firmware_info
from kubegpu.resources import build_resources
from tests.conformance.rocm.cases import cites, load
from tests.conformance.rocm.sysfs import KFD, build_node, rocm_testdata

TOPOLOGY = load("topology.yaml")


@cites("internal/pkg/amdgpu/amdgpu_test.go")
def test_render_nodes_map_to_their_gpus_pci_device(tmp_path: Path) -> None:
    """TestRenderDevIdsFromTopology."""
    case = TOPOLOGY["render_devids"]
    node = build_node(case["tree"], tmp_path, with_drm=False)
    expected = {int(k): v for k, v in case["expected"].items()}
    gpus = AmdBackend(str(node.root)).discover().gpus
    assert {g.minor: g.amd.pci_group for g in gpus if g.amd} == expected
    # Every partition of a GPU reports the GPU's PCI function, never a made-up function.
    assert {g.minor: g.pci_bus_id for g in gpus} == {
        render: devid[:-2] + ".0" for render, devid in expected.items()
    }


@cites("internal/pkg/amdgpu/amdgpu.go")
def test_render_nodes_with_drm_files_take_rocms_device_ids(tmp_path: Path) -> None:
    """GetAMDGPUs on the mi308 tree."""
    node = build_node("topology-parsing-mi308", tmp_path, numa=lambda gpu: gpu // 4)
    gpus = AmdBackend(str(node.root)).discover().gpus
    assert [g.uuid for g in gpus] == list(node.ids.values())
    assert len({g.uuid for g in gpus}) == 32
    by_id = {g.uuid: g for g in gpus}
    # A partition's own DRM nodes, not its GPU's: ROCm hands out card and renderD per device.
    assert by_id["amdgpu_xcp_1"].device_paths == ("/dev/dri/card1", "/dev/dri/renderD129")
    assert by_id["0000:80:00.0"].device_paths == ("/dev/dri/card8", "/dev/dri/renderD136")
    assert by_id["amdgpu_xcp_1"].numa_node == by_id["0000:0a:00.0"].numa_node == 0
    assert by_id["0001:0b:00.0"].numa_node == 1


@cites("internal/pkg/plugin/plugin_test.go")
def test_gpu_count_from_topology(tmp_path: Path) -> None:
    """TestCountGPUDevFromTopology."""
    case = TOPOLOGY["gpu_count"]
    node = build_node(case["tree"], tmp_path, with_drm=False)
    gpus = AmdBackend(str(node.root)).discover().gpus
    assert len(gpus) == case["expected"]
    assert len({g.uuid for g in gpus}) == case["expected"], "a copied node is still its own device"


@cites("testdata/topo-mi300-cpx")
@pytest.mark.parametrize(("tree", "count"), [("topo-mi300-cpx", 63), ("topo-mi210-xgmi-pcie", 8)])
def test_trees_without_gpu_id_files(tmp_path: Path, tree: str, count: int) -> None:
    """ROCm finds GPUs by drm_render_minor."""
    node = build_node(tree, tmp_path, with_drm=False)
    assert not list((node.root / KFD).glob("nodes/*/gpu_id"))
    gpus = AmdBackend(str(node.root)).discover().gpus
    assert len(gpus) == count
    assert len({g.uuid for g in gpus}) == count, "partitions share unique_id; IDs must not"


@cites("internal/pkg/allocator/besteffort_policy_test.go")
def test_every_cpx_partition_is_a_device(tmp_path: Path) -> None:
    """MI300X in CPX mode
    is 8 devices per GPU, the first on the PCI function, the others amdgpu_xcp_<n>."""
    node = build_node("topo-mi300-cpx", tmp_path, numa=lambda gpu: gpu // 4)
    gpus = AmdBackend(str(node.root)).discover().gpus
    assert [g.uuid for g in gpus] == list(node.ids.values())
    groups: dict[str, list[str]] = {}
    for g in gpus:
        assert g.amd is not None
        groups.setdefault(g.amd.pci_group, []).append(g.uuid)
        assert g.amd.partition == g.uuid.startswith("amdgpu_xcp_")
    assert [len(members) for members in groups.values()] == [8] * 7 + [7]


@cites("internal/pkg/amdgpu/amdgpu.go")
def test_platform_partitions_kfd_does_not_list_are_not_devices(tmp_path: Path) -> None:
    """a spare amdgpu_xcp_* render node
    (an MI300 in SPX mode has them) is only a device when KFD lists its render minor."""
    node = build_node("topo-mi210-xgmi-pcie", tmp_path)
    spare = node.root / "sys/devices/platform/amdgpu_xcp_99/drm"
    (spare / "renderD250").mkdir(parents=True)
    (spare / "card122").mkdir()
    gpus = AmdBackend(str(node.root)).discover().gpus
    assert "amdgpu_xcp_99" not in {g.uuid for g in gpus}
    assert len(gpus) == 8


@cites("internal/pkg/amdgpu/amdgpu_test.go")
def test_kfd_property_values(tmp_path: Path) -> None:
    """TestParseTopologyProperties."""
    case = TOPOLOGY["properties"]
    node = build_node(case["tree"], tmp_path, with_drm=False)
    by_node = {g.amd.kfd_node: g.amd for g in AmdBackend(str(node.root)).discover().gpus if g.amd}
    for kfd, size in case["mem_bank_size_in_bytes"].items():
        assert by_node[kfd].vram_bytes == size
    for kfd, simd in case["simd_count"].items():
        assert by_node[kfd].simd_count == simd


@cites("internal/pkg/amdgpu/amdgpu_test.go")
def test_firmware_info_from_debugfs(tmp_path: Path) -> None:
    """TestParseDebugFSFirmwareInfo."""
    case = TOPOLOGY["firmware"]
    text = (rocm_testdata() / case["file"]).read_text()
    parsed = firmware_info(text)
    assert {name: feat for name, feat, _ in parsed} == case["feature"]
    assert {name: fw for name, _, fw in parsed} == case["firmware"]
    # Read per card from the node's debugfs, as the labeller sees it.
    node = build_node("topo-mi210-xgmi-pcie", tmp_path)
    debugfs = node.root / "sys/kernel/debug/dri/0"
    debugfs.mkdir(parents=True)
    shutil.copy(rocm_testdata() / case["file"], debugfs / "amdgpu_firmware_info")
    first, second, *_ = AmdBackend(str(node.root)).discover().gpus
    assert first.amd is not None and first.amd.firmware == parsed
    assert second.amd is not None and second.amd.firmware == ()


@cites("docs/user-guide/configuration.md")
@pytest.mark.parametrize(
    ("tree", "mode", "single", "mixed"),
    [
        ("topo-mi300-cpx", ("cpx", "nps4"), {"amd.com/gpu": 63}, {"amd.com/cpx_nps4": 63}),
        ("topo-mi210-xgmi-pcie", None, {"amd.com/gpu": 8}, {"amd.com/gpu": 8}),
    ],
)
def test_resource_naming_strategy_on_rocms_trees(
    tmp_path: Path,
    tree: str,
    mode: tuple[str, str] | None,
    single: dict[str, int],
    mixed: dict[str, int],
) -> None:
    """(section "Resource Naming Strategy") a homogeneous partitioned node
    is one resource, `amd.com/gpu` under `single` and `amd.com/<compute>_<memory>` under
    `mixed`; GPUs that cannot be partitioned are `amd.com/gpu` under both. The CPX tree has
    63 devices (ROCm's data drops one partition, test_trees_without_gpu_id_files)."""
    node = build_node(tree, tmp_path, partition_mode=mode)
    inventory = AmdBackend(str(node.root)).discover()
    for strategy, expected in (("single", single), ("mixed", mixed)):
        config = parse_config(
            f"version: v1\nflags:\n  plugin:\n    amdResourceNamingStrategy: {strategy}\n"
        )
        specs = build_resources(inventory, config)
        assert {s.name: len(s.devices) for s in specs} == expected, strategy
