"""The PCI bus read from sysfs (`kubegpu.devices.pci`), against checked-in fixture trees.

Moved from tests/unit/test_labels.py with the readers (issue 9: only `devices` reads sysfs).
"""

from __future__ import annotations

from pathlib import Path

from kubegpu.devices.pci import CONFIG_SPACE_SIZE, pci_classes, pci_configs, pci_present

FIXTURES = Path(__file__).parent.parent / "fixtures"


def test_pci_present_reads_vendor_files() -> None:
    assert pci_present(str(FIXTURES / "pci-nvidia"))
    assert not pci_present(str(FIXTURES / "pci-none"))
    assert not pci_present(str(FIXTURES / "does-not-exist"))


def test_pci_classes_lists_nvidia_devices_only() -> None:
    assert pci_classes(str(FIXTURES / "pci-nvidia")) == {
        "0000:00:1e.0": "0x030200",
        "0000:17:00.0": "0x030000",
    }


def test_pci_configs_give_up_on_a_short_read(tmp_path: Path) -> None:
    dev = tmp_path / "sys/bus/pci/devices/0000:17:00.0"
    dev.mkdir(parents=True)
    (dev / "vendor").write_text("0x10de\n")
    (dev / "config").write_bytes(bytes(64))
    assert pci_configs(str(tmp_path)) is None
    (dev / "config").write_bytes(bytes(256))
    assert pci_configs(str(tmp_path)) == [bytes(256)]
    assert pci_configs(str(tmp_path / "nowhere")) is None


def test_pci_configs_skip_other_vendors_and_keep_bus_order(tmp_path: Path) -> None:
    devices = tmp_path / "sys/bus/pci/devices"
    for address, vendor, fill in [
        ("0000:3b:00.0", "0x10de", 2),
        ("0000:00:02.0", "0x8086", 9),  # an Intel function: not read for vGPU labels
        ("0000:17:00.0", "0x10DE", 1),  # sysfs case varies between kernels
    ]:
        dev = devices / address
        dev.mkdir(parents=True)
        (dev / "vendor").write_text(f"{vendor}\n")
        (dev / "config").write_bytes(bytes([fill]) * CONFIG_SPACE_SIZE)
    assert pci_configs(str(tmp_path)) == [bytes([1]) * 256, bytes([2]) * 256]
