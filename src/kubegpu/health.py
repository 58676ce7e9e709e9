"""GPU health: a pure policy (`HealthTracker`) and the async loop that feeds it.

What an Xid does comes from NVIDIA's Xid catalog (`kubegpu.xid_catalog`): application
errors are ignored, a fault the catalog resolves with a GPU reset or a reboot keeps the GPU
unhealthy until a reset is observed, anything else marks it unhealthy until its probes pass.
The operator's lists (`ignored_xids`, `critical_xids`, NVIDIA's `DP_*_HEALTHCHECKS` tokens)
and per-Xid overrides sit on top (`XidPolicy`).

Unlike NVIDIA's plugin, a device that went unhealthy can come back: once probes pass for
`recovery_seconds` after its last error it is advertised as healthy again (0 keeps the
old never-recover behaviour). A reset is observed when, after the fault, a probe fails (the
GPU dropped out of NVML, or NVML reports the reset still pending) and probes then pass: the
timer counts from that failure. The policy is a plain object with an injected clock so that
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

import msgspec

from kubegpu.config.v1 import HealthFlags
from kubegpu.devices.model import DeviceBackend, Fault, Health, HealthEvent, HealthEventKind
from kubegpu.devices.stop import Stop
from kubegpu.errors import ConfigError
from kubegpu.metrics import Metrics
from kubegpu.state import NodeStore
from kubegpu.supervisor import spawn
from kubegpu.xid_catalog import CATALOG, XidOutcome, catalog_outcome

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

#: How long a probe may take before it counts as failed (NVML calls can hang on a sick GPU).
PROBE_TIMEOUT_S = 10.0

ENV_DISABLE = "DP_DISABLE_HEALTHCHECKS"
ENV_ENABLE = "DP_ENABLE_HEALTHCHECKS"


def describe_xid(xid: int | None) -> str:
    if xid is None:
        return "hardware error"
    meaning = XID_MEANINGS.get(xid)
    if meaning is None and xid in CATALOG and CATALOG[xid].description != "Unused":
        meaning = CATALOG[xid].description
    return f"Xid {xid} ({meaning})" if meaning else f"Xid {xid}"


@dataclass(frozen=True)
class XidPolicy:
    """What each Xid does, from the catalog and the operator's settings (pure data).

    Highest first: `critical_xids` (config `criticalXids`, `DP_ENABLE_HEALTHCHECKS`) never
    ignore an Xid, though one the catalog resolves with a reset keeps that outcome;
    `overrides` (Xid -> outcome, meant for a per-Xid config key) say exactly what an Xid
    does; `ignored_xids` (config `ignoredXids`, `DP_DISABLE_HEALTHCHECKS`) ignore it;
    otherwise the catalog decides, and an Xid it does not list marks the device unhealthy.
    """

    ignored: frozenset[int] = frozenset()
    critical: frozenset[int] = frozenset()
    overrides: Mapping[int, XidOutcome] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_flags(
        cls, settings: HealthFlags, overrides: Mapping[int, XidOutcome] | None = None
    ) -> XidPolicy:
        return cls(
            frozenset(settings.ignored_xids),
            frozenset(settings.critical_xids),
            dict(settings.xid_overrides if overrides is None else overrides),
        )

    def outcome(self, xid: int | None) -> XidOutcome:
        if xid is None:
            # A hardware error reported without an Xid number: never ignored.
            return XidOutcome.UNHEALTHY
        if xid in self.overrides:
            outcome = self.overrides[xid]
        elif xid in self.ignored:
            outcome = XidOutcome.IGNORE
        else:
            outcome = catalog_outcome(xid)
        if xid in self.critical and outcome is XidOutcome.IGNORE:
            outcome = max(catalog_outcome(xid), XidOutcome.UNHEALTHY, key=_SEVERITY.index)
        return outcome


_SEVERITY = [XidOutcome.IGNORE, XidOutcome.UNHEALTHY, XidOutcome.UNTIL_RESET]


def xid_overrides(values: Mapping[int | str, str]) -> dict[int, XidOutcome]:
    """Validate a per-Xid override mapping (as a config file gives it): Xid -> outcome."""
    result: dict[int, XidOutcome] = {}
    choices = ", ".join(o.value for o in XidOutcome)
    for key, value in values.items():
        xid = int(key) if isinstance(key, int) or str(key).isdigit() else None
        if xid is None:
            raise ConfigError(f"Xid override {key!r}: the key must be an Xid number, like 48")
        try:
            result[xid] = XidOutcome(str(value).strip().lower())
        except ValueError:
            raise ConfigError(
                f"Xid override {xid}: {value!r} is not an outcome; use one of {choices}"
            ) from None
    return result


@dataclass(frozen=True)
class _Fault:
    """Why and since when a device is unhealthy."""

    reason: str
    last_error: float
    last_probe: float | None = None
    #: An Xid that needs a GPU reset: passing probes do not heal it until one is observed.
    awaiting_reset: bool = False
    #: The Xid that made the device unhealthy; None for a failed probe (a DRA taint's value).
    xid: int | None = None


class HealthTracker:
    """Which devices (GPU or MIG UUIDs) are unhealthy, and when they may recover."""

    def __init__(
        self,
        settings: HealthFlags,
        clock: Callable[[], float],
        xid_overrides: Mapping[int, XidOutcome] | None = None,
    ) -> None:
        self.settings = settings
        self.policy = XidPolicy.from_flags(settings, xid_overrides)
        self._clock = clock
        self._faults: dict[str, _Fault] = {}

    def observe(self, event: HealthEvent) -> bool:
        """Apply one event; True when the health map changed."""
        if self.settings.disabled:
            return False
        now = self._clock()
        kind = event.kind
        if kind is HealthEventKind.XID:
            outcome = self.policy.outcome(event.xid)
            if outcome is XidOutcome.IGNORE:
                return False
            reason = describe_xid(event.xid)
            # Another Xid never ends the wait for a reset; only a failed probe does.
            awaiting = outcome is XidOutcome.UNTIL_RESET or self.awaiting_reset(event.uuid)
            return self._mark(
                event.uuid,
                f"{reason}: {event.detail}" if event.detail else reason,
                now,
                awaiting_reset=awaiting,
                xid=event.xid,
            )
        if kind is HealthEventKind.PROBE_FAILED:
            # A probe failing after a reset-requiring Xid is the reset under way (the GPU
            # dropped out of NVML, or NVML says the reset is pending): from here the usual
            # timer applies, counted from the last failure.
            detail = f"probe failed: {event.detail or 'no detail'}"
            return self._mark(event.uuid, detail, now, awaiting_reset=False)
        fault = self._faults.get(event.uuid)
        if fault is None:
            return False
        if kind is HealthEventKind.HEALED:
            del self._faults[event.uuid]
            return True
        if kind is HealthEventKind.PROBE_OK:
            recovery = self.settings.recovery_seconds
            if not fault.awaiting_reset and recovery > 0 and now - fault.last_error >= recovery:
                del self._faults[event.uuid]
                return True
            self._faults[event.uuid] = dataclasses.replace(fault, last_probe=now)
        return False

    def _mark(
        self, uuid: str, reason: str, now: float, *, awaiting_reset: bool, xid: int | None = None
    ) -> bool:
        previous = self._faults.get(uuid)
        if previous is not None and previous.awaiting_reset:
            # The reset-requiring fault keeps its reason: a later error is its symptom.
            reason, xid = previous.reason, previous.xid
        self._faults[uuid] = _Fault(reason, now, now, awaiting_reset, xid)
        return previous is None

    def awaiting_reset(self, uuid: str) -> bool:
        """True while a device's fault needs a GPU reset before probes can heal it."""
        fault = self._faults.get(uuid)
        return fault is not None and fault.awaiting_reset

    def health(self) -> Mapping[str, Health]:
        """The unhealthy devices; anything not listed is healthy."""
        return dict.fromkeys(self._faults, Health.UNHEALTHY)

    def faults(self) -> Mapping[str, Fault]:
        """Unhealthy device -> why: the Xid that made it so (None: its probes failed) and
        the reason in words."""
        return {uuid: Fault(fault.xid, fault.reason) for uuid, fault in self._faults.items()}

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
    ignore list and the catalog's ignores); `all` makes every Xid critical. Either way the
    tokens decide over the Xid catalog for the Xids they name (`XidPolicy`).
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
        # Every Xid critical: the ignore list goes, and so do the catalog's own ignores.
        ignored = []
        critical += [x for x in sorted(CATALOG) if catalog_outcome(x) is XidOutcome.IGNORE]
        enable = [t for t in enable if t != "all"]
    critical += [x for x in _xid_list(ENV_ENABLE, enable) if x not in critical]
    return msgspec.structs.replace(
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
        xid_overrides: Mapping[int, XidOutcome] | None = None,
        probe_timeout: float = PROBE_TIMEOUT_S,
    ) -> None:
        self.backend = backend
        self.settings = settings
        self.tracker = HealthTracker(settings, clock, xid_overrides)
        self.store = store
        #: Counts every raw Xid, even ignored ones (not state: a counter of events seen).
        self._metrics = metrics
        self._join_timeout = join_timeout
        self._probe_timeout = probe_timeout
        #: Probes still running in a worker thread (a hung NVML call), by device UUID.
        self._hung: dict[str, asyncio.Task[str | None]] = {}

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
                failure = await self._probe(uuid)
                if failure is None:
                    self.handle(HealthEvent(uuid, HealthEventKind.PROBE_OK))
                else:
                    self.handle(HealthEvent(uuid, HealthEventKind.PROBE_FAILED, detail=failure))

    async def _probe(self, uuid: str) -> str | None:
        """The backend's probe, bounded in time; any failure is an answer, never an exception.

        A probe stuck in NVML (a GPU that stopped answering) cannot be interrupted: it is left
        running in its thread and counted as failed until it returns, so one dead GPU neither
        stalls the probes of the others nor piles up threads.
        """
        hung = self._hung.get(uuid)
        if hung is not None:
            if not hung.done():
                return f"NVML has not answered for more than {self._probe_timeout:g}s"
            del self._hung[uuid]
        call = spawn(f"probe {uuid}", asyncio.to_thread(self.backend.probe, uuid))
        try:
            return await asyncio.wait_for(asyncio.shield(call), self._probe_timeout)
        except TimeoutError:
            self._hung[uuid] = call
            return f"NVML did not answer within {self._probe_timeout:g}s"
        except Exception as exc:  # a backend bug must not end health checks (spawn logs it)
            return f"probe error: {exc}"

    def handle(self, event: HealthEvent) -> None:
        """Feed one health event (on the loop thread); store and log any change."""
        if event.kind is HealthEventKind.XID and event.xid is not None and self._metrics:
            self._metrics.xid(event.uuid, event.xid)
        before = self.tracker.health()
        why = self.tracker.faults()
        if not self.tracker.observe(event):
            if (
                event.kind is HealthEventKind.XID
                and event.uuid not in before
                and not self.settings.disabled
            ):
                log.info(
                    "%s: ignoring %s (in the ignored Xid list)", event.uuid, describe_xid(event.xid)
                )
            faults = self.tracker.faults()
            if faults != why:
                # Still unhealthy, for a newer reason (another Xid): a DRA taint names it.
                self.store.update(faults=faults)
            return
        after = self.tracker.health()
        for uuid in sorted(after.keys() - before.keys()):
            until = " (stays unhealthy until the GPU is reset)"
            log.warning(
                "%s unhealthy: %s%s",
                uuid,
                self.tracker.reason(uuid),
                until if self.tracker.awaiting_reset(uuid) else "",
            )
        for uuid in sorted(before.keys() - after.keys()):
            how = "healed by operator" if event.kind is HealthEventKind.HEALED else "probes pass"
            log.info("%s healthy again (%s)", uuid, how)
        self.store.update(health=after, faults=self.tracker.faults())


__all__ = [
    "PROBE_TIMEOUT_S",
    "XID_MEANINGS",
    "HealthMonitor",
    "HealthTracker",
    "XidOutcome",
    "XidPolicy",
    "describe_xid",
    "health_flags_from_env",
    "xid_overrides",
]
