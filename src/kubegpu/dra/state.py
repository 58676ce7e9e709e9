"""The claims prepared on this node: plan, commit, release, and restore at start.

`DeviceState` is the driver's side of a claim's preparation, as a Go DRA driver's device
state is (kubernetes-sigs/dra-driver-nvidia-gpu): it takes typed claims
(`kubegpu.dra.resourceclaim`) that the helper (`kubegpu.dra.service.ClaimPreparer`) read
and checked, plans their devices and CDI specs over the node-state store, applies the
limits of memory-sized claims, writes the specs and records them in the checkpoint, and
undoes all of it at unprepare. At start it recovers the checkpoint and writes again, from
the records alone, the spec of any prepared claim that went missing.

Its blocking methods (`start`, `commit`, `release`, `stop`) run on a thread, one at a time,
which the helper provides; the async ones (`resume`, `apply_limits`, `release_limits`)
on the event loop, in the same turn. A failure of one claim is its reason, one line
without the claim's name: the helper prefixes the name the kubelet asked for.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kubegpu import cdi
from kubegpu.config import Config
from kubegpu.devices import Gpu, Inventory
from kubegpu.dra.checkpoint import (
    Checkpoint,
    ClaimRecord,
    ClaimState,
    recover,
    remove_spec,
    retire,
)
from kubegpu.dra.claims import (
    NVIDIA_DRIVER,
    ClaimPlan,
    PreparedDevice,
    node_devices,
    plan_claim,
    spec_file_name,
)
from kubegpu.dra.limits import ClaimLimiter, LimitError
from kubegpu.dra.resourceclaim import Allocation, Claim, ClaimError, ClaimRef, DeviceResult
from kubegpu.dra.sizing import ClaimLimits, MemoryLimit
from kubegpu.dra.slices import DraDevice
from kubegpu.state import NodeState, NodeStore
from kubegpu.untrusted import escape, object_problem

log = logging.getLogger("kubegpu.dra")

#: A claim's answer: its devices, or the reason it was not prepared ("" when it was).
Answer = tuple[tuple[PreparedDevice, ...], str]


def label(claim: ClaimRef | ClaimRecord) -> str:
    """`namespace/name (uid)`, escaped: a record's names come from the checkpoint file."""
    return escape(f"{claim.namespace}/{claim.name} ({claim.uid})", 160)


def renamed(claim: ClaimRef, record: ClaimRecord) -> bool:
    """The request names the recorded UID differently. A record adopted from a spec file
    knows no names: any is taken."""
    named = bool(record.namespace or record.name)
    return named and (record.namespace, record.name) != (claim.namespace, claim.name)


def misnamed(record: ClaimRecord) -> str:
    """The reason a request naming `record`'s UID under other names is refused."""
    return (
        f"this UID was prepared as claim {record.namespace}/{record.name}; the kubelet "
        f"names a claim as the API holds it: left as it is"
    )


def recorded_claim(record: ClaimRecord, driver: str) -> Claim:
    """The claim a record was prepared from, as far as its CDI spec needs it: its names
    and its allocation results of `driver`, with what a sized claim consumed."""
    limits = record.limits
    results: list[DeviceResult] = []
    for device in record.devices:
        for request in device.requests:
            consumed = limits.consumed(device.device) if limits is not None else {}
            if any(r.device == device.device for r in results):
                consumed = {}  # once: the record holds the sum
            results.append(DeviceResult(request, driver, device.pool, device.device, consumed))
    return Claim(record.uid, record.namespace, record.name, Allocation(tuple(results)), record.pods)


class DeviceState:
    """The prepared claims of `driver` on this node (see the module doc)."""

    def __init__(
        self,
        store: NodeStore,
        *,
        data_dir: Path,
        cdi_dir: Path = Path(cdi.DEFAULT_DIRECTORY),
        driver: str = NVIDIA_DRIVER,
        pool: str = "",
        limiter: ClaimLimiter | None = None,
    ) -> None:
        self.store = store
        #: The limits of claims on memory-sized devices (their MPS daemons, kernel limits).
        self.limiter = limiter or ClaimLimiter()
        self.data_dir = data_dir
        self.cdi_dir = cdi_dir
        self.driver = driver
        #: This node's pool (the node name); empty accepts any pool name.
        self.pool = pool
        self._checkpoint: Checkpoint | None = None
        #: (inventory, config) -> (devices by name, node CDI spec), rebuilt on a change.
        self._node: tuple[Inventory, Config, Mapping[str, DraDevice], dict[str, Any]] | None = None

    @property
    def checkpoint(self) -> Checkpoint:
        assert self._checkpoint is not None, "DeviceState.start() was not called"
        return self._checkpoint

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        """Load the checkpoint, undoing what a stopped process left half done, and write
        again the missing specs of prepared claims (blocking; before the kubelet can call)."""
        self._checkpoint = recover(self.data_dir, self.cdi_dir)
        prepared = len(self._checkpoint.claims)
        if prepared:
            log.info("%d prepared claim(s) in the checkpoint", prepared)
        self._restore_specs()

    async def resume(self) -> None:
        """After `start`, on the loop: the MPS daemons of the prepared claims taken over or
        started again with their recorded limits, those of no recorded claim stopped."""
        records = {
            uid: r.limits
            for uid, r in self.checkpoint.claims.items()
            if r.state is ClaimState.PREPARED and r.limits is not None
        }
        await self.limiter.resume(records, self._gpu, self.store.state.config.flags.mps_root)

    def stop(self) -> None:
        """After the last call (blocking): the checkpoint removed if no claim is prepared."""
        if self._checkpoint is not None:
            retire(self._checkpoint, self.cdi_dir)

    def _gpu(self, uuid: str) -> Gpu:
        return self.store.state.inventory.gpu(uuid)

    def _restore_specs(self) -> None:
        """Write again the CDI spec of every prepared claim whose spec is gone.

        The kubelet prepares a claim once and keeps it in its own cache across restarts of
        either side, but the runtime reads the spec each time it creates one of the claim's
        containers: without it a container that restarts cannot start. The checkpoint
        holds the claim's allocation (its devices), which is all a spec is built from.
        """
        for uid, record in sorted(self.checkpoint.claims.items()):
            if record.state is not ClaimState.PREPARED or not record.devices:
                continue
            what = f"claim {label(record)}"
            problem = object_problem(record.namespace, record.name, uid)
            if problem is not None:  # the file was edited: its names are not a claim's
                log.error(
                    "%s in the checkpoint: its %s; its CDI spec is not written", what, problem
                )
                continue
            if (self.cdi_dir / spec_file_name(uid)).exists():
                continue
            limits = record.limits
            try:
                plan = self._plan(
                    recorded_claim(record, self.driver),
                    kernel_limits=limits is not None and limits.memory is MemoryLimit.NVML_CGROUP,
                    daemon_dir=limits.daemon_dir if limits is not None else "",
                )
                if plan.spec is None:
                    continue
                cdi.write_spec(plan.spec, str(self.cdi_dir), spec_file_name(uid))
            except (ClaimError, OSError) as exc:
                log.error(
                    "%s: its CDI spec is missing and cannot be written again (%s); its "
                    "containers cannot start until the pod is deleted and created again",
                    what,
                    exc,
                )
                continue
            log.warning("%s: its CDI spec was missing; written again from the checkpoint", what)

    # -- prepare ----------------------------------------------------------------------------

    def prepared(self, uid: str) -> ClaimRecord | None:
        """The record of a claim whose preparation is complete, with its spec on disk."""
        record = self.checkpoint.claims.get(uid)
        if record is None or record.state is not ClaimState.PREPARED:
            return None
        if record.devices and not (self.cdi_dir / spec_file_name(uid)).exists():
            return None  # removed behind our back: prepare it again
        return record

    def plan(self, claim: Claim) -> ClaimPlan:
        """The claim's devices and CDI spec on this node now; `ClaimError` when it cannot
        be served here."""
        return self._plan(claim, kernel_limits=self.store.state.inventory.memory_limits)

    def _plan(self, claim: Claim, *, kernel_limits: bool, daemon_dir: str = "") -> ClaimPlan:
        state = self.store.state
        devices, node_spec = self._node_view(state)
        return plan_claim(
            claim,
            self.driver,
            self.pool or "",
            devices,
            node_spec,
            state.config,
            kernel_limits=kernel_limits,
            daemon_dir=daemon_dir,
        )

    def _node_view(self, state: NodeState) -> tuple[Mapping[str, DraDevice], dict[str, Any]]:
        cached = self._node
        if cached is not None and cached[0] is state.inventory and cached[1] is state.config:
            return cached[2], cached[3]
        flags = state.config.flags
        devices = node_devices(self.driver, state.specs)
        node_spec = cdi.generate_spec(
            state.inventory,
            driver_root=flags.nvidia_driver_root,
            container_driver_root=flags.plugin.container_driver_root,
            device_id_strategy=flags.plugin.device_id_strategy.value,
            dev_root=flags.nvidia_dev_root,
        )
        self._node = (state.inventory, state.config, devices, node_spec)
        return devices, node_spec

    async def apply_limits(
        self, plans: Sequence[tuple[ClaimRef, ClaimPlan]]
    ) -> tuple[list[tuple[ClaimRef, ClaimPlan]], dict[str, str]]:
        """(the plans whose limits now hold, claim UID -> reason for those whose limits
        cannot be applied). Limits are applied before the spec that lets a container start
        is written."""
        ready: list[tuple[ClaimRef, ClaimPlan]] = []
        failed: dict[str, str] = {}
        for claim, plan in plans:
            if plan.limits is None:
                ready.append((claim, plan))
                continue
            try:
                limits = await self.limiter.apply(claim.uid, plan.limits, self._gpu, plan.pods)
            except LimitError as exc:
                failed[claim.uid] = f"its limits cannot be applied: {exc}"
                continue
            ready.append((claim, dataclasses.replace(plan, limits=limits)))
        return ready, failed

    def commit(self, plans: Sequence[tuple[ClaimRef, ClaimPlan]]) -> dict[str, Answer]:
        """Write the CDI specs, then record them in one checkpoint write (blocking). A
        crash in between leaves specs without records, which the next start removes
        (`checkpoint.recover`)."""
        checkpoint = self.checkpoint
        answers: dict[str, Answer] = {}
        for claim, plan in plans:
            try:
                if plan.spec is not None:
                    cdi.write_spec(plan.spec, str(self.cdi_dir), spec_file_name(claim.uid))
            except OSError as exc:
                with contextlib.suppress(OSError):  # a spec of an earlier attempt, if any
                    remove_spec(self.cdi_dir, claim.uid)
                checkpoint.claims.pop(claim.uid, None)
                answers[claim.uid] = (
                    (),
                    f"cannot write its CDI spec to {self.cdi_dir} ({exc.strerror or exc}); "
                    f"mount the CDI directory read-write, with room to write",
                )
                continue
            checkpoint.claims[claim.uid] = ClaimRecord(
                claim.uid,
                ClaimState.PREPARED,
                claim.namespace,
                claim.name,
                plan.devices,
                plan.limits,
                plan.pods,
            )
            answers[claim.uid] = (plan.devices, "")
        try:
            checkpoint.save()
        except OSError as exc:
            # Unrecorded specs would be removed at the next start under a running pod:
            # take them back now and let the kubelet ask again.
            for claim, _ in plans:
                if answers[claim.uid][1]:
                    continue
                checkpoint.claims.pop(claim.uid, None)
                with contextlib.suppress(OSError):
                    remove_spec(self.cdi_dir, claim.uid)
                answers[claim.uid] = ((), self._unsaved(exc))
        return answers

    async def release_limits(self, limited: Mapping[str, ClaimLimits]) -> None:
        """Undo the limits of claims that are not (or no longer) recorded."""
        for uid, limits in limited.items():
            await self.limiter.release(uid, limits)

    def _unsaved(self, exc: OSError) -> str:
        return (
            f"cannot write the checkpoint in {self.data_dir} ({exc.strerror or exc}); "
            f"the plugin's data directory must be writable, with room to write"
        )

    # -- unprepare --------------------------------------------------------------------------

    def release(
        self, claims: Sequence[ClaimRef]
    ) -> tuple[dict[str, str], set[str], dict[str, ClaimLimits]]:
        """(claim UID -> reason, "" when done; the UIDs whose record or spec was removed;
        the limits of the records dropped, to release next) (blocking). An unknown claim is
        done already.

        A claim recorded under another namespace or name is left alone: the kubelet names
        a claim as the API holds it, so such a request is not about that claim. Drop the
        records first, then the specs: a crash in between leaves a spec that no record
        accounts for, which the next start removes.
        """
        checkpoint = self.checkpoint
        answers: dict[str, str] = {}
        releasing: list[ClaimRef] = []
        for claim in claims:
            record = checkpoint.claims.get(claim.uid)
            if record is not None and renamed(claim, record):
                answers[claim.uid] = misnamed(record)
            else:
                releasing.append(claim)
        dropped = [checkpoint.claims.pop(c.uid, None) for c in releasing]
        if any(r is not None for r in dropped):
            try:
                checkpoint.save()
            except OSError as exc:
                for record in dropped:
                    if record is not None:
                        checkpoint.claims[record.uid] = record
                line = self._unsaved(exc)
                answers.update((c.uid, line) for c in releasing)
                return {c.uid: answers[c.uid] for c in claims}, set(), {}
        limited = {r.uid: r.limits for r in dropped if r is not None and r.limits is not None}
        released: set[str] = set()
        for claim, record in zip(releasing, dropped, strict=True):
            try:
                removed = remove_spec(self.cdi_dir, claim.uid)
            except OSError as exc:
                answers[claim.uid] = (
                    f"cannot remove its CDI spec from {self.cdi_dir} ({exc.strerror or exc})"
                )
                continue
            answers[claim.uid] = ""
            if record is not None or removed:
                released.add(claim.uid)
        return {c.uid: answers[c.uid] for c in claims}, released, limited


__all__ = ["Answer", "DeviceState", "label", "misnamed", "recorded_claim", "renamed"]
