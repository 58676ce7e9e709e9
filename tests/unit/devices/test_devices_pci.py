"""The PCI bus read from sysfs (`kubegpu.devices.pci`), against checked-in fixture trees.

Beside the readers, since only `devices` reads sysfs.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kubegpu.devices.pci import CONFIG_SPACE_SIZE, PciBus, pcie_roots, read_bus

FIXTURES = Path(__file__).parents[2] / "fixtures"


def test_presence_reads_vendor_files() -> None:
    assert read_bus(str(FIXTURES / "pci-nvidia")).present
    assert not read_bus(str(FIXTURES / "pci-none")).present
    assert not read_bus(str(FIXTURES / "does-not-exist")).present


def test_classes_list_nvidia_devices_only() -> None:
    assert read_bus(str(FIXTURES / "pci-nvidia")).classes == {
        "0000:00:1e.0": "0x030200",
        "0000:17:00.0": "0x030000",
    }


def test_configs_give_up_on_a_short_read(tmp_path: Path) -> None:
    dev = tmp_path / "sys/bus/pci/devices/0000:17:00.0"
    dev.mkdir(parents=True)
    (dev / "vendor").write_text("0x10de\n")
    (dev / "config").write_bytes(bytes(64))
    assert read_bus(str(tmp_path)).configs is None
    (dev / "config").write_bytes(bytes(256))
    assert read_bus(str(tmp_path)).configs == [bytes(256)]
    assert read_bus(str(tmp_path / "nowhere")).configs is None


def test_configs_skip_other_vendors_and_keep_bus_order(tmp_path: Path) -> None:
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
    assert read_bus(str(tmp_path)).configs == [bytes([1]) * 256, bytes([2]) * 256]


def test_a_bus_that_cannot_be_listed_or_has_no_nvidia_function() -> None:
    assert read_bus(str(FIXTURES / "does-not-exist")) == PciBus(False, {}, None)
    assert read_bus(str(FIXTURES / "pci-none")) == PciBus(False, {}, [])


def test_a_vendor_that_cannot_be_read_withholds_the_config_spaces(tmp_path: Path) -> None:
    devices = tmp_path / "sys/bus/pci/devices"
    for address in ("0000:17:00.0", "0000:3b:00.0"):
        (devices / address).mkdir(parents=True)
        (devices / address / "config").write_bytes(bytes(CONFIG_SPACE_SIZE))
    (devices / "0000:17:00.0" / "vendor").write_text("0x10de\n")
    # 0000:3b:00.0 has no vendor file: it might be NVIDIA's, so no vgpu.* from a part.
    assert read_bus(str(tmp_path)) == PciBus(True, {}, None)


def test_one_look_lists_the_bus_once(monkeypatch: pytest.MonkeyPatch) -> None:
    listed: list[Path] = []
    real = Path.iterdir

    def counted(self: Path) -> Iterator[Path]:
        listed.append(self)
        return real(self)

    monkeypatch.setattr(Path, "iterdir", counted)
    bus = read_bus(str(FIXTURES / "pci-nvidia"))
    assert bus.present and bus.classes
    assert listed == [FIXTURES / "pci-nvidia" / "sys/bus/pci/devices"]


def test_pcie_roots_follow_the_bus_links_to_their_root_complex(tmp_path: Path) -> None:
    """As Kubernetes' deviceattribute reads `resource.kubernetes.io/pcieRoot`."""
    bus = tmp_path / "sys/bus/pci/devices"
    bus.mkdir(parents=True)
    deep = tmp_path / "sys/devices/pci0000:16/0000:16:01.0/0000:17:00.0"
    flat = tmp_path / "sys/devices/pci0000:80/0000:81:00.0"
    for target in (deep, flat):
        target.mkdir(parents=True)
    (bus / "0000:17:00.0").symlink_to("../../../devices/pci0000:16/0000:16:01.0/0000:17:00.0")
    (bus / "0000:81:00.0").symlink_to("/sys/devices/pci0000:80/0000:81:00.0")  # absolute
    (bus / "0000:99:00.0").symlink_to("../../../devices/platform/0000:99:00.0")
    (bus / "0000:aa:00.0").mkdir()  # not a link
    ids = ["0000:17:00.0", "0000:81:00.0", "0000:99:00.0", "0000:aa:00.0", "0000:bb:00.0"]
    assert pcie_roots(str(tmp_path), ids) == {
        "0000:17:00.0": "pci0000:16",
        "0000:81:00.0": "pci0000:80",
    }
