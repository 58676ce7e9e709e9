"""`UsageCollector`: one snapshot of who uses what on the node's GPUs, taken when scraped.

Each `collect` reads, in a worker thread (the driver blocks): the backend's process table,
each process's cgroup under the proc root, and what kubegpu gave out: in device plugin mode
the kubelet's PodResources `List` joined with its device checkpoint for pod UIDs; in DRA
mode the driver's prepared claims (its checkpoint) and, where the kubelet reports them, the
containers using each claim device. A source that cannot be read costs its part only (its
processes fall under `unattributed`) and shows as `kubegpu_usage_source_up 0`.

Collections do not overlap: a scrape arriving while one runs waits for it (up to
`wait_seconds`) and answers the same snapshot, so a stuck driver holds one thread, not one
per scrape.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from kubegpu.api import POD_RESOURCES_SOCKET
from kubegpu.devices import ProcessSource, ProcessTable
from kubegpu.metrics import DeviceHealthRow, UsageSnapshot
from kubegpu.resources import ResourceSpec, Unit
from kubegpu.state import NodeState
from kubegpu.untrusted import escape
from kubegpu.usage.attribution import (
    Allocation,
    ClaimDevices,
    capped,
    device_health,
    dra_allocations,
    plugin_allocations,
    usage_rows,
)
from kubegpu.usage.cgroup import PodCgroup, read_cgroup
from kubegpu.usage.kubelet import (
    CheckpointReader,
    PodResourcesClient,
    PodResourcesListing,
    PodUids,
    SourceError,
)

log = logging.getLogger("kubegpu.usage")

T = TypeVar("T")

#: Rows per scrape at most (each row is up to four series): far above a node's containers
#: times its devices, a bound against anything that could multiply them.
DEFAULT_MAX_ROWS = 1024
#: The kubelet's device checkpoint, in the device-plugin directory.
KUBELET_CHECKPOINT = "kubelet_internal_checkpoint"


@dataclass(frozen=True)
class UsageSettings:
    #: Where the host's /proc is (`/host/proc` in the chart): NVML reports host PIDs.
    proc_root: Path = Path("/proc")
    #: The kubelet's PodResources socket; None: do not ask.
    pod_resources_socket: Path | None = Path(POD_RESOURCES_SOCKET)
    #: The kubelet's device checkpoint (plugin mode), for pod UIDs; None: none.
    kubelet_checkpoint: Path | None = None
    #: The `Hostname` label (the node's name).
    hostname: str = ""
    max_rows: int = DEFAULT_MAX_ROWS
    #: How long a scrape waits for a collection already running.
    wait_seconds: float = 10.0


@dataclass(frozen=True)
class DraView:
    """What DRA mode reads of the DRA driver (`kubegpu.dra.usage.dra_view` builds it)."""

    driver: str
    #: This node's pool (the node name).
    pool: str
    #: The prepared claims (`SourceError` when they cannot be read).
    claims: Callable[[], tuple[ClaimDevices, ...]]
    #: The driver's devices by published name, for these resources.
    devices: Callable[[tuple[ResourceSpec, ...]], dict[str, tuple[Unit, ResourceSpec]]]


class UsageCollector:
    """Takes `UsageSnapshot`s for `Metrics.follow_usage` (blocking; see the module doc)."""

    def __init__(
        self,
        settings: UsageSettings,
        *,
        backend: Callable[[], object | None],
        state: Callable[[], NodeState],
        dra: Callable[[], DraView | None] | None = None,
        pod_resources: PodResourcesClient | None = None,
    ) -> None:
        self.settings = settings
        self._backend = backend
        self._state = state
        self._dra = dra
        socket = settings.pod_resources_socket
        self._pod_resources = pod_resources or (
            PodResourcesClient(socket) if socket is not None else None
        )
        path = settings.kubelet_checkpoint
        self._checkpoint = CheckpointReader(path) if path is not None else None
        self._lock = threading.Lock()
        self._last = UsageSnapshot()
        #: Source -> the last failure logged, so a source down logs once, not per scrape.
        self._failing: dict[str, str] = {}

    def __call__(self) -> UsageSnapshot:
        return self.collect()

    def collect(self) -> UsageSnapshot:
        if not self._lock.acquire(timeout=self.settings.wait_seconds):
            return self._last  # a collection is stuck (the driver hangs): the last one
        try:
            self._last = self._collect()
            return self._last
        finally:
            self._lock.release()

    def devices(self) -> tuple[DeviceHealthRow, ...]:
        """The node's GPUs and MIG slices and their health, for `Metrics.follow_devices`:
        from the node's state only, so it answers while the driver hangs."""
        state = self._state()
        return device_health(state.inventory, state.health, self.settings.hostname)

    def _collect(self) -> UsageSnapshot:
        start = time.perf_counter()
        sources: dict[str, bool] = {}
        state = self._state()
        backend = self._backend()
        table = ProcessTable()
        if isinstance(backend, ProcessSource):
            table = backend.processes()
            sources["processes"] = not table.failures
            self._note("processes", "; ".join(f"{k}: {v}" for k, v in table.failures.items()))
        owners: dict[int, PodCgroup | None] = {}
        for process in table.processes:
            if process.pid not in owners:
                owners[process.pid] = read_cgroup(self.settings.proc_root, process.pid)
        allocations = self._allocations(state, sources)
        rows = usage_rows(table, owners, allocations, state.inventory, self.settings.hostname)
        kept, dropped = capped(rows, self.settings.max_rows)
        if dropped:
            self._note("rows", f"{dropped} rows over --usage-max-rows left out")
        return UsageSnapshot(kept, sources, dropped, time.perf_counter() - start)

    def _allocations(self, state: NodeState, sources: dict[str, bool]) -> tuple[Allocation, ...]:
        listing = PodResourcesListing()
        if self._pod_resources is not None:
            listing = self._read("pod-resources", sources, self._pod_resources.list, listing)
        if self._dra is not None:
            view = self._dra()
            if view is None:
                return ()  # the driver is not up yet: nothing prepared to attribute to
            none: tuple[ClaimDevices, ...] = ()
            claims = self._read("dra-checkpoint", sources, view.claims, none)
            return dra_allocations(
                claims,
                listing.claim_devices,
                view.devices(state.planned),
                driver=view.driver,
                pool=view.pool,
            )
        uids: PodUids = {}
        if self._checkpoint is not None:
            uids = self._read("kubelet-checkpoint", sources, self._checkpoint.pod_uids, uids)
        return plugin_allocations(listing.devices, state.planned, uids)

    def _read(self, name: str, sources: dict[str, bool], read: Callable[[], T], empty: T) -> T:
        try:
            value = read()
        except SourceError as err:
            sources[name] = False
            self._note(name, str(err))
            return empty
        sources[name] = True
        self._note(name, "")
        return value

    def _note(self, source: str, failure: str) -> None:
        """Log a source's failure when it starts or changes, and its recovery."""
        before = self._failing.get(source, "")
        if failure == before:
            return
        if failure:
            self._failing[source] = failure
            log.warning("GPU usage metrics: %s: %s", source, escape(failure, 400))
        else:
            self._failing.pop(source, None)
            log.info("GPU usage metrics: %s can be read again", source)

    def close(self) -> None:
        if self._pod_resources is not None:
            self._pod_resources.close()


__all__ = ["DEFAULT_MAX_ROWS", "KUBELET_CHECKPOINT", "DraView", "UsageCollector", "UsageSettings"]
