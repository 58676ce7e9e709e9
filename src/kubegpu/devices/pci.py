"""NVIDIA's functions on the PCI bus, read from sysfs (`<root>/sys/bus/pci/devices`).

The bus answers without a driver, which is why GFD reads it: `gpu.present` marks a
node whose driver is broken, `gpu.mode` comes from each GPU's PCI class, and the
`vgpu.*` labels from the config space's vendor capability. `kubegpu.labels` turns
these readings into labels; everything here only reads, under `root=` so tests run
against fixture trees (tests/fixtures/pci-*).
"""

from __future__ import annotations

from pathlib import Path

#: Where sysfs lists PCI functions, relative to the host's root.
DEVICES = "sys/bus/pci/devices"
#: NVIDIA's PCI vendor ID as sysfs writes it in `vendor`.
NVIDIA_VENDOR = "0x10de"
#: Bytes of a whole conventional config space; an unprivileged container reads only 64.
CONFIG_SPACE_SIZE = 256


def pci_present(root: str = "/") -> bool:
    """Whether any PCI device under `<root>/sys/bus/pci/devices` is NVIDIA's (no driver needed)."""
    devices = Path(root, DEVICES)
    try:
        entries = list(devices.iterdir())
    except OSError:
        return False
    for entry in entries:
        try:
            vendor = (entry / "vendor").read_text(encoding="ascii").strip().lower()
        except OSError:
            continue
        if vendor == NVIDIA_VENDOR:
            return True
    return False


def pci_classes(root: str = "/") -> dict[str, str]:
    """PCI bus id → class code for NVIDIA devices, for `gpu.mode`."""
    out: dict[str, str] = {}
    devices = Path(root, DEVICES)
    try:
        entries = list(devices.iterdir())
    except OSError:
        return out
    for entry in entries:
        try:
            if (entry / "vendor").read_text(encoding="ascii").strip().lower() != NVIDIA_VENDOR:
                continue
            out[entry.name.lower()] = (entry / "class").read_text(encoding="ascii").strip()
        except OSError:
            continue
    return out


def pci_configs(root: str = "/") -> list[bytes] | None:
    """The PCI config space of every NVIDIA function, for the `vgpu.*` labels.

    None when the bus cannot be read or a config space is cut short (an unprivileged
    container sees only 64 bytes): GFD then writes no `vgpu.*` labels, and so do we.
    """
    devices = Path(root, DEVICES)
    try:
        entries = sorted(devices.iterdir())
    except OSError:
        return None
    out: list[bytes] = []
    for entry in entries:
        try:
            if (entry / "vendor").read_text(encoding="ascii").strip().lower() != NVIDIA_VENDOR:
                continue
            config = (entry / "config").read_bytes()
        except OSError:
            return None
        if len(config) < CONFIG_SPACE_SIZE:
            return None
        out.append(config)
    return out
