"""`NvmlBackend`: the NVIDIA backend, NVML opened once and shared by discovery and health.

`open` finds and initialises NVML (from a driver root when the GPU operator's driver
container provides it) and turns every failure into an `InitError` that says what to fix.
`discover` is `discovery.discover`, `probe` and `watch` are `health`'s, over one `Session`.
"""

from __future__ import annotations

import ctypes
import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pynvml

from kubegpu.devices.model import HealthEvent, Inventory, ProcessTable, StopFlag
from kubegpu.devices.nvml import discovery, health
from kubegpu.devices.nvml.memlimits import NvmlMemoryLimits
from kubegpu.devices.nvml.processes import ProcessReader
from kubegpu.devices.nvml.session import Session, log
from kubegpu.errors import InitError
from kubegpu.nvidia_paths import LIBRARY_DIRS, NVML_LIBRARY


def find_library(driver_root: str) -> Path | None:
    """The first `libnvidia-ml.so.1` under the usual library directories of `driver_root`."""
    for directory in LIBRARY_DIRS:
        candidate = Path(driver_root, directory, NVML_LIBRARY)
        if candidate.exists():
            return candidate
    return None


def _missing_library(driver_root: str) -> str:
    # Env names, not flags: every command (serve, labels, info, check, cdi) reads these.
    return (
        f"NVML library {NVML_LIBRARY} not found under {driver_root}: install the NVIDIA driver, "
        "or give its root (NVIDIA_DRIVER_ROOT on the host, CONTAINER_DRIVER_ROOT where a "
        "container mounts it)"
    )


def _init_message(nvml: ModuleType, err: Any, driver_root: str) -> str:
    """What to tell the operator when nvmlInit fails, by error code."""
    code = getattr(err, "value", None)
    if code == nvml.NVML_ERROR_LIBRARY_NOT_FOUND:
        return _missing_library(driver_root)
    if code == nvml.NVML_ERROR_DRIVER_NOT_LOADED:
        return "NVIDIA kernel driver is not loaded: load it (modprobe nvidia) or run on a GPU node"
    if code == nvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH:
        return (
            "NVML library and NVIDIA kernel driver versions differ: "
            "reboot the node or reinstall the driver"
        )
    if code == nvml.NVML_ERROR_NO_PERMISSION:
        return (
            "no permission to use NVML: run the plugin privileged or give it access to /dev/nvidia*"
        )
    return f"nvmlInit failed ({err}): check that nvidia-smi works on the node"


class NvmlBackend:
    """NVIDIA GPUs, MIG slices, NVLink/PCIe topology and Xid health events via NVML."""

    name = "nvml"

    def __init__(
        self,
        nvml: ModuleType,
        *,
        dev_root: str = "/",
        host_root: str = "/",
        exists: Callable[[str], bool] | None = None,
        wait_timeout_ms: int = 1000,
        layout_check_seconds: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._nvml = nvml
        self._error: Any = nvml.NVMLError
        self._session = Session(nvml, host_root)
        self._dev_root = dev_root
        self._exists = exists or (lambda path: Path(dev_root, path.lstrip("/")).exists())
        self._wait_timeout_ms = wait_timeout_ms
        self._layout_check_seconds = layout_check_seconds
        self._clock = clock
        self._processes = ProcessReader(self._session)
        self._closed = False
        #: The limiter, or None where the driver has none; probed once.
        self._memory_limiter: NvmlMemoryLimits | None = None
        self._memory_probed = False

    @classmethod
    def open(
        cls,
        driver_root: str = "/",
        nvml: ModuleType | None = None,
        *,
        dev_root: str | None = None,
        host_root: str = "/",
        load_library: Callable[[str], object] = ctypes.CDLL,
        exists: Callable[[str], bool] | None = None,
        wait_timeout_ms: int = 1000,
        layout_check_seconds: float = 10.0,
    ) -> NvmlBackend:
        """Initialise NVML; raise `InitError` saying what is missing when it cannot start.

        With a driver root other than `/` the library is loaded from that tree (the GPU
        operator's driver container) rather than from the loader's search path.
        """
        if nvml is None:
            nvml = pynvml
        module: Any = nvml  # pynvml keeps the loaded library in a module global
        if driver_root not in ("", "/"):
            library = find_library(driver_root)
            if library is None:
                raise InitError(_missing_library(driver_root))
            if getattr(nvml, "nvmlLib", None) is None:
                try:
                    module.nvmlLib = load_library(str(library))
                except OSError as err:
                    raise InitError(
                        f"cannot load {library} ({err}): check the driver under {driver_root}"
                    ) from err
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as err:
            raise InitError(_init_message(nvml, err, driver_root or "/")) from err
        backend = cls(
            nvml,
            dev_root=dev_root or driver_root or "/",
            host_root=host_root,
            exists=exists,
            wait_timeout_ms=wait_timeout_ms,
            layout_check_seconds=layout_check_seconds,
        )
        try:
            count = int(nvml.nvmlDeviceGetCount())
        except nvml.NVMLError as err:
            backend.close()
            raise InitError(f"NVML cannot count GPUs ({err}): check that nvidia-smi works") from err
        if count == 0:
            backend.close()
            raise InitError("NVML found no GPUs: check `nvidia-smi -L` on the node and the driver")
        return backend

    def discover(self) -> Inventory:
        inventory = discovery.discover(self._session, self._exists, self.name)
        if self.memory_limiter(inventory) is None:
            return inventory
        return dataclasses.replace(inventory, memory_limits=True)

    def memory_limiter(self, inventory: Inventory | None = None) -> NvmlMemoryLimits | None:
        """Per-cgroup device memory limits on these GPUs, where the driver has them
        (checked once; `memlimits`)."""
        if not self._memory_probed:
            self._memory_probed = True
            uuids = [g.uuid for g in (inventory or self.discover()).gpus]
            self._memory_limiter = NvmlMemoryLimits.probe(
                self._nvml, uuids, self._session.host_root
            )
        return self._memory_limiter

    def probe(self, uuid: str) -> str | None:
        """A cheap NVML round trip: the handle by UUID and its memory info."""
        return health.probe(self._session, uuid)

    def processes(self) -> ProcessTable:
        """The processes on every GPU and MIG device, with memory and SM utilization."""
        return self._processes.read()

    def watch(self, stop: StopFlag, emit: Callable[[HealthEvent], None]) -> None:
        """Forward Xid/ECC events until `stop` is set; report failures as events, never raise."""
        health.watch(
            self._session,
            stop,
            emit,
            wait_timeout_ms=self._wait_timeout_ms,
            layout_check_seconds=self._layout_check_seconds,
            clock=self._clock,
        )

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._nvml.nvmlShutdown()
        except self._error as err:
            log.debug("nvmlShutdown failed: %s", err)
