"""The kubelet emulator's device health cache, as pkg/kubelet/cm/dra/healthinfo.go keeps it."""

from __future__ import annotations

from kubegpu.api import dra_health_pb2 as pb
from tests.rig.dra.health import (
    DEFAULT_HEALTH_TIMEOUT,
    HEALTHY,
    UNHEALTHY,
    UNKNOWN,
    DeviceHealth,
    HealthInfoCache,
    device_health,
)

DRIVER = "gpu.nvidia.com"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def reported(
    name: str, health: pb.HealthStatus, timeout: int = 0, message: str = ""
) -> DeviceHealth:
    return device_health(
        pb.DeviceHealth(
            device=pb.DeviceIdentifier(pool_name="n1", device_name=name),
            health=health,
            last_updated_time=5,  # the driver's time: the kubelet stamps its own
            health_check_timeout_seconds=timeout,
            message=message,
        )
    )


def test_a_report_holds_for_its_timeout_then_reads_unknown() -> None:
    clock = Clock()
    cache = HealthInfoCache(clock)
    assert cache.get(DRIVER, "n1", "gpu-0").health == UNKNOWN  # never reported
    changed = cache.update(DRIVER, [reported("gpu-0", pb.HEALTHY, timeout=60)])
    assert [(d.device_name, d.health, d.last_updated) for d in changed] == [
        ("gpu-0", HEALTHY, 1000.0)
    ]
    clock.now += 60
    assert cache.get(DRIVER, "n1", "gpu-0").health == HEALTHY
    clock.now += 1
    assert cache.get(DRIVER, "n1", "gpu-0").health == UNKNOWN


def test_zero_or_negative_timeouts_mean_the_kubelets_default() -> None:
    assert reported("gpu-0", pb.HEALTHY, timeout=0).timeout == DEFAULT_HEALTH_TIMEOUT
    assert reported("gpu-0", pb.HEALTHY, timeout=-5).timeout == DEFAULT_HEALTH_TIMEOUT
    assert reported("gpu-0", pb.HEALTHY, timeout=7).timeout == 7.0


def test_only_changes_are_reported_and_a_missing_device_turns_unknown_after_its_timeout() -> None:
    clock = Clock()
    cache = HealthInfoCache(clock)
    cache.update(DRIVER, [reported("gpu-0", pb.HEALTHY), reported("gpu-1", pb.HEALTHY)])
    assert (
        cache.update(DRIVER, [reported("gpu-0", pb.HEALTHY), reported("gpu-1", pb.HEALTHY)]) == []
    )
    moved = cache.update(
        DRIVER, [reported("gpu-0", pb.HEALTHY), reported("gpu-1", pb.UNHEALTHY, message="Xid 79")]
    )
    assert [(d.device_name, d.health, d.message) for d in moved] == [("gpu-1", UNHEALTHY, "Xid 79")]
    # gpu-1 left out: still as last reported until its timeout, then Unknown.
    assert cache.update(DRIVER, [reported("gpu-0", pb.HEALTHY)]) == []
    clock.now += DEFAULT_HEALTH_TIMEOUT + 1
    stale = cache.update(DRIVER, [reported("gpu-0", pb.HEALTHY)])
    assert [(d.device_name, d.health, d.message) for d in stale] == [("gpu-1", UNKNOWN, "")]


def test_a_long_message_is_cut_as_the_kubelet_cuts_it() -> None:
    message = reported("gpu-0", pb.UNHEALTHY, message="x" * 2000).message
    assert len(message) == 1024
    assert message.endswith("x...")


def test_an_ended_stream_forgets_the_driver() -> None:
    cache = HealthInfoCache(Clock())
    cache.update(DRIVER, [reported("gpu-0", pb.UNHEALTHY)])
    cache.update("other.example.com", [reported("gpu-0", pb.HEALTHY)])
    cache.clear(DRIVER)
    assert cache.get(DRIVER, "n1", "gpu-0").health == UNKNOWN
    assert cache.get("other.example.com", "n1", "gpu-0").health == HEALTHY
