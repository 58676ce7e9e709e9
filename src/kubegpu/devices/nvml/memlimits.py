"""Per-cgroup device memory limits through NVML: the kernel-enforced limit of a sized claim.

NVIDIA's R615 drivers (CUDA 13.4) partition a GPU's device memory by cgroup ("MPS v3
memory partitioning"): `nvmlDeviceSetMemoryLimits_v1` gives one device a soft and a hard
limit for the processes of one cgroup, named by its path under `/sys/fs/cgroup`
(`nameSpace`). The hard limit fails allocations beyond it with out-of-memory in the driver,
whatever the process does; the soft limit is what the cgroup keeps under memory pressure.
A claim's memory is reserved for it by the scheduler, so both are set to what it consumed.
Removing the cgroup clears its limits; `clear` does it at once (soft 0, hard
`NVML_DEVICE_MEMORY_LIMIT_MAX`). MIG devices have no such limits.

It needs the calls in the bindings (nvidia-ml-py 13.615 and later), a driver that answers
them, cgroup v2 at `/sys/fs/cgroup` and root. `NvmlMemoryLimits.probe` checks all but the
last (a refusal then fails the claim's prepare with the driver's reason) and returns None
when any is missing, so an older node keeps to the MPS limits.

A pod's cgroup is found where the kubelet makes it (`kubepods`, by QoS class, under the
cgroupfs or the systemd driver's names); the kubelet creates it before it asks a driver to
prepare the pod's claims.
"""

from __future__ import annotations

import logging
from pathlib import Path
from types import ModuleType
from typing import Any, Final

from kubegpu.errors import DeviceError

log = logging.getLogger("kubegpu.devices.nvml")

#: Where the kubelet and NVML see the cgroup v2 hierarchy.
CGROUP_ROOT: Final = "/sys/fs/cgroup"
_QOS: Final = ("", "burstable", "besteffort")


class MemoryLimitError(DeviceError):
    """The driver refused a memory limit, or the pod's cgroup is not where the kubelet
    puts one."""


def pod_cgroup(host_root: str | Path, pod_uid: str) -> str | None:
    """The pod's cgroup as the host names it (`/sys/fs/cgroup/kubepods.slice/...`), or None.

    `pod_uid` must be a checked UID (it becomes a path). The six places the kubelet uses:
    guaranteed, burstable and best-effort pods, under the cgroupfs driver
    (`kubepods/burstable/pod<uid>`) or the systemd one
    (`kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid with _>.slice`).
    """
    base = Path(host_root) / CGROUP_ROOT.lstrip("/")
    underscored = pod_uid.replace("-", "_")
    for qos in _QOS:
        cgroupfs = (
            Path("kubepods", qos, f"pod{pod_uid}") if qos else Path("kubepods", f"pod{pod_uid}")
        )
        if qos:
            systemd = Path(
                "kubepods.slice", f"kubepods-{qos}.slice", f"kubepods-{qos}-pod{underscored}.slice"
            )
        else:
            systemd = Path("kubepods.slice", f"kubepods-pod{underscored}.slice")
        for relative in (systemd, cgroupfs):
            if (base / relative).is_dir():
                return f"{CGROUP_ROOT}/{relative}"
    return None


class NvmlMemoryLimits:
    """Sets, clears and reads one cgroup's memory limit on one GPU (blocking NVML calls)."""

    mechanism: Final = "nvml-cgroup"

    def __init__(self, nvml: ModuleType, host_root: str = "/") -> None:
        self._nvml = nvml
        self._error: Any = nvml.NVMLError
        self.host_root = host_root

    @classmethod
    def probe(
        cls, nvml: ModuleType, uuids: list[str], host_root: str = "/"
    ) -> NvmlMemoryLimits | None:
        """The limiter when the bindings, cgroup v2 and the driver on every GPU of `uuids`
        have it; None (the reason at DEBUG) when not."""
        names = ("nvmlDeviceSetMemoryLimits_v1", "nvmlDeviceGetMemoryLimits_v1")
        missing = [n for n in (*names, "c_nvmlGetMemoryLimits_v1_t") if not hasattr(nvml, n)]
        if missing:
            log.debug("no per-cgroup memory limits: the NVML bindings lack %s", missing[0])
            return None
        controllers = Path(host_root, CGROUP_ROOT.lstrip("/"), "cgroup.controllers")
        if not controllers.is_file():
            log.debug("no per-cgroup memory limits: no cgroup v2 at %s", controllers.parent)
            return None
        limits = cls(nvml, host_root)
        for uuid in uuids:
            try:
                limits.read(uuid, CGROUP_ROOT)
            except MemoryLimitError as exc:
                log.debug("no per-cgroup memory limits: %s", exc)
                return None
        return limits

    def _handle(self, uuid: str) -> Any:
        try:
            return self._nvml.nvmlDeviceGetHandleByUUID(uuid)
        except self._error as err:
            raise MemoryLimitError(f"GPU {uuid}: {err}") from err

    def set_limit(self, uuid: str, cgroup: str, limit_bytes: int) -> None:
        """Hold the cgroup's processes to `limit_bytes` on the GPU (soft = hard: the
        scheduler reserved that much for the claim)."""
        self._set(uuid, cgroup, limit_bytes, limit_bytes)

    def clear(self, uuid: str, cgroup: str) -> None:
        """Remove the cgroup's limit on the GPU."""
        self._set(uuid, cgroup, 0, int(self._nvml.NVML_DEVICE_MEMORY_LIMIT_MAX))

    def _set(self, uuid: str, cgroup: str, soft: int, hard: int) -> None:
        handle = self._handle(uuid)
        limits = self._nvml.c_nvmlSetMemoryLimits_v1_t()
        limits.nameSpace = cgroup.encode()
        limits.softLimit = soft
        limits.hardLimit = hard
        try:
            self._nvml.nvmlDeviceSetMemoryLimits_v1(handle, limits)
        except self._error as err:
            raise MemoryLimitError(
                f"GPU {uuid}: the driver refused a memory limit for cgroup {cgroup} ({err})"
            ) from err

    def read(self, uuid: str, cgroup: str) -> tuple[int, int, int]:
        """(soft, hard, used) bytes of the cgroup on the GPU."""
        handle = self._handle(uuid)
        limits = self._nvml.c_nvmlGetMemoryLimits_v1_t()
        limits.nameSpace = cgroup.encode()
        try:
            self._nvml.nvmlDeviceGetMemoryLimits_v1(handle, limits)
        except self._error as err:
            raise MemoryLimitError(
                f"GPU {uuid}: cannot read the memory limit of cgroup {cgroup} ({err})"
            ) from err
        return int(limits.softLimit), int(limits.hardLimit), int(limits.currentUsed)

    def pod_cgroup(self, pod_uid: str) -> str | None:
        return pod_cgroup(self.host_root, pod_uid)


__all__ = ["CGROUP_ROOT", "MemoryLimitError", "NvmlMemoryLimits", "pod_cgroup"]
