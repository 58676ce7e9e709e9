"""Memory-sized shared GPUs: what a claim consumed, as the limits its containers get.

A GPU whose sharing entry has `sizing` (`kubegpu.config.v1.ClaimSizing`) is published with
a `memory` capacity the scheduler sizes claims by (`kubegpu.dra.slices`). The scheduler
writes what each claim took into its allocation result (`consumedCapacity`: `memory`,
`shares`); this module turns that into the claim's limits: a device-memory limit equal to
the memory consumed, and a compute share equal to its shares over the device's total
(`CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` semantics).

Which mechanism holds them is published on the device (`MEMORY_LIMIT`, `COMPUTE_LIMIT`)
and recorded with the prepared claim:

- `nvml-cgroup`: the driver's per-cgroup device memory limit (NVML's memory-limit calls on
  the pod's cgroup; R615 drivers and later, cgroup v2), enforced in the kernel driver;
- `mps-pinned-memory` / `mps-active-threads`: the claim's own MPS control daemon, whose
  default pinned-memory limit and active thread percentage every client it serves gets;
- `none`: the claim is sized for scheduling only (a time-sliced GPU without the kernel
  path).

Pure: plain functions over the claim's results and the published devices.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Required, TypedDict

from kubegpu.config.names import parse_quantity

# The mechanisms live with the resources, below the node labels that publish them too.
from kubegpu.resources import (
    ComputeLimit,
    MemoryLimit,
    ResourceSpec,
    Unit,
    mechanisms,
    sized,
    unit_memory_bytes,
)

#: Device attributes naming the mechanisms (kubegpu's own domain, see `kubegpu.dra.slices`).
MEMORY_LIMIT: Final = "kubegpu.io/memoryLimit"
COMPUTE_LIMIT: Final = "kubegpu.io/computeLimit"

_MIB: Final = 1 << 20


class DeviceLimitJson(TypedDict):
    """A `DeviceLimit` as the checkpoint file holds it."""

    device: str
    uuid: str
    memoryBytes: int
    shares: int
    totalShares: int


class LimitsJson(TypedDict, total=False):
    """`ClaimLimits` as the checkpoint file holds them."""

    memory: Required[str]
    compute: Required[str]
    devices: Required[list[DeviceLimitJson]]
    daemonDir: str
    cgroups: list[str]


class SizingError(ValueError):
    """A sized device's allocation result cannot be read as limits."""


@dataclass(frozen=True)
class DeviceLimit:
    """What one claim holds of one shared device."""

    #: The DRA device name (`gpu-3`).
    device: str
    gpu_uuid: str
    memory_bytes: int
    shares: int
    total_shares: int

    @property
    def memory_mib(self) -> int:
        return self.memory_bytes // _MIB

    @property
    def thread_percentage(self) -> int:
        """Its shares of the SMs, as MPS's active thread percentage (at least 1)."""
        return max(1, self.shares * 100 // self.total_shares)

    def to_json(self) -> DeviceLimitJson:
        return {
            "device": self.device,
            "uuid": self.gpu_uuid,
            "memoryBytes": self.memory_bytes,
            "shares": self.shares,
            "totalShares": self.total_shares,
        }

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> DeviceLimit:
        limit = cls(
            device=str(raw["device"]),
            gpu_uuid=str(raw["uuid"]),
            memory_bytes=int(raw["memoryBytes"]),
            shares=int(raw["shares"]),
            total_shares=int(raw["totalShares"]),
        )
        if limit.memory_mib < 1 or not 1 <= limit.shares <= limit.total_shares:
            raise ValueError(f"device limit out of range: {raw!r}")
        return limit


@dataclass(frozen=True)
class ClaimLimits:
    """The limits of one prepared claim, and where they are held (its checkpoint record)."""

    devices: tuple[DeviceLimit, ...]
    memory: MemoryLimit
    compute: ComputeLimit
    #: The claim's MPS control daemon's directory (`pipe/`, `log/`), once started.
    daemon_dir: str = ""
    #: The cgroups (paths as the host sees them) that got the kernel memory limit.
    cgroups: tuple[str, ...] = ()

    @property
    def mps(self) -> bool:
        """The claim has its own MPS control daemon."""
        return self.compute is ComputeLimit.MPS_THREADS

    @property
    def thread_percentage(self) -> int:
        """One percentage per daemon (MPS has no per-device one): the smallest share."""
        return min(d.thread_percentage for d in self.devices)

    def memory_mib(self) -> dict[str, int]:
        """Pinned device memory per GPU UUID, MiB."""
        return {d.gpu_uuid: d.memory_mib for d in self.devices}

    def with_applied(self, *, daemon_dir: str = "", cgroups: Sequence[str] = ()) -> ClaimLimits:
        return dataclasses.replace(self, daemon_dir=daemon_dir, cgroups=tuple(cgroups))

    def to_json(self) -> LimitsJson:
        out: LimitsJson = {
            "memory": self.memory.value,
            "compute": self.compute.value,
            "devices": [d.to_json() for d in self.devices],
        }
        if self.daemon_dir:
            out["daemonDir"] = self.daemon_dir
        if self.cgroups:
            out["cgroups"] = list(self.cgroups)
        return out

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> ClaimLimits:
        devices = tuple(DeviceLimit.from_json(d) for d in raw["devices"])
        if not devices:
            raise ValueError("limits without devices")
        return cls(
            devices=devices,
            memory=MemoryLimit(raw["memory"]),
            compute=ComputeLimit(raw["compute"]),
            daemon_dir=str(raw.get("daemonDir", "")),
            cgroups=tuple(str(c) for c in raw.get("cgroups", ())),
        )

    def consumed(self, device: str) -> dict[str, str]:
        """The device's `consumedCapacity` as the allocation result had it (to rebuild a
        claim's spec from its record)."""
        for d in self.devices:
            if d.device == device:
                return {"memory": str(d.memory_bytes), "shares": str(d.shares)}
        return {}


def device_limit(
    device: str,
    resource: ResourceSpec,
    unit: Unit,
    consumed: Sequence[Mapping[str, object]],
) -> DeviceLimit:
    """What a claim holds of a sized device, from its results' `consumedCapacity` (one per
    request that got the device; they add up).

    A result without one (an API server without DRAConsumableCapacity, where the device
    serves one claim at a time) holds the whole device. `SizingError` when a value is not
    one the scheduler writes.
    """
    total = resource.replicas
    whole = unit_memory_bytes(unit)
    memory = shares = 0
    taken = [entry for entry in consumed if entry]
    if not taken:
        return DeviceLimit(device, unit.gpu.uuid, whole, total, total)
    for entry in taken:
        memory += _amount(entry, "memory", device)
        shares += _amount(entry, "shares", device)
    if memory < _MIB or memory > whole:
        raise SizingError(
            f"device {device} was allocated {memory} bytes of memory; a sized device gives "
            f"from 1Mi to its {whole >> 20}Mi"
        )
    if not 1 <= shares <= total:
        raise SizingError(
            f"device {device} was allocated {shares} shares; it has 1 to {total} to give"
        )
    return DeviceLimit(device, unit.gpu.uuid, memory, shares, total)


def _amount(consumed: Mapping[str, object], name: str, device: str) -> int:
    value = consumed.get(name)
    if value is None:
        raise SizingError(f"device {device}'s consumedCapacity has no {name}")
    try:
        return parse_quantity(str(value))
    except ValueError:
        raise SizingError(
            f"device {device}'s consumedCapacity {name} is not a quantity the scheduler "
            f"writes ({str(value)[:40]!r})"
        ) from None


__all__ = [
    "COMPUTE_LIMIT",
    "MEMORY_LIMIT",
    "ClaimLimits",
    "ComputeLimit",
    "DeviceLimit",
    "DeviceLimitJson",
    "LimitsJson",
    "MemoryLimit",
    "SizingError",
    "device_limit",
    "mechanisms",
    "sized",
]
