"""Which container holds which devices, as the kubelet's `pod_devices.go`.

Entries are keyed by (pod, container, resource) and carry the plugin's `Allocate` answer,
so a restarted container gets the same answer without a new call. The checkpoint stores
exactly these entries.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from kubegpu.api import pb
from kubegpu.kubelet.checkpoint import PodDevicesEntry
from kubegpu.kubelet.model import Allocation, merge_responses


def containers_of(pod: dict[str, Any]) -> list[dict[str, Any]]:
    """A v1 Pod's init containers then containers (the order the scheduler numbers them in)."""
    spec = pod.get("spec") or {}
    return [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]


def to_allocation(entry: PodDevicesEntry, *, cached: bool) -> Allocation:
    """The public view of an entry; `cached` when no Allocate call produced it just now."""
    return Allocation(
        device_ids=entry.device_ids,
        response=entry.response,
        preferred=None,
        resource=entry.resource,
        pod=entry.pod,
        container=entry.container,
        cached=cached,
    )


class PodDevices:
    """The device assignments of every container on the node."""

    def __init__(self) -> None:
        self._entries: dict[tuple[str, str, str], PodDevicesEntry] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[PodDevicesEntry]:
        return iter(self._entries.values())

    def replace_all(self, entries: Iterable[PodDevicesEntry]) -> None:
        """Forget everything and hold `entries` (a restored checkpoint, or none on stop)."""
        self._entries = {(e.pod, e.container, e.resource): e for e in entries}

    def get(self, pod: str, container: str, resource: str) -> PodDevicesEntry | None:
        return self._entries.get((pod, container, resource))

    def add(self, entry: PodDevicesEntry) -> None:
        self._entries[(entry.pod, entry.container, entry.resource)] = entry

    def of_container(self, pod: str, container: str) -> list[PodDevicesEntry]:
        return [e for e in self._entries.values() if e.pod == pod and e.container == container]

    def in_use(self, resource: str) -> set[str]:
        """Devices of `resource` held by any container."""
        return {d for e in self._entries.values() if e.resource == resource for d in e.device_ids}

    def held_by_pod(self, resource: str, pod: str) -> set[str]:
        """Devices of `resource` held by the pod's containers (reusable within the pod)."""
        return {
            d
            for e in self._entries.values()
            if e.resource == resource and e.pod == pod
            for d in e.device_ids
        }

    def allocations(self, pod: str | None = None) -> list[Allocation]:
        return [
            to_allocation(e, cached=True)
            for e in self._entries.values()
            if pod is None or e.pod == pod
        ]

    def container_response(self, pod: str, container: str) -> pb.ContainerAllocateResponse:
        """The merged answer of every resource of one container, as given to the runtime."""
        return merge_responses(e.response for e in self.of_container(pod, container))

    def release(self, pod: str) -> list[str]:
        """Drop a deleted pod's entries; returns the device IDs they held."""
        return [
            d
            for k, e in list(self._entries.items())
            if k[0] == pod
            for d in self._entries.pop(k).device_ids
        ]
