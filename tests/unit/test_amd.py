"""AmdBackend against checked-in sysfs fixture trees."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import pytest

from kubegpu.devices import open_backend
from kubegpu.devices.amd import AmdBackend
from kubegpu.devices.model import HealthEvent, HealthEventKind, LinkKind, Vendor
from kubegpu.errors import InitError

FIXTURES = Path(__file__).parent.parent / "fixtures"
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

    stop = threading.Event()
    thread = threading.Thread(target=backend.watch, args=(stop, emit))
    thread.start()
    try:
        shutil.rmtree(tmp_path / "sys/class/drm/card1/device")
        assert seen.wait(5)
    finally:
        stop.set()
        thread.join(5)
    assert "is gone" in (backend.probe(one.uuid) or "")
    assert [(e.uuid, e.kind) for e in events] == [(one.uuid, HealthEventKind.PROBE_FAILED)]
