"""`FakeKube`: an in-memory `Kube` that records calls and fails on demand.

Test rig, kept out of the package. It answers as the API server would (a missing Node is
a 404 `KubeError`, creating an existing NodeFeature a 409) with the same messages as
`KubeClient`, so error paths are exercised as written.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import datetime
import itertools
import threading
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from kubegpu.kube.errors import KubeError, status_error
from kubegpu.kube.objects import (
    MISSING_NODE,
    MISSING_POD,
    MISSING_RESOURCE_CLAIM,
    MISSING_RESOURCE_SLICE,
    RESOURCE_API_VERSION,
    check_object_name,
)
from kubegpu.kube.protocol import RELIST, SliceEvent

#: The characters the API server draws `generateName` suffixes from (no vowels: no words).
_SUFFIX_ALPHABET: Final = "bcdfghjklmnpqrstvwxz2456789"

#: The API server's message for an update carrying a resourceVersion that is not current.
_MODIFIED: Final = (
    'Operation cannot be fulfilled on resourceslices.resource.k8s.io "{name}": the object has '
    "been modified; please apply your changes to the latest version and try again"
)


@dataclass
class FakeKube:
    """Nodes' metadata, Pods' metadata, NodeFeature objects, Events and the DRA objects
    (ResourceSlices, ResourceClaims, DeviceClasses), with a call log.

    `calls` reads like "get node/n1", "create nodefeature/ns/name", "create event/ns/name",
    "list resourceslices/<driver>/<node>", "replace resourceslice/<name>"; `requests()`
    counts them by verb and resource, as an API server would count requests.
    `fail_with` makes every call raise; `fail_next(prefix, error)` makes only the next call
    whose log line starts with `prefix` raise. Safe to call from worker threads.
    """

    #: Node name -> {"labels": {...}, "annotations": {...}}.
    nodes: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: Node name -> {"capacity": {...}, "allocatable": {...}}; set with `set_node_status`.
    node_statuses: dict[str, dict[str, Any]] = field(default_factory=dict)
    node_features: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    #: Pods' metadata by (namespace, name), as `get_pod_metadata` returns it.
    pods: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    #: (namespace, body, timeout) of every Event created.
    events: list[tuple[str, dict[str, Any], float | None]] = field(default_factory=list)
    calls: list[str] = field(default_factory=list)
    #: When set, every call raises it (to test error paths).
    fail_with: KubeError | None = None
    #: (node, label) of every `watch_node_label`, to assert what was watched.
    watched: list[tuple[str, str]] = field(default_factory=list)
    #: ResourceSlices by name, as stored (`metadata.resourceVersion`, `uid`, `generation`).
    resource_slices: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: ResourceClaims by (namespace, name), as stored; set up with `put_resource_claim`.
    resource_claims: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    #: DeviceClasses by name, as stored; set up with `put_device_class`.
    device_classes: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: The time the fake stamps on a device taint written without one, as the API server
    #: does on create and update (RFC 3339, whole seconds).
    clock: Callable[[], str] = field(default=lambda: _now(), repr=False)
    #: Edits each ResourceSlice as the server stores it (create and update), in place:
    #: models a server that drops or changes fields it does not serve (a feature gate
    #: that is off). None: stored as written.
    slice_storage: Callable[[dict[str, Any]], None] | None = field(default=None, repr=False)
    _versions: itertools.count[int] = field(default_factory=lambda: itertools.count(1), repr=False)
    _pending: list[tuple[str, BaseException]] = field(default_factory=list, repr=False)
    _watchers: list[_Watcher] = field(default_factory=list, repr=False)
    _slice_watchers: list[_SliceWatcher] = field(default_factory=list, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    # -- set-up and fault injection -------------------------------------------------------

    def add_node(self, name: str, labels: Mapping[str, str] | None = None) -> None:
        with self._lock:
            self.nodes[name] = {"labels": dict(labels or {}), "annotations": {}}
        self._notify(name)

    def set_node_status(
        self,
        name: str,
        capacity: Mapping[str, str] | None = None,
        allocatable: Mapping[str, str] | None = None,
    ) -> None:
        """Set an existing Node's status, as the kubelet reports it (allocatable defaults
        to the capacity)."""
        with self._lock:
            if name not in self.nodes:
                raise KeyError(name)
            self.node_statuses[name] = {
                "capacity": dict(capacity or {}),
                "allocatable": dict((capacity if allocatable is None else allocatable) or {}),
            }

    def set_node_label(self, name: str, label: str, value: str | None) -> None:
        """Set (None: remove) one label of an existing Node, as `kubectl label` would."""
        with self._lock:
            labels = self.nodes[name]["labels"]
            if value is None:
                labels.pop(label, None)
            else:
                labels[label] = value
        self._notify(name)

    def delete_node(self, name: str) -> None:
        with self._lock:
            self.nodes.pop(name, None)
            self.node_statuses.pop(name, None)
        self._notify(name)

    def fail_next(self, prefix: str, error: BaseException) -> None:
        """The next call whose log line starts with `prefix` raises `error` (once)."""
        with self._lock:
            self._pending.append((prefix, error))

    def _enter(self, call: str) -> None:
        with self._lock:
            self.calls.append(call)
            if self.fail_with is not None:
                raise self.fail_with
            for i, (prefix, error) in enumerate(self._pending):
                if call.startswith(prefix):
                    del self._pending[i]
                    raise error

    def request_counts(self) -> Counter[tuple[str, str]]:
        """Requests so far by verb and resource, from the call log: ("get", "node"),
        ("list", "resourceslices"), ("watch", "node"), ("create", "event")... What a client
        sent the API server (`make bench`'s API budget); safe from any thread."""
        with self._lock:
            lines = list(self.calls)
        counts: Counter[tuple[str, str]] = Counter()
        for line in lines:
            verb, _, path = line.partition(" ")
            counts[(verb, path.split("/", 1)[0])] += 1
        return counts

    # -- Nodes, Pods, Events --------------------------------------------------------------

    def get_node_metadata(self, name: str) -> dict[str, Any]:
        self._enter(f"get node/{name}")
        with self._lock:
            if name not in self.nodes:
                raise status_error(f"get Node {name}", 404, "Not Found", missing=MISSING_NODE)
            return copy.deepcopy(self.nodes[name])

    def get_node_status(self, name: str) -> dict[str, Any]:
        self._enter(f"get node/{name}/status")
        with self._lock:
            if name not in self.nodes:
                raise status_error(f"get Node {name}", 404, "Not Found", missing=MISSING_NODE)
            status = self.node_statuses.get(name, {})
            return {
                "capacity": dict(status.get("capacity", {})),
                "allocatable": dict(status.get("allocatable", {})),
            }

    def merge_patch_node(self, name: str, patch: dict[str, Any]) -> None:
        self._enter(f"patch node/{name}")
        with self._lock:
            if name not in self.nodes:
                raise status_error(f"patch Node {name}", 404, "Not Found", missing=MISSING_NODE)
            meta = self.nodes[name]
            for section in ("labels", "annotations"):
                for key, value in (patch.get("metadata", {}).get(section) or {}).items():
                    if value is None:
                        meta[section].pop(key, None)
                    else:
                        meta[section][key] = value
        self._notify(name)

    def get_pod_metadata(self, namespace: str, name: str) -> dict[str, Any]:
        self._enter(f"get pod/{namespace}/{name}")
        with self._lock:
            if (namespace, name) not in self.pods:
                raise status_error(
                    f"get Pod {namespace}/{name}", 404, "Not Found", missing=MISSING_POD
                )
            return copy.deepcopy(self.pods[(namespace, name)])

    def create_event(
        self, namespace: str, body: dict[str, Any], *, timeout: float | None = None
    ) -> None:
        self._enter(f"create event/{namespace}/{body.get('metadata', {}).get('name', '')}")
        with self._lock:
            self.events.append((namespace, copy.deepcopy(body), timeout))

    # -- NodeFeature ----------------------------------------------------------------------

    def get_node_feature(self, namespace: str, name: str) -> dict[str, Any] | None:
        self._enter(f"get nodefeature/{namespace}/{name}")
        with self._lock:
            obj = self.node_features.get((namespace, name))
            return copy.deepcopy(obj) if obj is not None else None

    def create_node_feature(self, namespace: str, body: dict[str, Any]) -> None:
        name = body["metadata"]["name"]
        self._enter(f"create nodefeature/{namespace}/{name}")
        with self._lock:
            if (namespace, name) in self.node_features:
                raise status_error(f"create NodeFeature {namespace}/{name}", 409, "Conflict")
            self.node_features[(namespace, name)] = copy.deepcopy(body)

    def replace_node_feature(self, namespace: str, body: dict[str, Any]) -> None:
        name = body["metadata"]["name"]
        self._enter(f"replace nodefeature/{namespace}/{name}")
        with self._lock:
            self.node_features[(namespace, name)] = copy.deepcopy(body)

    def delete_node_feature(self, namespace: str, name: str) -> bool:
        self._enter(f"delete nodefeature/{namespace}/{name}")
        with self._lock:
            return self.node_features.pop((namespace, name), None) is not None

    # -- Dynamic Resource Allocation ------------------------------------------------------

    def put_resource_claim(self, body: dict[str, Any]) -> dict[str, Any]:
        """Store a ResourceClaim as given (created or replaced, unconditionally); the stored copy.

        For set-up, and for a scheduler stand-in writing a claim's `status.allocation`.
        """
        meta = body["metadata"]
        key = (meta.get("namespace", "default"), meta["name"])
        with self._lock:
            stored = self._stamped(body, self.resource_claims.get(key), kind="ResourceClaim")
            self.resource_claims[key] = stored
            return copy.deepcopy(stored)

    def put_device_class(self, body: dict[str, Any]) -> dict[str, Any]:
        """Store a DeviceClass as given (created or replaced); the stored copy."""
        name = body["metadata"]["name"]
        with self._lock:
            stored = self._stamped(body, self.device_classes.get(name), kind="DeviceClass")
            self.device_classes[name] = stored
            return copy.deepcopy(stored)

    def list_resource_slices(self, driver: str, node: str) -> list[dict[str, Any]]:
        self._enter(f"list resourceslices/{driver}/{node}")
        with self._lock:
            return [
                copy.deepcopy(obj)
                for obj in self.resource_slices.values()
                if obj.get("spec", {}).get("driver") == driver
                and obj.get("spec", {}).get("nodeName") == node
            ]

    def create_resource_slice(self, body: dict[str, Any]) -> dict[str, Any]:
        meta = body.get("metadata") or {}
        with self._lock:
            name = meta.get("name") or f"{meta.get('generateName', '')}{self._suffix()}"
        self._enter(f"create resourceslice/{name}")
        what = f"create ResourceSlice {name}"
        with self._lock:
            if meta.get("resourceVersion"):
                # As the API server's storage answers: a version belongs to stored objects.
                raise status_error(
                    what,
                    500,
                    "Internal Server Error",
                    detail="resourceVersion should not be set on objects to be created",
                )
            if name in self.resource_slices:
                raise status_error(
                    what,
                    409,
                    "Conflict",
                    detail=f'resourceslices.resource.k8s.io "{name}" already exists',
                )
            named = copy.deepcopy(body)
            named.setdefault("metadata", {})["name"] = name
            named = self._slice_stored(named)
            stored = self._stamped(_taints_stamped(named, self.clock), None, kind="ResourceSlice")
            self.resource_slices[name] = stored
            due = self._slice_event("ADDED", stored)
        _deliver(due)
        return copy.deepcopy(stored)

    def replace_resource_slice(self, body: dict[str, Any]) -> dict[str, Any]:
        name = body["metadata"]["name"]
        self._enter(f"replace resourceslice/{name}")
        what = f"update ResourceSlice {name}"
        with self._lock:
            current = self.resource_slices.get(name)
            if current is None:
                raise status_error(what, 404, "Not Found", missing=MISSING_RESOURCE_SLICE)
            version = body["metadata"].get("resourceVersion")
            # An update without a version is unconditional, as ResourceSlice's strategy allows.
            if version and version != current["metadata"]["resourceVersion"]:
                raise status_error(
                    what,
                    409,
                    "Conflict",
                    detail=_MODIFIED.format(name=name),
                )
            # As the API server (ValidateResourceSliceUpdate): a slice's pool name is
            # immutable, "spec.pool.name: Invalid value: ...: field is immutable".
            was = current.get("spec", {}).get("pool", {}).get("name")
            now = body.get("spec", {}).get("pool", {}).get("name")
            if was != now:
                raise status_error(
                    what,
                    422,
                    "Unprocessable Entity",
                    detail=f'spec.pool.name: Invalid value: "{now}": field is immutable',
                )
            stamped = _taints_stamped(self._slice_stored(copy.deepcopy(body)), self.clock)
            stored = self._stamped(stamped, current, kind="ResourceSlice")
            self.resource_slices[name] = stored
            due = self._slice_event("MODIFIED", stored)
        _deliver(due)
        return copy.deepcopy(stored)

    def delete_resource_slice(self, name: str) -> bool:
        self._enter(f"delete resourceslice/{name}")
        with self._lock:
            gone = self.resource_slices.pop(name, None)
            if gone is None:
                return False
            # As the API server: the deleted object carries a version of its own.
            gone["metadata"]["resourceVersion"] = str(next(self._versions))
            due = self._slice_event("DELETED", gone)
        _deliver(due)
        return True

    def get_resource_claim(self, namespace: str, name: str) -> dict[str, Any]:
        check_object_name("get ResourceClaim", namespace, name)
        self._enter(f"get resourceclaim/{namespace}/{name}")
        with self._lock:
            claim = self.resource_claims.get((namespace, name))
            if claim is None:
                raise status_error(
                    f"get ResourceClaim {namespace}/{name}",
                    404,
                    "Not Found",
                    missing=MISSING_RESOURCE_CLAIM,
                )
            return copy.deepcopy(claim)

    def _stamped(
        self, body: dict[str, Any], current: dict[str, Any] | None, *, kind: str
    ) -> dict[str, Any]:
        """`body` as the API server stores it; call with `_lock` held.

        A new `resourceVersion` on every write; `uid` and `creationTimestamp` kept from the
        stored object; `generation` 1 on create, bumped when `spec` changes.
        """
        stored = copy.deepcopy(body)
        stored.setdefault("apiVersion", RESOURCE_API_VERSION)
        stored.setdefault("kind", kind)
        meta = stored.setdefault("metadata", {})
        meta["resourceVersion"] = str(next(self._versions))
        if current is None:
            meta.setdefault("uid", str(uuid.uuid4()))
            meta.setdefault("creationTimestamp", "2026-01-01T00:00:00Z")
            meta["generation"] = 1
        else:
            old = current["metadata"]
            meta["uid"] = old.get("uid")
            meta["creationTimestamp"] = old.get("creationTimestamp")
            changed = stored.get("spec") != current.get("spec")
            meta["generation"] = old.get("generation", 1) + (1 if changed else 0)
        return stored

    def _slice_stored(self, body: dict[str, Any]) -> dict[str, Any]:
        """`body` as `slice_storage` keeps it; call with `_lock` held."""
        if self.slice_storage is not None:
            self.slice_storage(body)
        return body

    def _suffix(self) -> str:
        """A `generateName` suffix of five characters, unique in this fake; call with `_lock`."""
        n = next(self._versions)
        letters = []
        for _ in range(5):
            n, digit = divmod(n, len(_SUFFIX_ALPHABET))
            letters.append(_SUFFIX_ALPHABET[digit])
        return "".join(letters)

    # -- the watches ----------------------------------------------------------------------

    async def watch_resource_slices(self, driver: str, node: str) -> AsyncIterator[SliceEvent]:
        """`RELIST`, ADDED for each stored slice, then every change made through this fake
        (any thread), as the API server's watch without a resourceVersion."""
        watcher = _SliceWatcher(driver, node, asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:
            self.calls.append(f"watch resourceslices/{driver}/{node}")
            self._slice_watchers.append(watcher)
            present = [
                SliceEvent("ADDED", copy.deepcopy(obj))
                for obj in self.resource_slices.values()
                if watcher.sees(obj)
            ]
        try:
            yield SliceEvent(RELIST, {})
            for event in present:
                yield event
            while True:
                yield await watcher.queue.get()
        finally:
            with self._lock:
                self._slice_watchers.remove(watcher)

    def _slice_event(
        self, kind: str, obj: dict[str, Any]
    ) -> list[tuple[_SliceWatcher, SliceEvent]]:
        """The event for each slice watcher that sees `obj`; call with `_lock` held."""
        return [
            (w, SliceEvent(kind, copy.deepcopy(obj))) for w in self._slice_watchers if w.sees(obj)
        ]

    async def watch_node_label(self, node: str, label: str) -> AsyncIterator[str | None]:
        """Yields the value now, then every change made through this fake (any thread)."""
        watcher = _Watcher(node, label, asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:
            self.calls.append(f"watch node/{node}")
            self.watched.append((node, label))
            self._watchers.append(watcher)
            last = self._label(node, label)
        try:
            yield last
            while True:
                value = await watcher.queue.get()
                if value != last:  # as the real watch: changes only
                    last = value
                    yield value
        finally:
            with self._lock:
                self._watchers.remove(watcher)

    def _label(self, node: str, label: str) -> str | None:
        value = self.nodes.get(node, {}).get("labels", {}).get(label)
        return str(value) if value else None

    def _notify(self, node: str) -> None:
        with self._lock:
            due = [(w, self._label(node, w.label)) for w in self._watchers if w.node == node]
        for watcher, value in due:
            watcher.loop.call_soon_threadsafe(watcher.queue.put_nowait, value)


def _deliver(due: list[tuple[_SliceWatcher, SliceEvent]]) -> None:
    for watcher, event in due:
        with contextlib.suppress(RuntimeError):  # the watcher's loop is gone: nobody listens
            watcher.loop.call_soon_threadsafe(watcher.queue.put_nowait, event)


def _taints_stamped(body: dict[str, Any], clock: Callable[[], str]) -> dict[str, Any]:
    """`body` (a ResourceSlice) with `timeAdded` set on every device taint that has none;
    one reading of `clock` per write that needs it."""
    now: str | None = None
    for device in body.get("spec", {}).get("devices") or []:
        for taint in device.get("taints") or []:
            if "timeAdded" not in taint:
                now = now or clock()
                taint["timeAdded"] = now
    return body


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class _Watcher:
    node: str
    label: str
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[str | None]


@dataclass(frozen=True)
class _SliceWatcher:
    driver: str
    node: str
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[SliceEvent]

    def sees(self, obj: Mapping[str, Any]) -> bool:
        spec = obj.get("spec") or {}
        return bool(spec.get("driver") == self.driver and spec.get("nodeName") == self.node)
