"""`KubeClient`: the `Kube` interface over lightkube's (blocking) client.

One client configuration for the whole process (`default_client()`): in-cluster service
account first (the DaemonSet case), else KUBECONFIG / ~/.kube/config. It is loaded on the
first call, not at construction: most `serve` processes never talk to the API and need
no credentials. A failed load is not remembered, so credentials that appear later (a
projected token) are picked up.

lightkube decodes into its own models; every call here hands back plain dictionaries in
the API's spelling, and sends the callers' bodies (NodeFeature, Event) exactly as given.

The two watches (a Node's label, a node's ResourceSlices) send their watch requests
themselves, through an HTTP client configured as lightkube configures its own: each
stream has a read deadline, asks for bookmarks and ends by itself within minutes, and how
it ended decides the next step (see `KubeClient._list_and_watch`).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import json
import logging
import os
import random
import threading
import time
import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, TypeVar

import httpx2
from lightkube import Client, ConfigError, NotReadyError
from lightkube.config.client_adapter import Client as http_client
from lightkube.config.client_adapter import ConnectionParams
from lightkube.config.kubeconfig import KubeConfig, SingleConfig
from lightkube.core.resource import ApiInfo, ResourceDef
from lightkube.core.selector import build_selector
from lightkube.generic_resource import (
    GenericGlobalResource,
    GenericNamespacedResource,
    create_namespaced_resource,
)
from lightkube.operators import BinaryOperator, SequenceOperator
from lightkube.resources.core_v1 import Node, Pod
from lightkube.types import PatchType

from kubegpu.kube.errors import (
    KubeError,
    first_line,
    no_credentials,
    status_object_error,
    translate,
    unreadable,
)
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

#: Seconds a watch may stay silent (no event, no bookmark) before its connection is taken
#: for dead and replaced. The API server sends a watch that allows bookmarks one about
#: every minute (its cacher's bookmark frequency), so only a dead stream is this quiet.
WATCH_READ_DEADLINE_S: Final = 75.0
#: client-go's reflector's `minWatchTimeout`: each watch asks the server to end it after
#: a random time between this and twice this (`timeoutSeconds`).
MIN_WATCH_TIMEOUT_S: Final = 300
#: A watch that ends sooner than this (seconds) counts as a failure for the backoff.
SHORT_WATCH_S: Final = 1.0
#: Unreadable watch events remembered per watch, so each is logged once.
SKIPPED_REMEMBERED: Final = 1024
#: The longest watch event line read (bytes): past it, the stream is taken for broken. The
#: API server refuses to store an object larger than etcd's request limit (1.5 MiB by
#: default, etcd's `--max-request-bytes`), and an event line is one object with a few bytes
#: around it; a line ten times longer is no event, and must not grow memory without bound.
MAX_WATCH_LINE_BYTES: Final = 16 * 1024 * 1024

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
    The watches' pacing is injectable for tests: `clock` times each stream (one that
    ends within `SHORT_WATCH_S` is a failure), `pause(stop, seconds)` waits out a backoff
    delay (True when stopped), `watch_deadline_s` is the read deadline,
    `watch_line_limit` the longest watch event line read (bytes).
    """

    def __init__(
        self,
        *,
        transport: httpx2.BaseTransport | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        backoff: tuple[float, float] = (1.0, 30.0),
        watch_timeout_s: int = MIN_WATCH_TIMEOUT_S,
        watch_deadline_s: float = WATCH_READ_DEADLINE_S,
        watch_line_limit: int = MAX_WATCH_LINE_BYTES,
        clock: Callable[[], float] = time.monotonic,
        pause: Callable[[threading.Event, float], bool] | None = None,
    ) -> None:
        self._transport = transport
        self._config: SingleConfig | None = None
        #: One lightkube `Client` per time limit: lightkube sets limits per client, not per call.
        self._clients: dict[float, Client] = {}
        self._lock = threading.Lock()
        self.timeout = timeout
        self.backoff = backoff
        self.watch_timeout_s = watch_timeout_s
        self.watch_deadline_s = watch_deadline_s
        self.watch_line_limit = watch_line_limit
        self._clock = clock
        self._pause = pause or _pause
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

    def _configured(self) -> SingleConfig:
        """The configuration, loaded on first use; call with `_lock` held. Raises `KubeError`."""
        if self._config is None:
            try:
                self._config = _load_config()
            except Exception as exc:  # missing file, bad context, bad YAML...
                raise no_credentials(exc) from exc
        return self._config

    def _new_client(self, timeout: float) -> Client:
        """A new lightkube `Client`; call with `_lock` held. Raises `KubeError`."""
        config = self._configured()
        try:
            return Client(config=config, timeout=httpx2.Timeout(timeout), transport=self._transport)
        except Exception as exc:  # an unreadable CA or client certificate...
            raise no_credentials(exc) from exc

    def _call(
        self,
        what: str,
        request: Callable[[Client], T],
        *,
        missing: str | None = None,
        timeout: float | None = None,
        schemaless: bool = False,
    ) -> T:
        """Run one request; every failure leaves as `KubeError`, at this one boundary.

        `schemaless`: the answer is taken as the server's JSON, so an answer that cannot be
        decoded (not JSON, a list item that is no object) is the server's fault, a
        `KubeError` like an outage, not a bug of ours to crash on.
        """
        limit = self.timeout if timeout is None else timeout
        client = self._client(limit)  # KubeError when there is no configuration
        try:
            return request(client)
        except Exception as exc:
            error = translate(what, exc, timeout=limit, missing=missing)
            if error is None and schemaless and isinstance(exc, ValueError | TypeError):
                error = unreadable(what, exc)
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
            f"list ResourceSlices of {driver} on {node}",
            read,
            missing=MISSING_DRA_API,
            schemaless=True,
        )

    def create_resource_slice(self, body: dict[str, Any]) -> dict[str, Any]:
        return self._call(
            f"create ResourceSlice {_name_of(body)}",
            lambda client: _whole(client.create(ResourceSlice.from_dict(body)), ResourceSlice),
            missing=MISSING_DRA_API,
            schemaless=True,
        )

    def replace_resource_slice(self, body: dict[str, Any]) -> dict[str, Any]:
        name = body["metadata"]["name"]
        return self._call(
            f"update ResourceSlice {name}",
            lambda client: _whole(
                client.replace(ResourceSlice.from_dict(body), name), ResourceSlice
            ),
            missing=MISSING_RESOURCE_SLICE,
            schemaless=True,
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

    # -- the watches ----------------------------------------------------------------------
    #
    # Both watches are an informer's list-and-watch (`_list_and_watch`): read, then watch
    # from the read's resourceVersion. Each stream is one HTTP request sent here, not
    # through lightkube's watch, which renews a stream the server ended at once and unseen
    # (a server that ends every watch at once made that a busy loop) and reads without a
    # deadline (a half-open connection was never noticed).

    async def watch_resource_slices(self, driver: str, node: str) -> AsyncIterator[SliceEvent]:
        """List, then watch from the list's resourceVersion (an informer's list-and-watch,
        so nothing between the two is lost), in a daemon thread feeding the loop."""
        fields: dict[str, FieldSelector] = {"spec.driver": driver, "spec.nodeName": node}
        what = f"list ResourceSlices of {driver} on {node}"

        def follow(emit: Callable[[SliceEvent], None], state: _WatchState) -> None:
            def read() -> str | None:
                def listed(client: Client) -> tuple[str | None, list[dict[str, Any]]]:
                    found = client.list(ResourceSlice, fields=fields, chunk_size=LIST_CHUNK)
                    items = [_whole(obj, ResourceSlice) for obj in found]
                    return _list_version(found), items

                version, present = self._call(
                    what, listed, missing=MISSING_DRA_API, schemaless=True
                )
                emit(SliceEvent(RELIST, {}))
                for obj in present:
                    emit(SliceEvent("ADDED", obj))
                return version

            def on_event(kind: str, obj: dict[str, Any]) -> str | None:
                emit(SliceEvent(kind, _whole(obj, ResourceSlice)))
                return None

            watch = _Watch(
                node=node,
                subject=f"ResourceSlices of {driver}",
                what=f"watch ResourceSlices of {driver} on {node}",
                path=_collection_path(ResourceSlice),
                selector=build_selector(
                    {"spec.driver": driver, "spec.nodeName": node}, for_fields=True
                ),
                read=read,
                on_event=on_event,
            )
            self._list_and_watch(watch, state)

        # aclosing: closing this iterator must stop the thread now, not at collection.
        async with contextlib.aclosing(_in_thread(follow, f"slices-{driver}-{node}")) as events:
            async for event in events:
                yield event

    async def watch_node_label(self, node: str, label: str) -> AsyncIterator[str | None]:
        """Read the Node, then watch it by name, in a daemon thread feeding the loop."""

        def follow(emit: Callable[[str | None], None], state: _WatchState) -> None:
            unset = object()
            last: object = unset

            def offer(value: str | None) -> None:
                nonlocal last
                if value != last:
                    last = value
                    emit(value)

            def read() -> str | None:
                obj = self._call(
                    f"get Node {node}", lambda c: c.get(Node, node), missing=MISSING_NODE
                )
                offer(label_of(obj.metadata, label))
                return obj.metadata.resourceVersion if obj.metadata else None

            def on_event(kind: str, obj: dict[str, Any]) -> str | None:
                if kind == "DELETED":
                    offer(None)
                    return None
                labels = obj["metadata"].get("labels") or {}
                if not isinstance(labels, dict):
                    return "metadata.labels is not a map"
                value = labels.get(label)
                offer(str(value) if value else None)
                return None

            def on_error(error: KubeError) -> None:
                if error.status == 404:
                    offer(None)  # no such Node: the label is unset

            watch = _Watch(
                node=node,
                subject=f"label {label}",
                what=f"watch Node {node}",
                path=_collection_path(Node),
                selector=build_selector({"metadata.name": node}, for_fields=True),
                read=read,
                on_event=on_event,
                on_error=on_error,
            )
            self._list_and_watch(watch, state)

        async with contextlib.aclosing(_in_thread(follow, f"labels-{node}")) as values:
            async for value in values:
                yield value

    def _list_and_watch(self, watch: _Watch, state: _WatchState) -> None:
        """Blocking: read, then watch from the read's version, again after every end, until
        stopped. No failure ends it; each is logged and paced by one `Backoff`:

        - a stream the server ends after a while (its `timeoutSeconds`) is watched again at
          once from the last version seen (an event's or a bookmark's): nothing is missed;
        - a stream that ends within `SHORT_WATCH_S` counts as a failure, as client-go's
          reflector counts a "very short watch": watched again after the backoff;
        - an expired version (410 Gone) is read again: at once the first time, after the
          backoff when the watch that follows expires again;
        - a stream silent for `watch_deadline_s` (no event, no bookmark) is a dead
          connection: replaced at once from the last version seen;
        - a failed read or watch request (a line past `watch_line_limit` is a broken
          stream) waits the backoff, or the server's Retry-After when longer (capped);
          then a failed read is read again, a failed watch watched again from the last
          version seen.
        """
        delay = Backoff(*self.backoff)
        read = False  # whether `watch.version` holds a read's (or a later event's) version
        expired = False  # whether the last attempt ended expired: another one then waits
        while not state.stop.is_set():
            started = self._clock()
            try:
                if not read:
                    watch.version = watch.read()
                    read = True
                http = state.open(self._watch_http)
                if http is None:
                    break  # stopped while reading
                started = self._clock()  # the stream's own time, not the read's
                end = self._stream(http, watch, state)
            except Exception as exc:
                if state.stop.is_set():
                    break  # closing the stream's client fails its read: not worth a warning
                error = exc if isinstance(exc, KubeError) else translate(watch.what, exc)
                if error is not None and error.status == 410:
                    end = _End.EXPIRED  # refused as too old rather than ended as such
                else:
                    if error is not None:
                        watch.on_error(error)
                    reason = (
                        str(error)
                        if error is not None
                        else f"{type(exc).__name__}: {first_line(exc)}"
                    )
                    expired = False
                    wait = delay.advance(error.retry_after if error is not None else None)
                    log.warning(
                        "node %s: cannot watch %s: %s; retrying in %.1fs",
                        watch.node,
                        watch.subject,
                        reason,
                        wait,
                    )
                    if self._pause(state.stop, wait):
                        break
                    continue
            finally:
                state.close_client()
            if end is _End.STOPPED or state.stop.is_set():
                break
            if end is not _End.EXPIRED:
                expired = False
            if end is _End.STALLED:
                log.info(
                    "node %s: the watch of %s sent nothing (no event, no bookmark) for %gs: "
                    "taking its connection for dead and watching again",
                    watch.node,
                    watch.subject,
                    self.watch_deadline_s,
                )
                continue
            lasted = self._clock() - started
            if lasted >= SHORT_WATCH_S:
                delay.reset()
            if end is _End.EXPIRED:
                read = False
                if not expired or lasted >= SHORT_WATCH_S:
                    expired = True
                    continue  # the version is too old: read again, at once the first time
                wait = delay.advance()
                log.warning(
                    "node %s: the watch of %s expired again at once (HTTP 410 Gone); "
                    "reading again in %.1fs",
                    watch.node,
                    watch.subject,
                    wait,
                )
            elif lasted < SHORT_WATCH_S:
                wait = delay.advance()
                log.warning(
                    "node %s: the API server ended the watch of %s after %.1fs (a watch "
                    "lasts minutes: is a proxy in between ending it?); watching again in %.1fs",
                    watch.node,
                    watch.subject,
                    lasted,
                    wait,
                )
            else:
                continue  # ended by the server's timeoutSeconds: watch on from where it ended
            if self._pause(state.stop, wait):
                break

    def _stream(self, http: httpx2.Client, watch: _Watch, state: _WatchState) -> _End:
        """One watch request from `watch.version`, read until it ends; how it ended.
        `watch.version` follows each event and bookmark, so a stream that breaks is
        watched again from the last version it delivered.

        Raises `KubeError` for an ERROR event other than 410 or a line longer than
        `MAX_WATCH_LINE_BYTES`, and httpx2's errors for a refused request or a broken
        stream, as every call here does.
        """
        params = {
            "watch": "true",
            # With bookmarks the server sends one about every minute (and just before
            # `timeoutSeconds`): a healthy watch is never silent for the read deadline,
            # and the next one resumes from a recent version.
            "allowWatchBookmarks": "true",
            "fieldSelector": watch.selector,
            # client-go's reflector's choice, spread so a fleet's watches do not all end
            # together; random, not secret.
            "timeoutSeconds": str(int(self.watch_timeout_s * (1 + random.random()))),
        }
        if watch.version is not None:
            params["resourceVersion"] = watch.version
        try:
            with http.stream("GET", watch.path, params=params) as answer:
                if answer.is_error:
                    answer.read()
                    answer.raise_for_status()
                for line in _lines(answer.iter_bytes(), self.watch_line_limit):
                    if state.stop.is_set():
                        return _End.STOPPED
                    if not line.strip():
                        continue
                    decoded = _watch_event(line)
                    if isinstance(decoded, str):
                        watch.skip(decoded, line)
                        continue
                    kind, obj = decoded
                    if kind == "ERROR":
                        if obj.get("code") == 410:  # expired: no failure, read again
                            return _End.EXPIRED
                        raise status_object_error(watch.what, obj)
                    seen = obj["metadata"].get("resourceVersion")
                    if not isinstance(seen, str) or not seen:
                        watch.skip("no metadata.resourceVersion", line)
                        continue
                    watch.version = seen
                    if kind == "BOOKMARK":
                        continue
                    problem = watch.on_event(kind, obj)
                    if problem is not None:
                        watch.skip(problem, line)
        except httpx2.ReadTimeout:
            return _End.STALLED
        except _LineTooLong as exc:
            raise KubeError(
                f"{watch.what}: the API server sent a line of over {exc.limit} bytes, longer "
                f"than any object it stores: taking the stream for broken"
            ) from None
        return _End.CLOSED

    def _watch_http(self) -> httpx2.Client:
        """An HTTP client of the stream's own, so that closing it ends only that stream,
        configured as lightkube configures its own (server, credentials, TLS), and with
        the read deadline lightkube's watch does without."""
        with self._lock:
            config = self._configured()
        timeout = httpx2.Timeout(self.timeout, read=self.watch_deadline_s)
        try:
            return http_client(config, ConnectionParams(timeout=timeout, transport=self._transport))
        except Exception as exc:  # an unreadable CA or client certificate...
            raise no_credentials(exc) from exc


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


def _pause(stop: threading.Event, seconds: float) -> bool:
    """Wait `seconds` or until `stop` is set (True)."""
    return stop.wait(seconds)


def _ignore(error: KubeError) -> None:
    pass


class _End(enum.Enum):
    """How one watch stream ended."""

    CLOSED = "closed"  # by the server, without an error
    EXPIRED = "expired"  # 410 Gone: the version is too old, read again
    STALLED = "stalled"  # nothing for the read deadline: a dead connection
    STOPPED = "stopped"  # the watch was closed on the loop's side


@dataclass
class _Watch:
    """One list-and-watch: what to read first, what to watch, what to do with an event."""

    node: str
    #: What is watched, for log lines: "ResourceSlices of gpu.nvidia.com", "label x".
    subject: str
    #: The call, for error messages: "watch Node n1".
    what: str
    #: The collection's URL path and the field selector the watch request sends.
    path: str
    selector: str
    #: Reads the present state (and hands it on); the resourceVersion to watch from.
    read: Callable[[], str | None]
    #: Takes an ADDED, MODIFIED or DELETED event's object (a JSON object with `metadata`);
    #: None, or why the object is unreadable (then logged once and skipped).
    on_event: Callable[[str, dict[str, Any]], str | None]
    #: Sees each failure of a read or a watch request before it is retried.
    on_error: Callable[[KubeError], None] = _ignore
    #: The resourceVersion to watch from: the read's, then each event's or bookmark's.
    version: str | None = None
    _skipped: set[int] = field(default_factory=set)

    def skip(self, problem: str, line: bytes) -> None:
        """Log an unreadable event once (by its text) and leave it alone: an object that
        cannot be read is no reason to stop watching the others."""
        key = hash(line)
        if key in self._skipped:
            return
        if len(self._skipped) >= SKIPPED_REMEMBERED:
            self._skipped.clear()
        self._skipped.add(key)
        # `problem` is this module's own text: nothing the server sent reaches the log.
        log.warning(
            "node %s: skipped an unreadable event on the watch of %s (%s); it is left alone",
            self.node,
            self.subject,
            problem,
        )


class _LineTooLong(Exception):
    def __init__(self, limit: int) -> None:
        super().__init__(f"a line of over {limit} bytes")
        self.limit = limit


def _lines(chunks: Iterable[bytes], limit: int) -> Iterator[bytes]:
    """The lines of a watch stream (each event is one JSON object and a "\\n"), at most
    `limit` bytes each: `_LineTooLong` as soon as one is longer, before more is read.

    Hand-written: httpx2's `iter_lines` keeps a line however long it grows, and splits
    at every character `str.splitlines` takes for a line end (U+0085 and U+2028 among
    them, which JSON carries unescaped inside a string). Only "\\n" ends an event.
    """
    pending = bytearray()
    for chunk in chunks:
        start = 0
        while (end := chunk.find(b"\n", start)) >= 0:
            if len(pending) + end - start > limit:
                raise _LineTooLong(limit)
            if pending:
                pending += chunk[start:end]
                yield bytes(pending)
                pending.clear()
            else:
                yield chunk[start:end]
            start = end + 1
        pending += chunk[start:]
        if len(pending) > limit:
            raise _LineTooLong(limit)
    if pending:
        yield bytes(pending)  # cut short: the stream broke inside an event


def _watch_event(line: bytes) -> tuple[str, dict[str, Any]] | str:
    """One line of a watch stream as (type, object), or what makes it unreadable."""
    try:
        event = json.loads(line)
    except ValueError:  # UnicodeDecodeError too: not UTF-8
        return "not JSON"
    if not isinstance(event, dict):
        return "not a JSON object"
    kind, obj = event.get("type"), event.get("object")
    if not isinstance(kind, str) or not isinstance(obj, dict):
        return "no type or no object"
    if kind != "ERROR":
        if kind not in ("ADDED", "MODIFIED", "DELETED", "BOOKMARK"):
            return "an event type the watch API does not have"
        if not isinstance(obj.get("metadata"), dict):
            return "no metadata"
    return kind, obj


def _list_version(found: Any) -> str | None:
    """A list answer's resourceVersion; None when the answer carries none (then the watch
    starts from the server's present state, as a watch without a version does)."""
    try:
        return str(found.resourceVersion)
    except NotReadyError:
        return None


def _collection_path(kind: type[Any]) -> str:
    """The URL path of a cluster-scoped resource's collection: `/api/v1/nodes`."""
    info = kind._api_info
    group, version = info.resource.group, info.resource.version
    return f"/apis/{group}/{version}/{info.plural}" if group else f"/api/{version}/{info.plural}"


@dataclass
class _WatchState:
    """Shared by the loop and the watch thread: the stop flag and the stream's own client.

    Closing the stream's client from the loop's side fails its read; the thread, seeing
    `stop`, ends. A read it does not interrupt ends within the read deadline.
    """

    stop: threading.Event = field(default_factory=threading.Event)
    _client: httpx2.Client | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def open(self, new: Callable[[], httpx2.Client]) -> httpx2.Client | None:
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
