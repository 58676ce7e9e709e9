"""Keeps the node's ResourceSlices in the API in step with the node-state store.

`SlicePublisher.run` follows the store as the labeller does (`NodeStore.subscribe`): on
every change of what the slices show (inventory: a MIG layout; config: a reload that
changes replicas or names; health) it builds the bodies (`kubegpu.dra.slices`), lists what
the API holds for this node and driver, and writes the difference:

- nothing when the API already shows the same devices (a restart rewrites nothing);
- otherwise the pool's next generation: the stored slices replaced, missing ones created,
  surplus ones deleted, so a scheduler that reads a half-written pool sees the old
  generation's slices as outdated and waits for the new ones (the API's pool rule);
- a 409 (someone wrote in between) reads the slices again and recomputes, at once;
- any other failure is logged and retried with `Backoff`; a store change cuts the wait
  short.

The slices are watched too (`Kube.watch_resource_slices`, per driver): a slice deleted or
changed by anyone else, or a watch that had to start again, makes the publisher read and
compare at once. That matters most at a kubelet start: the kubelet deletes every
ResourceSlice of its node when it starts (and a driver's slices when the driver has been
gone a while), expecting the drivers to publish them again. `resync()` asks for the same
comparison, for the driver to call when the kubelet registers it. Every `resync_s` the API
is compared again regardless, should a watch be unavailable.

Blocking API calls run in a worker thread; the loop itself never blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

from kubegpu.dra.slices import (
    DRIVERS,
    Fault,
    build_slices,
    carry_taint_times,
    device_body,
    dra_devices,
)
from kubegpu.kube import RELIST, Kube, KubeError, SliceEvent
from kubegpu.state import NodeState, NodeStore
from kubegpu.supervisor import spawn
from kubegpu.watch.backoff import Backoff

log = logging.getLogger("kubegpu.dra.publisher")

#: Re-reads after a 409 before the failure counts as one (then: backoff).
CONFLICT_RETRIES: Final = 3
#: Seconds between comparisons with the API when nothing changed here.
RESYNC_S: Final = 600.0


class SlicePublisher:
    """Publishes the store's devices for each of `drivers` as the node's pool.

    `faults` says why unhealthy devices are (their Xid), which names their taint; none
    known, an unhealthy device is a lost GPU. `pcie_roots` reads the root complex of PCI
    bus IDs (`kubegpu.devices.pci.pcie_roots` over the host's sysfs), for
    `resource.kubernetes.io/pcieRoot`; read on each sync, as GPUs may come and go.
    """

    def __init__(
        self,
        kube: Kube,
        store: NodeStore,
        node: str,
        *,
        drivers: Sequence[str] = tuple(DRIVERS.values()),
        faults: Callable[[], Mapping[str, Fault]] = dict,
        pcie_roots: Callable[[Sequence[str]], Mapping[str, str]] | None = None,
        backoff: Backoff | None = None,
        resync_s: float = RESYNC_S,
    ) -> None:
        self.kube = kube
        self.store = store
        self.node = node
        self.drivers = tuple(drivers)
        self.faults = faults
        self.pcie_roots = pcie_roots
        self.backoff = backoff or Backoff(1.0, 30.0)
        self.resync_s = resync_s
        #: Written slices by driver after the last sync (for tests and `kubegpu status`).
        self.published: dict[str, list[dict[str, Any]]] = {}
        #: Set when the API may no longer show what was published: compare again.
        self._poke = asyncio.Event()
        #: How many times the slices were compared with the API (for tests and metrics).
        self.syncs = 0
        # One sync at a time: the loop's and the registration's run in worker threads, and
        # two that both read an empty pool (a starting kubelet has just wiped it) would
        # both create it, leaving two slices of one pool that the scheduler refuses.
        self._syncing = threading.Lock()

    def resync(self) -> None:
        """Compare with the API (and publish what is missing) now rather than at the next
        change; call from the event loop, e.g. when the kubelet registers the driver."""
        self._poke.set()

    # -- the loop -------------------------------------------------------------------------

    async def run(self) -> None:
        """Publish now, then on every relevant change; runs until cancelled."""
        helpers = [
            spawn(f"ResourceSlice watch of {driver}", self._watch(driver))
            for driver in self.drivers
        ]
        helpers.append(spawn("ResourceSlice publisher's store follower", self._follow_store()))
        try:
            await self._publish()
        finally:
            for task in helpers:
                task.cancel()
            await asyncio.gather(*helpers, return_exceptions=True)

    async def _publish(self) -> None:
        while True:
            # Cleared before the state is read: whatever changes from here on, here or in
            # the API, is in this comparison or pokes the next one.
            self._poke.clear()
            state = self.store.state
            try:
                await asyncio.to_thread(self.sync, state)
            except KubeError as exc:
                delay = self.backoff.advance()
                log.warning(
                    "node %s: cannot publish ResourceSlices: %s; retrying in %.1fs",
                    self.node,
                    exc,
                    delay,
                )
                await self._poked(delay)
                continue
            self.backoff.reset()
            await self._poked(self.resync_s)

    async def _poked(self, timeout: float) -> None:
        """Until the slices may differ from the API's, or `timeout` seconds."""
        # asyncio.timeout, not wait_for: on Python 3.11 wait_for loses a cancellation that
        # arrives as the event is set, and the loop then sleeps a whole resync at shutdown.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self._poke.wait()

    async def _follow_store(self) -> None:
        """Poke the loop on every change of what the slices show."""
        last: NodeState | None = None
        # MPS readiness and version bumps alone change nothing the slices show.
        async for state in self.store.subscribe():
            if last is None or (state.inventory, state.config, state.health) != (
                last.inventory,
                last.config,
                last.health,
            ):
                self._poke.set()
            last = state

    async def _watch(self, driver: str) -> None:
        """Poke the loop when the API's slices of `driver` may differ from ours."""
        async for event in self.kube.watch_resource_slices(driver, self.node):
            if self._ours(driver, event):
                continue
            if event.type == "DELETED":
                log.info(
                    "node %s: ResourceSlice %s of %s was deleted; publishing it again",
                    self.node,
                    event.slice.get("metadata", {}).get("name"),
                    driver,
                )
            self._poke.set()

    def _ours(self, driver: str, event: SliceEvent) -> bool:
        """Whether `event` shows a slice exactly as the last sync left it (our own write)."""
        if event.type in (RELIST, "DELETED"):
            return False
        meta = event.slice.get("metadata") or {}
        return any(
            (obj["metadata"]["name"], obj["metadata"].get("resourceVersion"))
            == (meta.get("name"), meta.get("resourceVersion"))
            for obj in self.published.get(driver, ())
        )

    # -- one reconciliation (blocking) ----------------------------------------------------

    def sync(self, state: NodeState) -> bool:
        """Make the API show `state` for every driver; True when anything was written.

        Raises `KubeError` when the API cannot be read or written (after re-reading on
        `CONFLICT_RETRIES` conflicts).
        """
        with self._syncing:
            return self._sync(state)

    def _sync(self, state: NodeState) -> bool:
        wrote = False
        self.syncs += 1
        for driver in self.drivers:
            for attempt in range(CONFLICT_RETRIES + 1):
                try:
                    wrote = self._sync_driver(driver, state) or wrote
                    break
                except KubeError as exc:
                    if exc.status != 409 or attempt == CONFLICT_RETRIES:
                        raise
                    log.info("node %s: %s; reading the slices again", self.node, exc)
        return wrote

    def desired_devices(self, driver: str, state: NodeState) -> list[dict[str, Any]]:
        """The device bodies `driver` publishes for `state` (health and faults applied)."""
        faults = self.faults()
        buses = sorted({g.pci_bus_id for g in state.inventory.gpus})
        roots = self.pcie_roots(buses) if self.pcie_roots is not None and buses else {}
        return [
            device_body(
                device,
                state.inventory,
                driver,
                fault=faults.get(device.unit.uuid) or faults.get(device.unit.gpu.uuid),
                pcie_roots=roots,
            )
            for device in dra_devices(driver, state.planned)
        ]

    def _sync_driver(self, driver: str, state: NodeState) -> bool:
        stored = sorted(
            self.kube.list_resource_slices(driver, self.node),
            key=lambda s: s["metadata"]["name"],
        )
        devices = carry_taint_times(self.desired_devices(driver, state), stored)
        current = max((s["spec"]["pool"]["generation"] for s in stored), default=0)
        if _same(build_slices(self.node, driver, devices, generation=current), stored):
            self.published[driver] = stored
            return False
        wanted = build_slices(self.node, driver, devices, generation=current + 1)
        written = []
        for old, new in zip(stored, wanted, strict=False):
            meta = old["metadata"]
            new["metadata"] = {"name": meta["name"], "resourceVersion": meta["resourceVersion"]}
            written.append(self.kube.replace_resource_slice(new))
        for new in wanted[len(stored) :]:
            written.append(self.kube.create_resource_slice(new))
        # Surplus slices go last: until then they are an older generation, which the
        # scheduler already ignores.
        for old in stored[len(wanted) :]:
            self.kube.delete_resource_slice(old["metadata"]["name"])
        self.published[driver] = written
        log.info(
            "node %s: %s pool generation %d: %d devices in %d ResourceSlice(s)",
            self.node,
            driver,
            current + 1,
            len(devices),
            len(wanted),
        )
        return True

    def clear(self) -> int:
        """Delete this node's slices of every driver (uninstall); how many were deleted."""
        deleted = 0
        for driver in self.drivers:
            for obj in self.kube.list_resource_slices(driver, self.node):
                deleted += self.kube.delete_resource_slice(obj["metadata"]["name"])
            self.published.pop(driver, None)
        return deleted


def faults_of(xids: Mapping[str, int | None]) -> dict[str, Fault]:
    """`HealthTracker.xids()` as the publisher's `faults`:
    `SlicePublisher(..., faults=lambda: faults_of(tracker.xids()))`."""
    return {uuid: Fault(xid=xid) for uuid, xid in xids.items()}


def _same(wanted: Sequence[Mapping[str, Any]], stored: Sequence[Mapping[str, Any]]) -> bool:
    """Whether the stored slices show exactly the wanted specs (any order, same count)."""
    if len(wanted) != len(stored):
        return False

    def key(obj: Mapping[str, Any]) -> str:
        return json.dumps(obj.get("spec"), sort_keys=True)

    return sorted(map(key, wanted)) == sorted(map(key, stored))


__all__ = ["CONFLICT_RETRIES", "RESYNC_S", "SlicePublisher", "faults_of"]
