"""GPU health: a pure policy (`HealthTracker`) and the async loop that feeds it.

Unlike NVIDIA's plugin, a device that went unhealthy can come back: once probes pass for
`recovery_seconds` after its last error it is advertised as healthy again (0 keeps the
old never-recover behaviour). The policy is a plain object with an injected clock so that
every rule is unit-tested without threads or sleeps; `HealthMonitor` owns the I/O and
the path is one line: the backend's blocking `watch` in a thread -> one queue -> the
tracker -> `store.update(health=...)`. A MIG reconfiguration re-discovers the devices
into `store.update(inventory=...)`. Whoever cares (plugins, metrics, Node events)
subscribes to the store.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from kubegpu.config.v1 import HealthFlags
from kubegpu.devices.model import DeviceBackend, Health, HealthEvent, HealthEventKind
from kubegpu.devices.stop import Stop
from kubegpu.errors import ConfigError
from kubegpu.metrics import Metrics
from kubegpu.state import NodeStore
from kubegpu.supervisor import spawn

log = logging.getLogger("kubegpu.health")

#: Well-known Xids and what they mean (NVIDIA's Xid catalogue), for log messages.
XID_MEANINGS: Mapping[int, str] = {
    13: "graphics engine exception",
    31: "GPU memory page fault",
    43: "GPU stopped processing",
    45: "preemptive cleanup, due to previous errors",
    48: "double-bit ECC error",
    61: "internal micro-controller breakpoint/warning",
    62: "internal micro-controller halt",
    63: "ECC page retirement or row remapping recording event",
    64: "ECC page retirement or row remapper recording failure",
    68: "video processor exception",
    69: "graphics engine class error",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    109: "context switch timeout",
    119: "GSP RPC timeout",
    120: "GSP error",
    121: "C2C link corrected error",
    140: "unrecovered ECC error",
}

ENV_DISABLE = "DP_DISABLE_HEALTHCHECKS"
ENV_ENABLE = "DP_ENABLE_HEALTHCHECKS"


def describe_xid(xid: int | None) -> str:
    if xid is None:
        return "hardware error"
    meaning = XID_MEANINGS.get(xid)
    return f"Xid {xid} ({meaning})" if meaning else f"Xid {xid}"


@dataclass(frozen=True)
class _Fault:
    """Why and since when a device is unhealthy."""

    reason: str
    last_error: float
    last_probe: float | None = None


class HealthTracker:
    """Which devices (GPU or MIG UUIDs) are unhealthy, and when they may recover."""

    def __init__(self, settings: HealthFlags, clock: Callable[[], float]) -> None:
        self.settings = settings
        self._clock = clock
        self._faults: dict[str, _Fault] = {}

    def observe(self, event: HealthEvent) -> bool:
        """Apply one event; True when the health map changed."""
        if self.settings.disabled:
            return False
        now = self._clock()
        kind = event.kind
        if kind is HealthEventKind.XID:
            xid = event.xid
            ignored = xid in self.settings.ignored_xids and xid not in self.settings.critical_xids
            if xid is not None and ignored:
                return False
            reason = describe_xid(xid)
            return self._mark(
                event.uuid, f"{reason}: {event.detail}" if event.detail else reason, now
            )
        if kind is HealthEventKind.PROBE_FAILED:
            return self._mark(event.uuid, f"probe failed: {event.detail or 'no detail'}", now)
        fault = self._faults.get(event.uuid)
        if fault is None:
            return False
        if kind is HealthEventKind.HEALED:
            del self._faults[event.uuid]
            return True
        if kind is HealthEventKind.PROBE_OK:
            recovery = self.settings.recovery_seconds
            if recovery > 0 and now - fault.last_error >= recovery:
                del self._faults[event.uuid]
                return True
            self._faults[event.uuid] = _Fault(fault.reason, fault.last_error, now)
        return False

    def _mark(self, uuid: str, reason: str, now: float) -> bool:
        changed = uuid not in self._faults
        self._faults[uuid] = _Fault(reason, now, now)
        return changed

    def health(self) -> Mapping[str, Health]:
        """The unhealthy devices; anything not listed is healthy."""
        return dict.fromkeys(self._faults, Health.UNHEALTHY)

    def reason(self, uuid: str) -> str | None:
        fault = self._faults.get(uuid)
        return None if fault is None else fault.reason

    def due_probes(self) -> list[str]:
        """Unhealthy devices not probed within the last probe interval (none if never healing)."""
        if self.settings.recovery_seconds == 0:
            return []
        now = self._clock()
        interval = self.settings.probe_interval_seconds
        return sorted(
            uuid
            for uuid, fault in self._faults.items()
            if fault.last_probe is None or now - fault.last_probe >= interval
        )


def _xid_list(variable: str, tokens: list[str]) -> tuple[int, ...]:
    xids = []
    for token in tokens:
        if not token.isdigit():
            raise ConfigError(
                f"{variable}: {token!r} is not an Xid number; use a comma list like 48,79"
                + (" or 'all'/'xids'" if variable == ENV_DISABLE else " or 'all'")
            )
        xids.append(int(token))
    return tuple(xids)


def health_flags_from_env(env: Mapping[str, str], base: HealthFlags) -> HealthFlags:
    """Apply NVIDIA's health env vars on top of `base`.

    `DP_DISABLE_HEALTHCHECKS`: `all` or `xids` turns checks off; Xid numbers join the
    ignore list. `DP_ENABLE_HEALTHCHECKS`: Xid numbers become critical (overriding the
    ignore list); `all` makes every Xid critical.
    """

    def tokens(variable: str) -> list[str]:
        return [t.strip().lower() for t in env.get(variable, "").split(",") if t.strip()]

    disabled = base.disabled
    ignored = list(base.ignored_xids)
    critical = list(base.critical_xids)
    disable = tokens(ENV_DISABLE)
    if "all" in disable or "xids" in disable:
        disabled = True
        disable = [t for t in disable if t not in ("all", "xids")]
    ignored += [x for x in _xid_list(ENV_DISABLE, disable) if x not in ignored]
    enable = tokens(ENV_ENABLE)
    if "all" in enable:
        ignored = []
        enable = [t for t in enable if t != "all"]
    critical += [x for x in _xid_list(ENV_ENABLE, enable) if x not in critical]
    return dataclasses.replace(
        base, disabled=disabled, ignored_xids=tuple(ignored), critical_xids=tuple(critical)
    )


class HealthMonitor:
    """Runs a backend's health watch and probes; writes health and inventory to the store."""

    def __init__(
        self,
        backend: DeviceBackend,
        settings: HealthFlags,
        store: NodeStore,
        clock: Callable[[], float] = time.monotonic,
        *,
        metrics: Metrics | None = None,
        join_timeout: float = 5.0,
    ) -> None:
        self.backend = backend
        self.settings = settings
        self.tracker = HealthTracker(settings, clock)
        self.store = store
        #: Counts every raw Xid, even ignored ones (not state: a counter of events seen).
        self._metrics = metrics
        self._join_timeout = join_timeout

    async def run(self) -> None:
        """Watch and probe until cancelled; the watch thread is stopped and joined on exit."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[HealthEvent] = asyncio.Queue()
        stop = Stop()

        def emit(event: HealthEvent) -> None:
            # Called from the watch thread; after shutdown the loop may be gone.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(queue.put_nowait, event)

        watcher = threading.Thread(
            target=self._watch, args=(stop, emit), name="kubegpu-health-watch", daemon=True
        )
        watcher.start()
        if self.settings.disabled:
            log.info("health checks are disabled: every device stays healthy")
        # Probes beside the consumer; a failure of either ends `run` (a root task).
        probes = spawn("health probes", self._probe_loop())
        consumer = spawn("health events", self._consume(queue))
        try:
            done, _ = await asyncio.wait({probes, consumer}, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()
        finally:
            for task in (probes, consumer):
                task.cancel()
            await asyncio.gather(probes, consumer, return_exceptions=True)
            stop.set()
            await asyncio.shield(asyncio.to_thread(watcher.join, self._join_timeout))
            if watcher.is_alive():
                log.warning(
                    "backend %s did not stop watching within %.0fs",
                    self.backend.name,
                    self._join_timeout,
                )

    def _watch(self, stop: Stop, emit: Callable[[HealthEvent], None]) -> None:
        """Run the backend's watch, restarting it if it crashes (a bug must not end checks)."""
        while not stop.is_set():
            try:
                self.backend.watch(stop, emit)
            except Exception:
                log.exception(
                    "health watch of backend %s failed; restarting in 5s", self.backend.name
                )
                stop.wait(5.0)

    async def _consume(self, queue: asyncio.Queue[HealthEvent]) -> None:
        while True:
            event = await queue.get()
            if event.kind is HealthEventKind.RECONFIGURED:
                await self._rediscover(event.uuid)
            else:
                self.handle(event)

    async def _rediscover(self, uuid: str) -> None:
        """A MIG layout changed: discover again; the store takes it only if it serves."""
        log.info("%s reconfigured: rediscovering devices", uuid)
        try:
            inventory = await asyncio.to_thread(self.backend.discover)
        except Exception as exc:  # keep serving the last inventory
            log.error("re-discovery failed, keeping the last device list: %s", exc)
            return
        try:
            self.store.update(inventory=inventory)
        except ConfigError as exc:
            # A MIG layout the config can't use (e.g. single with mixed profiles).
            log.error("the new device layout does not fit the config; keeping the last: %s", exc)

    async def _probe_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.probe_interval_seconds)
            for uuid in self.tracker.due_probes():
                failure = await asyncio.to_thread(self.backend.probe, uuid)
                if failure is None:
                    self.handle(HealthEvent(uuid, HealthEventKind.PROBE_OK))
                else:
                    self.handle(HealthEvent(uuid, HealthEventKind.PROBE_FAILED, detail=failure))

    def handle(self, event: HealthEvent) -> None:
        """Feed one health event (on the loop thread); store and log any change."""
        if event.kind is HealthEventKind.XID and event.xid is not None and self._metrics:
            self._metrics.xid(event.uuid, event.xid)
        before = self.tracker.health()
        if not self.tracker.observe(event):
            if (
                event.kind is HealthEventKind.XID
                and event.uuid not in before
                and not self.settings.disabled
            ):
                log.info(
                    "%s: ignoring %s (in the ignored Xid list)", event.uuid, describe_xid(event.xid)
                )
            return
        after = self.tracker.health()
        for uuid in sorted(after.keys() - before.keys()):
            log.warning("%s unhealthy: %s", uuid, self.tracker.reason(uuid))
        for uuid in sorted(before.keys() - after.keys()):
            how = "healed by operator" if event.kind is HealthEventKind.HEALED else "probes pass"
            log.info("%s healthy again (%s)", uuid, how)
        self.store.update(health=after)


__all__ = [
    "XID_MEANINGS",
    "HealthMonitor",
    "HealthTracker",
    "describe_xid",
    "health_flags_from_env",
]
