"""The PCI bus read from sysfs (`kubegpu.devices.pci`), against checked-in fixture trees.

Moved from tests/unit/test_labels.py with the readers (issue 9: only `devices` reads sysfs).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kubegpu.devices.pci import (
    CONFIG_SPACE_SIZE,
    PciBus,
    pci_classes,
    pci_configs,
    pci_present,
    read_bus,
)

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


@pytest.mark.parametrize("fixture", ["pci-nvidia", "pci-none", "does-not-exist"])
def test_one_look_at_the_bus_reads_what_the_three_readers_do(fixture: str) -> None:
    root = str(FIXTURES / fixture)
    assert read_bus(root) == PciBus(pci_present(root), pci_classes(root), pci_configs(root))


def test_one_look_lists_the_bus_once(monkeypatch: pytest.MonkeyPatch) -> None:
    from kubegpu.devices import pci

    listings: list[str] = []
    real = pci._nvidia_functions

    def counted(root: str) -> pci.Functions:
        listings.append(root)
        return real(root)

    monkeypatch.setattr(pci, "_nvidia_functions", counted)
    read_bus(str(FIXTURES / "pci-nvidia"))
    assert len(listings) == 1
