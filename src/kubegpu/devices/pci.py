"""NVIDIA's functions on the PCI bus, read from sysfs (`<root>/sys/bus/pci/devices`),
and the PCIe root complex a GPU hangs off (for DRA's `resource.kubernetes.io/pcieRoot`).

The bus answers without a driver, which is why GFD reads it: `gpu.present` marks a
node whose driver is broken, `gpu.mode` comes from each GPU's PCI class, and the
`vgpu.*` labels from the config space's vendor capability. `kubegpu.labels` turns
these readings into labels; everything here only reads, under `root=` so tests run
against fixture trees (tests/fixtures/pci-*).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

#: Where sysfs lists PCI functions, relative to the host's root.
DEVICES = "sys/bus/pci/devices"
#: NVIDIA's PCI vendor ID as sysfs writes it in `vendor`.
NVIDIA_VENDOR = "0x10de"
#: Bytes of a whole conventional config space; an unprivileged container reads only 64.
CONFIG_SPACE_SIZE = 256


@dataclass(frozen=True)
class PciBus:
    """What one look at the bus says, for one labelling pass."""

    #: Whether any function is NVIDIA's (no driver needed): `gpu.present`.
    present: bool
    #: PCI bus id → class code of each NVIDIA function: `gpu.mode`.
    classes: dict[str, str]
    #: The config space of every NVIDIA function in bus order, for the `vgpu.*` labels;
    #: None when the bus or a vendor cannot be read or a config space is cut short (an
    #: unprivileged container sees only 64 bytes): GFD then writes no `vgpu.*` labels, and
    #: so do we.
    configs: list[bytes] | None


def read_bus(root: str = "/") -> PciBus:
    """NVIDIA's functions under `<root>/sys/bus/pci/devices`, from one listing."""
    try:
        entries = sorted(Path(root, DEVICES).iterdir())
    except OSError:
        return PciBus(False, {}, None)
    nvidia: list[Path] = []
    complete = True  # every function's vendor was read
    for entry in entries:
        try:
            vendor = (entry / "vendor").read_text(encoding="ascii").strip().lower()
        except OSError:
            complete = False
            continue
        if vendor == NVIDIA_VENDOR:
            nvidia.append(entry)
    classes: dict[str, str] = {}
    for entry in nvidia:
        try:
            classes[entry.name.lower()] = (entry / "class").read_text(encoding="ascii").strip()
        except OSError:
            continue
    return PciBus(bool(nvidia), classes, _configs(nvidia) if complete else None)


def _configs(nvidia: list[Path]) -> list[bytes] | None:
    out: list[bytes] = []
    for entry in nvidia:
        try:
            config = (entry / "config").read_bytes()
        except OSError:
            return None
        if len(config) < CONFIG_SPACE_SIZE:
            return None
        out.append(config)
    return out


def pcie_roots(root: str, bus_ids: Iterable[str]) -> dict[str, str]:
    """PCI bus ID -> its PCIe root complex (`pci0000:16`), as Kubernetes reads it.

    `/sys/bus/pci/devices/<id>` links to `/sys/devices/pci<domain>:<bus>/.../<id>`; the
    first directory under `/sys/devices` is the root (k8s.io/dynamic-resource-allocation
    deviceattribute's reading). A bus ID without such a link (not a PCI device here, a
    tree that does not nest) is left out: no attribute rather than a wrong one.
    """
    devices = Path(root, "sys/devices")
    found: dict[str, str] = {}
    for bus_id in bus_ids:
        link = Path(root, DEVICES, bus_id)
        try:
            pointed = link.readlink()
        except OSError:
            continue
        # A relative link (the kernel's) resolves beside it; an absolute one under `root`.
        base = (
            Path(root) / pointed.relative_to("/")
            if pointed.is_absolute()
            else link.parent / pointed
        )
        target = Path(os.path.normpath(base))
        if target.name != bus_id or not target.is_relative_to(devices):
            continue
        first = target.relative_to(devices).parts[0]
        if first.startswith("pci") and first != bus_id:
            found[bus_id] = first
    return found
