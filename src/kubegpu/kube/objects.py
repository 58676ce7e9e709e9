"""What kubegpu reads and writes in the API, independent of the client: names and shapes."""

from __future__ import annotations

from typing import Any, Final

from kubegpu.kube.errors import KubeError
from kubegpu.kube.protocol import Kube
from kubegpu.untrusted import object_problem

#: NFD's NodeFeature custom resource (nfd.k8s-sigs.io/v1alpha1, namespaced).
NFD_GROUP: Final = "nfd.k8s-sigs.io"
NFD_VERSION: Final = "v1alpha1"
NFD_PLURAL: Final = "nodefeatures"

#: Dynamic Resource Allocation's API group and the version kubegpu speaks (GA since 1.34).
RESOURCE_GROUP: Final = "resource.k8s.io"
RESOURCE_VERSION: Final = "v1"
RESOURCE_API_VERSION: Final = f"{RESOURCE_GROUP}/{RESOURCE_VERSION}"

#: The 404 hints that say what is missing and what to set, by kind.
MISSING_NODE: Final = "; does it exist? check NODE_NAME"
MISSING_POD: Final = "; does it exist? check POD_NAME"
MISSING_NODE_FEATURE: Final = "; does it exist (is NFD installed)?"
MISSING_DRA_API: Final = "; does the API server serve resource.k8s.io/v1 (Kubernetes 1.34+)?"
MISSING_RESOURCE_SLICE: Final = "; was it deleted? list the node's slices again"
MISSING_RESOURCE_CLAIM: Final = "; does it exist (was the pod or its claim deleted)?"


def check_object_name(what: str, namespace: str, name: str) -> None:
    """`KubeError` naming the call `what` when `namespace` or `name` is not one Kubernetes
    allows. Checked before the request is built: its path is made of them, and a `../` in
    either would send the request, with its credentials, to another path of the API."""
    problem = object_problem(namespace, name)
    if problem is not None:
        raise KubeError(f"{what}: not sent: the {problem}")


def label_of(metadata: Any, label: str) -> str | None:
    """One label of a client object's `metadata`, None when unset or empty."""
    labels = metadata.labels or {}
    value = labels.get(label)
    return str(value) if value else None


def owner_references(api: Kube, namespace: str, pod_name: str | None) -> list[dict[str, Any]]:
    """The labeller's DaemonSet (as controller) and Pod, to own the NodeFeature object.

    As GFD: Kubernetes then deletes the object with the DaemonSet, so an uninstall leaves
    no stale GPU labels behind. No pod name, or a pod no DaemonSet owns: no owners.
    Raises `KubeError` when the pod cannot be read.
    """
    if not pod_name:
        return []
    pod = api.get_pod_metadata(namespace, pod_name)
    daemonset = next(
        (o for o in pod.get("ownerReferences") or [] if o.get("kind") == "DaemonSet"), None
    )
    if daemonset is None:
        return []
    return [
        {
            "apiVersion": daemonset.get("apiVersion"),
            "kind": "DaemonSet",
            "name": daemonset.get("name"),
            "uid": daemonset.get("uid"),
            "controller": True,
        },
        {"apiVersion": "v1", "kind": "Pod", "name": pod.get("name"), "uid": pod.get("uid")},
    ]
