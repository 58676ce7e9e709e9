"""`KubeClient`: the `Kube` interface over lightkube's (blocking) client.

One client configuration for the whole process (`default_client()`): in-cluster service
account first (the DaemonSet case), else KUBECONFIG / ~/.kube/config. It is loaded on the
first call, not at construction: most `serve` processes never talk to the API and need
no credentials. A failed load is not remembered, so credentials that appear later (a
projected token) are picked up.

lightkube decodes into its own models; every call here hands back plain dictionaries in
the API's spelling, and sends the callers' bodies (NodeFeature, Event) exactly as given.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import threading
import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, TypeVar

import httpx2
from lightkube import ApiError, Client, ConfigError
from lightkube.config.kubeconfig import KubeConfig, SingleConfig
from lightkube.core.resource import ApiInfo, ResourceDef
from lightkube.generic_resource import (
    GenericGlobalResource,
    GenericNamespacedResource,
    create_namespaced_resource,
)
from lightkube.operators import BinaryOperator, SequenceOperator
from lightkube.resources.core_v1 import Node, Pod
from lightkube.types import OnErrorAction, OnErrorResult, PatchType

from kubegpu.kube.errors import KubeError, first_line, no_credentials, translate
from kubegpu.kube.objects import (
    MISSING_DRA_API,
    MISSING_NODE,
    MISSING_NODE_FEATURE,
    MISSING_POD,
    MISSING_RESOURCE_CLAIM,
    MISSING_RESOURCE_SLICE,
    NFD_GROUP,
    NFD_PLURAL,
    NFD_VERSION,
    RESOURCE_GROUP,
    RESOURCE_VERSION,
    check_object_name,
    label_of,
)
from kubegpu.kube.protocol import RELIST, SliceEvent
from kubegpu.watch.backoff import Backoff

log = logging.getLogger(__name__)

#: Seconds one request may take unless the caller says otherwise.
DEFAULT_TIMEOUT: Final = 10.0

#: Objects per page when listing: a node's slices fit in one; a page bounds the worst case.
LIST_CHUNK: Final = 100

#: NFD's NodeFeature, as a schema-less resource: its body goes out and comes back as is.
NodeFeature = create_namespaced_resource(NFD_GROUP, NFD_VERSION, "NodeFeature", NFD_PLURAL)


class CoreEvent(GenericNamespacedResource):
    """core/v1 Event, schema-less for the same reason: the typed model would rewrite the
    caller's timestamps. Not put in lightkube's registry, where v1 Event stays the typed one.
    """

    _api_info = ApiInfo(resource=ResourceDef("", "v1", "Event"), plural="events", verbs=["post"])


class ResourceSlice(GenericGlobalResource):
    """resource.k8s.io/v1 ResourceSlice, schema-less: the publisher's bodies go out as built
    (lightkube's typed model would drop fields it does not know, such as those of a newer
    API server) and come back as the API server wrote them. Not put in lightkube's
    registry, where the typed model stays.
    """

    _api_info = ApiInfo(
        resource=ResourceDef(RESOURCE_GROUP, RESOURCE_VERSION, "ResourceSlice"),
        plural="resourceslices",
        verbs=["delete", "get", "list", "post", "put", "watch"],
    )


class ResourceClaim(GenericNamespacedResource):
    """resource.k8s.io/v1 ResourceClaim, read as the API server wrote it (schema-less)."""

    _api_info = ApiInfo(
        resource=ResourceDef(RESOURCE_GROUP, RESOURCE_VERSION, "ResourceClaim"),
        plural="resourceclaims",
        verbs=["get"],
    )


T = TypeVar("T")
#: A value of a lightkube field selector.
FieldSelector = str | BinaryOperator | SequenceOperator


class KubeClient:
    """`Kube` over lightkube; thread-safe, configured on first use.

    `transport` replaces the HTTP transport under every request (an `httpx2.MockTransport`
    in the tests, which then drive the real requests, URLs, bodies and error mapping).
    """

    def __init__(
        self,
        *,
        transport: httpx2.BaseTransport | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        backoff: tuple[float, float] = (1.0, 30.0),
        watch_timeout_s: int = 300,
    ) -> None:
        self._transport = transport
        self._config: SingleConfig | None = None
        #: One lightkube `Client` per time limit: lightkube sets limits per client, not per call.
        self._clients: dict[float, Client] = {}
        self._lock = threading.Lock()
        self.timeout = timeout
        self.backoff = backoff
        self.watch_timeout_s = watch_timeout_s
        # Connections are pooled per client: a KubeClient dropped unclosed still closes them.
        weakref.finalize(self, _close_all, self._clients)

    def connect(self) -> KubeClient:
        """Load the configuration now (raises `KubeError` when there is none); returns self."""
        self._client(self.timeout)
        return self

    def close(self) -> None:
        """Close the pooled connections; a later call opens new ones."""
        with self._lock:
            _close_all(self._clients)

    # -- configuration --------------------------------------------------------------------

    def _client(self, timeout: float) -> Client:
        """The shared lightkube `Client` for this time limit, configuring on first use."""
        with self._lock:
            client = self._clients.get(timeout)
            if client is None:
                client = self._new_client(timeout)
                self._clients[timeout] = client
            return client

    def _new_client(self, timeout: float) -> Client:
        """A new lightkube `Client`; call with `_lock` held. Raises `KubeError`."""
        try:
            if self._config is None:
                self._config = _load_config()
            return Client(
                config=self._config, timeout=httpx2.Timeout(timeout), transport=self._transport
            )
        except Exception as exc:  # missing file, bad context, bad YAML, unreadable CA...
            raise no_credentials(exc) from exc

    def _call(
        self,
        what: str,
        request: Callable[[Client], T],
        *,
        missing: str | None = None,
        timeout: float | None = None,
    ) -> T:
        """Run one request; every failure leaves as `KubeError`, at this one boundary."""
        limit = self.timeout if timeout is None else timeout
        client = self._client(limit)  # KubeError when there is no configuration
        try:
            return request(client)
        except Exception as exc:
            error = translate(what, exc, timeout=limit, missing=missing)
            if error is None:
                raise
            raise error from exc

    # -- Nodes and Pods -------------------------------------------------------------------

    def get_node_metadata(self, name: str) -> dict[str, Any]:
        def read(client: Client) -> dict[str, Any]:
            meta = client.get(Node, name).metadata
            labels = meta.labels if meta is not None else None
            annotations = meta.annotations if meta is not None else None
            return {"labels": dict(labels or {}), "annotations": dict(annotations or {})}

        return self._call(f"get Node {name}", read, missing=MISSING_NODE)

    def get_node_status(self, name: str) -> dict[str, Any]:
        def read(client: Client) -> dict[str, Any]:
            status = client.get(Node, name).status
            capacity = status.capacity if status is not None else None
            allocatable = status.allocatable if status is not None else None
            return {"capacity": dict(capacity or {}), "allocatable": dict(allocatable or {})}

        return self._call(f"get Node {name}", read, missing=MISSING_NODE)

    def merge_patch_node(self, name: str, patch: dict[str, Any]) -> None:
        self._call(
            f"patch Node {name}",
            lambda client: client.patch(Node, name, patch, patch_type=PatchType.MERGE),
            missing=MISSING_NODE,
        )

    def get_pod_metadata(self, namespace: str, name: str) -> dict[str, Any]:
        def read(client: Client) -> dict[str, Any]:
            meta = client.get(Pod, name, namespace=namespace).metadata
            if meta is None:
                return {"name": None, "uid": None, "ownerReferences": []}
            owners = [
                {"apiVersion": o.apiVersion, "kind": o.kind, "name": o.name, "uid": o.uid}
                for o in meta.ownerReferences or []
            ]
            return {"name": meta.name, "uid": meta.uid, "ownerReferences": owners}

        return self._call(f"get Pod {namespace}/{name}", read, missing=MISSING_POD)

    def create_event(
        self, namespace: str, body: dict[str, Any], *, timeout: float | None = None
    ) -> None:
        name = body.get("metadata", {}).get("name", "")
        self._call(
            f"create Event {namespace}/{name}",
            lambda client: client.create(CoreEvent.from_dict(body), namespace=namespace),
            timeout=timeout,
        )

    # -- NodeFeature (NFD) ----------------------------------------------------------------

    def get_node_feature(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            obj = self._nfd(
                "get", namespace, name, lambda c: c.get(NodeFeature, name, namespace=namespace)
            )
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise
        return dict(obj)

    def create_node_feature(self, namespace: str, body: dict[str, Any]) -> None:
        name = body["metadata"]["name"]
        self._nfd(
            "create",
            namespace,
            name,
            lambda c: c.create(NodeFeature.from_dict(body), namespace=namespace),
        )

    def replace_node_feature(self, namespace: str, body: dict[str, Any]) -> None:
        name = body["metadata"]["name"]
        self._nfd(
            "update",
            namespace,
            name,
            lambda c: c.replace(NodeFeature.from_dict(body), name, namespace=namespace),
        )

    def delete_node_feature(self, namespace: str, name: str) -> bool:
        try:
            self._nfd(
                "delete",
                namespace,
                name,
                lambda c: c.delete(NodeFeature, name, namespace=namespace),
            )
        except KubeError as exc:
            if exc.status == 404:
                return False
            raise
        return True

    def _nfd(self, verb: str, namespace: str, name: str, request: Callable[[Client], T]) -> T:
        return self._call(
            f"{verb} NodeFeature {namespace}/{name}", request, missing=MISSING_NODE_FEATURE
        )

    # -- Dynamic Resource Allocation (resource.k8s.io/v1) ----------------------------------

    def list_resource_slices(self, driver: str, node: str) -> list[dict[str, Any]]:
        # The API server filters on both fields (ResourceSlice's selectable fields), so a
        # node's publisher reads only its own slices, page by page.
        def read(client: Client) -> list[dict[str, Any]]:
            found = client.list(
                ResourceSlice,
                fields={"spec.driver": driver, "spec.nodeName": node},
                chunk_size=LIST_CHUNK,
            )
            return [_whole(obj, ResourceSlice) for obj in found]

        return self._call(
            f"list ResourceSlices of {driver} on {node}", read, missing=MISSING_DRA_API
        )

    def create_resource_slice(self, body: dict[str, Any]) -> dict[str, Any]:
        return self._call(
            f"create ResourceSlice {_name_of(body)}",
            lambda client: _whole(client.create(ResourceSlice.from_dict(body)), ResourceSlice),
            missing=MISSING_DRA_API,
        )

    def replace_resource_slice(self, body: dict[str, Any]) -> dict[str, Any]:
        name = body["metadata"]["name"]
        return self._call(
            f"update ResourceSlice {name}",
            lambda client: _whole(
                client.replace(ResourceSlice.from_dict(body), name), ResourceSlice
            ),
            missing=MISSING_RESOURCE_SLICE,
        )

    def delete_resource_slice(self, name: str) -> bool:
        try:
            self._call(
                f"delete ResourceSlice {name}",
                lambda client: client.delete(ResourceSlice, name),
            )
        except KubeError as exc:
            if exc.status == 404:
                return False
            raise
        return True

    def get_resource_claim(self, namespace: str, name: str) -> dict[str, Any]:
        check_object_name("get ResourceClaim", namespace, name)
        return self._call(
            f"get ResourceClaim {namespace}/{name}",
            lambda client: _whole(
                client.get(ResourceClaim, name, namespace=namespace), ResourceClaim
            ),
            missing=MISSING_RESOURCE_CLAIM,
        )

    # -- the ResourceSlice watch ----------------------------------------------------------

    async def watch_resource_slices(self, driver: str, node: str) -> AsyncIterator[SliceEvent]:
        """List, then watch from the list's resourceVersion (an informer's list-and-watch,
        so nothing between the two is lost), in a daemon thread feeding the loop."""

        def follow(emit: Callable[[SliceEvent], None], state: _WatchState) -> None:
            self._follow_slices(driver, node, emit, state)

        # aclosing: closing this iterator must stop the thread now, not at collection.
        async with contextlib.aclosing(_in_thread(follow, f"slices-{driver}-{node}")) as events:
            async for event in events:
                yield event

    def _follow_slices(
        self, driver: str, node: str, emit: Callable[[SliceEvent], None], state: _WatchState
    ) -> None:
        """Blocking: list and watch again after every failure or expiry, until stopped."""
        fields: dict[str, FieldSelector] = {"spec.driver": driver, "spec.nodeName": node}
        delay = Backoff(*self.backoff)
        while not state.stop.is_set():
            what = f"list ResourceSlices of {driver} on {node}"
            try:

                def read(client: Client) -> tuple[str, list[dict[str, Any]]]:
                    found = client.list(ResourceSlice, fields=fields, chunk_size=LIST_CHUNK)
                    items = [_whole(obj, ResourceSlice) for obj in found]
                    return found.resourceVersion, items

                version, present = self._call(what, read, missing=MISSING_DRA_API)
                emit(SliceEvent(RELIST, {}))
                for obj in present:
                    emit(SliceEvent("ADDED", obj))
                what = f"watch ResourceSlices of {driver} on {node}"
                watcher = state.open(lambda: self._watch_client())
                if watcher is None:
                    break  # stopped while listing
                for kind, event in watcher.watch(
                    ResourceSlice,
                    fields=fields,
                    resource_version=version,
                    server_timeout=self.watch_timeout_s,
                    on_error=_end_on_error_event,
                ):
                    if state.stop.is_set():
                        break
                    emit(SliceEvent(kind, _whole(event, ResourceSlice)))
                delay.reset()
            except Exception as exc:
                if state.stop.is_set():
                    break  # closing the watch's client fails its stream: not worth a warning
                error = exc if isinstance(exc, KubeError) else translate(what, exc)
                reason = (
                    str(error) if error is not None else f"{type(exc).__name__}: {first_line(exc)}"
                )
                log.warning(
                    "node %s: cannot watch ResourceSlices of %s: %s; retrying in %.1fs",
                    node,
                    driver,
                    reason,
                    delay.delay,
                )
                delay.block(state.stop)
            finally:
                state.close_client()

    # -- the node label watch -------------------------------------------------------------

    async def watch_node_label(self, node: str, label: str) -> AsyncIterator[str | None]:
        """Read the Node, then watch it by name, in a daemon thread feeding the loop."""

        def follow(emit: Callable[[str | None], None], state: _WatchState) -> None:
            self._follow(node, label, emit, state)

        async with contextlib.aclosing(_in_thread(follow, f"labels-{node}")) as values:
            async for value in values:
                yield value

    def _follow(
        self, node: str, label: str, emit: Callable[[str | None], None], state: _WatchState
    ) -> None:
        """Blocking: offer each new value until stopped; no failure ends the watch."""
        unset = object()
        last: object = unset
        delay = Backoff(*self.backoff)

        def offer(value: str | None) -> None:
            nonlocal last
            if value != last:
                last = value
                emit(value)

        while not state.stop.is_set():
            what = f"get Node {node}"
            try:
                obj = self._call(what, lambda c: c.get(Node, node), missing=MISSING_NODE)
                offer(label_of(obj.metadata, label))
                what = f"watch Node {node}"
                watcher = state.open(lambda: self._watch_client())
                if watcher is None:
                    break  # stopped while the Node was read
                for kind, event in watcher.watch(
                    Node,
                    fields={"metadata.name": node},
                    resource_version=obj.metadata.resourceVersion if obj.metadata else None,
                    server_timeout=self.watch_timeout_s,
                    on_error=_end_on_error_event,
                ):
                    if state.stop.is_set():
                        break
                    offer(None if kind == "DELETED" else label_of(event.metadata, label))
                delay.reset()
            except Exception as exc:
                if state.stop.is_set():
                    break  # closing the watch's client fails its stream: not worth a warning
                error = exc if isinstance(exc, KubeError) else translate(what, exc)
                if isinstance(error, KubeError) and error.status == 404:
                    offer(None)  # no such Node: the label is unset
                reason = (
                    str(error) if error is not None else f"{type(exc).__name__}: {first_line(exc)}"
                )
                log.warning(
                    "node %s: cannot watch label %s: %s; retrying in %.1fs",
                    node,
                    label,
                    reason,
                    delay.delay,
                )
                delay.block(state.stop)
            finally:
                state.close_client()

    def _watch_client(self) -> Client:
        """A client of the watch's own, so that closing it ends only that watch."""
        with self._lock:
            return self._new_client(self.timeout)


def _whole(
    obj: Any, kind: type[GenericGlobalResource | GenericNamespacedResource]
) -> dict[str, Any]:
    """A generic object as a plain dictionary, `apiVersion` and `kind` filled in.

    The items of a list answer carry neither; filled in, every object reads as `kubectl
    get -o json` shows it, whichever call returned it.
    """
    whole = dict(obj)
    resource = kind._api_info.resource
    whole.setdefault("apiVersion", resource.api_version)
    whole.setdefault("kind", resource.kind)
    return whole


def _name_of(body: dict[str, Any]) -> str:
    """The object's name, or its `generateName` prefix followed by "*" when the server names it."""
    meta = body.get("metadata") or {}
    return str(meta.get("name") or f"{meta.get('generateName', '')}*")


async def _in_thread(
    follow: Callable[[Callable[[T], None], _WatchState], None], name: str
) -> AsyncGenerator[T, None]:
    """What a blocking `follow(emit, state)` emits, run in a daemon thread (lightkube's
    watch is a blocking iterator), handed to the loop; closing the iterator stops it."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[T] = asyncio.Queue()
    state = _WatchState()

    def emit(item: T) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # the loop is gone: nobody is listening
            state.stop.set()

    threading.Thread(target=follow, args=(emit, state), daemon=True, name=name).start()
    try:
        while True:
            yield await queue.get()
    finally:
        state.close()


def _close_all(clients: dict[float, Client]) -> None:
    for client in clients.values():
        client.close()
    clients.clear()


def _end_on_error_event(error: Exception, count: int) -> OnErrorResult:
    """An ERROR event (usually 410 Gone) ends the stream quietly: read again, watch again.

    lightkube raises `ApiError` for an ERROR event; a refused watch request or a broken
    stream is httpx2's own error, which leaves the stream to be logged and retried.
    """
    if isinstance(error, ApiError):
        return OnErrorResult(OnErrorAction.STOP)
    return OnErrorResult(OnErrorAction.RAISE)


@dataclass
class _WatchState:
    """Shared by the loop and the watch thread: the stop flag and the stream's own client.

    lightkube renews a watch the server ended by itself, so the stream never ends on its
    own; closing its client from the loop's side makes the next renewal fail, and the
    thread, seeing `stop`, ends. A stream that is quiet ends within `watch_timeout_s`.
    """

    stop: threading.Event = field(default_factory=threading.Event)
    _client: Client | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def open(self, new: Callable[[], Client]) -> Client | None:
        """The stream's client, made by `new`; None once stopped."""
        with self._lock:
            if self.stop.is_set():
                return None
            self._client = new()
            return self._client

    def close_client(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()

    def close(self) -> None:
        self.stop.set()
        self.close_client()


def _load_config() -> SingleConfig:
    """In-cluster service account, else KUBECONFIG (read now), else ~/.kube/config.

    As the official client: in-cluster only when the pod's environment names the API
    server (KUBERNETES_SERVICE_HOST/PORT) and the service account's files are there.
    """
    if os.environ.get("KUBERNETES_SERVICE_HOST") and os.environ.get("KUBERNETES_SERVICE_PORT"):
        try:
            return _current(KubeConfig.from_service_account())
        except ConfigError:
            pass  # no service account mounted: fall back to a kubeconfig
    return _current(KubeConfig.from_file(_kubeconfig_path()))


def _kubeconfig_path() -> str:
    """The first existing file of KUBECONFIG (a path list, as kubectl reads it), or the default."""
    paths = [p for p in (os.environ.get("KUBECONFIG") or "").split(os.pathsep) if p]
    existing = [p for p in paths if Path(p).expanduser().is_file()]
    return (existing or paths or ["~/.kube/config"])[0]


def _current(config: KubeConfig) -> SingleConfig:
    single = config.get()
    if single is None:  # only with a default, which is not passed: for the type checker
        raise ConfigError("no current context")
    return single


@functools.cache
def default_client() -> KubeClient:
    """The process's one client; configured lazily, on its first call."""
    return KubeClient()
