"""Values the kubelet emulator hands out: observed device state, records, allocations, errors."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, MutableMapping
from dataclasses import dataclass

from kubegpu.api import HEALTHY, pb
from kubegpu.errors import KubegpuError

log = logging.getLogger("kubegpu.kubelet")


class AdmissionError(KubegpuError):
    """The emulated kubelet rejected a pod at admission.

    `reason` is what the kubelet writes into the pod status: `OutOf<resource>` when the
    node's allocatable is too small (the scheduler's "Insufficient <resource>"), or
    `UnexpectedAdmissionError` when the device manager or the plugin failed.
    """

    def __init__(self, reason: str, message: str, *, resource: str, pod: str, container: str):
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.message = message
        self.resource = resource
        self.pod = pod
        self.container = container


class ContainerStartError(KubegpuError):
    """`PreStartContainer` failed, so the kubelet would not start the container."""


class CheckpointError(KubegpuError):
    """`kubelet_internal_checkpoint` is unreadable or corrupt; the kubelet refuses to start."""


@dataclass(frozen=True)
class DeviceState:
    """One device of a resource as the kubelet sees it now."""

    id: str
    #: `Healthy` or `Unhealthy` (every device of a dead endpoint reads `Unhealthy`).
    health: str
    #: NUMA node IDs from `topology.nodes`; empty when the device has no topology.
    numa_nodes: tuple[int, ...]
    #: Socket file name of the endpoint whose report this is.
    endpoint: str

    @property
    def healthy(self) -> bool:
        return self.health == HEALTHY


@dataclass(frozen=True)
class RegistrationRecord:
    """One `Register` call the kubelet received, and its outcome."""

    #: `time.monotonic()` when the call arrived.
    time: float
    resource: str
    endpoint: str
    version: str
    #: None when the registration succeeded, else the error text returned to the plugin.
    error: str | None

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(frozen=True)
class RpcRecord:
    """One call the kubelet made to a plugin (method name without the service)."""

    time: float
    resource: str
    endpoint: str
    method: str
    #: None on success, else the Go-style error text.
    error: str | None


@dataclass(frozen=True)
class Allocation:
    """The devices a container got for one resource and the plugin's answer for them."""

    device_ids: tuple[str, ...]
    #: `container_responses[0]` of the `Allocate` answer (or the cached one).
    response: pb.ContainerAllocateResponse
    #: What `GetPreferredAllocation` answered; None when it was not called.
    preferred: tuple[str, ...] | None = None
    resource: str = ""
    pod: str = ""
    container: str = ""
    #: True when a container restart reused the checkpointed response (no RPC).
    cached: bool = False

    @property
    def envs(self) -> dict[str, str]:
        return dict(self.response.envs)

    @property
    def mounts(self) -> tuple[pb.Mount, ...]:
        return tuple(self.response.mounts)

    @property
    def device_specs(self) -> tuple[pb.DeviceSpec, ...]:
        return tuple(self.response.devices)

    @property
    def cdi_devices(self) -> tuple[str, ...]:
        return tuple(d.name for d in self.response.cdi_devices)

    @property
    def annotations(self) -> dict[str, str]:
        return dict(self.response.annotations)


def merge_responses(
    responses: Iterable[pb.ContainerAllocateResponse | Allocation],
) -> pb.ContainerAllocateResponse:
    """Merge several resources' answers for one container as the kubelet does.

    The first value wins on a conflicting env var, annotation, mount or device container
    path (the kubelet logs the conflict and keeps going); CDI names are de-duplicated.
    """
    merged = pb.ContainerAllocateResponse()
    mount_paths: set[str] = set()
    device_paths: set[str] = set()
    cdi_names: set[str] = set()
    for item in responses:
        resp = item.response if isinstance(item, Allocation) else item
        _merge_first_wins(merged.envs, resp.envs, "environment variable")
        for mount in resp.mounts:
            if mount.container_path in mount_paths:
                log.info("mount %s already specified; skipping", mount.container_path)
                continue
            mount_paths.add(mount.container_path)
            merged.mounts.append(mount)
        for dev in resp.devices:
            if dev.container_path in device_paths:
                log.info("device %s already specified; skipping", dev.container_path)
                continue
            device_paths.add(dev.container_path)
            merged.devices.append(dev)
        _merge_first_wins(merged.annotations, resp.annotations, "annotation")
        for cdi in resp.cdi_devices:
            if cdi.name not in cdi_names:
                cdi_names.add(cdi.name)
                merged.cdi_devices.append(cdi)
    return merged


def _merge_first_wins(
    target: MutableMapping[str, str], source: Mapping[str, str], what: str
) -> None:
    """Copy `source` into `target`, keeping the first value on a conflict (as the kubelet)."""
    for key, value in source.items():
        if key not in target:
            target[key] = value
        elif target[key] != value:
            log.warning("%s %s has conflicting settings; keeping %r", what, key, target[key])
