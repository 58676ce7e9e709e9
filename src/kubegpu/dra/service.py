"""The DRAPlugin service the kubelet calls: NodePrepareResources, NodeUnprepareResources.

`ClaimPreparer` does the work over the node-state store, the API (to read claims) and the
checkpoint; `DraServicer` is its gRPC face, served under both service names the kubelet
may pick (`k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin`, and `...v1beta1.DRAPlugin` for the
kubelets of 1.32 and 1.33: the messages are identical).

Failures of one claim (deleted, replaced by a claim of the same name, not allocated, a
device this node lacks, a full disk, a UID prepared under another namespace or name) go
in that claim's `error`, and the kubelet retries it; a malformed request (a namespace,
name or UID that Kubernetes would not allow, `kubegpu.untrusted`) is refused whole with
INVALID_ARGUMENT at the `kubegpu.rpc` boundary, which also bounds the request's size.
Those checks come first: the names then go into the claim's API path, its CDI spec's
file name, the checkpoint and the log, and could otherwise steer any of them.

Writes are serialized, as the kubelet's own helper does for Go drivers, and run on a
thread of their own; the API reads for a prepare happen before taking the turn, in a
pool of their own (`READ_THREADS`), at most `READS_PER_PREPARE` at a time for one
request, and for at most `MAX_CLAIMS_READ` claims of it. So an unprepare never waits on
an API read, and a one-claim prepare waits on a few reads of other requests at most,
never on all the claims of a large one. A claim already prepared is answered from the
checkpoint without the API, so a kubelet restart re-preparing every running pod's claims
costs no API call, and the claims a large request had beyond `MAX_CLAIMS_READ` are
prepared by the kubelet's next call.

Each call logs one line of what it did (and one of what failed), naming a few claims
escaped and bounded, whatever the number of claims; each claim's own line is DEBUG.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol, TypeVar

import grpc

from kubegpu import cdi, rpc
from kubegpu.api import dra_pb2
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
    ClaimError,
    ClaimPlan,
    PreparedDevice,
    node_devices,
    plan_claim,
    spec_file_name,
)
from kubegpu.dra.health import HealthServicer, add_health_servicer
from kubegpu.dra.limits import ClaimLimiter, LimitError
from kubegpu.dra.sizing import ClaimLimits, MemoryLimit
from kubegpu.dra.slices import DraDevice
from kubegpu.errors import AllocationError
from kubegpu.state import NodeState, NodeStore
from kubegpu.untrusted import escape, object_problem

log = logging.getLogger("kubegpu.dra")
T = TypeVar("T")

#: The service names the kubelet may call, newest first (the order GetInfo lists them
#: in, and the kubelet picks the first it supports).
SERVICES = (
    "k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin",
    "k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin",
)
#: As the registration lists them: `<proto package version>.<service>`.
SUPPORTED_VERSIONS = ("v1.DRAPlugin", "v1beta1.DRAPlugin")

#: The largest request worth decoding: the kubelet sends one pod's claims (each a
#: namespace, name and UID, under 400 bytes), so a megabyte is hundreds of times more.
MAX_REQUEST_BYTES = 1024 * 1024
#: Threads reading claims from the API, for all requests together.
READ_THREADS = 16
#: API reads one prepare has in flight at once: a large request takes this share of the
#: read threads, and the others keep the rest.
READS_PER_PREPARE = 4
#: Claims one prepare reads from the API (those not prepared yet); the others of the
#: request are answered with an error, and prepared by the kubelet's next call, which
#: gets those of this call from the checkpoint. A pod rarely has more than a few claims.
MAX_CLAIMS_READ = 128
#: Claims one log line names before "and N more".
LOGGED_CLAIMS = 5


class ClaimSource(Protocol):
    """Where claims are read (`kubegpu.kube.Kube`); a blocking call, run in a thread."""

    def get_resource_claim(self, namespace: str, name: str) -> dict[str, Any]: ...


def _checked(claims: Sequence[dra_pb2.Claim]) -> list[dra_pb2.Claim]:
    """The request's claims, each UID once (its first entry; the answer is keyed by UID),
    or `AllocationError` naming the first claim whose namespace, name or UID Kubernetes
    would not allow."""
    unique: dict[str, dra_pb2.Claim] = {}
    for i, claim in enumerate(claims):
        problem = object_problem(claim.namespace, claim.name, claim.uid)
        if problem is not None:
            raise AllocationError(
                f"claim {i} of {len(claims)}: its {problem}; send the claim's "
                f"metadata.namespace, .name and .uid as the API server holds them"
            )
        unique.setdefault(claim.uid, claim)
    return list(unique.values())


def _label(claim: dra_pb2.Claim | ClaimRecord) -> str:
    """`namespace/name (uid)`, escaped: a record's names come from the checkpoint file."""
    return escape(f"{claim.namespace}/{claim.name} ({claim.uid})", 160)


def _renamed(claim: dra_pb2.Claim, record: ClaimRecord) -> bool:
    """The request names the recorded UID differently. A record adopted from a spec file
    knows no names: any is taken."""
    named = bool(record.namespace or record.name)
    return named and (record.namespace, record.name) != (claim.namespace, claim.name)


def _some(items: Sequence[str]) -> str:
    """The first `LOGGED_CLAIMS` of `items`, each cut to a few hundred characters, and how
    many more: one log line, whatever the request held."""
    shown = "; ".join(escape(item, 300) for item in items[:LOGGED_CLAIMS])
    more = len(items) - LOGGED_CLAIMS
    return f"{shown}; and {more} more" if more > 0 else shown


class ClaimPreparer:
    """Prepares and unprepares claims of `driver` on this node (see the module doc)."""

    def __init__(
        self,
        store: NodeStore,
        claims: ClaimSource,
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
        self._claims = claims
        self.data_dir = data_dir
        self.cdi_dir = cdi_dir
        self.driver = driver
        #: This node's pool (the node name); empty accepts any pool name.
        self.pool = pool
        self._turn = asyncio.Lock()
        #: API reads, and the turn's writes (commit, release): separate, so that a write
        #: never queues behind reads, nor reads behind anything else in the process.
        self._reads: ThreadPoolExecutor | None = None
        self._writes: ThreadPoolExecutor | None = None
        self._checkpoint: Checkpoint | None = None
        #: (inventory, config) -> (devices by name, node CDI spec), rebuilt on a change.
        self._node: tuple[Inventory, Config, Mapping[str, DraDevice], dict[str, Any]] | None = None

    @property
    def checkpoint(self) -> Checkpoint:
        assert self._checkpoint is not None, "ClaimPreparer.start() was not called"
        return self._checkpoint

    def start(self) -> None:
        """Load the checkpoint, undoing what a stopped process left half done (blocking;
        before the kubelet can call)."""
        self.close()
        self._reads = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="dra-read")
        self._writes = ThreadPoolExecutor(1, thread_name_prefix="dra-write")
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

    def _gpu(self, uuid: str) -> Gpu:
        return self.store.state.inventory.gpu(uuid)

    def close(self, wait: bool = False) -> None:
        """Stop the worker threads: queued reads are dropped and a read under way is not
        waited for (the API may be slow); a write under way finishes, waited for with
        `wait`."""
        if self._reads is not None:
            self._reads.shutdown(wait=False, cancel_futures=True)
        if self._writes is not None:
            self._writes.shutdown(wait=wait, cancel_futures=True)
        self._reads = self._writes = None

    def stop(self) -> None:
        """After the last call (blocking): the threads, the write under way waited for, then
        the checkpoint, removed if no claim is prepared."""
        self.close(wait=True)
        if self._checkpoint is not None:
            retire(self._checkpoint, self.cdi_dir)

    async def _run(
        self, pool: ThreadPoolExecutor | None, call: Callable[..., T], *args: object
    ) -> T:
        assert pool is not None, "ClaimPreparer.start() was not called"
        return await asyncio.get_running_loop().run_in_executor(pool, call, *args)

    def _restore_specs(self) -> None:
        """Write again the CDI spec of every prepared claim whose spec is gone.

        The kubelet prepares a claim once and keeps it in its own cache across restarts of
        either side, but the runtime reads the spec each time it creates one of the claim's
        containers: without it a container that restarts cannot start. The checkpoint
        holds the claim's allocation (its devices), which is all a spec is built from.
        """
        state = self.store.state
        for uid, record in sorted(self.checkpoint.claims.items()):
            if record.state is not ClaimState.PREPARED or not record.devices:
                continue
            label = f"claim {_label(record)}"
            problem = object_problem(record.namespace, record.name, uid)
            if problem is not None:  # the file was edited: its names are not a claim's
                log.error(
                    "%s in the checkpoint: its %s; its CDI spec is not written", label, problem
                )
                continue
            if (self.cdi_dir / spec_file_name(uid)).exists():
                continue
            try:
                devices, node_spec = self._node_view(state)
                limits = record.limits
                plan = plan_claim(
                    uid,
                    _recorded_claim(record, self.driver),
                    self.driver,
                    self.pool or "",
                    devices,
                    node_spec,
                    state.config,
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
                    label,
                    exc,
                )
                continue
            log.warning("%s: its CDI spec was missing; written again from the checkpoint", label)

    # -- prepare --------------------------------------------------------------------------

    async def prepare(
        self, claims: Sequence[dra_pb2.Claim]
    ) -> dict[str, tuple[tuple[PreparedDevice, ...], str]]:
        """Claim UID -> (devices, error) for every claim of the request."""
        claims = _checked(claims)
        answers: dict[str, tuple[tuple[PreparedDevice, ...], str]] = {}
        todo = [c for c in claims if self._prepared(c.uid) is None]
        todo, deferred = todo[:MAX_CLAIMS_READ], todo[MAX_CLAIMS_READ:]
        fetched = await self._read(todo)
        async with self._turn:
            plans: list[tuple[dra_pb2.Claim, ClaimPlan]] = []
            for claim in claims:
                done = self._prepared(claim.uid)
                if done is None:
                    continue
                if _renamed(claim, done):
                    answers[claim.uid] = ((), self._misnamed(claim, done))
                else:
                    answers[claim.uid] = (done.devices, "")
            for claim, got in zip(todo, fetched, strict=True):
                if claim.uid in answers:
                    continue  # prepared by a call that ran while this one read the API
                if isinstance(got, str):
                    answers[claim.uid] = ((), got)
                    continue
                try:
                    plans.append((claim, self._plan(claim, got)))
                except ClaimError as exc:
                    answers[claim.uid] = ((), self._refuse(claim, str(exc)))
            for claim in deferred:
                if claim.uid not in answers:
                    answers[claim.uid] = ((), self._deferred(claim, len(todo) + len(deferred)))
            plans = await self._limit(plans, answers)
            if plans:
                answers.update(await self._run(self._writes, self._commit, plans))
            for claim, plan in plans:
                if plan.limits is not None and answers[claim.uid][1]:
                    await self.limiter.release(claim.uid, plan.limits)  # not recorded: undone
        self._log_prepared(claims, answers, {c.uid for c, _ in plans})
        return {c.uid: answers[c.uid] for c in claims}

    async def _limit(
        self,
        plans: Sequence[tuple[dra_pb2.Claim, ClaimPlan]],
        answers: dict[str, tuple[tuple[PreparedDevice, ...], str]],
    ) -> list[tuple[dra_pb2.Claim, ClaimPlan]]:
        """The plans whose limits now hold (applied before the spec that lets a container
        start is written); a claim whose limits cannot be applied gets its error line."""
        ready: list[tuple[dra_pb2.Claim, ClaimPlan]] = []
        for claim, plan in plans:
            if plan.limits is None:
                ready.append((claim, plan))
                continue
            try:
                limits = await self.limiter.apply(claim.uid, plan.limits, self._gpu, plan.pods)
            except LimitError as exc:
                answers[claim.uid] = (
                    (),
                    self._refuse(claim, f"its limits cannot be applied: {exc}"),
                )
                continue
            ready.append((claim, dataclasses.replace(plan, limits=limits)))
        return ready

    def _prepared(self, uid: str) -> ClaimRecord | None:
        """The record of a claim whose preparation is complete, with its spec on disk."""
        record = self.checkpoint.claims.get(uid)
        if record is None or record.state is not ClaimState.PREPARED:
            return None
        if record.devices and not (self.cdi_dir / spec_file_name(uid)).exists():
            return None  # removed behind our back: prepare it again
        return record

    async def _read(self, claims: Sequence[dra_pb2.Claim]) -> list[dict[str, Any] | str]:
        """Each claim from the API (or its error line), `READS_PER_PREPARE` at a time."""
        slots = asyncio.Semaphore(READS_PER_PREPARE)

        async def one(claim: dra_pb2.Claim) -> dict[str, Any] | str:
            async with slots:
                return await self._fetch(claim)

        return list(await asyncio.gather(*(one(c) for c in claims)))

    async def _fetch(self, claim: dra_pb2.Claim) -> dict[str, Any] | str:
        """The claim from the API, or this claim's error line."""
        try:
            got = await self._run(
                self._reads, self._claims.get_resource_claim, claim.namespace, claim.name
            )
        except Exception as exc:  # KubeError, or no credentials: this claim fails
            return self._refuse(claim, f"cannot read it from the API: {exc}")
        meta = got.get("metadata") if isinstance(got, Mapping) else None
        uid = meta.get("uid") if isinstance(meta, Mapping) else None
        if uid != claim.uid:
            return self._refuse(
                claim,
                f"the API holds another claim of that name (UID {uid}, the kubelet asked for "
                f"{claim.uid}): the claim was deleted and created again; the pod that used "
                f"the old one cannot start",
            )
        return got

    def _refuse(self, claim: dra_pb2.Claim, reason: str) -> str:
        """This claim's error line, for the answer (the call's summary logs it)."""
        return rpc.bounded(f"claim {claim.namespace}/{claim.name} ({claim.uid}): {reason}")

    def _misnamed(self, claim: dra_pb2.Claim, record: ClaimRecord) -> str:
        return self._refuse(
            claim,
            f"this UID was prepared as claim {record.namespace}/{record.name}; the kubelet "
            f"names a claim as the API holds it: left as it is",
        )

    def _deferred(self, claim: dra_pb2.Claim, unprepared: int) -> str:
        return self._refuse(
            claim,
            f"not prepared in this call: one call reads at most {MAX_CLAIMS_READ} claims from "
            f"the API and this one has {unprepared} not prepared yet; the kubelet's next call "
            f"prepares it",
        )

    def _log_prepared(
        self,
        claims: Sequence[dra_pb2.Claim],
        answers: Mapping[str, tuple[tuple[PreparedDevice, ...], str]],
        planned: set[str],
    ) -> None:
        """One line for the claims this call prepared, one for those it could not."""
        done: list[str] = []
        failed: list[str] = []
        for claim in claims:
            devices, error = answers[claim.uid]
            if error:
                failed.append(error)
                log.debug("NodePrepareResources: %s", error)
            elif claim.uid in planned:
                named = ", ".join(d.device for d in devices) or "no device of ours"
                done.append(f"{_label(claim)}: {escape(named, 200)}")
                log.debug("prepared claim %s", done[-1])
        if done:
            log.info("NodePrepareResources: prepared %d claim(s): %s", len(done), _some(done))
        if failed:
            log.warning(
                "NodePrepareResources: %d of %d claim(s) not prepared (the kubelet retries "
                "them): %s",
                len(failed),
                len(claims),
                _some(failed),
            )

    def _unsaved(self, exc: OSError) -> str:
        return (
            f"cannot write the checkpoint in {self.data_dir} ({exc.strerror or exc}); "
            f"the plugin's data directory must be writable, with room to write"
        )

    def _plan(self, claim: dra_pb2.Claim, body: Mapping[str, Any]) -> ClaimPlan:
        state = self.store.state
        devices, node_spec = self._node_view(state)
        return plan_claim(
            claim.uid,
            body,
            self.driver,
            self.pool or "",
            devices,
            node_spec,
            state.config,
            kernel_limits=state.inventory.memory_limits,
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

    def _commit(
        self, plans: Sequence[tuple[dra_pb2.Claim, ClaimPlan]]
    ) -> dict[str, tuple[tuple[PreparedDevice, ...], str]]:
        """Write the CDI specs, then record them in one checkpoint write (blocking; holds
        the turn). A crash in between leaves specs without records, which the next start
        removes (`checkpoint.recover`)."""
        checkpoint = self.checkpoint
        answers: dict[str, tuple[tuple[PreparedDevice, ...], str]] = {}
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
                    self._refuse(
                        claim,
                        f"cannot write its CDI spec to {self.cdi_dir} ({exc.strerror or exc}); "
                        f"mount the CDI directory read-write, with room to write",
                    ),
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
                answers[claim.uid] = ((), self._refuse(claim, self._unsaved(exc)))
        return answers

    # -- unprepare ------------------------------------------------------------------------

    async def unprepare(self, claims: Sequence[dra_pb2.Claim]) -> dict[str, str]:
        """Claim UID -> error ("" when done); an unknown claim is done already."""
        claims = _checked(claims)
        async with self._turn:
            answers, released, limited = await self._run(self._writes, self._release, claims)
            for uid, limits in limited.items():
                await self.limiter.release(uid, limits)
        done = [_label(c) for c in claims if c.uid in released]
        failed = [answers[c.uid] for c in claims if answers[c.uid]]
        for line in done:
            log.debug("unprepared claim %s", line)
        for line in failed:
            log.debug("NodeUnprepareResources: %s", line)
        if done:
            log.info("NodeUnprepareResources: unprepared %d claim(s): %s", len(done), _some(done))
        if failed:
            log.warning(
                "NodeUnprepareResources: %d of %d claim(s) not unprepared: %s",
                len(failed),
                len(claims),
                _some(failed),
            )
        return answers

    def _release(
        self, claims: Sequence[dra_pb2.Claim]
    ) -> tuple[dict[str, str], set[str], dict[str, ClaimLimits]]:
        """(claim UID -> error, the UIDs whose record or spec was removed, the limits of
        the records dropped, to release next) (blocking; holds the turn).

        A claim recorded under another namespace or name is left alone: the kubelet names
        a claim as the API holds it, so such a request is not about that claim. Drop the
        records first, then the specs: a crash in between leaves a spec that no record
        accounts for, which the next start removes.
        """
        checkpoint = self.checkpoint
        answers: dict[str, str] = {}
        releasing: list[dra_pb2.Claim] = []
        for claim in claims:
            record = checkpoint.claims.get(claim.uid)
            if record is not None and _renamed(claim, record):
                answers[claim.uid] = self._misnamed(claim, record)
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
                answers.update((c.uid, self._refuse(c, line)) for c in releasing)
                return {c.uid: answers[c.uid] for c in claims}, set(), {}
        limited = {r.uid: r.limits for r in dropped if r is not None and r.limits is not None}
        released: set[str] = set()
        for claim, record in zip(releasing, dropped, strict=True):
            try:
                removed = remove_spec(self.cdi_dir, claim.uid)
            except OSError as exc:
                answers[claim.uid] = self._refuse(
                    claim, f"cannot remove its CDI spec from {self.cdi_dir} ({exc.strerror or exc})"
                )
                continue
            answers[claim.uid] = ""
            if record is not None or removed:
                released.add(claim.uid)
        return {c.uid: answers[c.uid] for c in claims}, released, limited


def _recorded_claim(record: ClaimRecord, driver: str) -> dict[str, Any]:
    """The claim as the API held it when it was prepared, as far as a CDI spec needs it:
    its name and its allocation results of `driver` (with what a sized claim consumed),
    from the checkpoint's record."""
    limits = record.limits
    results: list[dict[str, Any]] = []
    for device in record.devices:
        for request in device.requests:
            result: dict[str, Any] = {
                "request": request,
                "driver": driver,
                "pool": device.pool,
                "device": device.device,
            }
            consumed = limits.consumed(device.device) if limits is not None else {}
            if consumed and not any(r["device"] == device.device for r in results):
                result["consumedCapacity"] = consumed  # once: the record holds the sum
            results.append(result)
    return {
        "metadata": {"namespace": record.namespace, "name": record.name, "uid": record.uid},
        "status": {"allocation": {"devices": {"results": results}}},
    }


def _status(exc: Exception, rpc_name: str) -> tuple[grpc.StatusCode, str]:
    return rpc.status_for(exc, rpc_name, log)


class DraServicer:
    """The two DRAPlugin RPCs over a `ClaimPreparer`."""

    def __init__(self, preparer: ClaimPreparer) -> None:
        self.preparer = preparer

    async def NodePrepareResources(
        self,
        request: dra_pb2.NodePrepareResourcesRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> dra_pb2.NodePrepareResourcesResponse:
        answers = await self.preparer.prepare(request.claims)
        response = dra_pb2.NodePrepareResourcesResponse()
        for uid, (devices, error) in answers.items():
            entry = response.claims[uid]
            if error:
                entry.error = error
                continue
            for d in devices:
                entry.devices.add(
                    request_names=d.requests,
                    pool_name=d.pool,
                    device_name=d.device,
                    cdi_device_ids=d.cdi_ids,
                )
        return response

    async def NodeUnprepareResources(
        self,
        request: dra_pb2.NodeUnprepareResourcesRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> dra_pb2.NodeUnprepareResourcesResponse:
        answers = await self.preparer.unprepare(request.claims)
        response = dra_pb2.NodeUnprepareResourcesResponse()
        for uid, error in answers.items():
            response.claims[uid].error = error
        return response


def dra_server(servicer: DraServicer, health: HealthServicer | None = None) -> grpc.aio.Server:
    """A grpc.aio server answering `servicer` under every name in `SERVICES` (and the
    device health stream, `health`, when given), inside the `kubegpu.rpc` error boundary
    with the request size bound."""
    server = grpc.aio.server(
        interceptors=[
            rpc.Boundary(lambda: MAX_REQUEST_BYTES, status=_status, subject="the DRA plugin")
        ]
    )
    methods = {
        "NodePrepareResources": grpc.unary_unary_rpc_method_handler(
            servicer.NodePrepareResources,
            request_deserializer=dra_pb2.NodePrepareResourcesRequest.FromString,
            response_serializer=dra_pb2.NodePrepareResourcesResponse.SerializeToString,
        ),
        "NodeUnprepareResources": grpc.unary_unary_rpc_method_handler(
            servicer.NodeUnprepareResources,
            request_deserializer=dra_pb2.NodeUnprepareResourcesRequest.FromString,
            response_serializer=dra_pb2.NodeUnprepareResourcesResponse.SerializeToString,
        ),
    }
    for service in SERVICES:
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, methods),))
    if health is not None:
        add_health_servicer(health, server)
    return server


__all__ = [
    "MAX_REQUEST_BYTES",
    "SERVICES",
    "SUPPORTED_VERSIONS",
    "ClaimPreparer",
    "ClaimSource",
    "DraServicer",
    "dra_server",
]
