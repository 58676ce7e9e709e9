"""The node-state store: one immutable snapshot of what this node has and serves.

Inventory (what the backend discovered), health (the tracker's unhealthy devices, and
why each is: its `Fault`, so a DRA taint and the kubelet's health stream name one Xid), the
config in force and the readiness of the MPS control daemons live in one frozen
`NodeState` with a version. Writers replace fields (`store.update(health=...)`), each
update makes a new version; readers never see a half-applied change. What the kubelet
gets is *derived*: `NodeState.specs` runs the pure `build_resources` once per version.

Consumers subscribe instead of being called back, as grpc's aio health service waits on
a condition: `NodeStore.subscribe()` yields the newest snapshot whenever the version
moves (intermediate versions may be skipped: right for the plugins, which only need the
latest list), `NodeStore.changes()` yields every (before, after) pair (for metrics and
Node events, which count transitions).

A config or device layout that cannot be served never enters the store: `update` builds the
resources before it commits and raises `ConfigError`, so the last good state keeps serving.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from kubegpu.config import Config
from kubegpu.devices.model import Fault, Health, Inventory
from kubegpu.resources import ResourceSpec, SharingKind, build_resources


@dataclass(frozen=True)
class NodeState:
    """One version of the node's state; replace fields with `NodeStore.update`."""

    #: Devices as last discovered (a MIG layout change brings a new one).
    inventory: Inventory = field(default_factory=lambda: Inventory(gpus=()))
    #: The config in force (only ever one that could serve the inventory).
    config: Config = field(default_factory=Config)
    #: Unhealthy devices (GPU or MIG UUIDs) by the health policy; absent means healthy.
    health: Mapping[str, Health] = field(default_factory=dict)
    #: Why each unhealthy device is (its Xid, or a failed probe), written with `health` by
    #: the health monitor; absent: nobody said.
    faults: Mapping[str, Fault] = field(default_factory=dict)
    #: MPS-shared resource -> whether its control daemon answers; absent means not ready.
    mps_ready: Mapping[str, bool] = field(default_factory=dict)
    #: Bumped by every update; 0 is the empty state before start-up.
    version: int = 0

    @cached_property
    def planned(self) -> tuple[ResourceSpec, ...]:
        """The resources the config makes of the inventory, health applied, MPS ignored
        (what MPS daemons are started for)."""
        return build_resources(self.inventory.with_health(self.health), self.config)

    @cached_property
    def specs(self) -> tuple[ResourceSpec, ...]:
        """What is advertised: `planned`, with the GPUs of an MPS resource whose daemon is
        not ready shown unhealthy (present, but not allocatable until it answers)."""
        down = {
            d.unit.gpu.uuid
            for s in self.planned
            if s.sharing is SharingKind.MPS and not self.mps_ready.get(s.name, False)
            for d in s.devices
        }
        if not down:
            return self.planned
        health = {**self.health, **dict.fromkeys(down, Health.UNHEALTHY)}
        return build_resources(self.inventory.with_health(health), self.config)

    @cached_property
    def owners(self) -> Mapping[str, str]:
        """GPU or MIG UUID -> the resource advertising it (for per-resource metrics)."""
        owners = {d.unit.uuid: s.name for s in self.planned for d in s.devices}
        owners.update({d.unit.gpu.uuid: s.name for s in self.planned for d in s.devices})
        return owners


class NodeStore:
    """Holds the current `NodeState`; every change goes through `update` (loop thread)."""

    def __init__(self, state: NodeState | None = None) -> None:
        self._state = state or NodeState()
        #: Set and replaced on every update: waiters hold the one they started on.
        self._changed = asyncio.Event()
        self._queues: set[asyncio.Queue[tuple[NodeState, NodeState]]] = set()

    @property
    def state(self) -> NodeState:
        return self._state

    def update(self, **fields: Any) -> NodeState:
        """Replace `fields` (inventory, config, health, faults, mps_ready) in a new version.

        Raises `ConfigError` when the config cannot serve the inventory; the store then
        keeps the last good state (the resources are built here, once per version).
        """
        before = self._state
        if all(getattr(before, k) == v for k, v in fields.items()):
            return before  # nothing changed: no new version, nobody woken
        after = dataclasses.replace(before, version=before.version + 1, **fields)
        if "planned" in before.__dict__ and fields.keys() <= {"mps_ready", "faults"}:
            # Only readiness or a reason moved: the resources are the same (cached_property's
            # slot).
            after.__dict__["planned"] = before.planned
        after.planned  # noqa: B018 - built now, so a ConfigError leaves the store as it was
        self._state = after
        for queue in self._queues:
            queue.put_nowait((before, after))
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()
        return after

    async def subscribe(self, since: int = -1) -> AsyncIterator[NodeState]:
        """The current state, then the newest one after each change (coalescing)."""
        seen = since
        while True:
            changed = self._changed
            state = self._state
            if state.version > seen:
                seen = state.version
                yield state
                continue
            await changed.wait()

    def changes(self) -> AsyncIterator[tuple[NodeState, NodeState]]:
        """Every update from this call on as (before, after), none skipped.

        The queue is registered here, not when iteration starts, so a subscriber started
        as a task misses nothing that happens before it first runs.
        """
        queue: asyncio.Queue[tuple[NodeState, NodeState]] = asyncio.Queue()
        self._queues.add(queue)
        return self._drain(queue)

    async def _drain(
        self, queue: asyncio.Queue[tuple[NodeState, NodeState]]
    ) -> AsyncIterator[tuple[NodeState, NodeState]]:
        try:
            while True:
                yield await queue.get()
        finally:
            self._queues.discard(queue)


__all__ = ["NodeState", "NodeStore"]
