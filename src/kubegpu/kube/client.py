"""`KubeClient`: the `Kube` interface over the official (blocking) Kubernetes client.

One client configuration for the whole process (`default_client()`): in-cluster service
account first (the DaemonSet case), else KUBECONFIG / ~/.kube/config. It is loaded on the
first call, not at construction: most `serve` processes never talk to the API and need
no credentials. A failed load is not remembered, so credentials that appear later (a
projected token) are picked up.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Final

from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes import watch as k8s_watch

from kubegpu.kube.errors import KubeError, first_line, no_credentials, translate
from kubegpu.kube.objects import (
    MISSING_NODE,
    MISSING_NODE_FEATURE,
    MISSING_POD,
    NFD_GROUP,
    NFD_PLURAL,
    NFD_VERSION,
    label_of,
)
from kubegpu.watch.backoff import Backoff

log = logging.getLogger(__name__)

#: Seconds one request may take unless the caller says otherwise.
DEFAULT_TIMEOUT: Final = 10.0


class KubeClient:
    """`Kube` over the official client; thread-safe, configured on first use.

    `core`, `custom` and `watch_factory` replace the client's `CoreV1Api`,
    `CustomObjectsApi` and `watch.Watch` (tests drive the real translation code through them).
    """

    def __init__(
        self,
        *,
        core: Any = None,
        custom: Any = None,
        watch_factory: Callable[[], Any] | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        backoff: tuple[float, float] = (1.0, 30.0),
        watch_timeout_s: int = 300,
    ) -> None:
        self._core = core
        self._custom = custom
        self._watch_factory = watch_factory
        self._api_client: Any = None
        self._lock = threading.Lock()
        self.timeout = timeout
        self.backoff = backoff
        self.watch_timeout_s = watch_timeout_s

    def connect(self) -> KubeClient:
        """Load the configuration now (raises `KubeError` when there is none); returns self."""
        self._core_api()
        return self

    # -- configuration --------------------------------------------------------------------

    def _load(self) -> Any:
        """The shared `ApiClient`, on this client's own `Configuration` (never the global one)."""
        with self._lock:
            if self._api_client is None:
                configuration = k8s.Configuration()
                try:
                    k8s_config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
                except k8s_config.ConfigException:
                    try:
                        # KUBECONFIG read now, not when the client was imported (its default).
                        k8s_config.load_kube_config(  # type: ignore[no-untyped-call]
                            config_file=os.environ.get("KUBECONFIG") or None,
                            client_configuration=configuration,
                        )
                    except Exception as exc:  # missing file, bad context, bad YAML...
                        raise no_credentials(exc) from exc
                self._api_client = k8s.ApiClient(configuration)
            return self._api_client

    def _core_api(self) -> Any:
        if self._core is None:
            self._core = k8s.CoreV1Api(self._load())
        return self._core

    def _custom_api(self) -> Any:
        if self._custom is None:
            self._custom = k8s.CustomObjectsApi(self._load())
        return self._custom

    def _call(
        self,
        what: str,
        api: Callable[[], Any],
        method: str,
        *args: Any,
        missing: str | None = None,
        timeout: float | None = None,
        **kwargs: Any,
    ) -> Any:
        """Run one request; every failure leaves as `KubeError`, at this one boundary."""
        limit = self.timeout if timeout is None else timeout
        try:
            return getattr(api(), method)(*args, _request_timeout=limit, **kwargs)
        except KubeError:
            raise  # from loading the configuration
        except Exception as exc:
            error = translate(what, exc, timeout=limit, missing=missing)
            if error is None:
                raise
            raise error from exc

    # -- Nodes and Pods -------------------------------------------------------------------

    def get_node_metadata(self, name: str) -> dict[str, Any]:
        node = self._call(
            f"get Node {name}", self._core_api, "read_node", name, missing=MISSING_NODE
        )
        meta = node.metadata
        return {"labels": dict(meta.labels or {}), "annotations": dict(meta.annotations or {})}

    def merge_patch_node(self, name: str, patch: dict[str, Any]) -> None:
        self._call(
            f"patch Node {name}",
            self._core_api,
            "patch_node",
            name,
            patch,
            missing=MISSING_NODE,
            _content_type="application/merge-patch+json",
        )

    def get_pod_metadata(self, namespace: str, name: str) -> dict[str, Any]:
        pod = self._call(
            f"get Pod {namespace}/{name}",
            self._core_api,
            "read_namespaced_pod",
            name,
            namespace,
            missing=MISSING_POD,
        )
        meta = pod.metadata
        owners = [
            {"apiVersion": o.api_version, "kind": o.kind, "name": o.name, "uid": o.uid}
            for o in meta.owner_references or []
        ]
        return {"name": meta.name, "uid": meta.uid, "ownerReferences": owners}

    def create_event(
        self, namespace: str, body: dict[str, Any], *, timeout: float | None = None
    ) -> None:
        name = body.get("metadata", {}).get("name", "")
        self._call(
            f"create Event {namespace}/{name}",
            self._core_api,
            "create_namespaced_event",
            namespace,
            body,
            timeout=timeout,
        )

    # -- NodeFeature (NFD) ----------------------------------------------------------------

    def get_node_feature(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            obj = self._nfd("get", namespace, name, "get_namespaced_custom_object", name)
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise
        return dict(obj)

    def create_node_feature(self, namespace: str, body: dict[str, Any]) -> None:
        name = body["metadata"]["name"]
        self._nfd("create", namespace, name, "create_namespaced_custom_object", body)

    def replace_node_feature(self, namespace: str, body: dict[str, Any]) -> None:
        name = body["metadata"]["name"]
        self._nfd("update", namespace, name, "replace_namespaced_custom_object", name, body)

    def delete_node_feature(self, namespace: str, name: str) -> bool:
        try:
            self._nfd("delete", namespace, name, "delete_namespaced_custom_object", name)
        except KubeError as exc:
            if exc.status == 404:
                return False
            raise
        return True

    def _nfd(self, verb: str, namespace: str, name: str, method: str, *args: Any) -> Any:
        return self._call(
            f"{verb} NodeFeature {namespace}/{name}",
            self._custom_api,
            method,
            NFD_GROUP,
            NFD_VERSION,
            namespace,
            NFD_PLURAL,
            *args,
            missing=MISSING_NODE_FEATURE,
        )

    # -- the node label watch -------------------------------------------------------------

    async def watch_node_label(self, node: str, label: str) -> AsyncIterator[str | None]:
        """Read the Node, then watch it by name, in a daemon thread feeding the loop."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[str | None] = asyncio.Queue()
        state = _WatchState()

        def emit(value: str | None) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, value)
            except RuntimeError:  # the loop is gone: nobody is listening
                state.stop.set()

        thread = threading.Thread(
            target=self._follow,
            args=(node, label, emit, state),
            daemon=True,
            name=f"labels-{node}",
        )
        thread.start()
        try:
            while True:
                yield await queue.get()
        finally:
            state.stop.set()
            if state.current is not None:
                state.current.stop()

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
                obj = self._call(what, self._core_api, "read_node", node, missing=MISSING_NODE)
                offer(label_of(obj.metadata, label))
                what = f"watch Node {node}"
                watcher = self._watch_factory() if self._watch_factory else _new_watch()
                state.current = watcher
                for event in watcher.stream(
                    self._core_api().list_node,
                    field_selector=f"metadata.name={node}",
                    resource_version=obj.metadata.resource_version,
                    timeout_seconds=self.watch_timeout_s,
                ):
                    if state.stop.is_set() or event.get("type") == "ERROR":
                        break  # ERROR is usually 410 Gone: re-read and watch again
                    gone = event.get("type") == "DELETED"
                    offer(None if gone else label_of(event["object"].metadata, label))
                delay.reset()
            except Exception as exc:
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


@dataclass
class _WatchState:
    stop: threading.Event = field(default_factory=threading.Event)
    #: The running `watch.Watch`, stopped from the loop's side to end a blocking stream.
    current: Any = None


def _new_watch() -> Any:
    return k8s_watch.Watch()  # type: ignore[no-untyped-call]


@functools.cache
def default_client() -> KubeClient:
    """The process's one client; configured lazily, on its first call."""
    return KubeClient()
