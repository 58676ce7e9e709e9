"""The Kubernetes calls the label sinks make, behind the small `KubeApi` protocol.

`KubernetesApi` wraps the official client (blocking, so the sinks call it in a thread);
`FakeKubeApi` keeps objects in memory for tests and for anyone embedding the labeller.
Moved here verbatim from the old `labeller.py`; the `kubegpu.kube` adapter replaces it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from kubegpu.labeller.sinks import NFD_GROUP, NFD_PLURAL, NFD_VERSION, PublishError


class KubeApi(Protocol):
    """The few Kubernetes calls the sinks make; blocking, called from a worker thread."""

    def get_node_metadata(self, name: str) -> dict[str, Any]:
        """`metadata` of the Node (`labels`, `annotations`)."""
        ...

    def merge_patch_node(self, name: str, patch: dict[str, Any]) -> None:
        """Apply a JSON merge patch (RFC 7386: `null` deletes a key) to the Node."""
        ...

    def get_node_feature(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The NodeFeature object, or None when there is none."""
        ...

    def get_pod_metadata(self, namespace: str, name: str) -> dict[str, Any]:
        """`metadata` of a Pod (`name`, `uid`, `ownerReferences` in API spelling)."""
        ...

    def create_node_feature(self, namespace: str, body: dict[str, Any]) -> None: ...

    def replace_node_feature(self, namespace: str, body: dict[str, Any]) -> None:
        """Replace the object named in `body` (carries `metadata.resourceVersion`)."""
        ...


class KubernetesApi:
    """`KubeApi` over the official client: in-cluster config first, then kubeconfig."""

    def __init__(self) -> None:
        import kubernetes

        # The client's config loaders are untyped; keep them behind `Any` here.
        client: Any = kubernetes.client
        config: Any = kubernetes.config
        try:
            config.load_incluster_config()
        except config.ConfigException:
            try:
                config.load_kube_config()
            except (config.ConfigException, OSError) as exc:
                raise PublishError(
                    f"no Kubernetes credentials: not in a pod and no kubeconfig ({exc})"
                ) from exc
        self._core = client.CoreV1Api()
        self._custom = client.CustomObjectsApi()

    def get_node_metadata(self, name: str) -> dict[str, Any]:
        node = self._call(f"get Node {name}", self._core.read_node, name)
        meta = node.metadata
        return {"labels": dict(meta.labels or {}), "annotations": dict(meta.annotations or {})}

    def merge_patch_node(self, name: str, patch: dict[str, Any]) -> None:
        self._call(
            f"patch Node {name}",
            self._core.patch_node,
            name,
            patch,
            _content_type="application/merge-patch+json",
        )

    def get_node_feature(self, namespace: str, name: str) -> dict[str, Any] | None:
        from kubernetes.client.exceptions import ApiException

        try:
            obj: Any = self._custom.get_namespaced_custom_object(
                NFD_GROUP, NFD_VERSION, namespace, NFD_PLURAL, name
            )
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise PublishError(f"get NodeFeature {namespace}/{name}: {_api_reason(exc)}") from exc
        return dict(obj)

    def get_pod_metadata(self, namespace: str, name: str) -> dict[str, Any]:
        pod = self._call(
            f"get Pod {namespace}/{name}", self._core.read_namespaced_pod, name, namespace
        )
        meta = pod.metadata
        owners = [
            {"apiVersion": o.api_version, "kind": o.kind, "name": o.name, "uid": o.uid}
            for o in meta.owner_references or []
        ]
        return {"name": meta.name, "uid": meta.uid, "ownerReferences": owners}

    def create_node_feature(self, namespace: str, body: dict[str, Any]) -> None:
        self._call(
            f"create NodeFeature {namespace}/{body['metadata']['name']}",
            self._custom.create_namespaced_custom_object,
            NFD_GROUP,
            NFD_VERSION,
            namespace,
            NFD_PLURAL,
            body,
        )

    def replace_node_feature(self, namespace: str, body: dict[str, Any]) -> None:
        name = body["metadata"]["name"]
        self._call(
            f"update NodeFeature {namespace}/{name}",
            self._custom.replace_namespaced_custom_object,
            NFD_GROUP,
            NFD_VERSION,
            namespace,
            NFD_PLURAL,
            name,
            body,
        )

    @staticmethod
    def _call(what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Translate the client's exceptions into `PublishError`, at this one boundary."""
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        try:
            return fn(*args, **kwargs)
        except ApiException as exc:
            raise PublishError(f"{what}: {_api_reason(exc)}") from exc
        except HTTPError as exc:
            raise PublishError(f"{what}: API server unreachable ({exc})") from exc


def _api_reason(exc: Any) -> str:
    hint = {403: "; check the ServiceAccount's RBAC", 404: "; does it exist (is NFD installed)?"}
    return f"HTTP {exc.status} {exc.reason}{hint.get(exc.status, '')}"


@dataclass
class FakeKubeApi:
    """In-memory `KubeApi`: Nodes' metadata and NodeFeature objects, with a call log."""

    nodes: dict[str, dict[str, Any]] = field(default_factory=dict)
    node_features: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    #: Pods' metadata by (namespace, name), as `get_pod_metadata` returns it.
    pods: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    calls: list[str] = field(default_factory=list)
    #: When set, every call raises it (to test error paths).
    fail_with: PublishError | None = None

    def add_node(self, name: str, labels: Mapping[str, str] | None = None) -> None:
        self.nodes[name] = {"labels": dict(labels or {}), "annotations": {}}

    def _enter(self, call: str) -> None:
        self.calls.append(call)
        if self.fail_with is not None:
            raise self.fail_with

    def get_node_metadata(self, name: str) -> dict[str, Any]:
        self._enter(f"get node/{name}")
        if name not in self.nodes:
            raise PublishError(f"get Node {name}: HTTP 404 Not Found")
        return copy.deepcopy(self.nodes[name])

    def merge_patch_node(self, name: str, patch: dict[str, Any]) -> None:
        self._enter(f"patch node/{name}")
        if name not in self.nodes:
            raise PublishError(f"patch Node {name}: HTTP 404 Not Found")
        meta = self.nodes[name]
        for section in ("labels", "annotations"):
            for key, value in patch.get("metadata", {}).get(section, {}).items():
                if value is None:
                    meta[section].pop(key, None)
                else:
                    meta[section][key] = value

    def get_node_feature(self, namespace: str, name: str) -> dict[str, Any] | None:
        self._enter(f"get nodefeature/{namespace}/{name}")
        obj = self.node_features.get((namespace, name))
        return copy.deepcopy(obj) if obj is not None else None

    def get_pod_metadata(self, namespace: str, name: str) -> dict[str, Any]:
        self._enter(f"get pod/{namespace}/{name}")
        if (namespace, name) not in self.pods:
            raise PublishError(f"get Pod {namespace}/{name}: HTTP 404 Not Found")
        return copy.deepcopy(self.pods[(namespace, name)])

    def create_node_feature(self, namespace: str, body: dict[str, Any]) -> None:
        name = body["metadata"]["name"]
        self._enter(f"create nodefeature/{namespace}/{name}")
        if (namespace, name) in self.node_features:
            raise PublishError(f"create NodeFeature {namespace}/{name}: HTTP 409 Conflict")
        self.node_features[(namespace, name)] = copy.deepcopy(body)

    def replace_node_feature(self, namespace: str, body: dict[str, Any]) -> None:
        name = body["metadata"]["name"]
        self._enter(f"replace nodefeature/{namespace}/{name}")
        self.node_features[(namespace, name)] = copy.deepcopy(body)
