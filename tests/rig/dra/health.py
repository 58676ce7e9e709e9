"""The kubelet's DRA device health: what drivers stream, and what pods' status shows.

Written from `pkg/kubelet/cm/dra/healthinfo.go` (healthInfoCache: updateHealthInfo,
getHealthInfo, clearDriver) and `manager.go` (HandleWatchResourcesStream, buildDeviceHealth,
UpdateAllocatedResourcesStatus, buildResourceHealth). What the kubelet does and we do too:

- Each response of a driver's `NodeWatchResources` stream is the driver's complete list.
  A reported device is stamped with the time the kubelet received it (not the driver's
  `last_updated_time`) and keeps its own timeout (`health_check_timeout_seconds`, 30 s when
  zero or negative); a device whose report is older than its timeout reads as Unknown.
- A report counts as a change when the device is new or its health, message or timeout
  moved; a device missing from a response turns Unknown once its timeout has passed.
  A change notifies the pods whose prepared claims hold the device.
- When the stream ends (any way) the driver's health is forgotten: its devices read Unknown.
- A container with claims shows, per claim reference, `claim:<name>` or
  `claim:<name>/<request>` in `allocatedResourcesStatus`, each device of the claim (of that
  request; a subrequest counts for its request) as one entry whose `resourceID` is the
  device's first CDI device ID, else `<driver>/<pool>/<device>`, deduplicated by ID; a
  message (cut to 1024 characters) when the driver gave one (ResourceHealthStatusMessage,
  beta and on by default in 1.36). Init containers are not looked at.

Deliberate differences: the cache is not checkpointed (`dra_health_state`): a restarted
emulator starts with no health, as one whose drivers' streams all ended; entries are
sorted (the kubelet's order follows Go maps).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any, Final

from kubegpu.api import dra_health_pb2 as pb
from tests.rig.dra.state import ClaimInfo

#: `DefaultHealthTimeout`.
DEFAULT_HEALTH_TIMEOUT: Final = 30.0
#: `v1.ResourceHealthMessageMaxLength`.
MESSAGE_MAX: Final = 1024

HEALTHY: Final = "Healthy"
UNHEALTHY: Final = "Unhealthy"
UNKNOWN: Final = "Unknown"
_STATUS: Final = {pb.HEALTHY: HEALTHY, pb.UNHEALTHY: UNHEALTHY}


@dataclass(frozen=True)
class DeviceHealth:
    """One device's health as the kubelet keeps it (`state.DeviceHealth`)."""

    pool_name: str
    device_name: str
    health: str = UNKNOWN
    message: str = ""
    last_updated: float = 0.0
    timeout: float = DEFAULT_HEALTH_TIMEOUT

    @property
    def key(self) -> str:
        return f"{self.pool_name}/{self.device_name}"


def device_health(reported: pb.DeviceHealth) -> DeviceHealth:
    """`buildDeviceHealth`: a reported device, before the kubelet stamps its own time."""
    seconds = reported.health_check_timeout_seconds
    message = reported.message
    if len(message) > MESSAGE_MAX:
        message = message[: MESSAGE_MAX - 3] + "..."
    return DeviceHealth(
        pool_name=reported.device.pool_name,
        device_name=reported.device.device_name,
        health=_STATUS.get(reported.health, UNKNOWN),
        message=message,
        last_updated=float(reported.last_updated_time),
        timeout=float(seconds) if seconds > 0 else DEFAULT_HEALTH_TIMEOUT,
    )


class HealthInfoCache:
    """Driver -> "pool/device" -> `DeviceHealth` (`healthInfoCache`)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._drivers: dict[str, dict[str, DeviceHealth]] = {}

    def get(self, driver: str, pool: str, device: str) -> DeviceHealth:
        """The device's health, Unknown when unreported or older than its timeout."""
        found = self._drivers.get(driver, {}).get(f"{pool}/{device}")
        if found is None or self.clock() - found.last_updated > found.timeout:
            return DeviceHealth(pool, device)
        return found

    def update(self, driver: str, devices: Iterable[DeviceHealth]) -> list[DeviceHealth]:
        """Store one response of `driver`'s stream; the devices whose health changed."""
        now = self.clock()
        current = self._drivers.setdefault(driver, {})
        changed: list[DeviceHealth] = []
        reported: set[str] = set()
        for device in devices:
            device = replace(device, last_updated=now)
            reported.add(device.key)
            old = current.get(device.key)
            if old is None or (old.health, old.message, old.timeout) != (
                device.health,
                device.message,
                device.timeout,
            ):
                changed.append(device)
            current[device.key] = device
        for key, old in list(current.items()):
            if key in reported or old.health == UNKNOWN or now - old.last_updated <= old.timeout:
                continue
            stale = replace(old, health=UNKNOWN, message="", last_updated=now)
            current[key] = stale
            changed.append(stale)
        return changed

    def clear(self, driver: str) -> None:
        """Forget `driver` (its stream ended)."""
        self._drivers.pop(driver, None)


def holds(info: ClaimInfo, driver: str, changed: Iterable[DeviceHealth]) -> bool:
    """Whether the claim holds any of `driver`'s `changed` devices."""
    keys = {d.key for d in changed}
    return any(
        f"{dev.pool_name}/{dev.device_name}" in keys for dev in info.driver_state.get(driver, ())
    )


def resource_health(
    driver: str, pool: str, device: str, cdi_ids: tuple[str, ...], health: DeviceHealth
) -> dict[str, Any]:
    """One `allocatedResourcesStatus[].resources[]` entry (`buildResourceHealth`)."""
    entry: dict[str, Any] = {
        "resourceID": cdi_ids[0] if cdi_ids else f"{driver}/{pool}/{device}",
        "health": health.health,
    }
    if health.message:
        entry["message"] = health.message
    return entry


__all__ = [
    "DEFAULT_HEALTH_TIMEOUT",
    "HEALTHY",
    "UNHEALTHY",
    "UNKNOWN",
    "DeviceHealth",
    "HealthInfoCache",
    "device_health",
    "holds",
    "resource_health",
]
