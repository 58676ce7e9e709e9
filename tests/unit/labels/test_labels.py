"""GFD-compatible node labels from hand-built inventories."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from kubegpu.config import parse_config
from kubegpu.config.v1 import Config
from kubegpu.devices.model import Gpu, Inventory, MigDevice, Vendor
from kubegpu.devices.pci import read_bus
from kubegpu.labels import family, gpu_labels, gpu_mode, sanitise
from tests.unit.dra.conftest import bodies

FIXTURES = Path(__file__).parents[2] / "fixtures"


def gpu(index: int = 0, product: str = "Tesla T4", **kw: object) -> Gpu:
    args: dict[str, object] = {
        "index": index,
        "uuid": f"GPU-{index:04d}",
        "minor": index,
        "product": product,
        "memory_mib": 15360,
        "pci_bus_id": f"0000:{0x17 + index:02x}:00.0",
        "numa_node": 0,
        "compute_capability": (7, 5),
        "brand": "Tesla",
    }
    args.update(kw)
    return Gpu(**args)  # type: ignore[arg-type]


def mig(parent: int, gi: int, profile: str = "1g.5gb", memory: int = 4864) -> MigDevice:
    return MigDevice(
        uuid=f"MIG-{parent}-{gi}",
        parent_uuid=f"GPU-{parent:04d}",
        parent_index=parent,
        gi_id=gi,
        ci_id=0,
        profile=profile,
        memory_mib=memory,
        multiprocessors=14,
        attributes={"engines.copy": 1, "engines.jpeg": 0, "engines.decoder": 0},
    )


def a100(index: int, *migs: MigDevice) -> Gpu:
    return gpu(
        index,
        "NVIDIA A100-SXM4-40GB",
        memory_mib=40960,
        compute_capability=(8, 0),
        mig_capable=True,
        mig_enabled=bool(migs),
        mig_devices=migs,
        brand="NVIDIA",
    )


def inv(*gpus: Gpu) -> Inventory:
    return Inventory(gpus=gpus, driver_version="550.54.15", cuda_driver_version=(12, 4))


def cfg(text: str = "version: v1") -> Config:
    return parse_config(text)


TIME_SLICING_20 = """
version: v1
sharing:
  timeSlicing:
    failRequestsGreaterThanOne: true
    resources:
    - name: nvidia.com/gpu
      replicas: 20
"""


def test_t4_node_has_every_gfd_label_with_gfd_formats() -> None:
    labels = gpu_labels(inv(gpu()), cfg(), machine_type="g4dn.xlarge", timestamp=1700000000)
    assert labels == {
        "nvidia.com/gpu.present": "true",
        "nvidia.com/gpu.machine": "g4dn.xlarge",
        "nvidia.com/gpu.product": "Tesla-T4",
        "nvidia.com/gpu.count": "1",
        "nvidia.com/gpu.replicas": "1",
        "nvidia.com/gpu.sharing-strategy": "none",
        "nvidia.com/gpu.memory": "15360",
        "nvidia.com/gpu.family": "turing",
        "nvidia.com/gpu.compute.major": "7",
        "nvidia.com/gpu.compute.minor": "5",
        "nvidia.com/gpu.mode": "compute",
        "nvidia.com/cuda.driver-version.major": "550",
        "nvidia.com/cuda.driver-version.minor": "54",
        "nvidia.com/cuda.driver-version.revision": "15",
        "nvidia.com/cuda.driver-version.full": "550.54.15",
        "nvidia.com/cuda.driver.major": "550",
        "nvidia.com/cuda.driver.minor": "54",
        "nvidia.com/cuda.driver.rev": "15",
        "nvidia.com/cuda.runtime-version.major": "12",
        "nvidia.com/cuda.runtime-version.minor": "4",
        "nvidia.com/cuda.runtime-version.full": "12.4",
        "nvidia.com/cuda.runtime.major": "12",
        "nvidia.com/cuda.runtime.minor": "4",
        "nvidia.com/mig.capable": "false",
        "nvidia.com/mps.capable": "false",
        "nvidia.com/gfd.timestamp": "1700000000",
    }


def test_no_timestamp_and_no_machine_type_leave_their_labels_out() -> None:
    labels = gpu_labels(inv(gpu()), cfg(), machine_type=None, timestamp=None)
    assert "nvidia.com/gfd.timestamp" not in labels
    assert "nvidia.com/gpu.machine" not in labels


def test_machine_type_spaces_become_dashes() -> None:
    labels = gpu_labels(inv(gpu()), cfg(), machine_type=" PowerEdge R750xa \n", timestamp=None)
    assert labels["nvidia.com/gpu.machine"] == "PowerEdge-R750xa"


def test_seed_003_time_slicing_marks_product_shared_with_20_replicas() -> None:
    a10g = gpu(product="NVIDIA A10G", compute_capability=(8, 6), memory_mib=23028)
    labels = gpu_labels(inv(a10g), cfg(TIME_SLICING_20), machine_type=None, timestamp=None)
    assert labels["nvidia.com/gpu.product"] == "NVIDIA-A10G-SHARED"
    assert labels["nvidia.com/gpu.replicas"] == "20"
    assert labels["nvidia.com/gpu.sharing-strategy"] == "time-slicing"
    assert labels["nvidia.com/gpu.count"] == "1"
    assert labels["nvidia.com/gpu.family"] == "ampere"


def test_renamed_shared_resource_keeps_plain_product() -> None:
    text = TIME_SLICING_20.replace(
        "replicas: 20", "replicas: 4\n      rename: nvidia.com/gpu.shared"
    )
    labels = gpu_labels(inv(gpu()), cfg(text), machine_type=None, timestamp=None)
    assert labels["nvidia.com/gpu.product"] == "Tesla-T4"
    assert labels["nvidia.com/gpu.replicas"] == "4"


def test_mps_sharing_sets_strategy_and_mps_capable() -> None:
    text = TIME_SLICING_20.replace("timeSlicing", "mps").replace(
        "    failRequestsGreaterThanOne: true\n", ""
    )
    text += "flags:\n  mpsRoot: /run/nvidia/mps\n"
    labels = gpu_labels(inv(gpu()), cfg(text), machine_type=None, timestamp=None)
    assert labels["nvidia.com/gpu.sharing-strategy"] == "mps"
    assert labels["nvidia.com/mps.capable"] == "true"
    assert labels["nvidia.com/gpu.product"] == "Tesla-T4-SHARED"


def test_sharing_limited_to_other_devices_is_not_shared() -> None:
    text = TIME_SLICING_20 + "      devices: [GPU-99999999-9999-4999-8999-999999999999]\n"
    labels = gpu_labels(inv(gpu()), cfg(text), machine_type=None, timestamp=None)
    assert labels["nvidia.com/gpu.replicas"] == "1"
    assert labels["nvidia.com/gpu.product"] == "Tesla-T4"


@pytest.mark.parametrize(
    ("cc", "name"),
    [
        ((3, 7), "kepler"),
        ((5, 2), "maxwell"),
        ((6, 0), "pascal"),
        ((7, 0), "volta"),
        ((7, 2), "volta"),
        ((7, 5), "turing"),
        ((8, 0), "ampere"),
        ((8, 6), "ampere"),
        ((8, 7), "ampere"),
        ((8, 9), "ada-lovelace"),
        ((9, 0), "hopper"),
        ((10, 0), "blackwell"),
        ((12, 0), "blackwell"),
        ((4, 0), "undefined"),
        ((11, 0), "undefined"),
        ((13, 0), "rubin"),
    ],
)
def test_family_from_compute_capability(cc: tuple[int, int], name: str) -> None:
    assert family(*cc) == name


def test_product_is_sanitised_like_gfd() -> None:
    assert sanitise("NVIDIA H100 80GB HBM3") == "NVIDIA-H100-80GB-HBM3"
    assert sanitise("Quadro RTX 6000/8000 (rev a1)") == "Quadro-RTX-60008000-rev-a1"


def test_mode_uses_pci_class_when_known_else_brand() -> None:
    t4 = gpu()
    assert gpu_mode([t4], {t4.pci_bus_id: "0x030000"}) == "graphics"
    assert gpu_mode([t4], {t4.pci_bus_id: "0x030200"}) == "compute"
    assert gpu_mode([gpu(product="NVIDIA GeForce RTX 4090", brand="GeForce")]) == "graphics"
    assert gpu_mode([gpu(product="NVIDIA H100 80GB HBM3", brand="NVIDIA")]) == "compute"
    assert gpu_mode([gpu(product="Mystery", brand="")]) == "unknown"


def test_mixed_models_label_the_most_common_one() -> None:
    node = inv(gpu(0, "Tesla V100"), gpu(1, "Tesla T4"), gpu(2, "Tesla T4"))
    labels = gpu_labels(node, cfg(), machine_type=None, timestamp=None)
    assert labels["nvidia.com/gpu.product"] == "Tesla-T4"
    assert labels["nvidia.com/gpu.count"] == "2"


def test_no_gpus_only_present_and_timestamp() -> None:
    # GFD writes gpu.machine only with its device labels, i.e. when it found GPUs.
    labels = gpu_labels(Inventory(gpus=()), cfg(), machine_type="m", timestamp=5, present=True)
    assert labels == {
        "nvidia.com/gpu.present": "true",
        "nvidia.com/gfd.timestamp": "5",
    }
    assert "nvidia.com/gpu.present" not in gpu_labels(
        Inventory(gpus=()), cfg(), machine_type=None, timestamp=None
    )


def test_readable_gpus_are_present_even_if_the_pci_scan_says_no() -> None:
    labels = gpu_labels(inv(gpu()), cfg(), machine_type=None, timestamp=None, present=False)
    assert labels["nvidia.com/gpu.present"] == "true"


def test_amd_gpus_are_not_labelled_as_nvidia() -> None:
    labels = gpu_labels(
        Inventory(gpus=(gpu(vendor=Vendor.AMD),)), cfg(), machine_type=None, timestamp=None
    )
    assert labels == {}


def test_unparseable_versions_are_left_out() -> None:
    node = Inventory(gpus=(gpu(),), driver_version="", cuda_driver_version=(0, 0))
    labels = gpu_labels(node, cfg(), machine_type=None, timestamp=None)
    assert not any(k.startswith("nvidia.com/cuda.") for k in labels)
    two_part = Inventory(gpus=(gpu(),), driver_version="535.104")
    labels = gpu_labels(two_part, cfg(), machine_type=None, timestamp=None)
    assert labels["nvidia.com/cuda.driver-version.revision"] == ""


MIG_SINGLE = "version: v1\nflags:\n  migStrategy: single\n"
MIG_MIXED = "version: v1\nflags:\n  migStrategy: mixed\n"


def test_mig_single_labels_describe_the_slice() -> None:
    node = inv(a100(0, mig(0, 1), mig(0, 2)), a100(1, mig(1, 1)))
    labels = gpu_labels(node, cfg(MIG_SINGLE), machine_type=None, timestamp=None)
    assert labels["nvidia.com/mig.strategy"] == "single"
    assert labels["nvidia.com/mig.capable"] == "true"
    assert labels["nvidia.com/gpu.product"] == "NVIDIA-A100-SXM4-40GB-MIG-1g.5gb"
    assert labels["nvidia.com/gpu.count"] == "3"
    assert labels["nvidia.com/gpu.replicas"] == "1"
    assert labels["nvidia.com/gpu.memory"] == "4864"
    assert labels["nvidia.com/gpu.multiprocessors"] == "14"
    assert labels["nvidia.com/gpu.slices.gi"] == "1"
    assert labels["nvidia.com/gpu.slices.ci"] == "1"
    assert labels["nvidia.com/gpu.engines.copy"] == "1"
    assert labels["nvidia.com/gpu.engines.ofa"] == "0"
    assert labels["nvidia.com/gpu.family"] == "ampere"
    assert labels["nvidia.com/mps.capable"] == "false"


def test_mig_single_with_two_profiles_is_invalid() -> None:
    node = inv(a100(0, mig(0, 1)), a100(1, mig(1, 1, "3g.20gb", 19968)))
    labels = gpu_labels(node, cfg(MIG_SINGLE), machine_type=None, timestamp=None)
    assert labels["nvidia.com/gpu.product"] == "NVIDIA-A100-SXM4-40GB-MIG-INVALID"
    assert labels["nvidia.com/gpu.count"] == "0"
    assert labels["nvidia.com/gpu.memory"] == "0"


def test_mig_single_with_mig_and_full_gpus_is_invalid() -> None:
    node = inv(a100(0, mig(0, 1)), a100(1))
    labels = gpu_labels(node, cfg(MIG_SINGLE), machine_type=None, timestamp=None)
    assert labels["nvidia.com/gpu.product"].endswith("-MIG-INVALID")


def test_mig_mixed_labels_each_profile_and_keeps_full_gpu_labels() -> None:
    node = inv(a100(0, mig(0, 1), mig(0, 2, "3g.20gb", 19968)), a100(1, mig(1, 1)))
    labels = gpu_labels(node, cfg(MIG_MIXED), machine_type=None, timestamp=None)
    assert labels["nvidia.com/mig.strategy"] == "mixed"
    assert labels["nvidia.com/gpu.product"] == "NVIDIA-A100-SXM4-40GB"
    assert labels["nvidia.com/gpu.count"] == "2"
    # MIG-enabled full GPUs cannot be shared: GFD writes replicas=0 for them.
    assert labels["nvidia.com/gpu.replicas"] == "0"
    assert labels["nvidia.com/mig-1g.5gb.count"] == "2"
    assert labels["nvidia.com/mig-1g.5gb.product"] == "NVIDIA-A100-SXM4-40GB-MIG-1g.5gb"
    assert labels["nvidia.com/mig-1g.5gb.memory"] == "4864"
    assert labels["nvidia.com/mig-3g.20gb.count"] == "1"
    assert labels["nvidia.com/mig-3g.20gb.slices.gi"] == "3"
    assert labels["nvidia.com/mig-3g.20gb.memory"] == "19968"
    assert labels["nvidia.com/mig-3g.20gb.sharing-strategy"] == "none"


def test_mig_mixed_shared_profile() -> None:
    text = MIG_MIXED + (
        "sharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/mig-1g.5gb\n"
        "      replicas: 2\n"
    )
    node = inv(a100(0, mig(0, 1)))
    labels = gpu_labels(node, cfg(text), machine_type=None, timestamp=None)
    assert labels["nvidia.com/mig-1g.5gb.replicas"] == "2"
    assert labels["nvidia.com/mig-1g.5gb.product"].endswith("-MIG-1g.5gb-SHARED")
    assert labels["nvidia.com/mig-1g.5gb.sharing-strategy"] == "time-slicing"


def test_mig_strategy_none_adds_no_mig_labels() -> None:
    labels = gpu_labels(inv(a100(0, mig(0, 1))), cfg(), machine_type=None, timestamp=None)
    assert "nvidia.com/mig.strategy" not in labels
    assert not any(k.startswith("nvidia.com/mig-") for k in labels)


def test_pci_class_feeds_gpu_mode() -> None:
    t4 = gpu(pci_bus_id="0000:17:00.0")
    labels = gpu_labels(
        inv(t4),
        cfg(),
        machine_type=None,
        timestamp=None,
        pci_classes=read_bus(str(FIXTURES / "pci-nvidia")).classes,
    )
    assert labels["nvidia.com/gpu.mode"] == "graphics"


def test_a_bare_resource_name_in_the_sharing_config_means_nvidia_com() -> None:
    text = TIME_SLICING_20.replace("name: nvidia.com/gpu", "name: gpu")
    labels = gpu_labels(inv(gpu()), cfg(text), machine_type=None, timestamp=None)
    assert labels["nvidia.com/gpu.replicas"] == "20"
    assert labels["nvidia.com/gpu.product"].endswith("-SHARED")


def test_rename_by_default_keeps_the_plain_product_name() -> None:
    text = TIME_SLICING_20.replace("timeSlicing:\n", "timeSlicing:\n    renameByDefault: true\n")
    assert "renameByDefault" in text
    labels = gpu_labels(inv(gpu()), cfg(text), machine_type=None, timestamp=None)
    assert labels["nvidia.com/gpu.replicas"] == "20"
    assert not labels["nvidia.com/gpu.product"].endswith("-SHARED")


_SHARE = """version: v1
flags:
  migStrategy: {strategy}
  mpsRoot: /run/nvidia/mps
sharing:
  {kind}:
    renameByDefault: {by_default}
    resources:
    - name: {name}
      replicas: 4
{rename}"""


@pytest.mark.parametrize("kind", ["timeSlicing", "mps"])
@pytest.mark.parametrize("name", ["nvidia.com/gpu", "gpu"])
@pytest.mark.parametrize(
    ("by_default", "rename"),
    [("false", ""), ("true", ""), ("false", "      rename: nvidia.com/gpu.shared\n")],
)
def test_labels_say_what_serve_advertises(
    kind: str, name: str, by_default: str, rename: str
) -> None:
    """Issue 8: the replicas and -SHARED labels must match `build_resources` (what serve
    registers) for the same node and config."""
    from kubegpu.resources import build_resources

    node = inv(gpu(0), gpu(1))
    config = cfg(
        _SHARE.format(strategy="none", kind=kind, name=name, by_default=by_default, rename=rename)
    )
    labels = gpu_labels(node, config, machine_type=None, timestamp=None)
    (spec,) = build_resources(node, config)
    assert labels["nvidia.com/gpu.replicas"] == str(spec.replicas)
    renamed = spec.name != "nvidia.com/gpu"
    assert labels["nvidia.com/gpu.product"].endswith("-SHARED") == (
        spec.replicas > 1 and not renamed
    )
    assert labels["nvidia.com/gpu.sharing-strategy"] == ("mps" if kind == "mps" else "time-slicing")


def _config_space(caps: dict[int, bytes], first: int, status: int = 0x10) -> bytes:
    space = bytearray(256)
    space[0:2] = b"\xde\x10"
    space[0x06] = status
    space[0x34] = first
    for pos, cap in caps.items():
        space[pos : pos + len(cap)] = cap
    return bytes(space)


def test_vendor_capability_survives_bad_chains() -> None:
    from kubegpu.labels import vendor_capability

    looped = _config_space({0x40: b"\x05\x50\x00", 0x50: b"\x01\x40\x00"}, 0x40)
    assert vendor_capability(looped) is None  # 0x40 -> 0x50 -> 0x40: stops, no hang
    broken = _config_space({0x40: b"\xff\x50\x00"}, 0x40)
    assert vendor_capability(broken) is None
    no_list = _config_space({0x40: b"\x09\x00\x08"}, 0x40, status=0)
    assert vendor_capability(no_list) is None
    found = _config_space({0x40: b"\x05\x60\x00", 0x60: b"\x09\x00\x04\x00"}, 0x40)
    assert vendor_capability(found) == b"\x09\x00\x04\x00"
    assert vendor_capability(found[:64]) is None  # what an unprivileged read returns


# -- kubegpu's own labels: what holds a sized claim's limits ---------------------------------


def _sized(strategy: str, extra: str = "") -> Config:
    return cfg(
        f"version: v1\nflags: {{mpsRoot: /run/nvidia/mps{extra}}}\nsharing:\n  {strategy}:\n"
        "    resources:\n    - {name: gpu, replicas: 4, sizing: {}}\n"
    )


@pytest.mark.parametrize(
    ("strategy", "kernel", "memory", "compute"),
    [
        ("mps", False, "mps-pinned-memory", "mps-active-threads"),
        ("mps", True, "nvml-cgroup", "mps-active-threads"),
        ("timeSlicing", False, "none", "none"),
        ("timeSlicing", True, "nvml-cgroup", "none"),
    ],
)
def test_a_sized_node_labels_the_mechanisms_its_devices_publish(
    strategy: str, kernel: bool, memory: str, compute: str
) -> None:
    node = dataclasses.replace(inv(gpu(0), gpu(1)), memory_limits=kernel)
    config = _sized(strategy)
    labels = gpu_labels(node, config, machine_type=None, timestamp=None)
    assert labels["kubegpu.io/gpu.memory-limit"] == memory
    assert labels["kubegpu.io/gpu.compute-limit"] == compute
    # The same answer as the DRA devices' attributes (one function decides both).
    for body in bodies(node, config):
        assert body["attributes"]["kubegpu.io/memoryLimit"] == {"string": memory}
        assert body["attributes"]["kubegpu.io/computeLimit"] == {"string": compute}


@pytest.mark.parametrize("config", ["version: v1", TIME_SLICING_20])
def test_an_unsized_node_has_only_gfd_labels(config: str) -> None:
    node = dataclasses.replace(inv(gpu(0)), memory_limits=True)
    labels = gpu_labels(node, cfg(config), machine_type=None, timestamp=None)
    assert labels
    assert all(key.startswith("nvidia.com/") for key in labels)


def test_mig_slices_without_the_kernel_path_make_the_node_label_the_weakest() -> None:
    node = dataclasses.replace(inv(gpu(0), a100(1, mig(1, 1, "1g.10gb", 9984))), memory_limits=True)
    config = cfg(
        "version: v1\nflags: {migStrategy: mixed}\nsharing:\n  timeSlicing:\n    resources:\n"
        "    - {name: gpu, replicas: 2, sizing: {}}\n"
        "    - {name: nvidia.com/mig-1g.10gb, replicas: 2, sizing: {}}\n"
    )
    labels = gpu_labels(node, config, machine_type=None, timestamp=None)
    assert labels["kubegpu.io/gpu.memory-limit"] == "none"
