"""`Kube`: every Kubernetes call kubegpu makes, as one small interface.

`KubeClient` implements it over lightkube, `FakeKube` in memory. Dictionaries
are in the API's own spelling (`ownerReferences`, `resourceVersion`), as `kubectl get -o
json` shows them, so callers never see the client's model classes.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Final, NamedTuple, Protocol

#: The `SliceEvent.type` that says "events may have been missed: read the slices again".
RELIST: Final = "RELIST"


class SliceEvent(NamedTuple):
    """One event of `Kube.watch_resource_slices`.

    `type` is the API's ADDED, MODIFIED or DELETED with the slice as the API sent it (any
    JSON object with `metadata`: judge it before use), or `RELIST` (and an empty `slice`)
    when the watch lists again: at its start, after its version expired (410) or its list
    failed. What changed before is not reported then, so read the slices again. A stream
    that broke is resumed from the last version seen, and reports what it missed.
    """

    type: str
    slice: dict[str, Any]


class Kube(Protocol):
    """Blocking calls (run them in a worker thread), except the `watch_*` iterators.

    Every failure is a `KubeError` whose one-line message names the call and the object.
    """

    def get_node_metadata(self, name: str) -> dict[str, Any]:
        """`metadata` of the Node: `labels` and `annotations` (both always present)."""
        ...

    def get_node_status(self, name: str) -> dict[str, Any]:
        """`status` of the Node: `capacity` and `allocatable` (both always present), each
        resource name -> quantity as the API spells it ("8", "16Gi")."""
        ...

    def merge_patch_node(self, name: str, patch: dict[str, Any]) -> None:
        """Apply a JSON merge patch (RFC 7386: `null` deletes a key) to the Node."""
        ...

    def get_node_feature(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The NodeFeature object, or None when there is none."""
        ...

    def create_node_feature(self, namespace: str, body: dict[str, Any]) -> None:
        """Create the NodeFeature named in `body`; an existing one is a 409 `KubeError`."""
        ...

    def replace_node_feature(self, namespace: str, body: dict[str, Any]) -> None:
        """Replace the object named in `body` (carries `metadata.resourceVersion`)."""
        ...

    def delete_node_feature(self, namespace: str, name: str) -> bool:
        """Delete the NodeFeature; False when there was none."""
        ...

    def get_pod_metadata(self, namespace: str, name: str) -> dict[str, Any]:
        """`metadata` of a Pod (`name`, `uid`, `ownerReferences` in API spelling)."""
        ...

    def create_event(
        self, namespace: str, body: dict[str, Any], *, timeout: float | None = None
    ) -> None:
        """Create a core/v1 Event; `timeout` (seconds) bounds this one request."""
        ...

    def list_resource_slices(self, driver: str, node: str) -> list[dict[str, Any]]:
        """The resource.k8s.io/v1 ResourceSlices of `driver` on `node` (every page)."""
        ...

    def create_resource_slice(self, body: dict[str, Any]) -> dict[str, Any]:
        """Create a ResourceSlice (`metadata.name` or `generateName`); the object as stored."""
        ...

    def replace_resource_slice(self, body: dict[str, Any]) -> dict[str, Any]:
        """Replace the ResourceSlice named in `body`; the object as stored.

        A `metadata.resourceVersion` that is no longer current is a 409 `KubeError` (read
        again), a slice that is gone a 404.
        """
        ...

    def delete_resource_slice(self, name: str) -> bool:
        """Delete the ResourceSlice; False when there was none."""
        ...

    def get_resource_claim(self, namespace: str, name: str) -> dict[str, Any]:
        """A resource.k8s.io/v1 ResourceClaim; a 404 `KubeError` when there is none."""
        ...

    def watch_resource_slices(self, driver: str, node: str) -> AsyncIterator[SliceEvent]:
        """Changes of the ResourceSlices of `driver` on `node`, as `SliceEvent`s.

        Each list first yields a `RELIST` event, then, as the API server's watch without a
        resourceVersion does, an ADDED event for each slice that exists, then every change.
        Never raises for API trouble: failures are logged and the watch started again with
        backoff, as for `watch_node_label`.
        """
        ...

    def watch_node_label(self, node: str, label: str) -> AsyncIterator[str | None]:
        """The label's value now, then each change; None when unset or the Node is gone.

        Never raises for API trouble: failures are logged and retried with backoff, as a
        label watch must outlive an API server restart.
        """
        ...
