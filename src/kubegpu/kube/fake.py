"""`FakeKube`: an in-memory `Kube` that records calls and fails on demand.

For tests, and for anyone embedding kubegpu without a cluster. It answers as the API
server would (a missing Node is a 404 `KubeError`, creating an existing NodeFeature a
409) with the same messages as `KubeClient`, so error paths are exercised as written.
"""

from __future__ import annotations

import asyncio
import copy
import threading
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from kubegpu.kube.errors import KubeError, status_error
from kubegpu.kube.objects import MISSING_NODE, MISSING_POD


@dataclass
class FakeKube:
    """Nodes' metadata, Pods' metadata, NodeFeature objects and Events, with a call log.

    `calls` reads like "get node/n1", "create nodefeature/ns/name", "create event/ns/name".
    `fail_with` makes every call raise; `fail_next(prefix, error)` makes only the next call
    whose log line starts with `prefix` raise. Safe to call from worker threads.
    """

    #: Node name -> {"labels": {...}, "annotations": {...}}.
    nodes: dict[str, dict[str, Any]] = field(default_factory=dict)
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
    _pending: list[tuple[str, BaseException]] = field(default_factory=list, repr=False)
    _watchers: list[_Watcher] = field(default_factory=list, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    # -- set-up and fault injection -------------------------------------------------------

    def add_node(self, name: str, labels: Mapping[str, str] | None = None) -> None:
        with self._lock:
            self.nodes[name] = {"labels": dict(labels or {}), "annotations": {}}
        self._notify(name)

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

    # -- Nodes, Pods, Events --------------------------------------------------------------

    def get_node_metadata(self, name: str) -> dict[str, Any]:
        self._enter(f"get node/{name}")
        with self._lock:
            if name not in self.nodes:
                raise status_error(f"get Node {name}", 404, "Not Found", missing=MISSING_NODE)
            return copy.deepcopy(self.nodes[name])

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

    # -- the node label watch -------------------------------------------------------------

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


@dataclass(frozen=True)
class _Watcher:
    node: str
    label: str
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[str | None]
