"""NVML discovery (devices/nvml/discovery.py) against the fake pynvml: GPUs, MIG slices."""

from __future__ import annotations

import logging
from pathlib import Path

import pynvml
import pytest

from kubegpu.devices.model import Health
from kubegpu.devices.nvml import (
    NvmlBackend,
)
from kubegpu.testing import FakeNvml
from tests.unit.devices.nvml.conftest import open_backend as _open

# -- discover -------------------------------------------------------------------------------


def test_discover_fills_the_model(fake: FakeNvml) -> None:
    fake.gpus[0].brand = pynvml.NVML_BRAND_TESLA
    inventory = _open(fake).discover()
    assert inventory.backend == "nvml"
    assert inventory.driver_version == "550.54.15"
    assert inventory.cuda_driver_version == (12, 4)
    first, second = inventory.gpus
    assert first.uuid == fake.gpus[0].uuid
    assert (first.index, first.minor, first.device_paths) == (0, 0, ("/dev/nvidia0",))
    assert first.product == "NVIDIA H100 80GB HBM3"
    assert first.memory_mib == 81559
    assert first.pci_bus_id == "0000:17:00.0"
    assert (first.numa_node, second.numa_node) == (0, 1)
    assert first.compute_capability == (9, 0)
    assert first.brand == "Tesla"
    assert first.health is Health.HEALTHY
    assert not first.mig_capable and not first.mig_enabled


def test_control_paths_only_those_that_exist(tmp_path: Path, fake: FakeNvml) -> None:
    (tmp_path / "dev").mkdir()
    (tmp_path / "dev/nvidiactl").touch()
    (tmp_path / "dev/nvidia-uvm").touch()
    backend = NvmlBackend.open(nvml=fake, dev_root=str(tmp_path))
    assert backend.discover().control_device_paths == ("/dev/nvidiactl", "/dev/nvidia-uvm")


def test_numa_from_sysfs_when_nvml_cannot_tell(tmp_path: Path, fake: FakeNvml) -> None:
    fake.fail("nvmlDeviceGetNumaNodeId", pynvml.NVML_ERROR_NOT_SUPPORTED)
    node = tmp_path / "sys/bus/pci/devices/0000:17:00.0"
    node.mkdir(parents=True)
    (node / "numa_node").write_text("1\n")
    other = tmp_path / "sys/bus/pci/devices/0000:27:00.0"
    other.mkdir(parents=True)
    (other / "numa_node").write_text("-1\n")
    gpus = _open(fake, host_root=str(tmp_path)).discover().gpus
    assert [g.numa_node for g in gpus] == [1, None]


def test_negative_nvml_numa_is_none() -> None:
    fake = FakeNvml()
    fake.add_gpu(numa_node=None)
    assert _open(fake).discover().gpus[0].numa_node is None


def test_optional_failures_fall_back(fake: FakeNvml) -> None:
    fake.fail("nvmlDeviceGetCudaComputeCapability", pynvml.NVML_ERROR_UNKNOWN, gpu=0)
    fake.fail("nvmlDeviceGetBrand", pynvml.NVML_ERROR_NOT_SUPPORTED)
    fake.fail("nvmlSystemGetDriverVersion", pynvml.NVML_ERROR_UNKNOWN)
    inventory = _open(fake).discover()
    assert inventory.driver_version == ""
    assert inventory.gpus[0].compute_capability == (0, 0)
    assert inventory.gpus[0].health is Health.HEALTHY
    assert inventory.gpus[1].compute_capability == (9, 0)


def test_essential_failure_marks_gpu_unhealthy(
    fake: FakeNvml, caplog: pytest.LogCaptureFixture
) -> None:
    fake.fail("nvmlDeviceGetMemoryInfo", pynvml.NVML_ERROR_GPU_IS_LOST, gpu=1)
    with caplog.at_level(logging.WARNING, "kubegpu.devices.nvml"):
        gpus = _open(fake).discover().gpus
    assert [g.health for g in gpus] == [Health.HEALTHY, Health.UNHEALTHY]
    assert gpus[1].memory_mib == 0
    assert "memory: GPU is lost" in caplog.text


def test_gpu_without_uuid_is_skipped(fake: FakeNvml, caplog: pytest.LogCaptureFixture) -> None:
    fake.fail("nvmlDeviceGetUUID", pynvml.NVML_ERROR_GPU_IS_LOST, gpu=0)
    with caplog.at_level(logging.WARNING, "kubegpu.devices.nvml"):
        gpus = _open(fake).discover().gpus
    assert [g.uuid for g in gpus] == [fake.gpus[1].uuid]
    assert "skipping GPU 0" in caplog.text


def test_lost_gpu_is_skipped_not_fatal(fake: FakeNvml) -> None:
    backend = _open(fake)
    fake.gpus[0].lost = True
    assert [g.index for g in backend.discover().gpus] == [1]


def test_mig_devices() -> None:
    fake = FakeNvml()
    gpu = fake.add_gpu("NVIDIA A100-SXM4-40GB", memory_mib=40960, compute_capability=(8, 0))
    gpu.add_mig("3g.20gb", memory_mib=19968, multiprocessors=42)
    gpu.add_mig("2g.10gb", memory_mib=9728)
    gpu.add_mig("1g.5gb+me", memory_mib=4864)
    gpu.add_mig("1c.1g.5gb", memory_mib=4864, gi_id=9, ci_id=1)
    (found,) = _open(fake).discover().gpus
    assert found.mig_capable and found.mig_enabled
    assert [m.profile for m in found.mig_devices] == ["3g.20gb", "2g.10gb", "1g.5gb+me", "1g.5gb"]
    first = found.mig_devices[0]
    assert first.uuid == gpu.migs[0].uuid
    assert (first.parent_uuid, first.parent_index, first.gi_id, first.ci_id) == (gpu.uuid, 0, 1, 0)
    assert first.memory_mib == 19968
    assert first.multiprocessors == 42
    assert first.attributes["slices.gi"] == 3
    assert first.attributes["engines.copy"] == 1


def test_compute_instance_profile_name() -> None:
    fake = FakeNvml()
    gpu = fake.add_gpu(memory_mib=81559)
    gpu.add_mig("1c.3g.40gb", memory_mib=40192, gi_id=2, ci_id=0)
    gpu.add_mig("2c.3g.40gb", memory_mib=40192, gi_id=2, ci_id=1)
    (found,) = _open(fake).discover().gpus
    assert [m.profile for m in found.mig_devices] == ["1c.3g.40gb", "2c.3g.40gb"]


@pytest.mark.parametrize(
    ("profile", "memory_mib"),
    [
        # The A100's 2g has profile ID 14, the index of NVML_GPU_INSTANCE_PROFILE_2_SLICE_NO_ME;
        # the 1g with two memory slices has ID 15, the index of 1_SLICE_ALL_ME: a backend
        # comparing IDs with index constants names them 2g.10gb-me and 1g.10gb+me.all.
        ("2g.10gb", 9728),
        ("1g.10gb", 9728),
        ("1g.5gb", 4864),
        ("1g.5gb+me", 4864),
        ("1g.5gb-me", 4864),
        ("1g.5gb+me.all", 4864),
        ("2g.10gb+me.all", 9728),
        ("1g.5gb+gfx", 4864),
        ("4g.20gb+gfx", 19968),
        ("3g.20gb", 19968),
        ("4g.20gb", 19968),
        ("7g.40gb", 40192),
    ],
)
def test_mig_profile_named_from_profile_id_via_index_lookup(profile: str, memory_mib: int) -> None:
    """go-nvlib mig_device.go GetProfile: the GI's profile ID is matched against the ID of
    each profile index's info, and the index carries the name's attribute."""
    fake = FakeNvml()
    gpu = fake.add_gpu("NVIDIA A100-SXM4-40GB", memory_mib=40536)
    mig = gpu.add_mig(profile, memory_mib=memory_mib)
    (found,) = _open(fake).discover().gpus
    assert [m.profile for m in found.mig_devices] == [profile]
    # The simulation is only faithful if IDs and indices differ where the driver's do.
    if profile == "2g.10gb":
        assert mig.gi_profile_id != pynvml.NVML_GPU_INSTANCE_PROFILE_2_SLICE


def test_unknown_profile_id_is_named_from_slice_counts() -> None:
    fake = FakeNvml()
    gpu = fake.add_gpu("NVIDIA A100-SXM4-40GB", memory_mib=40536)
    gpu.add_mig("2g.10gb+me", memory_mib=9728).gi_profile_id = 99
    (found,) = _open(fake).discover().gpus
    assert [m.profile for m in found.mig_devices] == ["2g.10gb"]


def test_compute_instance_slices_come_from_its_profile() -> None:
    fake = FakeNvml()
    gpu = fake.add_gpu(memory_mib=81559)
    mig = gpu.add_mig("1c.3g.40gb", memory_mib=40192, gi_id=2)
    # Attributes disagreeing with the profile: the profile wins, as in go-nvlib.
    mig.ci_slices = 3
    (found,) = _open(fake).discover().gpus
    assert [m.profile for m in found.mig_devices] == ["1c.3g.40gb"]


def test_mig_index_is_the_mig_device_slot_not_the_gpu_instance_id() -> None:
    """NVIDIA internal/rm nvml_devices.go: `fmt.Sprintf("%d:%d", gpuIndex, migIndex)`, the
    index given to GetMigDeviceHandleByIndex; 7x 1g.5gb on an A100 have GI IDs 7..13."""
    fake = FakeNvml()
    fake.add_gpu()
    gpu = fake.add_gpu("NVIDIA A100-SXM4-40GB", memory_mib=40536)
    for gi_id in range(7, 14):
        gpu.add_mig("1g.5gb", memory_mib=4864, gi_id=gi_id)
    found = _open(fake).discover().gpus[1]
    assert [m.index for m in found.mig_devices] == [f"1:{n}" for n in range(7)]
    assert [m.gi_id for m in found.mig_devices] == list(range(7, 14))


def test_mig_capable_but_disabled() -> None:
    fake = FakeNvml()
    fake.add_gpu(mig_capable=True)
    (found,) = _open(fake).discover().gpus
    assert found.mig_capable and not found.mig_enabled and found.mig_devices == ()


def test_unreadable_mig_device_is_skipped() -> None:
    fake = FakeNvml()
    gpu = fake.add_gpu()
    gpu.add_mig("1g.10gb")
    fake.fail("nvmlDeviceGetAttributes", pynvml.NVML_ERROR_UNKNOWN)
    (found,) = _open(fake).discover().gpus
    assert found.mig_enabled and found.mig_devices == ()


def test_mig_capability_device_nodes(tmp_path: Path) -> None:
    fake = FakeNvml()
    gpu = fake.add_gpu()
    gpu.add_mig("1g.10gb", gi_id=7)
    base = tmp_path / "proc/driver/nvidia/capabilities/gpu0/mig/gi7"
    (base / "ci0").mkdir(parents=True)
    (base / "access").write_text("DeviceFileMinor: 66\nDeviceFileMode: 292\n")
    (base / "ci0/access").write_text("DeviceFileMinor: 67\nDeviceFileMode: 292\n")
    (found,) = _open(fake, host_root=str(tmp_path)).discover().gpus
    assert found.mig_devices[0].device_paths == (
        "/dev/nvidia-caps/nvidia-cap66",
        "/dev/nvidia-caps/nvidia-cap67",
    )
