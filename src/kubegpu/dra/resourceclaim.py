"""A resource.k8s.io/v1 ResourceClaim as the DRA driver uses it: small typed values.

The API returns a claim as a JSON object whose shape is not taken on trust (a proxy in
front of the API server, or the server itself, may send anything). It is parsed once,
where the claim is read (`parse_claim`), into frozen values: the claim's names, its
allocation's device results and the pods it is reserved for. A claim that is not
allocated, or whose allocation is not shaped as the API server writes one, fails there
with `ClaimError`, one line naming the claim; everything past that point works on the
typed values, so the planner never looks into an API body, and the checkpoint's records
give the same values directly (`kubegpu.dra.state`).

Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from kubegpu.errors import PreconditionError
from kubegpu.untrusted import is_uid


class ClaimError(PreconditionError):
    """This claim cannot be prepared on this node (not allocated, unknown device...)."""


@dataclass(frozen=True, slots=True)
class ClaimRef:
    """A claim as the kubelet names it in a request: checked against what Kubernetes
    allows before it reaches an API path, a file name or a log line."""

    namespace: str
    name: str
    uid: str


@dataclass(frozen=True, slots=True)
class DeviceResult:
    """One entry of the claim's `status.allocation.devices.results`."""

    #: The request it answers, without a subrequest (`gpu` for `gpu/large`): the kubelet
    #: matches containers to requests by the base name.
    request: str
    driver: str
    pool: str
    device: str
    #: What the request took of a shared device (`consumedCapacity`), each quantity as
    #: the API wrote it (read by `kubegpu.dra.sizing`); empty for a device held whole.
    consumed: Mapping[str, object] = field(
        default_factory=lambda: MappingProxyType({}), compare=False
    )


@dataclass(frozen=True, slots=True)
class Allocation:
    """The claim's `status.allocation`: the devices the scheduler gave it, every
    driver's (the driver serves only its own)."""

    results: tuple[DeviceResult, ...] = ()

    def of(self, driver: str) -> tuple[DeviceResult, ...]:
        return tuple(r for r in self.results if r.driver == driver)


@dataclass(frozen=True, slots=True)
class Claim:
    """An allocated ResourceClaim, as far as preparing it on a node needs."""

    uid: str
    namespace: str
    name: str
    allocation: Allocation
    #: The UIDs of the pods it is reserved for (`status.reservedFor`), those that are UIDs
    #: only: they become cgroup paths.
    reserved_for: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        """`namespace/name`, for error lines."""
        return f"{self.namespace}/{self.name}"


def _field(obj: object, key: str) -> object:
    """`obj[key]` of a JSON object, None when `obj` is no object or lacks it."""
    return obj.get(key) if isinstance(obj, Mapping) else None


def _text(value: object) -> str:
    return str(value) if value else ""


def body_uid(body: object) -> object:
    """The `metadata.uid` of a claim as the API sent it (None when it has none), to
    compare with the UID the kubelet asked for before anything else is read."""
    return _field(_field(body, "metadata"), "uid")


def parse_claim(body: object) -> Claim:
    """The claim the API sent; `ClaimError` when it is not allocated or its allocation is
    not shaped as the API server writes one."""
    meta = _field(body, "metadata")
    uid, namespace, name = (_text(_field(meta, k)) for k in ("uid", "namespace", "name"))
    label = f"{namespace}/{name}"
    status = _field(body, "status")
    allocation = _field(status, "allocation")
    if not allocation:
        raise ClaimError(
            f"claim {label} is not allocated; the scheduler allocates it before the pod "
            f"reaches this node"
        )
    results = _field(_field(allocation, "devices"), "results") or []
    if (
        not isinstance(allocation, Mapping)
        or not isinstance(results, list)
        or not all(isinstance(r, Mapping) for r in results)
    ):
        raise ClaimError(
            f"claim {label}: its status.allocation is not shaped as the API server writes "
            f"one (devices.results, a list of results); a proxy in front of the API "
            f"server, or the server itself, sent a malformed claim"
        )
    return Claim(
        uid,
        namespace,
        name,
        Allocation(tuple(_result(r) for r in results)),
        _reserved_pods(_field(status, "reservedFor")),
    )


def _result(raw: Mapping[str, object]) -> DeviceResult:
    consumed = raw.get("consumedCapacity")
    return DeviceResult(
        request=str(raw.get("request", "")).split("/", 1)[0],
        driver=str(raw.get("driver", "")),
        pool=str(raw.get("pool", "")),
        device=str(raw.get("device", "")),
        consumed=MappingProxyType(
            {str(k): v for k, v in consumed.items()} if isinstance(consumed, Mapping) else {}
        ),
    )


def _reserved_pods(reserved: object) -> tuple[str, ...]:
    if not isinstance(reserved, list):
        return ()
    uids = (
        str(_field(r, "uid"))
        for r in reserved
        if _field(r, "resource") == "pods" and _field(r, "apiGroup") in (None, "")
    )
    return tuple(dict.fromkeys(u for u in uids if is_uid(u)))


__all__ = [
    "Allocation",
    "Claim",
    "ClaimError",
    "ClaimRef",
    "DeviceResult",
    "body_uid",
    "parse_claim",
]
