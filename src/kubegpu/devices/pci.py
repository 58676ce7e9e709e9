"""NVIDIA's functions on the PCI bus, read from sysfs (`<root>/sys/bus/pci/devices`).

The bus answers without a driver, which is why GFD reads it: `gpu.present` marks a
node whose driver is broken, `gpu.mode` comes from each GPU's PCI class, and the
`vgpu.*` labels from the config space's vendor capability. `kubegpu.labels` turns
these readings into labels; everything here only reads, under `root=` so tests run
against fixture trees (tests/fixtures/pci-*).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

#: Where sysfs lists PCI functions, relative to the host's root.
DEVICES = "sys/bus/pci/devices"
#: NVIDIA's PCI vendor ID as sysfs writes it in `vendor`.
NVIDIA_VENDOR = "0x10de"
#: Bytes of a whole conventional config space; an unprivileged container reads only 64.
CONFIG_SPACE_SIZE = 256


#: NVIDIA's functions in bus order, and whether every function's vendor could be read;
#: None when the bus itself cannot be listed.
Functions = tuple[list[Path], bool] | None


@dataclass(frozen=True)
class PciBus:
    """What one look at the bus says, for one labelling pass (see the three readers)."""

    present: bool
    classes: dict[str, str]
    configs: list[bytes] | None


def read_bus(root: str = "/") -> PciBus:
    """`pci_present`, `pci_classes` and `pci_configs` from one listing of the bus."""
    functions = _nvidia_functions(root)
    return PciBus(_present(functions), _classes(functions), _configs(functions))


def _nvidia_functions(root: str) -> Functions:
    """NVIDIA's functions on the bus, in bus order, and whether every function's vendor
    could be read; None when the bus itself cannot be listed."""
    try:
        entries = sorted(Path(root, DEVICES).iterdir())
    except OSError:
        return None
    found: list[Path] = []
    complete = True
    for entry in entries:
        try:
            vendor = (entry / "vendor").read_text(encoding="ascii").strip().lower()
        except OSError:
            complete = False
            continue
        if vendor == NVIDIA_VENDOR:
            found.append(entry)
    return found, complete


def pci_present(root: str = "/") -> bool:
    """Whether any PCI device under `<root>/sys/bus/pci/devices` is NVIDIA's (no driver needed)."""
    return _present(_nvidia_functions(root))


def _present(functions: Functions) -> bool:
    return functions is not None and bool(functions[0])


def pci_classes(root: str = "/") -> dict[str, str]:
    """PCI bus id → class code for NVIDIA devices, for `gpu.mode`."""
    return _classes(_nvidia_functions(root))


def _classes(functions: Functions) -> dict[str, str]:
    out: dict[str, str] = {}
    for entry in functions[0] if functions is not None else ():
        try:
            out[entry.name.lower()] = (entry / "class").read_text(encoding="ascii").strip()
        except OSError:
            continue
    return out


def pci_configs(root: str = "/") -> list[bytes] | None:
    """The PCI config space of every NVIDIA function, for the `vgpu.*` labels.

    None when the bus cannot be read or a config space is cut short (an unprivileged
    container sees only 64 bytes): GFD then writes no `vgpu.*` labels, and so do we.
    """
    return _configs(_nvidia_functions(root))


def _configs(functions: Functions) -> list[bytes] | None:
    if functions is None or not functions[1]:
        return None
    out: list[bytes] = []
    for entry in functions[0]:
        try:
            config = (entry / "config").read_bytes()
        except OSError:
            return None
        if len(config) < CONFIG_SPACE_SIZE:
            return None
        out.append(config)
    return out
