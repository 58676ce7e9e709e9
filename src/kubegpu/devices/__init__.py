"""GPU backends behind one model: the only package that imports pynvml or reads sysfs.

`open_backend` is the factory: it picks the backend by name (or probes for one with
`auto`) and translates "nothing here" into `InitError`, which the daemon turns into
either exit 1 or, with `--fail-on-init-error=false`, the `NullBackend` that advertises
nothing and says what to fix.

Besides the backends (`nvml/`, `amd`, `simulated`), the host's other sysfs facts are
read here too, for the labels: `pci` (NVIDIA functions on the PCI bus: presence, class,
config space) and `host` (the DMI machine type). `kubegpu.labels` only formats them.
"""

from __future__ import annotations

from collections.abc import Callable

from kubegpu.devices.amd import AmdBackend
from kubegpu.devices.model import (
    DeviceBackend,
    DeviceID,
    Fault,
    Gpu,
    GpuProcess,
    Health,
    HealthEvent,
    HealthEventKind,
    Inventory,
    Link,
    LinkKind,
    MigDevice,
    ProcessKind,
    ProcessSource,
    ProcessTable,
    ResourceName,
    StopFlag,
    Vendor,
)
from kubegpu.devices.nvml import NvmlBackend
from kubegpu.devices.simulated import SimulatedBackend
from kubegpu.devices.stop import Stop
from kubegpu.errors import InitError

BACKENDS = ("auto", "nvml", "amd", "simulated")


class NullBackend:
    """A backend with no devices, used when init failed and failing is switched off."""

    name = "null"

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def discover(self) -> Inventory:
        return Inventory(gpus=(), backend=self.name)

    def probe(self, uuid: str) -> str | None:
        return f"no backend ({self.reason})"

    def processes(self) -> ProcessTable:
        return ProcessTable()

    def watch(self, stop: StopFlag, emit: Callable[[HealthEvent], None]) -> None:
        stop.wait()

    def close(self) -> None:
        pass


def open_backend(
    kind: str = "auto",
    *,
    simulate: str | None = None,
    driver_root: str = "/",
    dev_root: str | None = None,
    sysfs_root: str = "/",
) -> DeviceBackend:
    """Open the named backend; `simulate` (a preset name or YAML path) implies `simulated`.

    Raises `InitError` with a message that says what is missing and what to do.
    """
    if simulate is not None or kind == "simulated":
        return SimulatedBackend.load(simulate or "h100-8")
    if kind not in BACKENDS:
        raise InitError(f"unknown backend {kind!r}; use one of {', '.join(BACKENDS)}")
    if kind == "amd":
        return AmdBackend(root=sysfs_root)

    def nvml() -> DeviceBackend:
        return NvmlBackend.open(driver_root=driver_root, dev_root=dev_root, host_root=sysfs_root)

    if kind == "nvml":
        return nvml()
    # auto: NVIDIA first (the common case), then AMD, else a combined explanation.
    try:
        return nvml()
    except InitError as nvml_error:
        if AmdBackend.present(root=sysfs_root):
            return AmdBackend(root=sysfs_root)
        raise InitError(f"{nvml_error}; no AMD GPU (/sys/class/kfd) either") from nvml_error


__all__ = [
    "BACKENDS",
    "DeviceBackend",
    "DeviceID",
    "Fault",
    "Gpu",
    "GpuProcess",
    "Health",
    "HealthEvent",
    "HealthEventKind",
    "Inventory",
    "Link",
    "LinkKind",
    "MigDevice",
    "NullBackend",
    "ProcessKind",
    "ProcessSource",
    "ProcessTable",
    "ResourceName",
    "Stop",
    "StopFlag",
    "Vendor",
    "open_backend",
]
