"""What discovery and the health watch share: one initialised NVML and its MIG UUID map."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any, TypeVar

log = logging.getLogger("kubegpu.devices.nvml")

T = TypeVar("T")


class Session:
    """An initialised `pynvml` (or a fake), the host root and the MIG UUIDs seen so far."""

    def __init__(self, nvml: ModuleType, host_root: str = "/") -> None:
        self.nvml = nvml
        #: `nvml.NVMLError`: the only exception type the NVML calls here raise.
        self.error: Any = nvml.NVMLError
        #: Where /sys and /proc of the host are mounted (NUMA fallback, MIG capabilities).
        self.host_root = host_root
        #: (GPU UUID, GI id, CI id) -> MIG UUID, refreshed by discover and layout checks, so
        #: an Xid event naming a GPU instance and compute instance finds its slice.
        self.mig_uuids: dict[tuple[str, int, int], str] = {}
        #: Every GPU UUID read so far: the devices to report when NVML as a whole fails.
        self.gpu_uuids: set[str] = set()
        #: Bumped by each `reinit`, so threads that saw the same failure re-initialise once.
        self.generation = 0
        self._reinit_lock = threading.Lock()
        #: Error codes after which this process must initialise NVML again: the driver was
        #: unloaded, reloaded or upgraded under it.
        self.gone_codes = frozenset(
            getattr(nvml, name)
            for name in (
                "NVML_ERROR_UNINITIALIZED",
                "NVML_ERROR_DRIVER_NOT_LOADED",
                "NVML_ERROR_LIB_RM_VERSION_MISMATCH",
            )
        )

    def is_gone(self, err: Any) -> bool:
        """True when `err` says NVML itself is unusable, not just one call or one GPU."""
        return getattr(err, "value", None) in self.gone_codes

    def reinit(self, seen: int) -> bool:
        """Initialise NVML again after the failure seen at generation `seen`.

        Only the first thread to get here for that generation does it; the others find the
        generation moved on and retry at once. False when NVML is still unavailable.
        """
        with self._reinit_lock:
            if self.generation != seen:
                return True
            try:
                self.nvml.nvmlShutdown()
            except self.error as err:
                log.debug("nvmlShutdown before re-initialising failed: %s", err)
            try:
                self.nvml.nvmlInit()
            except self.error as err:
                log.warning("NVML is still unavailable (%s); retrying later", err)
                return False
            self.generation += 1
            # MIG slices may have been recreated with new UUIDs while NVML was away.
            self.mig_uuids.clear()
            log.info("NVML initialised again")
            return True

    def optional(self, fn: Callable[..., T], *args: Any, default: T) -> T:
        """Call an NVML function whose failure only costs an optional field."""
        try:
            return fn(*args)
        except self.error as err:
            log.debug("%s%r failed: %s", getattr(fn, "__name__", fn), args[1:], err)
            return default

    def handle_and_uuid(self, index: int) -> tuple[Any, str] | None:
        """The handle and UUID of GPU `index`; None (logged) when the UUID is unreadable."""
        try:
            handle = self.nvml.nvmlDeviceGetHandleByIndex(index)
            uuid = str(self.nvml.nvmlDeviceGetUUID(handle))
        except self.error as err:
            log.warning("skipping GPU %d: cannot read its UUID (%s)", index, err)
            return None
        self.gpu_uuids.add(uuid)
        return handle, uuid

    def iter_mig_handles(self, handle: Any, gpu_uuid: str) -> Iterator[tuple[int, Any]]:
        """(MIG device index, handle) for each populated slot of a GPU."""
        count = int(self.optional(self.nvml.nvmlDeviceGetMaxMigDeviceCount, handle, default=0))
        for slot in range(count):
            try:
                yield slot, self.nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
            except self.error as err:
                if err.value not in (
                    self.nvml.NVML_ERROR_NOT_FOUND,
                    self.nvml.NVML_ERROR_INVALID_ARGUMENT,
                ):
                    log.warning("GPU %s: cannot read MIG device %d (%s)", gpu_uuid, slot, err)
