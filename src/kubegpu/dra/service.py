"""The DRAPlugin service the kubelet calls: NodePrepareResources, NodeUnprepareResources.

`ClaimPreparer` is the helper part, as k8s.io/dynamic-resource-allocation's kubeletplugin
helper is for Go drivers: it checks the request, reads each claim from the API, checks
that it is the claim the kubelet asked for and parses it once into typed values
(`kubegpu.dra.resourceclaim`), hands those to the device state (`kubegpu.dra.state`,
which plans, commits, releases and keeps the checkpoint), and answers per claim.
`DraServicer` is its gRPC face, served under both service names the kubelet may pick
(`k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin`, and `...v1beta1.DRAPlugin` for the kubelets
of 1.32 and 1.33: the messages are identical).

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
import logging
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, TypeVar

import grpc

from kubegpu import rpc
from kubegpu.api import dra_pb2
from kubegpu.dra.claims import ClaimPlan
from kubegpu.dra.health import HealthServicer, add_health_servicer
from kubegpu.dra.resourceclaim import Claim, ClaimError, ClaimRef, body_uid, parse_claim
from kubegpu.dra.state import Answer, DeviceState, label, misnamed, renamed
from kubegpu.errors import AllocationError
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
    """Where claims are read (`kubegpu.kube.Kube`); a blocking call, run in a thread. The
    claim comes as the API sent it, any JSON: `parse_claim` judges it."""

    def get_resource_claim(self, namespace: str, name: str) -> object: ...


def _checked(claims: Sequence[dra_pb2.Claim]) -> list[ClaimRef]:
    """The request's claims, each UID once (its first entry; the answer is keyed by UID),
    or `AllocationError` naming the first claim whose namespace, name or UID Kubernetes
    would not allow."""
    unique: dict[str, ClaimRef] = {}
    for i, claim in enumerate(claims):
        problem = object_problem(claim.namespace, claim.name, claim.uid)
        if problem is not None:
            raise AllocationError(
                f"claim {i} of {len(claims)}: its {problem}; send the claim's "
                f"metadata.namespace, .name and .uid as the API server holds them"
            )
        unique.setdefault(claim.uid, ClaimRef(claim.namespace, claim.name, claim.uid))
    return list(unique.values())


def _refuse(claim: ClaimRef, reason: str) -> str:
    """This claim's error line, for the answer (the call's summary logs it)."""
    return rpc.bounded(f"claim {claim.namespace}/{claim.name} ({claim.uid}): {reason}")


def _some(items: Sequence[str]) -> str:
    """The first `LOGGED_CLAIMS` of `items`, each cut to a few hundred characters, and how
    many more: one log line, whatever the request held."""
    shown = "; ".join(escape(item, 300) for item in items[:LOGGED_CLAIMS])
    more = len(items) - LOGGED_CLAIMS
    return f"{shown}; and {more} more" if more > 0 else shown


class ClaimPreparer:
    """The kubelet's side of claim preparation over a `DeviceState` (see the module doc):
    reads and checks each claim, takes the turn, and answers per claim."""

    def __init__(self, state: DeviceState, claims: ClaimSource) -> None:
        #: The prepared claims: plan, commit, release, checkpoint.
        self.state = state
        self._claims = claims
        self._turn = asyncio.Lock()
        #: API reads, and the turn's writes (commit, release): separate, so that a write
        #: never queues behind reads, nor reads behind anything else in the process.
        self._reads: ThreadPoolExecutor | None = None
        self._writes: ThreadPoolExecutor | None = None

    def start(self) -> None:
        """Start the worker threads and the device state (blocking; before the kubelet
        can call)."""
        self.close()
        self._reads = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="dra-read")
        self._writes = ThreadPoolExecutor(1, thread_name_prefix="dra-write")
        self.state.start()

    async def resume(self) -> None:
        """After `start`, on the loop: the prepared claims' limits held again."""
        await self.state.resume()

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
        the device state's checkpoint, removed if no claim is prepared."""
        self.close(wait=True)
        self.state.stop()

    async def _run(
        self, pool: ThreadPoolExecutor | None, call: Callable[..., T], *args: object
    ) -> T:
        assert pool is not None, "ClaimPreparer.start() was not called"
        return await asyncio.get_running_loop().run_in_executor(pool, call, *args)

    # -- prepare --------------------------------------------------------------------------

    async def prepare(self, request: Sequence[dra_pb2.Claim]) -> dict[str, Answer]:
        """Claim UID -> (devices, error) for every claim of the request."""
        claims = _checked(request)
        state = self.state
        answers: dict[str, Answer] = {}
        todo = [c for c in claims if state.prepared(c.uid) is None]
        todo, deferred = todo[:MAX_CLAIMS_READ], todo[MAX_CLAIMS_READ:]
        fetched = await self._read(todo)
        async with self._turn:
            plans: list[tuple[ClaimRef, ClaimPlan]] = []
            for claim in claims:
                done = state.prepared(claim.uid)
                if done is None:
                    continue
                if renamed(claim, done):
                    answers[claim.uid] = ((), _refuse(claim, misnamed(done)))
                else:
                    answers[claim.uid] = (done.devices, "")
            for claim, got in zip(todo, fetched, strict=True):
                if claim.uid in answers:
                    continue  # prepared by a call that ran while this one read the API
                if isinstance(got, str):
                    answers[claim.uid] = ((), got)
                    continue
                try:
                    plans.append((claim, state.plan(got)))
                except ClaimError as exc:
                    answers[claim.uid] = ((), _refuse(claim, str(exc)))
            for claim in deferred:
                if claim.uid not in answers:
                    answers[claim.uid] = ((), self._deferred(claim, len(todo) + len(deferred)))
            plans, failed = await state.apply_limits(plans)
            for claim in claims:
                if claim.uid in failed:
                    answers[claim.uid] = ((), _refuse(claim, failed[claim.uid]))
            if plans:
                committed = await self._run(self._writes, state.commit, plans)
                for claim, _ in plans:
                    devices, reason = committed[claim.uid]
                    answers[claim.uid] = (devices, _refuse(claim, reason) if reason else "")
            # The limits of a claim that was not recorded are undone.
            await state.release_limits(
                {
                    claim.uid: plan.limits
                    for claim, plan in plans
                    if plan.limits is not None and answers[claim.uid][1]
                }
            )
        self._log_prepared(claims, answers, {c.uid for c, _ in plans})
        return {c.uid: answers[c.uid] for c in claims}

    async def _read(self, claims: Sequence[ClaimRef]) -> list[Claim | str]:
        """Each claim from the API (or its error line), `READS_PER_PREPARE` at a time."""
        slots = asyncio.Semaphore(READS_PER_PREPARE)

        async def one(claim: ClaimRef) -> Claim | str:
            async with slots:
                return await self._fetch(claim)

        return list(await asyncio.gather(*(one(c) for c in claims)))

    async def _fetch(self, claim: ClaimRef) -> Claim | str:
        """The claim from the API, checked and parsed, or this claim's error line."""
        try:
            got = await self._run(
                self._reads, self._claims.get_resource_claim, claim.namespace, claim.name
            )
        except Exception as exc:  # KubeError, or no credentials: this claim fails
            return _refuse(claim, f"cannot read it from the API: {exc}")
        uid = body_uid(got)
        if uid != claim.uid:
            return _refuse(
                claim,
                f"the API holds another claim of that name (UID {uid}, the kubelet asked for "
                f"{claim.uid}): the claim was deleted and created again; the pod that used "
                f"the old one cannot start",
            )
        try:
            return parse_claim(got)
        except ClaimError as exc:
            return _refuse(claim, str(exc))

    def _deferred(self, claim: ClaimRef, unprepared: int) -> str:
        return _refuse(
            claim,
            f"not prepared in this call: one call reads at most {MAX_CLAIMS_READ} claims from "
            f"the API and this one has {unprepared} not prepared yet; the kubelet's next call "
            f"prepares it",
        )

    def _log_prepared(
        self,
        claims: Sequence[ClaimRef],
        answers: Mapping[str, Answer],
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
                done.append(f"{label(claim)}: {escape(named, 200)}")
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

    # -- unprepare ------------------------------------------------------------------------

    async def unprepare(self, request: Sequence[dra_pb2.Claim]) -> dict[str, str]:
        """Claim UID -> error ("" when done); an unknown claim is done already."""
        claims = _checked(request)
        async with self._turn:
            reasons, released, limited = await self._run(self._writes, self.state.release, claims)
            await self.state.release_limits(limited)
        answers = {c.uid: _refuse(c, reasons[c.uid]) if reasons[c.uid] else "" for c in claims}
        done = [label(c) for c in claims if c.uid in released]
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
