"""A stand-in for kube-scheduler's DRA allocator, so tests can allocate claims without a cluster.

THIS IS NOT THE KUBELET. It does, for one node, what the scheduler's DynamicResources plugin
(`pkg/scheduler/framework/plugins/dynamicresources`) and its allocator
(`k8s.io/dynamic-resource-allocation/structured`) do, plus the two bits of the
kube-controller-manager that tests need (reservation and deallocation):

- `schedule(pod)`: every claim the pod names (`spec.resourceClaims[].resourceClaimName`) is
  allocated if it is not yet and gets the pod in `status.reservedFor`; extended resources
  that a DeviceClass maps (`spec.extendedResourceName`, or the implicit
  `deviceclass.resource.kubernetes.io/<class>`) and that no device plugin serves on the node
  become the special claim of KEP-5004 (`<pod>-extended-resources-<5 chars>`, owned by the
  pod, annotated `resource.kubernetes.io/extended-resource-claim: "true"`, one request
  `container-<i>-request-<j>` per container and resource, `i` counting init containers
  first, `j` the resource's index in the container's sorted requests), allocated, and named
  in the returned pod's `status.extendedResourceClaimStatus` with its `requestMappings`
  (`extendeddynamicresources.go`: createDeviceRequests, createRequestMappings).
- Allocation of `exactly` requests: `ExactCount` (`count`, default 1) or `All` devices of
  the node's ResourceSlices (`spec.nodeName` or `spec.allNodes`) that pass every CEL
  selector of the class and of the request; a device with a taint of effect NoSchedule or
  NoExecute is skipped unless the request tolerates it; a device already allocated to any
  claim is skipped unless it has `allowMultipleAllocations`, in which case each claim
  consumes capacity (the request's `capacity.requests` rounded up by the capacity's
  `requestPolicy`, else its `default`, else all of it; a device whose policy refuses the
  amount is skipped) up to the device's total, and the result gets a `shareID` and
  `consumedCapacity`; `matchAttribute` constraints hold across the listed (or
  all) requests. Results, class and claim configuration and a node selector on
  `metadata.name` are written to `status.allocation` with the API's field names.
- `release(pod)`: the pod leaves `reservedFor`; a claim nobody reserves is deallocated and
  the pod's special claim deleted (the resourceclaim controller and garbage collector).

CEL runs in cel-python (`celpy`) with the DRA variable `device` (`driver`, `attributes`,
`capacity`, `allowMultipleAllocations`; attribute and capacity maps keyed by domain, a
device's unqualified names under its driver's domain). Supported from the Kubernetes CEL
library: `quantity("10Gi")` and the quantity methods `compareTo`, `isGreaterThan`,
`isLessThan`, `asInteger`; version attributes are plain strings (no `semver()`). A selector
that fails at runtime (a missing attribute) fails the allocation, as in the real allocator.

What the real allocator does and this does not: `firstAvailable` sub-requests, admin
access, partitionable devices (`sharedCounters`/`consumesCounters`), binding conditions,
ResourceClaimTemplates (the controller's job), pools spread over several slices with
generations (the newest generation wins), node selectors other than the node's name, a
CEL cost limit, scoring between nodes, preemption, and the in-flight allocation cache; its
search order differs (first fit in slice and device order here).
"""

from __future__ import annotations

import copy
import itertools
import logging
import re
import secrets
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Protocol

import celpy
from celpy import celtypes
from celpy.adapter import json_to_cel
from celpy.celparser import CELParseError
from celpy.evaluation import CELEvalError

from kubegpu.errors import KubegpuError
from kubegpu.kubelet.pod_devices import containers_of

log = logging.getLogger("tests.rig.dra")

EXTENDED_CLAIM_ANNOTATION = "resource.kubernetes.io/extended-resource-claim"
DEVICE_CLASS_PREFIX = "deviceclass.resource.kubernetes.io/"
_SUFFIX_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"  # apimachinery's generateName alphabet


class Cluster(Protocol):
    """The API objects the stand-in reads and writes (held by `FakeKube`)."""

    resource_slices: dict[str, dict[str, Any]]
    resource_claims: dict[tuple[str, str], dict[str, Any]]
    device_classes: dict[str, dict[str, Any]]

    def put_resource_claim(self, body: dict[str, Any]) -> dict[str, Any]: ...


class UnschedulableError(KubegpuError):
    """The pod cannot be scheduled on the node; the message says which claim and why."""


# ------------------------------------------------------------------ quantities

_SUFFIXES: dict[str, Fraction | int] = {
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
    "n": Fraction(1, 10**9), "u": Fraction(1, 10**6), "m": Fraction(1, 1000), "": 1,
    "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
}  # fmt: skip
_QUANTITY = re.compile(
    r"^([+-]?[0-9.]+)(?:([eE][+-]?[0-9]+)|(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E)?)$"
)


def parse_quantity(text: Any) -> Fraction:
    """A Kubernetes resource.Quantity ("80Gi", "500m", "1e3", 4) as an exact number."""
    match = _QUANTITY.match(str(text).strip())
    if match is None:
        raise ValueError(f"invalid quantity {text!r}: use a number with an optional suffix")
    number, exponent, suffix = match.groups()
    value = Fraction(number)
    if exponent:
        return value * Fraction(10) ** int(exponent[1:])
    return value * _SUFFIXES[suffix or ""]


def format_quantity(value: Fraction) -> str:
    for suffix in ("Ei", "Pi", "Ti", "Gi", "Mi", "Ki"):
        unit = Fraction(_SUFFIXES[suffix])
        scaled = value / unit
        if scaled.denominator == 1 and value >= unit:
            return f"{scaled.numerator}{suffix}"
    if value.denominator == 1:
        return str(value.numerator)
    return f"{int(value * 1000)}m"


def _cel_number(value: Fraction) -> Any:
    if value.denominator == 1:
        return celtypes.IntType(value.numerator)
    return celtypes.DoubleType(float(value))


def _num(value: Any) -> Fraction:
    return Fraction(str(value)) if isinstance(value, float) else Fraction(int(value))


_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "quantity": lambda s: _cel_number(parse_quantity(s)),
    "compareTo": lambda a, b: celtypes.IntType((_num(a) > _num(b)) - (_num(a) < _num(b))),
    "isGreaterThan": lambda a, b: celtypes.BoolType(_num(a) > _num(b)),
    "isLessThan": lambda a, b: celtypes.BoolType(_num(a) < _num(b)),
    "asInteger": lambda a: celtypes.IntType(int(_num(a))),
}


class Selector:
    """One compiled CEL expression over `device`."""

    _env = celpy.Environment()

    def __init__(self, expression: str) -> None:
        self.expression = expression
        try:
            self._program = self._env.program(self._env.compile(expression), functions=_FUNCTIONS)
        except CELParseError as exc:
            raise UnschedulableError(
                f"CEL selector {expression!r} does not compile: {exc}"
            ) from None

    def matches(self, device: Device) -> bool:
        try:
            result = self._program.evaluate({"device": device.cel()})
        except CELEvalError as exc:
            raise UnschedulableError(
                f"CEL runtime error in {self.expression!r}: {exc.args[0]}"
            ) from None
        if isinstance(result, CELEvalError):
            raise UnschedulableError(f"CEL runtime error in {self.expression!r}: {result.args[0]}")
        return bool(result)


# ------------------------------------------------------------------ devices


@dataclass
class Device:
    """One device of a ResourceSlice on the node."""

    driver: str
    pool: str
    name: str
    spec: dict[str, Any]
    _cel: Any = field(default=None, repr=False)

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.driver, self.pool, self.name)

    @property
    def shared(self) -> bool:
        return bool(self.spec.get("allowMultipleAllocations"))

    def attribute(self, qualified: str) -> Any:
        domain, _, name = qualified.rpartition("/")
        for key, value in (self.spec.get("attributes") or {}).items():
            d, _, n = key.rpartition("/")
            if (d or self.driver) == (domain or self.driver) and n == name:
                return next(iter(value.values()), None)
        return None

    def capacity(self) -> dict[str, Fraction]:
        return {k: parse_quantity(v["value"]) for k, v in (self.spec.get("capacity") or {}).items()}

    def cel(self) -> Any:
        if self._cel is None:
            attributes: dict[str, dict[str, Any]] = {}
            for key, value in (self.spec.get("attributes") or {}).items():
                domain, _, name = key.rpartition("/")
                attributes.setdefault(domain or self.driver, {})[name] = next(iter(value.values()))
            capacity: dict[str, dict[str, Any]] = {}
            for key, value in (self.spec.get("capacity") or {}).items():
                domain, _, name = key.rpartition("/")
                capacity.setdefault(domain or self.driver, {})[name] = _cel_number(
                    parse_quantity(value["value"])
                )
            cel = json_to_cel(
                {
                    "driver": self.driver,
                    "attributes": attributes,
                    "allowMultipleAllocations": self.shared,
                }
            )
            assert isinstance(cel, celtypes.MapType)
            cel[celtypes.StringType("capacity")] = celtypes.MapType(
                {
                    celtypes.StringType(d): celtypes.MapType(
                        {celtypes.StringType(n): v for n, v in names.items()}
                    )
                    for d, names in capacity.items()
                }
            )
            self._cel = cel
        return self._cel


def _tolerated(taint: dict[str, Any], tolerations: list[dict[str, Any]]) -> bool:
    for t in tolerations:
        if t.get("effect") and t["effect"] != taint.get("effect"):
            continue
        if t.get("operator") == "Exists":
            if not t.get("key") or t["key"] == taint.get("key"):
                return True
        elif t.get("key") == taint.get("key") and t.get("value", "") == taint.get("value", ""):
            return True
    return False


# ------------------------------------------------------------------ the stand-in


class SchedulerStandIn:
    """kube-scheduler's DRA allocation for pods bound to one node (see the module's notes)."""

    def __init__(
        self,
        cluster: Cluster,
        node: str,
        *,
        device_plugin_allocatable: Callable[[str], int] = lambda resource: 0,
    ) -> None:
        self.cluster = cluster
        self.node = node
        #: How much of an extended resource the node's device plugins offer (then not DRA).
        self.device_plugin_allocatable = device_plugin_allocatable

    # ---------------------------------------------------------- pods

    def schedule(self, pod: dict[str, Any]) -> dict[str, Any]:
        """Allocate and reserve the pod's claims; the pod with the status the scheduler writes."""
        pod = copy.deepcopy(pod)
        meta = pod["metadata"]
        namespace = meta.setdefault("namespace", "default")
        for pod_claim in (pod.get("spec") or {}).get("resourceClaims") or []:
            name = pod_claim.get("resourceClaimName")
            if not name:
                raise UnschedulableError(
                    f"pod claim {pod_claim.get('name')}: the stand-in needs resourceClaimName "
                    "(ResourceClaimTemplates are not supported)"
                )
            claim = self.cluster.resource_claims.get((namespace, name))
            if claim is None:
                raise UnschedulableError(f'resourceclaim.resource.k8s.io "{name}" not found')
            self._allocate_and_reserve(copy.deepcopy(claim), pod)
        extended = self._extended_claim(pod)
        if extended is not None:
            claim, mappings = extended
            stored = self._allocate_and_reserve(claim, pod)
            pod.setdefault("status", {})["extendedResourceClaimStatus"] = {
                "requestMappings": mappings,
                "resourceClaimName": stored["metadata"]["name"],
            }
        return pod

    def release(self, pod: dict[str, Any]) -> None:
        """The pod is gone: unreserve its claims, deallocate unused ones, drop its special claim."""
        uid = pod["metadata"].get("uid")
        for key, claim in list(self.cluster.resource_claims.items()):
            status = claim.get("status") or {}
            reserved = status.get("reservedFor") or []
            if not any(r.get("uid") == uid for r in reserved):
                continue
            owned = any(o.get("uid") == uid for o in claim["metadata"].get("ownerReferences") or [])
            if owned and claim["metadata"].get("annotations", {}).get(EXTENDED_CLAIM_ANNOTATION):
                del self.cluster.resource_claims[key]
                continue
            updated = copy.deepcopy(claim)
            left = [r for r in reserved if r.get("uid") != uid]
            updated["status"]["reservedFor"] = left
            if not left:
                updated["status"].pop("allocation", None)
                updated["status"].pop("reservedFor", None)
            self.cluster.put_resource_claim(updated)

    # ---------------------------------------------------------- claims

    def allocate(self, claim: dict[str, Any]) -> dict[str, Any]:
        """Allocate a claim on the node (if it is not already); the stored claim."""
        if (claim.get("status") or {}).get("allocation") is None:
            claim = copy.deepcopy(claim)
            claim.setdefault("status", {})["allocation"] = self._allocation(claim)
        return self.cluster.put_resource_claim(claim)

    def _allocate_and_reserve(self, claim: dict[str, Any], pod: dict[str, Any]) -> dict[str, Any]:
        status = claim.setdefault("status", {})
        if status.get("allocation") is None:
            status["allocation"] = self._allocation(claim)
        meta = pod["metadata"]
        reserved = status.setdefault("reservedFor", [])
        if not any(r.get("uid") == meta.get("uid") for r in reserved):
            reserved.append({"resource": "pods", "name": meta["name"], "uid": meta.get("uid")})
        return self.cluster.put_resource_claim(claim)

    def _devices(self) -> list[Device]:
        devices = []
        for _, body in sorted(self.cluster.resource_slices.items()):
            spec = body.get("spec") or {}
            if spec.get("nodeName") != self.node and not spec.get("allNodes"):
                continue
            pool = (spec.get("pool") or {}).get("name", "")
            for dev in spec.get("devices") or []:
                devices.append(Device(spec["driver"], pool, dev["name"], dev))
        return devices

    def _in_use(
        self, skip: tuple[str, str]
    ) -> tuple[set[tuple[str, str, str]], dict[Any, Fraction]]:
        """Devices held exclusively by other claims, and capacity consumed from shared ones."""
        exclusive: set[tuple[str, str, str]] = set()
        consumed: dict[Any, Fraction] = {}
        for key, claim in self.cluster.resource_claims.items():
            if key == skip:
                continue
            allocation = (claim.get("status") or {}).get("allocation") or {}
            for r in (allocation.get("devices") or {}).get("results") or []:
                dev = (r["driver"], r["pool"], r["device"])
                if r.get("shareID") is None:
                    exclusive.add(dev)
                for name, value in (r.get("consumedCapacity") or {}).items():
                    consumed[(dev, name)] = consumed.get((dev, name), Fraction(0)) + parse_quantity(
                        value
                    )
        return exclusive, consumed

    def _allocation(self, claim: dict[str, Any]) -> dict[str, Any]:
        meta = claim["metadata"]
        what = f"ResourceClaim {meta.get('namespace', 'default')}/{meta['name']}"
        spec = (claim.get("spec") or {}).get("devices") or {}
        requests = spec.get("requests") or []
        devices = self._devices()
        exclusive, consumed = self._in_use((meta.get("namespace", "default"), meta["name"]))
        options: list[list[tuple[tuple[Device, ...], dict[str, Fraction]]]] = []
        for request in requests:
            options.append(list(self._choices(what, request, devices, exclusive, consumed)))
        constraints = spec.get("constraints") or []
        for combo in itertools.product(*options):
            picked = {r["name"]: c for r, c in zip(requests, combo, strict=True)}
            if _constraints_hold(constraints, picked) and _no_overlap(picked, consumed):
                return self._result(claim, requests, picked)
        raise UnschedulableError(f"{what}: cannot allocate all claims on node {self.node}")

    def _choices(
        self,
        what: str,
        request: dict[str, Any],
        devices: list[Device],
        exclusive: set[tuple[str, str, str]],
        consumed: dict[Any, Fraction],
    ) -> Iterator[tuple[tuple[Device, ...], dict[str, Fraction]]]:
        exactly = request.get("exactly")
        if exactly is None:
            raise UnschedulableError(
                f"{what}: request {request.get('name')}: only 'exactly' requests are supported "
                "by the scheduler stand-in"
            )
        class_name = exactly.get("deviceClassName")
        device_class = self.cluster.device_classes.get(class_name)
        if device_class is None:
            raise UnschedulableError(
                f"{what}: request {request['name']}: device class {class_name} does not exist"
            )
        selectors = [
            Selector(s["cel"]["expression"])
            for s in [
                *((device_class.get("spec") or {}).get("selectors") or []),
                *(exactly.get("selectors") or []),
            ]
            if "cel" in s
        ]
        tolerations = exactly.get("tolerations") or []
        wanted = {
            name: parse_quantity(value)
            for name, value in ((exactly.get("capacity") or {}).get("requests") or {}).items()
        }
        fitting: list[tuple[Device, dict[str, Fraction]]] = []
        for dev in devices:
            if any(
                t.get("effect") in ("NoSchedule", "NoExecute") and not _tolerated(t, tolerations)
                for t in dev.spec.get("taints") or []
            ):
                continue
            if dev.key in exclusive:
                continue
            use: dict[str, Fraction] = {}
            if dev.shared:
                taken = _consumption(dev, wanted)
                if taken is None:
                    continue  # the request breaks the device's request policy
                use = taken
                if any(
                    consumed.get((dev.key, n), Fraction(0)) + v > dev.capacity()[n]
                    for n, v in use.items()
                ):
                    continue
            elif any((dev.key, n) in consumed for n in dev.capacity()):
                continue  # partly consumed by shares: not free for an exclusive request
            if all(s.matches(dev) for s in selectors):
                fitting.append((dev, use))
        mode = exactly.get("allocationMode", "ExactCount")
        if mode == "All":
            if fitting:
                yield tuple(d for d, _ in fitting), {}
            return
        count = int(exactly.get("count", 1))
        for combo in itertools.combinations(fitting, count):
            yield (
                tuple(d for d, _ in combo),
                {f"{d.name}/{n}": v for d, u in combo for n, v in u.items()},
            )

    def _result(
        self,
        claim: dict[str, Any],
        requests: list[dict[str, Any]],
        picked: dict[str, tuple[tuple[Device, ...], dict[str, Fraction]]],
    ) -> dict[str, Any]:
        results = []
        config = []
        for request in requests:
            devs, use = picked[request["name"]]
            for dev in devs:
                result: dict[str, Any] = {
                    "request": request["name"],
                    "driver": dev.driver,
                    "pool": dev.pool,
                    "device": dev.name,
                }
                tolerations = (request.get("exactly") or {}).get("tolerations")
                if tolerations:
                    result["tolerations"] = tolerations
                if dev.shared:
                    result["shareID"] = secrets.token_hex(4)
                    result["consumedCapacity"] = {
                        n: format_quantity(v)
                        for key, v in use.items()
                        for d, _, n in [key.partition("/")]
                        if d == dev.name
                    }
                results.append(result)
            class_name = request["exactly"]["deviceClassName"]
            for c in (self.cluster.device_classes[class_name].get("spec") or {}).get(
                "config"
            ) or []:
                config.append({"source": "FromClass", "requests": [request["name"]], **c})
        for c in ((claim.get("spec") or {}).get("devices") or {}).get("config") or []:
            config.append({"source": "FromClaim", **c})
        allocation: dict[str, Any] = {
            "devices": {"results": results},
            "nodeSelector": {
                "nodeSelectorTerms": [
                    {
                        "matchFields": [
                            {"key": "metadata.name", "operator": "In", "values": [self.node]}
                        ]
                    }
                ]
            },
        }
        if config:
            allocation["devices"]["config"] = config
        return allocation

    # ---------------------------------------------------------- extended resources

    def _class_mapping(self) -> dict[str, str]:
        mapping: dict[str, str] = {}
        for name, body in sorted(self.cluster.device_classes.items()):
            mapping[DEVICE_CLASS_PREFIX + name] = name
            explicit = (body.get("spec") or {}).get("extendedResourceName")
            if explicit:
                mapping.setdefault(explicit, name)
        return mapping

    def _extended_claim(
        self, pod: dict[str, Any]
    ) -> tuple[dict[str, Any], list[dict[str, str]]] | None:
        mapping = self._class_mapping()
        meta = pod["metadata"]
        requests: list[dict[str, Any]] = []
        mappings: list[dict[str, str]] = []
        for i, container in enumerate(containers_of(pod)):
            res = container.get("resources") or {}
            asked = {**(res.get("limits") or {}), **(res.get("requests") or {})}
            order = sorted(asked)
            for resource in order:
                class_name = mapping.get(resource)
                count = parse_quantity(asked[resource])
                if class_name is None or count == 0 or self.device_plugin_allocatable(resource) > 0:
                    continue
                name = f"container-{i}-request-{order.index(resource)}"
                requests.append(
                    {
                        "name": name,
                        "exactly": {
                            "deviceClassName": class_name,
                            "allocationMode": "ExactCount",
                            "count": int(count),
                        },
                    }
                )
                mappings.append(
                    {
                        "containerName": container["name"],
                        "resourceName": resource,
                        "requestName": name,
                    }
                )
        if not requests:
            return None
        requests.sort(key=lambda r: str(r["name"]))
        suffix = "".join(secrets.choice(_SUFFIX_ALPHABET) for _ in range(5))
        claim = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {
                "name": f"{meta['name']}-extended-resources-{suffix}",
                "generateName": f"{meta['name']}-extended-resources-",
                "namespace": meta.get("namespace", "default"),
                "annotations": {EXTENDED_CLAIM_ANNOTATION: "true"},
                "ownerReferences": [
                    {
                        "apiVersion": "v1",
                        "kind": "Pod",
                        "name": meta["name"],
                        "uid": meta.get("uid"),
                        "controller": True,
                        "blockOwnerDeletion": True,
                    }
                ],
            },
            "spec": {"devices": {"requests": requests}},
        }
        return claim, mappings


def _consumption(dev: Device, wanted: dict[str, Fraction]) -> dict[str, Fraction] | None:
    """What a request takes of each capacity of a shared device, or None when the device
    cannot serve it: a capacity it does not have, or an amount its request policy refuses.

    As the allocator's `CmpRequestOverCapacity` (k8s.io/dynamic-resource-allocation
    structured/internal/incubating, consumablecapacity.go, v0.36): an unrequested capacity
    takes the policy's `default` (else all of it); a requested one is rounded up by
    `validRange` (to `min`, then to `min + n * step`) or to the first of `validValues` at
    least as large; the result breaks the policy when it is not the default and is above
    `max`, off the step grid, or not a valid value.
    """
    capacity = dev.spec.get("capacity") or {}
    if any(name not in capacity for name in wanted):
        return None  # requestsContainNonExistCapacity
    use = {}
    for name, total in dev.capacity().items():
        policy = capacity[name].get("requestPolicy") or {}
        if name not in wanted:
            default = policy.get("default")
            use[name] = parse_quantity(default) if default is not None else total
            continue
        amount = _round_up(wanted[name], policy)
        if _violates(amount, policy):
            return None
        use[name] = amount
    return use


def _round_up(amount: Fraction, policy: dict[str, Any]) -> Fraction:
    valid_range = policy.get("validRange") or {}
    if valid_range.get("min") is not None:
        low = parse_quantity(valid_range["min"])
        if amount < low:
            return low
        if valid_range.get("step") is None:
            return amount
        step = parse_quantity(valid_range["step"])
        steps = -((low - amount) // step)  # ceil((amount - low) / step)
        return low + steps * step
    for value in sorted(parse_quantity(v) for v in policy.get("validValues") or ()):
        if amount <= value:
            return value
    return amount


def _violates(amount: Fraction, policy: dict[str, Any]) -> bool:
    default = policy.get("default")
    if default is not None and amount == parse_quantity(default):
        return False
    valid_range = policy.get("validRange")
    if valid_range is not None:
        if valid_range.get("max") is not None and amount > parse_quantity(valid_range["max"]):
            return True
        if valid_range.get("step") is not None:
            low = parse_quantity(valid_range.get("min") or 0)
            return (amount - low) % parse_quantity(valid_range["step"]) != 0
        return False
    values = policy.get("validValues") or ()
    return bool(values) and amount not in {parse_quantity(v) for v in values}


def _no_overlap(
    picked: dict[str, tuple[tuple[Device, ...], dict[str, Fraction]]], consumed: dict[Any, Fraction]
) -> bool:
    """One device serves one request of a claim at most; shares add up within capacity."""
    seen: set[tuple[str, str, str]] = set()
    extra: dict[Any, Fraction] = {}
    for devs, use in picked.values():
        for dev in devs:
            if dev.key in seen and not dev.shared:
                return False
            seen.add(dev.key)
            for key, v in use.items():
                d, _, n = key.partition("/")
                if d == dev.name:
                    extra[(dev.key, n)] = extra.get((dev.key, n), Fraction(0)) + v
    return all(
        consumed.get(k, Fraction(0)) + v
        <= next(
            dev.capacity()[k[1]] for devs, _ in picked.values() for dev in devs if dev.key == k[0]
        )
        for k, v in extra.items()
    )


def _constraints_hold(
    constraints: list[dict[str, Any]],
    picked: dict[str, tuple[tuple[Device, ...], dict[str, Fraction]]],
) -> bool:
    for constraint in constraints:
        attribute = constraint.get("matchAttribute")
        if not attribute:
            continue
        names = constraint.get("requests") or list(picked)
        values = [dev.attribute(attribute) for n in names for dev in picked[n][0]]
        if any(v is None for v in values) or len(set(map(str, values))) > 1:
            return False
    return True
