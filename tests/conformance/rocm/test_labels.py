"""`kubegpu labels` on AMD nodes against ROCm's node labeller: keys, value formats, counts."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from kubegpu.devices.amd import AmdBackend
from kubegpu.labeller import NodePatchSink
from kubegpu.labels_amd import BETA_PREFIX, KINDS, PREFIX, amd_labels
from tests.conformance.rocm.cases import cites, load
from tests.conformance.rocm.sysfs import KFD, build_node

LABELS = load("labels.yaml")


@cites("cmd/k8s-node-labeller/main_test.go")
def test_label_kinds_are_rocms() -> None:
    """TestInitLabelLists: the same label keys under amd.com and beta.amd.com."""
    assert {f"{PREFIX}/gpu.{k}" for k in KINDS} == set(LABELS["all_label_keys"])
    assert {f"{BETA_PREFIX}/gpu.{k}" for k in KINDS} == set(LABELS["all_experimental_label_keys"])


@cites("cmd/k8s-node-labeller/main_test.go")
def test_mi210_node_values(tmp_path: Path) -> None:
    """TestRemoveOldNodeLabels' MI210 values, from ROCm's MI210 KFD tree."""
    case = LABELS["mi210"]
    node = build_node(case["tree"], tmp_path, product_name=case["product_name"])
    (node.root / "sys/module/amdgpu/version").write_text(case["driver_version"] + "\n")
    labels = amd_labels(AmdBackend(str(node.root)).discover())
    assert {k: labels.get(k) for k in case["labels"]} == case["labels"]
    # Eight identical GPUs: one value each, counted 8 under beta.
    assert labels["beta.amd.com/gpu.cu-count.104"] == "8"
    assert labels["beta.amd.com/gpu.product-name"] == "Instinct_MI210"
    assert not any(k.startswith("amd.com/gpu.cu-count.") for k in labels)


@cites("cmd/k8s-node-labeller/README.md")
def test_readme_example(tmp_path: Path) -> None:
    """The README's example node (one Vega10 GPU, KFD capture in testdata/topology-parsing)."""
    case = LABELS["readme_example"]
    node = build_node(case["tree"], tmp_path)
    for kfd in case["drop_nodes"]:
        shutil.rmtree(node.root / KFD / "nodes" / str(kfd))
    labels = amd_labels(AmdBackend(str(node.root)).discover())
    family = "beta.amd.com/gpu.family.AI"
    assert {k: labels.get(k) for k in case["labels"] if k != family} == {
        k: v for k, v in case["labels"].items() if k != family
    }


@cites("cmd/k8s-node-labeller/README.md")
@pytest.mark.deliberate("amd-family-needs-gfx-target")
def test_family_needs_the_kfd_gfx_target(tmp_path: Path) -> None:
    """ROCm asks libdrm for the family; kubegpu reads KFD's gfx_target_version, which this
    old capture (kernel before 5.x) lacks, so no family label is written for it."""
    case = LABELS["readme_example"]
    node = build_node(case["tree"], tmp_path)
    labels = amd_labels(AmdBackend(str(node.root)).discover())
    assert not any(".family" in k for k in labels)


@cites("internal/pkg/allocator/besteffort_policy_test.go")
def test_cpx_node_partition_labels_and_counts(tmp_path: Path) -> None:
    """MI300X in CPX/NPS1 (topo-mi300-cpx): partitions count for the KFD kinds, only PCI
    functions for the PCI ones, and the node-wide partition mode label."""
    node = build_node("topo-mi300-cpx", tmp_path, partition_mode=("CPX", "NPS1"))
    labels = amd_labels(AmdBackend(str(node.root)).discover())
    assert labels["amd.com/gpu.compute-memory-partition"] == "cpx_nps1"
    assert labels["amd.com/gpu.compute-partitioning-supported"] == "true"
    assert labels["amd.com/gpu.memory-partitioning-supported"] == "true"
    assert labels["beta.amd.com/gpu.simd-count.152"] == "63"
    assert labels["amd.com/gpu.cu-count"] == "38"
    assert labels["beta.amd.com/gpu.device-id.74a1"] == "8"
    assert labels["amd.com/gpu.product-name"] == "AMD_Instinct_MI300X"
    assert labels["amd.com/gpu.family"] == "AI"
    assert "amd.com/gpu.vram" not in labels, "the tree has no mem_banks: ROCm writes none"


@cites("cmd/k8s-node-labeller/main_test.go")
@pytest.mark.parametrize("index", [0, 1])
def test_rocm_labels_left_by_its_labeller_are_replaced(index: int) -> None:
    """TestRemoveOldNodeLabels: ROCm's own labels go; everything else stays."""
    case = LABELS["remove_old"][index]
    sink = NodePatchSink(api=None, node_name="n")  # type: ignore[arg-type]
    patch = sink.patch_for({"labels": case["before"]}, {})
    removed = {k for k, v in patch.get("metadata", {}).get("labels", {}).items() if v is None}
    assert {k: v for k, v in case["before"].items() if k not in removed} == case["after"]


@cites("helm/amd-gpu/templates/labeller.yaml")
@pytest.mark.deliberate("amd-all-label-kinds")
def test_every_label_kind_without_flags(tmp_path: Path) -> None:
    """ROCm's chart runs the labeller with `-vram -cu-count -simd-count -device-id -family`;
    kubegpu writes the other kinds too (driver version, partitioning) with no flag."""
    node = build_node("topo-mi300-cpx", tmp_path, partition_mode=("cpx", "nps1"))
    labels = amd_labels(AmdBackend(str(node.root)).discover())
    written = {k.removeprefix(f"{PREFIX}/gpu.") for k in labels if k.startswith(f"{PREFIX}/")}
    assert written == set(KINDS) - {"firmware", "vram"}, "firmware is beta-only; no mem_banks"


@cites("cmd/k8s-node-labeller/main_test.go")
def test_kubegpu_labels_on_an_amd_node(tmp_path: Path) -> None:
    """`kubegpu labels --oneshot` with BACKEND=amd writes ROCm's labels for the node."""
    from kubegpu.cli.labels import labels_main

    case = LABELS["mi210"]
    node = build_node(case["tree"], tmp_path, product_name=case["product_name"])
    out = tmp_path / "features"
    argv = ["--oneshot", "-o", str(out), "--no-timestamp", "--sysfs-root", str(node.root)]
    env = {"BACKEND": "amd", "GFD_MACHINE_TYPE_FILE": str(tmp_path / "none")}
    assert labels_main(argv, environ=env) == 0
    written = dict(line.split("=", 1) for line in out.read_text().splitlines())
    assert {k: written.get(k) for k in case["labels"]} == case["labels"]
    assert not any(k.startswith("nvidia.com/gpu.product") for k in written)
