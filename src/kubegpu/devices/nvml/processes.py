"""The processes on each GPU and MIG device, with their memory and SM utilization.

Memory comes from the driver's three process lists (compute, graphics, MPS clients), read
on each MIG device's own handle in MIG mode, so every process is tied to the slice it runs
on. SM utilization comes from the driver's per-process samples
(`nvmlDeviceGetProcessesUtilizationInfo`, or `nvmlDeviceGetProcessUtilization` on drivers
before it): each read asks only for samples newer than the last one seen on that GPU, and a
process keeps its latest sample for `SAMPLE_TTL_S`, so reads more frequent than the
driver's sample period do not flap to 0. The driver keeps no per-process samples on MIG
devices (it answers NOT_SUPPORTED), so MIG processes have no utilization.

Reads run in a scrape's worker thread while the health watch uses the same session: NVML
is thread-safe, and the sample bookkeeping here has its own lock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from kubegpu.devices.model import GpuProcess, ProcessKind, ProcessTable
from kubegpu.devices.nvml.session import Session, log

#: How long a process's latest utilization sample stands for it (seconds): a little more
#: than the driver's sample period (about a second), so a read between two samples still
#: sees the last one, and an idle process (the driver writes no sample) drops to 0 soon.
SAMPLE_TTL_S = 5.0
#: GPU/compute instance ID the driver gives a process outside MIG.
NO_INSTANCE = 0xFFFFFFFF

#: The process lists, in the order a process's kinds are reported.
_LISTS = (
    (ProcessKind.COMPUTE, "nvmlDeviceGetComputeRunningProcesses"),
    (ProcessKind.GRAPHICS, "nvmlDeviceGetGraphicsRunningProcesses"),
    (ProcessKind.MPS, "nvmlDeviceGetMPSComputeRunningProcesses"),
)


@dataclass
class _Sample:
    stamp_us: int
    sm: int
    memory: int


class ProcessReader:
    """Reads the process table over a `Session`, remembering the samples already seen."""

    def __init__(self, session: Session, clock: Callable[[], float] = time.time) -> None:
        self._s = session
        self._clock = clock
        self._lock = threading.Lock()
        #: GPU UUID -> the newest sample timestamp read from it (µs, the driver's clock).
        self._last_seen: dict[str, int] = {}
        #: (GPU UUID, pid) -> its latest sample.
        self._samples: dict[tuple[str, int], _Sample] = {}
        #: False once the driver lacks nvmlDeviceGetProcessesUtilizationInfo.
        self._info_call = True

    def read(self) -> ProcessTable:
        nvml, s = self._s.nvml, self._s
        processes: list[GpuProcess] = []
        failures: dict[str, str] = {}
        try:
            count = int(nvml.nvmlDeviceGetCount())
        except s.error as err:
            return ProcessTable(failures={"*": f"cannot count GPUs ({err})"})
        for index in range(count):
            entry = s.handle_and_uuid(index)
            if entry is None:
                failures[f"gpu {index}"] = "its UUID is unreadable"
                continue
            handle, uuid = entry
            try:
                processes.extend(self._gpu(handle, uuid, failures))
            except s.error as err:
                failures[uuid] = str(err)
        return ProcessTable(tuple(processes), failures)

    def _gpu(self, handle: Any, uuid: str, failures: dict[str, str]) -> Iterator[GpuProcess]:
        s = self._s
        mig_mode = s.optional(s.nvml.nvmlDeviceGetMigMode, handle, default=None)
        if mig_mode is not None and mig_mode[0] == s.nvml.NVML_DEVICE_MIG_ENABLE:
            for _, mig in s.iter_mig_handles(handle, uuid):
                try:
                    mig_uuid = str(s.nvml.nvmlDeviceGetUUID(mig))
                    yield from self._listed(mig, mig_uuid, None)
                except s.error as err:
                    failures[f"{uuid} MIG"] = str(err)
            return
        yield from self._listed(handle, uuid, self._utilization(handle, uuid))

    def _listed(
        self, handle: Any, uuid: str, util: dict[int, tuple[int, int]] | None
    ) -> Iterator[GpuProcess]:
        """One `GpuProcess` per pid of the three lists; `util` None: no samples here."""
        seen: dict[int, tuple[list[ProcessKind], Any]] = {}
        for kind, function in _LISTS:
            try:
                listed = getattr(self._s.nvml, function)(handle)
            except self._s.error as err:
                # Graphics and MPS lists are missing on some GPUs and drivers: only the
                # compute list is essential.
                if kind is ProcessKind.COMPUTE:
                    raise
                log.debug("%s on %s failed: %s", function, uuid, err)
                continue
            for info in listed:
                pid = int(info.pid)
                kinds, first = seen.setdefault(pid, ([], info))
                if kind not in kinds:
                    kinds.append(kind)
                if _memory(info) is not None and _memory(first) is None:
                    seen[pid] = (kinds, info)
        for pid, (kinds, info) in seen.items():
            sample = util.get(pid, (0, 0)) if util is not None else None
            yield GpuProcess(
                pid=pid,
                uuid=uuid,
                kinds=tuple(kinds),
                used_memory_bytes=_memory(info),
                gpu_instance_id=_instance(getattr(info, "gpuInstanceId", NO_INSTANCE)),
                compute_instance_id=_instance(getattr(info, "computeInstanceId", NO_INSTANCE)),
                sm_percent=None if sample is None else sample[0],
                memory_percent=None if sample is None else sample[1],
            )

    def _utilization(self, handle: Any, uuid: str) -> dict[int, tuple[int, int]] | None:
        """pid -> (SM %, memory %) from the samples of the last `SAMPLE_TTL_S`; None when
        the GPU keeps no per-process samples."""
        nvml, s = self._s.nvml, self._s
        with self._lock:
            since = self._last_seen.get(uuid, 0)
            try:
                samples = self._samples_since(handle, since)
            except s.error as err:
                if err.value == nvml.NVML_ERROR_NOT_SUPPORTED:
                    return None
                # NOT_FOUND: nothing new since `since`; other errors cost the samples only.
                if err.value != nvml.NVML_ERROR_NOT_FOUND:
                    log.debug("per-process utilization of %s failed: %s", uuid, err)
                samples = []
            for pid, stamp, sm, memory in samples:
                key = (uuid, pid)
                known = self._samples.get(key)
                if known is None or stamp >= known.stamp_us:
                    self._samples[key] = _Sample(stamp, sm, memory)
                since = max(since, stamp)
            self._last_seen[uuid] = since
            horizon = int((self._clock() - SAMPLE_TTL_S) * 1_000_000)
            fresh: dict[int, tuple[int, int]] = {}
            for key, sample in list(self._samples.items()):
                if key[0] != uuid:
                    continue
                if sample.stamp_us < horizon:
                    del self._samples[key]  # the process went idle or away
                else:
                    fresh[key[1]] = (sample.sm, sample.memory)
            return fresh

    def _samples_since(self, handle: Any, since: int) -> list[tuple[int, int, int, int]]:
        """(pid, timestamp µs, SM %, memory %) of the samples newer than `since`."""
        nvml = self._s.nvml
        if self._info_call:
            try:
                raw = nvml.nvmlDeviceGetProcessesUtilizationInfo(handle, since)
            except self._s.error as err:
                if err.value not in (
                    nvml.NVML_ERROR_FUNCTION_NOT_FOUND,
                    nvml.NVML_ERROR_NOT_SUPPORTED,
                ):
                    raise
                self._info_call = False  # an older driver: the older call from now on
            else:
                return [(int(x.pid), int(x.timeStamp), int(x.smUtil), int(x.memUtil)) for x in raw]
        try:
            raw = nvml.nvmlDeviceGetProcessUtilization(handle, since)
        except self._s.error as err:
            # pynvml raises NVMLError(SUCCESS) when the driver answers "no samples" with
            # success and a count of 0 instead of NOT_FOUND.
            if err.value == nvml.NVML_SUCCESS:
                return []
            raise
        return [(int(x.pid), int(x.timeStamp), int(x.smUtil), int(x.memUtil)) for x in raw]


def _memory(info: Any) -> int | None:
    value = getattr(info, "usedGpuMemory", None)
    # pynvml turns NVML_VALUE_NOT_AVAILABLE into None (Windows WDDM, no permission).
    return None if value is None else int(value)


def _instance(value: Any) -> int | None:
    number = int(value)
    return None if number == NO_INSTANCE else number
