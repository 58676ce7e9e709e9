"""AmdBackend against checked-in sysfs fixture trees."""

from __future__ import annotations

import dataclasses
import shutil
import threading
from pathlib import Path

import pytest

from kubegpu.config import parse_config
from kubegpu.devices import open_backend
from kubegpu.devices.amd import AmdBackend, marketing_name
from kubegpu.devices.model import (
    AmdInfo,
    AmdNode,
    Gpu,
    HealthEvent,
    HealthEventKind,
    Inventory,
    Link,
    LinkKind,
    Vendor,
)
from kubegpu.devices.stop import Stop
from kubegpu.errors import InitError
from kubegpu.labels_amd import amd_labels, counted, family, product_label, vram_label
from kubegpu.placement import amd_pair_weight
from kubegpu.resources import build_resources
from tests.waiting import WAIT

FIXTURES = Path(__file__).parents[2] / "fixtures"
MI250 = FIXTURES / "amd-mi250"
RADEON = FIXTURES / "amd-radeon"


def test_present() -> None:
    assert AmdBackend.present(str(MI250))
    assert not AmdBackend.present(str(FIXTURES / "pci-none"))


def test_absent_kfd_is_an_init_error(tmp_path: Path) -> None:
    with pytest.raises(InitError, match="no AMD KFD topology"):
        AmdBackend(root=str(tmp_path))
    with pytest.raises(InitError, match="no AMD KFD topology"):
        open_backend("amd", sysfs_root=str(tmp_path))


def test_kfd_without_gpus(tmp_path: Path) -> None:
    node = tmp_path / "sys/class/kfd/kfd/topology/nodes/0"
    node.mkdir(parents=True)
    (node / "gpu_id").write_text("0\n")
    with pytest.raises(InitError, match="no AMD GPU"):
        AmdBackend(root=str(tmp_path)).discover()


def test_mi250_node() -> None:
    inv = AmdBackend(root=str(MI250)).discover()
    assert inv.backend == "amd"
    assert inv.driver_version == "6.7.0"
    assert inv.control_device_paths == ("/dev/kfd",)
    zero, one = inv.gpus
    assert zero.vendor is Vendor.AMD
    # ROCm's device ID: the PCI address (the old `AMD-<unique_id>` collided for partitions).
    assert zero.uuid == "0000:c1:00.0"
    assert (zero.index, one.index) == (0, 1)
    assert zero.product == "AMD Instinct MI250X"
    assert zero.brand == "Instinct"
    assert zero.memory_mib == 65520
    assert zero.pci_bus_id == "0000:c1:00.0"
    assert (zero.numa_node, one.numa_node) == (0, 1)
    assert zero.minor == 128
    assert zero.device_paths == ("/dev/dri/card0", "/dev/dri/renderD128")
    assert one.device_paths == ("/dev/dri/card1", "/dev/dri/renderD129")
    assert zero.compute_capability == (9, 0)
    assert zero.links == (zero.link_to(one.uuid),)
    link = zero.link_to(one.uuid)
    assert link is not None and link.kind is LinkKind.NVLINK and link.count == 1


def test_radeon_fallbacks_and_non_amd_cards_skipped() -> None:
    inv = AmdBackend(root=str(RADEON)).discover()
    (gpu,) = inv.gpus
    assert gpu.uuid == "0000:03:00.0", "the PCI address identifies it, as in ROCm's plugin"
    assert gpu.product == "AMD Radeon RX 7900 XTX", "from the device-id table"
    assert gpu.brand == "Radeon"
    assert gpu.numa_node is None
    assert gpu.compute_capability == (11, 0)
    assert gpu.device_paths == ("/dev/dri/card1", "/dev/dri/renderD129")
    assert inv.control_device_paths == ()
    assert inv.driver_version == ""


def test_bus_id_from_kfd_location_when_no_card(tmp_path: Path) -> None:
    shutil.copytree(RADEON, tmp_path, dirs_exist_ok=True)
    shutil.rmtree(tmp_path / "sys/class/drm/card1")
    (gpu,) = AmdBackend(root=str(tmp_path)).discover().gpus
    assert gpu.pci_bus_id == "0000:03:00.0"
    assert gpu.device_paths == ("/dev/dri/renderD129",)
    assert gpu.product == "AMD Radeon RX 7900 XTX"


def test_factory_auto_falls_back_to_amd(monkeypatch: pytest.MonkeyPatch) -> None:
    import kubegpu.devices.nvml as nvml

    def no_nvidia(**_: object) -> nvml.NvmlBackend:
        raise InitError("no NVIDIA")

    monkeypatch.setattr(nvml.NvmlBackend, "open", staticmethod(no_nvidia))
    assert open_backend("auto", sysfs_root=str(MI250)).name == "amd"


def test_probe_and_watch_notice_a_lost_gpu(tmp_path: Path) -> None:
    shutil.copytree(MI250, tmp_path, dirs_exist_ok=True)
    backend = AmdBackend(root=str(tmp_path), poll_seconds=0.01)
    zero, one = backend.discover().gpus
    assert backend.probe(zero.uuid) is None
    assert "not an AMD GPU" in (backend.probe("AMD-nope") or "")
    events: list[HealthEvent] = []
    seen = threading.Event()

    def emit(event: HealthEvent) -> None:
        events.append(event)
        seen.set()

    stop = Stop()
    thread = threading.Thread(target=backend.watch, args=(stop, emit))
    thread.start()
    try:
        shutil.rmtree(tmp_path / "sys/class/drm/card1/device")
        assert seen.wait(WAIT)
    finally:
        stop.set()
        thread.join(WAIT)
    assert "is gone" in (backend.probe(one.uuid) or "")
    assert [(e.uuid, e.kind) for e in events] == [(one.uuid, HealthEventKind.PROBE_FAILED)]


# --- ROCm-style labels (kubegpu.labels_amd) ---------------------------------------------


@pytest.mark.parametrize(
    ("target", "name"),
    [
        (90010, "AI"),  # MI210 gfx90a
        (90402, "AI"),  # MI300X gfx942
        (90012, "RV"),  # Renoir APU gfx90c
        (100300, "NV"),  # Navi 21 gfx1030
        (100305, "YC"),
        (110000, "GC_11_0_0"),  # Navi 31 gfx1100
        (110003, "GC_11_0_1"),  # Phoenix APU
        (110501, "GC_11_5_0"),
        (120001, "GC_12_0_0"),
        (80003, "VI"),
        (0, None),
    ],
)
def test_family_from_gfx_target(target: int, name: str | None) -> None:
    assert family(target) == name


def test_value_formats() -> None:
    assert product_label(" AMD Instinct MI300X (OAM) ") == "AMD_Instinct_MI300X_OAM"
    assert vram_label(17163091968) == "16G"  # 16368 MiB
    assert vram_label(206141652992) == "192G"
    assert vram_label(1024 * 1024 * 1535 + 1048575) == "1G", "whole MiB first, then GiB rounded"
    assert vram_label(1024 * 1024 * 2560) == "3G", "halves round up, as Go's math.Round"


def test_several_values_are_counted_under_both_prefixes() -> None:
    labels = counted("vram", ["64G", "64G", "192G"])
    assert labels == {
        "beta.amd.com/gpu.vram.64G": "2",
        "beta.amd.com/gpu.vram.192G": "1",
        "amd.com/gpu.vram.64G": "2",
        "amd.com/gpu.vram.192G": "1",
    }


def _amd_gpu(index: int, **info: object) -> Gpu:
    base = {"kfd_node": index + 1, "pci_group": f"0000:{index:02x}:00:0"}
    return Gpu(
        index=index,
        uuid=f"0000:{index:02x}:00.0",
        minor=128 + index,
        product="AMD Instinct MI210",
        memory_mib=0,
        pci_bus_id=f"0000:{index:02x}:00.0",
        numa_node=0,
        compute_capability=(9, 0),
        vendor=Vendor.AMD,
        amd=AmdInfo(**(base | info)),  # type: ignore[arg-type]
    )


def test_mixed_partition_modes_write_no_partition_label() -> None:
    inv = Inventory(
        gpus=(
            _amd_gpu(
                0,
                compute_partition="cpx",
                memory_partition="nps1",
                marketing_name="AMD Instinct MI210",
            ),
            _amd_gpu(1, compute_partition="spx", memory_partition="nps1"),
        ),
        amd=AmdNode(compute_partitioning_supported=True),
    )
    labels = amd_labels(inv)
    assert "amd.com/gpu.compute-memory-partition" not in labels
    assert labels["amd.com/gpu.compute-partitioning-supported"] == "true"
    assert labels["amd.com/gpu.memory-partitioning-supported"] == "false"
    assert labels["amd.com/gpu.product-name"] == "AMD_Instinct_MI210", "marketing name"


def test_no_amd_gpus_no_amd_labels() -> None:
    assert amd_labels(Inventory(gpus=())) == {}


def test_unknown_board_has_no_product_label() -> None:
    gpu = dataclasses.replace(_amd_gpu(0, device_id=0x1234), product="AMD GPU 0x1234")
    assert marketing_name(0x1234, None) == ""
    labels = amd_labels(Inventory(gpus=(gpu,)))
    assert not any("product-name" in k for k in labels)
    assert labels["amd.com/gpu.device-id"] == "1234"


# --- ROCm's pair weights (kubegpu.placement) -------------------------------------------


def test_pair_weight_terms() -> None:
    a, b = _amd_gpu(0), _amd_gpu(1)
    xgmi = dataclasses.replace(a, links=(Link(b.uuid, LinkKind.NVLINK, 1, iolink_type=11),))
    pcie = dataclasses.replace(a, links=(Link(b.uuid, LinkKind.SAME_NUMA, iolink_type=2),))
    assert amd_pair_weight(xgmi, b) == 20 + 10 + 10
    assert amd_pair_weight(pcie, b) == 20 + 40 + 10
    # No KFD link: counted as "other", never better than a listed link.
    assert amd_pair_weight(a, dataclasses.replace(b, numa_node=1)) == 20 + 50 + 20
    same = dataclasses.replace(b, amd=dataclasses.replace(b.amd, pci_group=a.amd.pci_group))  # type: ignore[type-var,union-attr]
    assert amd_pair_weight(xgmi, same) == 10 + 10 + 10


def test_marketing_names_from_libdrms_table(tmp_path: Path) -> None:
    """Radeon boards have no product_name file: the name comes from amdgpu.ids by revision."""
    assert marketing_name(0x744C, 0xCC) == "AMD Radeon RX 7900 XT"
    assert marketing_name(0x744C, 0x01, exact=True) == "", "libdrm matches the revision exactly"
    assert marketing_name(0x744C, None) == "AMD Radeon RX 7900 XTX"
    shutil.copytree(RADEON, tmp_path, dirs_exist_ok=True)
    (tmp_path / "sys/class/drm/card1/device/revision").write_text("0xcc\n")
    (gpu,) = AmdBackend(root=str(tmp_path)).discover().gpus
    assert gpu.product == "AMD Radeon RX 7900 XT"
    labels = amd_labels(Inventory(gpus=(gpu,)))
    assert labels["amd.com/gpu.product-name"] == "AMD_Radeon_RX_7900_XT"


# -- ROCm's resource naming strategy (docs/user-guide/configuration.md, "Resource Naming
# Strategy", at ROCm/k8s-device-plugin ed7646843003: the examples below are its own) ----


def _partitioned(gpus: int, compute: str, memory: str, per_gpu: int, first: int = 0) -> list[Gpu]:
    """`gpus` GPUs in one mode, `per_gpu` devices each (a CPX MI300X is 8)."""
    out: list[Gpu] = []
    for g in range(first, first + gpus):
        gpu = _amd_gpu(g, compute_partition=compute, memory_partition=memory)
        for p in range(per_gpu):
            index = len(out) + first * per_gpu
            out.append(dataclasses.replace(gpu, index=index, uuid=f"{gpu.uuid}/{p}"))
    return out


def _named(gpus: list[Gpu], strategy: str | None, extra: str = "") -> dict[str, int]:
    text = "version: v1\n" + extra
    if strategy is not None:
        text += f"flags:\n  plugin:\n    amdResourceNamingStrategy: {strategy}\n"
    specs = build_resources(Inventory(gpus=tuple(gpus)), parse_config(text))
    return {s.name: len(s.devices) for s in specs}


@pytest.mark.parametrize("strategy", [None, "single", "mixed"])
def test_unpartitioned_gpus_are_amd_gpu_whatever_the_strategy(strategy: str | None) -> None:
    # "If a node has GPUs which do not support partitioning, such as MI210, then the GPUs
    # are reported under resource name amd.com/gpu regardless of the resource naming
    # strategy."
    assert _named([_amd_gpu(i) for i in range(8)], strategy) == {"amd.com/gpu": 8}


def test_a_homogeneous_node_is_one_resource_named_by_strategy() -> None:
    # "A node which has 8 GPUs where all GPUs are partitioned using CPX-NPS4 style will
    # report its resources as: amd.com/gpu: 64" (single) / "amd.com/cpx_nps4: 64" (mixed).
    node = _partitioned(8, "cpx", "nps4", 8)
    assert _named(node, None) == {"amd.com/gpu": 64}
    assert _named(node, "single") == {"amd.com/gpu": 64}
    assert _named(node, "mixed") == {"amd.com/cpx_nps4": 64}


def test_a_heterogeneous_node_under_mixed_is_a_resource_per_mode() -> None:
    # "A node which has 8 GPUs where 5 GPU's are following SPX-NPS1 and 3 GPU's are
    # following CPX-NPS1 will report its resources as: amd.com/spx_nps1: 5,
    # amd.com/cpx_nps1: 24".
    node = _partitioned(5, "spx", "nps1", 1) + _partitioned(3, "cpx", "nps1", 8, first=5)
    assert _named(node, "mixed") == {"amd.com/spx_nps1": 5, "amd.com/cpx_nps1": 24}
    # ROCm's single refuses such a node; kubegpu keeps advertising it as amd.com/gpu
    # (docs/migrating-from-rocm.md).
    assert _named(node, "single") == {"amd.com/gpu": 29}


def test_mixed_keeps_renamed_gpus_and_names_unpartitioned_ones_amd_gpu() -> None:
    node = _partitioned(1, "spx", "nps1", 1) + _partitioned(1, "cpx", "nps1", 2, first=1)
    node.append(_amd_gpu(5))  # no mode beside two modes: amd.com/gpu, as ROCm names an MI210
    assert _named(node, "mixed") == {"amd.com/spx_nps1": 1, "amd.com/cpx_nps1": 2, "amd.com/gpu": 1}
    # One mode beside a device without one: all under that mode, as ROCm's homogeneous node.
    assert _named(node[1:], "mixed") == {"amd.com/cpx_nps1": 3}
    # A mode sysfs should never say cannot name a resource: that device has no mode.
    odd = _partitioned(1, "c px", "nps1", 1, first=7)
    assert _named(odd + node[:3], "mixed") == {
        "amd.com/gpu": 1,
        "amd.com/spx_nps1": 1,
        "amd.com/cpx_nps1": 2,
    }
    renamed = "resources:\n  gpus:\n  - pattern: '*MI210*'\n    name: amd.com/instinct\n"
    assert _named(node, "mixed", renamed) == {"amd.com/instinct": 4}


def test_the_strategy_is_a_serve_flag_with_rocms_spelling_too() -> None:
    from kubegpu.cli.options import parse
    from kubegpu.cli.serve import SERVE_KEYS, serve

    for argv in (
        ["-resource_naming_strategy=mixed"],
        ["--resource_naming_strategy", "mixed"],
        ["--resource-naming-strategy=mixed"],
    ):
        assert parse(serve, argv, {})["resource_naming_strategy"] == "mixed"
    assert (
        parse(serve, [], {"RESOURCE_NAMING_STRATEGY": "mixed"})["resource_naming_strategy"]
        == "mixed"
    )
    assert SERVE_KEYS["resource_naming_strategy"] == "flags.plugin.amdResourceNamingStrategy"
