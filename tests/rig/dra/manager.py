"""The kubelet's DRA manager: prepare a pod's claims, hand out CDI devices, unprepare.

Written from `pkg/kubelet/cm/dra/manager.go` (Manager.prepareResources, GetResources,
unprepareResourcesForPod, unprepareResources, reconcileLoop, PodMightNeedToUnprepareResources)
and `k8s.io/dynamic-resource-allocation/resourceclaim` (Name, IsForPod, IsReservedForPod).
What it keeps:

- A validation pass first, touching nothing: each claim of the pod (`spec.resourceClaims`,
  plus the scheduler's special claim named in `status.extendedResourceClaimStatus`, KEP-5004)
  is read from the API, must be owned by the pod when it came from a template, must list the
  pod in `status.reservedFor`, must be allocated, and every driver in its allocation must be
  registered. Any failure stops there with the kubelet's text.
- Then the claim-info cache: each claim gets the pod's UID and the cache is checkpointed
  before any driver is called; claims already prepared are skipped.
- One NodePrepareResources per plugin with all of this pod's unprepared claims of that
  driver. An RPC error, an answer for an unknown claim UID, a per-claim `error`, or an answer
  missing claims fails the whole call; nothing is marked prepared then, and the next attempt
  sends the same claims again (the kubelet's pod worker retries the sync).
- Success marks the claims prepared and checkpoints them with the devices and CDI IDs.
- Unprepare on pod termination: a claim still used by another pod only loses this pod's
  reference; the others go to their driver in one NodeUnprepareResources per driver and leave
  the cache when it succeeds. Without cache entries (checkpoint lost) the names come from the
  pod's spec and status.

Failures surface as the kubelet reports them: PrepareResources wraps its error as "prepare
dynamic resources: ..." and the runtime manager turns it into a Warning event
`FailedPrepareDynamicResources` ("Failed to prepare dynamic resources: ..."); the pod is not
rejected but stays Pending and is synced again. `PrepareError` carries both.

Deliberate differences: drivers are called in name order (the kubelet iterates a Go map);
a claim restored from the checkpoint and prepared again keeps the new answer's devices
(the kubelet appends them to the restored ones, listing each device twice); the API is
read synchronously from the given `ClaimReader` (the emulator runs against `FakeKube`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn, Protocol

import grpc

from kubegpu.api import dra_health_pb2
from kubegpu.api import dra_pb2 as dra
from kubegpu.errors import KubegpuError
from kubegpu.kubelet.pod_devices import containers_of
from tests.rig.dra.health import (
    HealthInfoCache,
    device_health,
    holds,
    resource_health,
)
from tests.rig.dra.plugins import DRAPlugin, DRAPluginManager, PluginError, rpc_error_text
from tests.rig.dra.state import ClaimInfo, ClaimInfoCache, PreparedDevice

log = logging.getLogger("tests.rig.dra")

FAILED_PREPARE = "FailedPrepareDynamicResources"


class ClaimReader(Protocol):
    """Where the kubelet reads ResourceClaims (the kube contract's `get_resource_claim`)."""

    def get_resource_claim(self, namespace: str, name: str) -> dict[str, Any]: ...


class PrepareError(KubegpuError):
    """PrepareResources failed: the pod stays Pending with a Warning event.

    `reason` is the event's reason, `message` its text (as `kubectl describe pod` shows it),
    `cause` the DRA manager's own error.
    """

    def __init__(self, cause: str) -> None:
        self.reason = FAILED_PREPARE
        self.cause = cause
        self.message = f"Failed to prepare dynamic resources: prepare dynamic resources: {cause}"
        super().__init__(self.message)


class UnprepareError(KubegpuError):
    """UnprepareResources failed: the pod stays Terminating and is synced again."""

    def __init__(self, cause: str) -> None:
        self.cause = cause
        super().__init__(f"unprepare dynamic resources: {cause}")


@dataclass(frozen=True)
class DRACall:
    """One call the kubelet made to a DRA plugin."""

    time: float
    driver: str
    endpoint: str
    #: "NodePrepareResources" or "NodeUnprepareResources".
    method: str
    #: The claims sent, as (namespace, name, uid).
    claims: tuple[tuple[str, str, str], ...]
    #: None on success, else the error the manager reported for the call.
    error: str | None


def _meta(obj: dict[str, Any]) -> dict[str, Any]:
    meta: dict[str, Any] = obj.get("metadata") or {}
    return meta


def pod_key(pod: dict[str, Any]) -> str:
    return f"{_meta(pod).get('namespace', 'default')}/{_meta(pod).get('name', '')}"


def claim_name(pod: dict[str, Any], pod_claim: dict[str, Any]) -> tuple[str | None, bool]:
    """(claim name or None when none is needed, must check owner) (`resourceclaim.Name`)."""
    if pod_claim.get("resourceClaimName"):
        return str(pod_claim["resourceClaimName"]), False
    if pod_claim.get("resourceClaimTemplateName"):
        for status in (pod.get("status") or {}).get("resourceClaimStatuses") or []:
            if status.get("name") == pod_claim.get("name"):
                name = status.get("resourceClaimName")
                return (str(name) if name else None), True
        raise _Failed(f'pod "{pod_key(pod)}": ResourceClaim not created yet')
    raise _Failed(
        f'pod "{pod_key(pod)}", spec.resourceClaim "{pod_claim.get("name")}": API unsupported'
    )


def extended_claim_name(pod: dict[str, Any]) -> str | None:
    status = (pod.get("status") or {}).get("extendedResourceClaimStatus")
    return str(status["resourceClaimName"]) if status else None


class _Failed(Exception):
    """An error of the manager, with the kubelet's text."""


class DRAManager:
    """Prepares and unprepares ResourceClaims of pods through registered DRA plugins."""

    def __init__(
        self,
        kube: ClaimReader,
        plugins: DRAPluginManager,
        state_dir: Path,
        *,
        on_change: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.kube = kube
        self.plugins = plugins
        self.cache = ClaimInfoCache(state_dir)
        self._on_change = on_change
        #: Device health from the drivers' streams (see `tests.rig.dra.health`).
        self.health = HealthInfoCache()
        #: Pod UIDs of each health update sent to the pod workers (`m.update`), in order.
        self.health_updates: list[set[str]] = []
        plugins.health_handler = self.handle_health_stream
        #: Every call to a plugin, in order (kept across restarts).
        self.calls: list[DRACall] = []

    def load(self) -> None:
        """Read the checkpoint (kubelet start): restored claims are not prepared."""
        self.cache.load()

    # ------------------------------------------------------------ prepare

    async def prepare(self, pod: dict[str, Any]) -> None:
        """PrepareResources for a pod; `PrepareError` when the kubelet would fail the sync."""
        try:
            await self._prepare(pod)
        except _Failed as exc:
            log.warning("preparing claims of pod %s failed: %s", pod_key(pod), exc)
            raise PrepareError(str(exc)) from None
        finally:
            await self._changed()

    async def _prepare(self, pod: dict[str, Any]) -> None:
        meta = _meta(pod)
        uid, namespace = str(meta.get("uid", "")), str(meta.get("namespace", "default"))
        pod_claims = list((pod.get("spec") or {}).get("resourceClaims") or [])
        extended = extended_claim_name(pod)
        if extended is not None:
            pod_claims.append({"resourceClaimName": extended})

        # Validation pass: nothing in the cache changes unless every claim is usable.
        checked: list[tuple[dict[str, Any], ClaimInfo, dict[str, DRAPlugin]]] = []
        for pod_claim in pod_claims:
            name, must_check_owner = claim_name(pod, pod_claim)
            if name is None:
                continue
            claim = self._fetch(namespace, name)
            if must_check_owner and not _owned_by(claim, uid):
                raise _Failed(
                    f"ResourceClaim {name} was not created for pod {pod_key(pod)} "
                    "(pod is not owner)"
                )
            if not any(r.get("uid") == uid for r in _status(claim).get("reservedFor") or []):
                raise _Failed(
                    f"pod {meta.get('name')} ({uid}) is not allowed to use ResourceClaim "
                    f"{name} ({_meta(claim).get('uid')})"
                )
            allocation = _status(claim).get("allocation")
            if allocation is None:
                raise _Failed(f"ResourceClaim {name}: not allocated")
            results = (allocation.get("devices") or {}).get("results") or []
            info = ClaimInfo(
                claim_uid=str(_meta(claim).get("uid", "")),
                claim_name=name,
                namespace=namespace,
                driver_state={str(r["driver"]): [] for r in results},
            )
            plugins: dict[str, DRAPlugin] = {}
            for driver in info.driver_state:
                try:
                    plugins[driver] = self.plugins.get(driver)
                except PluginError as exc:
                    raise _Failed(str(exc)) from None
            checked.append((claim, info, plugins))

        # The cache: reference the pod, checkpoint, and batch what is not prepared yet.
        batches: dict[DRAPlugin, list[dra.Claim]] = {}
        to_prepare: dict[str, ClaimInfo] = {}
        for _claim, fresh, plugins in checked:
            cached = self.cache.get(fresh.claim_name, namespace)
            if cached is None:
                info = fresh
                self.cache.add(info)
            else:
                info = cached
            if info.claim_uid != fresh.claim_uid:
                raise _Failed(
                    f"old ResourceClaim with same name {fresh.claim_name} and different UID "
                    f"{info.claim_uid} still exists (previous pod force-deleted?!)"
                )
            info.pod_uids.add(uid)
            self.cache.sync()
            if info.prepared:
                continue
            to_prepare[info.claim_uid] = info
            request = dra.Claim(namespace=namespace, uid=info.claim_uid, name=info.claim_name)
            for driver in sorted(info.driver_state):
                batches.setdefault(plugins[driver], []).append(request)

        answers: dict[str, dict[str, list[PreparedDevice]]] = {}
        for plugin, claims in sorted(batches.items(), key=lambda b: (b[0].driver, b[0].endpoint)):
            response = await self._call_prepare(plugin, claims)
            for claim_uid, result in response.claims.items():
                sent = next((c for c in claims if c.uid == claim_uid), None)
                if sent is None:
                    self._fail_call(
                        f"NodePrepareResources returned result for unknown claim UID {claim_uid}"
                    )
                if result.error:
                    self._fail_call(
                        f"NodePrepareResources failed for ResourceClaim {sent.name}: {result.error}"
                    )
                answers.setdefault(claim_uid, {})[plugin.driver] = [
                    PreparedDevice(
                        pool_name=d.pool_name,
                        device_name=d.device_name,
                        request_names=tuple(d.request_names),
                        cdi_device_ids=tuple(d.cdi_device_ids),
                    )
                    for d in result.devices
                ]
            unfinished = len(claims) - len(response.claims)
            if unfinished:
                self._fail_call(f"NodePrepareResources skipped {unfinished} ResourceClaims")

        for claim_uid, info in to_prepare.items():
            for driver, devices in answers.get(claim_uid, {}).items():
                info.driver_state[driver] = devices
            info.prepared = True
        self.cache.sync()

    def _fetch(self, namespace: str, name: str) -> dict[str, Any]:
        try:
            return self.kube.get_resource_claim(namespace, name)
        except KubegpuError as exc:
            raise _Failed(f"fetch ResourceClaim {name}: {exc}") from None

    def _fail_call(self, error: str) -> NoReturn:
        # The call itself went through: amend its record with the manager's verdict.
        last = self.calls[-1]
        self.calls[-1] = DRACall(
            last.time, last.driver, last.endpoint, last.method, last.claims, error
        )
        raise _Failed(error)

    async def _call_prepare(
        self, plugin: DRAPlugin, claims: list[dra.Claim]
    ) -> dra.NodePrepareResourcesResponse:
        started = time.monotonic()
        sent = tuple((c.namespace, c.name, c.uid) for c in claims)
        try:
            response = await plugin.prepare(dra.NodePrepareResourcesRequest(claims=claims))
        except grpc.RpcError as exc:
            error = f"NodePrepareResources: {rpc_error_text(exc)}"
            self.calls.append(
                DRACall(
                    started, plugin.driver, plugin.endpoint, "NodePrepareResources", sent, error
                )
            )
            raise _Failed(error) from None
        self.calls.append(
            DRACall(started, plugin.driver, plugin.endpoint, "NodePrepareResources", sent, None)
        )
        return response

    # ------------------------------------------------------------ container devices

    def cdi_devices(self, pod: dict[str, Any], container: str) -> list[str]:
        """The CDI device IDs the runtime gets for one container (`GetResources`)."""
        spec_container = next((c for c in containers_of(pod) if c.get("name") == container), None)
        if spec_container is None:
            raise ValueError(f"pod {pod_key(pod)} has no container {container!r}")
        namespace = str(_meta(pod).get("namespace", "default"))
        resources = spec_container.get("resources") or {}
        wanted: dict[str, list[str]] = {}
        by_pod_claim: dict[str, list[str]] = {}
        for ref in resources.get("claims") or []:
            by_pod_claim.setdefault(str(ref["name"]), []).append(str(ref.get("request") or ""))
        for pod_claim in (pod.get("spec") or {}).get("resourceClaims") or []:
            requests = by_pod_claim.get(str(pod_claim.get("name")))
            if requests is None:
                continue
            try:
                name, _ = claim_name(pod, pod_claim)
            except _Failed as exc:
                raise PrepareError(str(exc)) from None
            if name is not None:
                wanted.setdefault(name, []).extend(requests)
        extended = (pod.get("status") or {}).get("extendedResourceClaimStatus")
        if extended:
            asked = {**(resources.get("limits") or {}), **(resources.get("requests") or {})}
            for mapping in extended.get("requestMappings") or []:
                if mapping.get("containerName") == container and _nonzero(
                    asked.get(mapping.get("resourceName"))
                ):
                    wanted.setdefault(str(extended["resourceClaimName"]), []).append(
                        str(mapping["requestName"])
                    )
        ids: list[str] = []
        for name, requests in wanted.items():
            info = self.cache.get(name, namespace)
            if info is None:
                raise KubegpuError(
                    f"internal error: unable to get claim info for ResourceClaim {name} in "
                    f"namespace {namespace}"
                )
            for request in requests:
                ids.extend(info.cdi_devices(request))
        return ids

    # ------------------------------------------------------------ unprepare

    def might_need_unprepare(self, pod_uid: str) -> bool:
        return self.cache.has_pod_reference(pod_uid)

    async def unprepare(self, pod: dict[str, Any]) -> None:
        """UnprepareResources for a terminated pod; `UnprepareError` when it must be retried."""
        meta = _meta(pod)
        uid, namespace = str(meta.get("uid", "")), str(meta.get("namespace", "default"))
        names = self.cache.claim_names_for_pod(uid)
        try:
            if not names:
                for pod_claim in (pod.get("spec") or {}).get("resourceClaims") or []:
                    name, _ = claim_name(pod, pod_claim)
                    if name is not None:
                        names.append(name)
                extended = extended_claim_name(pod)
                if extended is not None:
                    names.append(extended)
            await self._unprepare(uid, namespace, names)
        except _Failed as exc:
            log.warning("unpreparing claims of pod %s failed: %s", pod_key(pod), exc)
            raise UnprepareError(str(exc)) from None
        finally:
            await self._changed()

    async def reconcile(self, active_pod_uids: set[str]) -> None:
        """The manager's reconcile loop: unprepare claims of pods no longer active."""
        inactive: dict[str, tuple[str, list[str]]] = {}
        for info in self.cache:
            for uid in sorted(info.pod_uids - active_pod_uids):
                inactive.setdefault(uid, (info.namespace, []))[1].append(info.claim_name)
        for uid, (namespace, names) in inactive.items():
            try:
                await self._unprepare(uid, namespace, names)
            except _Failed as exc:
                log.info("unpreparing claims of pod %s in the reconcile loop failed: %s", uid, exc)
        await self._changed()

    async def _unprepare(self, uid: str, namespace: str, names: list[str]) -> None:
        batches: dict[str, list[dra.Claim]] = {}
        to_delete: list[str] = []
        for name in names:
            info = self.cache.get(name, namespace)
            if info is None:
                continue
            if len(info.pod_uids) > 1:
                # Checkpointed with the rest below, once this call has succeeded.
                info.pod_uids.discard(uid)
                continue
            to_delete.append(name)
            request = dra.Claim(namespace=namespace, uid=info.claim_uid, name=info.claim_name)
            for driver in sorted(info.driver_state):
                batches.setdefault(driver, []).append(request)
        for driver, claims in sorted(batches.items()):
            try:
                plugin = self.plugins.get(driver)
            except PluginError as exc:
                raise _Failed(str(exc)) from None
            started = time.monotonic()
            sent = tuple((c.namespace, c.name, c.uid) for c in claims)
            method = "NodeUnprepareResources"
            try:
                response = await plugin.unprepare(dra.NodeUnprepareResourcesRequest(claims=claims))
            except grpc.RpcError as exc:
                error = f"{method}: {rpc_error_text(exc)}"
                self.calls.append(DRACall(started, driver, plugin.endpoint, method, sent, error))
                raise _Failed(error) from None
            self.calls.append(DRACall(started, driver, plugin.endpoint, method, sent, None))
            for claim_uid, result in response.claims.items():
                match = next((c for c in claims if c.uid == claim_uid), None)
                if match is None:
                    self._fail_call(f"{method} returned result for unknown claim UID {claim_uid}")
                if result.error:
                    self._fail_call(
                        f"{method} failed for ResourceClaim {match.name}: {result.error}"
                    )
            unfinished = len(claims) - len(response.claims)
            if unfinished:
                self._fail_call(f"{method} skipped {unfinished} ResourceClaims")
        for name in to_delete:
            self.cache.delete(name, namespace)
        self.cache.sync()

    async def _changed(self) -> None:
        if self._on_change is not None:
            await self._on_change()

    # ------------------------------------------------------------ device health

    async def handle_health_stream(
        self, driver: str, stream: AsyncIterator[dra_health_pb2.NodeWatchResourcesResponse]
    ) -> None:
        """Read one health stream to its end (`HandleWatchResourcesStream`); an RPC error
        leaves as `grpc.RpcError`. The driver's health is forgotten when it ends."""
        try:
            async for response in stream:
                changed = self.health.update(driver, map(device_health, response.devices))
                if not changed:
                    continue
                pods = {
                    uid
                    for info in self.cache
                    if holds(info, driver, changed)
                    for uid in info.pod_uids
                }
                if pods:
                    log.info("sending health update notification for pods %s", sorted(pods))
                    self.health_updates.append(pods)
                await self._changed()
        finally:
            self.health.clear(driver)
        await self._changed()  # an error or a cancellation tells its own watchers

    def allocated_resources_status(self, pod: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
        """Container name -> its DRA `allocatedResourcesStatus` entries, as the kubelet
        writes them into the pod's status (`UpdateAllocatedResourcesStatus`); containers
        without claims, or whose claims are not prepared here, are left out."""
        namespace = str(_meta(pod).get("namespace", "default"))
        spec = pod.get("spec") or {}
        generated = {
            str(s.get("name")): str(s["resourceClaimName"])
            for s in (pod.get("status") or {}).get("resourceClaimStatuses") or []
            if s.get("resourceClaimName")
        }
        pod_claims = {str(c.get("name")): c for c in spec.get("resourceClaims") or []}
        out: dict[str, list[dict[str, Any]]] = {}
        for container in spec.get("containers") or []:
            statuses: list[dict[str, Any]] = []
            for ref in (container.get("resources") or {}).get("claims") or []:
                name = generated.get(str(ref.get("name")))
                if name is None:
                    pod_claim = pod_claims.get(str(ref.get("name")))
                    try:
                        name = claim_name(pod, pod_claim)[0] if pod_claim is not None else None
                    except _Failed:
                        name = None
                info = self.cache.get(name, namespace) if name else None
                if info is None:
                    continue
                request = str(ref.get("request") or "")
                resources: list[dict[str, Any]] = []
                seen: set[str] = set()
                for driver, devices in sorted(info.driver_state.items()):
                    for dev in devices:
                        base = request.split("/", 1)[0]
                        if request and dev.request_names and base not in dev.request_names:
                            continue
                        entry = resource_health(
                            driver,
                            dev.pool_name,
                            dev.device_name,
                            dev.cdi_device_ids,
                            self.health.get(driver, dev.pool_name, dev.device_name),
                        )
                        if entry["resourceID"] in seen:
                            continue
                        seen.add(entry["resourceID"])
                        resources.append(entry)
                if resources:
                    label = f"claim:{ref['name']}" + (f"/{request}" if request else "")
                    statuses.append({"name": label, "resources": resources})
            if statuses:
                out[str(container.get("name"))] = sorted(statuses, key=lambda s: s["name"])
        return out


def _status(obj: dict[str, Any]) -> dict[str, Any]:
    status: dict[str, Any] = obj.get("status") or {}
    return status


def _owned_by(claim: dict[str, Any], pod_uid: str) -> bool:
    return any(
        ref.get("uid") == pod_uid and ref.get("controller")
        for ref in _meta(claim).get("ownerReferences") or []
    )


def _nonzero(value: Any) -> bool:
    return value is not None and str(value).strip() not in ("", "0")
