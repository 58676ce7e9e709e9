"""Keeps the node's ResourceSlices in the API in step with the node-state store.

`SlicePublisher.run` follows the store as the labeller does (`NodeStore.subscribe`): on
every change of what the slices show (inventory: a MIG layout; config: a reload that
changes replicas or names; health, and why a device is unhealthy: a newer Xid of a device
already unhealthy names its taint) it builds the bodies (`kubegpu.dra.slices`),
compares them with what the API holds for this node and driver (see below for when that
is read), and writes the difference:

- nothing when the API already shows the same devices (a restart rewrites nothing);
- otherwise the pool's next generation: the stored slices replaced, missing ones created,
  surplus ones deleted, so a scheduler that reads a half-written pool sees the old
  generation's slices as outdated and waits for the new ones (the API's pool rule);
- a 409 (someone wrote in between) reads the slices again and recomputes, at once;
- any other failure is logged and retried with `Backoff` (a server's Retry-After heeded,
  capped); a store change cuts the wait short.

What the API holds is data from outside and is read as such:

- a listed slice that cannot be read (no `spec.pool`, a device without a name: a broken
  server or a proxy in between) is logged once and left alone, neither rewritten nor
  deleted, never a crash; the pool is published around it;
- a write the server stores differently from what was sent (it drops fields it does not
  serve: device taints without the `DRADeviceTaints` feature gate) is logged once, and
  the server's version is the accepted state for what was sent: the same devices are not
  written again for a difference the server itself makes (each rewrite would bump the
  pool's generation for nothing, and its watch event would start the next).

The slices are watched too (`Kube.watch_resource_slices`, per driver): a slice deleted or
changed by anyone else, or a watch that had to start again, makes the publisher read and
compare at once. That matters most at a kubelet start: the kubelet deletes every
ResourceSlice of its node when it starts (and a driver's slices when the driver has been
gone a while), expecting the drivers to publish them again. `resync()` asks for the same
comparison, for the driver to call when the kubelet registers it; it reads the API unless
every watch listed within the last `FRESH_LIST_S` (a registration right after the start:
that list, and the watch's events since, already cover it). Every `resync_s` the API is
read and compared again regardless, should a watch be unavailable. The first comparison
waits for the watches' first list (at most `FIRST_LIST_WAIT_S`) and reads the API after
it, so that list needs no comparison of its own.

The API is read only when it may hold something else than what the last sync left there:
at the start, after a failure or a conflict, when the watch reports a change that is not
this publisher's own write (or lists again), at the periodic comparison and when asked.
Otherwise the comparison is with the slices as the last write's answers show them, which
costs no request. The watch event of the publisher's own write, which may arrive before
the write's answer, is judged once the answer is in: its name and resourceVersion are the
answer's, and it reads nothing.

Writes are paced, so a storm of changes (a GPU flapping, Xids on every GPU) costs the API
a few writes, not one per change. The first change after a quiet spell is written at once
(an Xid taints its device as soon as the store has it); while changes keep coming, the
next write waits `PACE_FIRST_S`, then twice that, up to `PACE_CAP_S`, and whatever changed
meanwhile goes out in that one write, which always shows the newest state. A quiet spell
as long as the cap starts the spacing over.

Blocking API calls run in a worker thread; the loop itself never blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

from kubegpu.dra.slices import (
    DRIVERS,
    Device,
    build_slices,
    carry_taint_times,
    device_body,
    dra_devices,
)
from kubegpu.kube import RELIST, Kube, KubeError, SliceEvent
from kubegpu.state import NodeState, NodeStore
from kubegpu.supervisor import spawn
from kubegpu.untrusted import escape
from kubegpu.watch.backoff import Backoff

log = logging.getLogger("kubegpu.dra.publisher")

#: Re-reads after a 409 before the failure counts as one (then: backoff).
CONFLICT_RETRIES: Final = 3
#: Seconds between comparisons with the API when nothing changed here.
RESYNC_S: Final = 600.0
#: The spacing of writes while changes keep coming: the first, doubled up to the cap.
PACE_FIRST_S: Final = 1.0
PACE_CAP_S: Final = 10.0
#: How long the first comparison waits for the watches' first list.
FIRST_LIST_WAIT_S: Final = 5.0
#: A `resync` this soon after every watch listed reads nothing more (see the module doc).
FRESH_LIST_S: Final = 5.0
#: Unreadable slices and server changes remembered as logged (each is logged once).
LOGGED_REMEMBERED: Final = 1024
#: Differences named in the line that reports a write the server changed.
DIFFERENCES_SHOWN: Final = 5


class SlicePublisher:
    """Publishes the store's devices for each of `drivers` as the node's pool.

    Why unhealthy devices are (their Xid, `NodeState.faults`) names their taint; none
    known, an unhealthy device is a lost GPU. `pcie_roots` reads the root complex of PCI
    bus IDs (`kubegpu.devices.pci.pcie_roots` over the host's sysfs), for
    `resource.kubernetes.io/pcieRoot`; read on each sync, as GPUs may come and go.
    `backoff` paces retries after a failure, `pace` the writes of a storm (its clock and
    sleep, like `clock`, injectable for tests).
    """

    def __init__(
        self,
        kube: Kube,
        store: NodeStore,
        node: str,
        *,
        drivers: Sequence[str] = tuple(DRIVERS.values()),
        pcie_roots: Callable[[Sequence[str]], Mapping[str, str]] | None = None,
        backoff: Backoff | None = None,
        pace: Backoff | None = None,
        clock: Callable[[], float] = time.monotonic,
        resync_s: float = RESYNC_S,
        first_list_wait_s: float = FIRST_LIST_WAIT_S,
    ) -> None:
        self.kube = kube
        self.store = store
        self.node = node
        self.drivers = tuple(drivers)
        self.pcie_roots = pcie_roots
        self.backoff = backoff or Backoff(1.0, 30.0)
        self.pace = pace or Backoff(PACE_FIRST_S, PACE_CAP_S, clock=clock)
        self._clock = clock
        self.resync_s = resync_s
        self.first_list_wait_s = first_list_wait_s
        #: Written slices by driver after the last sync, sorted by name (for tests and
        #: `kubegpu status`; and what the API holds while nothing says otherwise).
        self.published: dict[str, list[dict[str, Any]]] = {}
        #: Set when the API may no longer show what was published: compare again.
        self._poke = asyncio.Event()
        #: How many times the slices were compared with the API (for tests and metrics).
        self.syncs = 0
        # One sync at a time: the loop's runs in a worker thread, beside any other caller
        # of `sync`, and two that both read an empty pool (a starting kubelet has just
        # wiped it) would both create it, leaving two slices of one pool that the
        # scheduler refuses.
        self._syncing = threading.Lock()
        #: By driver: for each spec of the last write that the server stored differently
        #: (canonical JSON), the server's version, which stands for it in comparisons.
        self._accepted: dict[str, dict[str, str]] = {}
        #: What was logged once already (unreadable slices, writes the server changed).
        self._logged: set[tuple[str, ...]] = set()
        # What the loop knows of the API, kept on the event loop's thread only:
        #: Drivers whose `published` is what the API holds: compared without a list.
        self._known: set[str] = set()
        #: Drivers the API may show otherwise since (applied before the next sync).
        self._stale: set[str] = set()
        #: Watch events that arrived during the loop's sync, judged once it is done (the
        #: event of its own write may come before the write's answer).
        self._held: list[tuple[str, SliceEvent]] | None = None
        #: When each driver's watch last listed (the loop's clock), and its first list.
        self._listed_at: dict[str, float] = {}
        self._first_list = {driver: asyncio.Event() for driver in self.drivers}

    def resync(self) -> None:
        """Compare with the API (and publish what is missing) now rather than at the next
        change; call from the event loop, e.g. when the kubelet registers the driver.

        The API is read unless every watch listed within the last `FRESH_LIST_S`: the
        watch's list and its events since then show what changed.
        """
        now = self._clock()
        fresh = all(
            now - self._listed_at.get(driver, -math.inf) < FRESH_LIST_S for driver in self.drivers
        )
        if not fresh:
            self._stale.update(self.drivers)
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
            await self._first_lists()
            await self._publish()
        finally:
            for task in helpers:
                task.cancel()
            await asyncio.gather(*helpers, return_exceptions=True)

    async def _first_lists(self) -> None:
        """Until every watch has listed once, or `first_list_wait_s`: the first comparison
        then reads the API after the watches did, and their first list pokes nothing more
        (a watch that cannot list yet must not hold the slices back for long)."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.first_list_wait_s):
                for listed in self._first_list.values():
                    await listed.wait()

    async def _publish(self) -> None:
        while True:
            # Cleared before the state is read: whatever changes from here on, here or in
            # the API, is in this comparison or pokes the next one.
            self._poke.clear()
            self._known -= self._stale
            self._stale.clear()
            state = self.store.state
            try:
                wrote = await self._loop_sync(state)
            except KubeError as exc:
                delay = self.backoff.advance(exc.retry_after)
                log.warning(
                    "node %s: cannot publish ResourceSlices: %s; retrying in %.1fs",
                    self.node,
                    exc,
                    delay,
                )
                await self._poked(delay)
                continue
            self.backoff.reset()
            if wrote:
                # The next write waits (changes meanwhile poke, and go out together then).
                await self.pace.wait()
            self.pace.mark()
            if not await self._poked(self.resync_s):
                self._stale.update(self.drivers)  # the periodic comparison reads the API
            self.pace.reset_if_stable(self.pace.cap)

    async def _loop_sync(self, state: NodeState) -> bool:
        """The loop's sync: without a list for the drivers whose API state is known; the
        watch events that arrive meanwhile are judged after it."""
        trusted = frozenset(self._known)
        self._known.clear()  # until this sync says otherwise
        self._held = []
        try:
            wrote = await asyncio.to_thread(self.sync, state, trusted=trusted)
            self._known.update(self.drivers)
            return wrote
        finally:
            held, self._held = self._held, None
            for driver, event in held:
                self._judge(driver, event)

    async def _poked(self, timeout: float) -> bool:
        """Until the slices may differ from the API's (True), or `timeout` seconds."""
        # asyncio.timeout, not wait_for: on Python 3.11 wait_for loses a cancellation that
        # arrives as the event is set, and the loop then sleeps a whole resync at shutdown.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self._poke.wait()
        return self._poke.is_set()

    async def _follow_store(self) -> None:
        """Poke the loop on every change of what the slices show."""
        last: NodeState | None = None
        # MPS readiness and version bumps alone change nothing the slices show.
        async for state in self.store.subscribe():
            if last is None or (state.inventory, state.config, state.health, state.faults) != (
                last.inventory,
                last.config,
                last.health,
                last.faults,
            ):
                self._poke.set()
            last = state

    async def _watch(self, driver: str) -> None:
        """Poke the loop when the API's slices of `driver` may differ from ours."""
        async for event in self.kube.watch_resource_slices(driver, self.node):
            if event.type == RELIST:
                self._listed_at[driver] = self._clock()
                self._first_list[driver].set()
            if self._held is not None:
                self._held.append((driver, event))
            else:
                self._judge(driver, event)

    def _judge(self, driver: str, event: SliceEvent) -> None:
        """Poke a comparison, which reads the API, unless `event` is our own write."""
        if self._ours(driver, event):
            return
        if event.type == "DELETED":
            log.info(
                "node %s: ResourceSlice %s of %s was deleted; publishing it again",
                self.node,
                _shown_name(event.slice),
                driver,
            )
        self._stale.add(driver)
        self._poke.set()

    def _ours(self, driver: str, event: SliceEvent) -> bool:
        """Whether `event` shows nothing the last sync did not leave: a slice exactly as
        it left it (our own write), or the deletion of one it does not publish (its own
        surplus slice, or one it leaves alone).

        Whatever else it shows (a slice of any shape: the API's objects are data) pokes
        a comparison, which reads the slices and judges them.
        """
        if event.type == RELIST:
            return False
        shown = _identity(event.slice)
        if shown is None:
            return False
        published = [_identity(obj) for obj in self.published.get(driver, ())]
        if event.type == "DELETED":
            return all(name is None or name[0] != shown[0] for name in published)
        return shown in published

    # -- one reconciliation (blocking) ----------------------------------------------------

    def sync(self, state: NodeState, *, trusted: frozenset[str] = frozenset()) -> bool:
        """Make the API show `state` for every driver; True when anything was written.

        The slices of each driver are listed, except for `trusted` drivers, whose last
        `published` slices stand for what the API holds (the loop's knowledge; a conflict
        lists them after all). Raises `KubeError` when the API cannot be read or written
        (after re-reading on `CONFLICT_RETRIES` conflicts).
        """
        with self._syncing:
            return self._sync(state, trusted)

    def _sync(self, state: NodeState, trusted: frozenset[str]) -> bool:
        wrote = False
        self.syncs += 1
        for driver in self.drivers:
            for attempt in range(CONFLICT_RETRIES + 1):
                try:
                    trust = driver in trusted and attempt == 0
                    wrote = self._sync_driver(driver, state, trust=trust) or wrote
                    break
                except KubeError as exc:
                    if exc.status != 409 or attempt == CONFLICT_RETRIES:
                        raise
                    log.info("node %s: %s; reading the slices again", self.node, exc)
        return wrote

    def desired_devices(self, driver: str, state: NodeState) -> list[Device]:
        """The device bodies `driver` publishes for `state` (health and faults applied)."""
        faults = state.faults
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

    def _stored(self, driver: str, *, trust: bool) -> list[dict[str, Any]]:
        """The driver's slices in the API, by name: the last sync's when trusted (and each
        of them readable: a write's answer is the API's object too), else listed."""
        known = self.published.get(driver)
        if trust and known is not None and all(_unreadable(obj) is None for obj in known):
            return known
        return sorted(
            self._readable(driver, self.kube.list_resource_slices(driver, self.node)),
            key=lambda s: s["metadata"]["name"],
        )

    def _sync_driver(self, driver: str, state: NodeState, *, trust: bool = False) -> bool:
        stored = self._stored(driver, trust=trust)
        # The driver's slices on this node in another pool (the daemon once ran under
        # another node name) cannot be rewritten into ours: the API server refuses to
        # change a slice's pool name. Deleted, as Kubernetes' own slice controller deletes
        # the pools it does not publish; ours are written first.
        foreign = [s for s in stored if s["spec"]["pool"].get("name") != self.node]
        stored = [s for s in stored if s["spec"]["pool"].get("name") == self.node]
        try:
            return self._write_pool(driver, state, stored)
        finally:
            for old in foreign:
                log.warning(
                    "node %s: deleting ResourceSlice %s of %s: it is in pool %s, not this node's",
                    self.node,
                    _shown_name(old),
                    driver,
                    escape(str(old["spec"]["pool"].get("name"))),
                )
                self.kube.delete_resource_slice(old["metadata"]["name"])

    def _write_pool(self, driver: str, state: NodeState, stored: list[dict[str, Any]]) -> bool:
        devices = carry_taint_times(self.desired_devices(driver, state), stored)
        current = max((s["spec"]["pool"]["generation"] for s in stored), default=0)
        accepted = self._accepted.get(driver, {})
        if _same(build_slices(self.node, driver, devices, generation=current), stored, accepted):
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
        self.published[driver] = sorted(written, key=_name_key)
        self._accepted[driver] = self._as_stored(driver, wanted, written)
        log.info(
            "node %s: %s pool generation %d: %d devices in %d ResourceSlice(s)",
            self.node,
            driver,
            current + 1,
            len(devices),
            len(wanted),
        )
        return True

    def _readable(self, driver: str, listed: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """The listed slices this publisher can compare and rewrite; each other one is
        logged once and left alone (the API's objects are data: a broken server or a
        proxy in between must not end the driver)."""
        readable = []
        for obj in listed:
            problem = _unreadable(obj)
            if problem is None:
                readable.append(dict(obj))
            elif self._first_time("unreadable", driver, _fingerprint(obj)):
                log.warning(
                    "node %s: ResourceSlice %s of %s cannot be read (%s): left alone, "
                    "neither rewritten nor deleted; is the API server, or a proxy in "
                    "between, broken?",
                    self.node,
                    _shown_name(obj),
                    driver,
                    problem,
                )
        return readable

    def _as_stored(
        self, driver: str, sent: Sequence[Mapping[str, Any]], stored: Sequence[Mapping[str, Any]]
    ) -> dict[str, str]:
        """For each slice the server stored differently from what was sent: the sent spec
        (canonical) -> the stored one; the difference logged once."""
        accepted = {}
        for body, answer in zip(sent, stored, strict=False):
            wrote, kept = _canonical(body.get("spec")), _canonical(answer.get("spec"))
            if wrote == kept:
                continue
            accepted[wrote] = kept
            found: set[str] = set()
            _differences(json.loads(wrote), json.loads(kept), "spec", found)
            if self._first_time("changed", driver, *sorted(found)):
                shown = sorted(found)[:DIFFERENCES_SHOWN]
                more = len(found) - len(shown)
                hint = (
                    "; device taints need the DRADeviceTaints feature gate on the API "
                    "server (docs/dra.md), and until then an unhealthy device stays "
                    "allocatable"
                    if any("taints" in d for d in found)
                    else ""
                )
                log.warning(
                    "node %s: the API server stored the %s pool differently from what was "
                    "written (%s%s); its version stands, and the same devices are not "
                    "written again%s",
                    self.node,
                    driver,
                    escape(", ".join(shown), limit=400),
                    f", {more} more" if more > 0 else "",
                    hint,
                )
        return accepted

    def _first_time(self, *key: str) -> bool:
        """Whether `key` is logged for the first time (and remember it, boundedly)."""
        if key in self._logged:
            return False
        if len(self._logged) >= LOGGED_REMEMBERED:
            self._logged.clear()
        self._logged.add(key)
        return True

    def clear(self) -> int:
        """Delete this node's slices of every driver (uninstall); how many were deleted."""
        deleted = 0
        for driver in self.drivers:
            for obj in self.kube.list_resource_slices(driver, self.node):
                name = _identity(obj)
                if name is None:
                    continue  # nothing to name in a delete: left alone
                deleted += self.kube.delete_resource_slice(name[0])
            self.published.pop(driver, None)
        return deleted


def _same(
    wanted: Sequence[Mapping[str, Any]],
    stored: Sequence[Mapping[str, Any]],
    accepted: Mapping[str, str],
) -> bool:
    """Whether the stored slices show the wanted specs (any order, same count), a spec
    the server stored differently when last written standing as its stored version.

    Taint times are left out: the server stamps them, and `carry_taint_times` has
    already given the wanted taints the stored ones.
    """
    if len(wanted) != len(stored):
        return False
    want = [_canonical(obj.get("spec")) for obj in wanted]
    have = [_canonical(obj.get("spec")) for obj in stored]
    return sorted(accepted.get(spec, spec) for spec in want) == sorted(have)


def _canonical(spec: Any) -> str:
    """A slice's spec as comparable text: sorted keys, taints without `timeAdded`."""
    if isinstance(spec, Mapping) and isinstance(spec.get("devices"), list):
        spec = dict(spec)
        spec["devices"] = [_untimed(device) for device in spec["devices"]]
    return json.dumps(spec, sort_keys=True)


def _untimed(device: Any) -> Any:
    if not isinstance(device, Mapping) or not isinstance(device.get("taints"), list):
        return device
    taints = [
        {k: v for k, v in t.items() if k != "timeAdded"} if isinstance(t, Mapping) else t
        for t in device["taints"]
    ]
    return {**device, "taints": taints}


def _differences(sent: Any, stored: Any, path: str, found: set[str]) -> None:
    """What the server changed in a written spec, as paths ("spec.devices[].taints
    dropped"), list positions folded into "[]" so one change to many devices is one."""
    if isinstance(sent, dict) and isinstance(stored, dict):
        for key in sorted(sent.keys() | stored.keys()):
            if key not in stored:
                found.add(f"{path}.{key} dropped")
            elif key not in sent:
                found.add(f"{path}.{key} added")
            else:
                _differences(sent[key], stored[key], f"{path}.{key}", found)
    elif isinstance(sent, list) and isinstance(stored, list) and len(sent) == len(stored):
        for one, other in zip(sent, stored, strict=True):
            _differences(one, other, f"{path}[]", found)
    elif sent != stored:
        found.add(f"{path} changed")


def _unreadable(obj: Any) -> str | None:
    """Why a listed slice cannot be compared or rewritten; None when it can.

    Everything the publisher reads of a stored slice is checked here, once, rather than
    trusted where it is read.
    """
    if not isinstance(obj, Mapping):
        return "not an object"
    meta = obj.get("metadata")
    if not isinstance(meta, Mapping) or not isinstance(meta.get("name"), str):
        return "no metadata.name"
    if not isinstance(meta.get("resourceVersion"), str):
        return "no metadata.resourceVersion"
    spec = obj.get("spec")
    if not isinstance(spec, Mapping):
        return "no spec"
    pool = spec.get("pool")
    if not isinstance(pool, Mapping):
        return "no spec.pool"
    generation = pool.get("generation")
    if not isinstance(generation, int) or isinstance(generation, bool) or generation < 0:
        return "no spec.pool.generation"
    devices = spec.get("devices") or []
    if not isinstance(devices, list):
        return "spec.devices is not a list"
    for device in devices:
        if not isinstance(device, Mapping) or not isinstance(device.get("name"), str):
            return "a device without a name"
        taints = device.get("taints") or []
        if not isinstance(taints, list) or not all(_readable_taint(t) for t in taints):
            return "a device taint without a key, a value or an effect"
    return None


def _readable_taint(taint: Any) -> bool:
    return (
        isinstance(taint, Mapping)
        and isinstance(taint.get("key"), str)
        and isinstance(taint.get("value", ""), str)
        and isinstance(taint.get("effect"), str)
    )


def _identity(obj: Mapping[str, Any]) -> tuple[str, str | None] | None:
    """A slice's (name, resourceVersion); None when it has no name."""
    meta = obj.get("metadata")
    if not isinstance(meta, Mapping) or not isinstance(meta.get("name"), str):
        return None
    version = meta.get("resourceVersion")
    return meta["name"], version if isinstance(version, str) else None


def _name_key(obj: Mapping[str, Any]) -> str:
    """A written slice's name, for sorting (an answer without one sorts first)."""
    name = _identity(obj)
    return name[0] if name is not None else ""


def _shown_name(obj: Mapping[str, Any]) -> str:
    """A slice's name for a log line: escaped and bounded (it comes from the API)."""
    name = _identity(obj)
    return escape(name[0]) if name is not None else "(without a name)"


def _fingerprint(obj: Any) -> str:
    """A digest of an object's content, for remembering that it was logged."""
    text = json.dumps(obj, sort_keys=True, default=repr)
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


__all__ = ["CONFLICT_RETRIES", "PACE_CAP_S", "PACE_FIRST_S", "RESYNC_S", "SlicePublisher"]
