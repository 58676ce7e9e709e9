"""What the kubelet says it gave each container: its PodResources API and device checkpoint.

`PodResourcesClient.list` calls `List` on the kubelet's pod-resources socket: pod and
container names with the device plugin device IDs they hold, and (where the kubelet's
KubeletPodResourcesDynamicResources feature is on) the DRA claim devices they use. That API
names pods but never gives their UID, which is all a process's cgroup says; the kubelet's
device manager checkpoint (`kubelet_internal_checkpoint` in the device-plugin directory, which
kubegpu mounts to serve its sockets) has the UID with the same container name and device IDs,
so `checkpoint_pod_uids` lets the two be joined. Its layout is the kubelet's (checkpoint v2,
`PodDeviceEntries`); its checksum is not checked: a file the kubelet is rewriting only costs
one scrape its UIDs.

Every name read here comes from outside: `valid_names` keeps only what Kubernetes itself
allows for a namespace, pod and container (DNS-1123 labels and subdomains, checked by
`kubegpu.untrusted`), so a label value or a log line never carries anything else.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc

from kubegpu.api import pod_resources_stub, podresources_pb2, podresources_pb2_grpc
from kubegpu.files import NotRegularFile, read_regular
from kubegpu.untrusted import escape, is_dns_label, is_dns_subdomain

log = logging.getLogger("kubegpu.usage")

#: The largest List answer read: a node's 110 pods with a few devices each take a few KiB.
MAX_LIST_BYTES = 16 * 1024 * 1024
#: The largest device checkpoint read: an entry is about 1 KiB (its Allocate answer).
MAX_CHECKPOINT_BYTES = 8 * 1024 * 1024


class SourceError(Exception):
    """A source of allocations cannot be read now (one line, names what and why)."""


def valid_names(namespace: str, pod: str, container: str) -> bool:
    """True when all three are names Kubernetes allows (empty pod/container: not known)."""
    return (
        is_dns_label(namespace)
        and (not pod or is_dns_subdomain(pod))
        and (not container or is_dns_label(container))
    )


@dataclass(frozen=True)
class ContainerDevices:
    """Device plugin devices of one resource held by one container."""

    namespace: str
    pod: str
    container: str
    resource: str
    device_ids: tuple[str, ...]


@dataclass(frozen=True)
class ContainerClaimDevice:
    """One DRA claim device used by one container."""

    namespace: str
    pod: str
    container: str
    claim: str
    driver: str
    pool: str
    device: str


@dataclass(frozen=True)
class PodResourcesListing:
    devices: tuple[ContainerDevices, ...] = ()
    claim_devices: tuple[ContainerClaimDevice, ...] = ()


class PodResourcesClient:
    """A client of the kubelet's PodResources API on a unix socket (blocking calls)."""

    def __init__(self, socket: Path, timeout: float = 5.0) -> None:
        self.socket = socket
        self.timeout = timeout
        self._lock = threading.Lock()
        self._channel: grpc.Channel | None = None
        #: Entries left out for names Kubernetes would refuse, logged once each.
        self._refused: set[tuple[str, str, str]] = set()

    def _stub(self) -> podresources_pb2_grpc.PodResourcesListerStub:
        with self._lock:
            if self._channel is None:
                self._channel = grpc.insecure_channel(
                    f"unix://{self.socket}",
                    options=[("grpc.max_receive_message_length", MAX_LIST_BYTES)],
                )
            return pod_resources_stub(self._channel)

    def list(self) -> PodResourcesListing:
        """Every pod's containers with their devices; `SourceError` when the kubelet does
        not answer."""
        if not self.socket.exists():
            raise SourceError(
                f"no PodResources socket at {self.socket}: mount the kubelet's "
                f"pod-resources directory (or set --pod-resources-socket)"
            )
        stub = self._stub()
        try:
            answer = stub.List(podresources_pb2.ListPodResourcesRequest(), timeout=self.timeout)
        except grpc.RpcError as err:
            what = f"{err.code().name}: {err.details()}" if isinstance(err, grpc.Call) else err
            raise SourceError(
                f"PodResources List on {self.socket} failed ({escape(str(what))})"
            ) from err
        return self._listing(answer)

    def _listing(self, answer: podresources_pb2.ListPodResourcesResponse) -> PodResourcesListing:
        devices: list[ContainerDevices] = []
        claims: list[ContainerClaimDevice] = []
        for pod in answer.pod_resources:
            for container in pod.containers:
                if not self._acceptable(pod.namespace, pod.name, container.name):
                    continue
                for held in container.devices:
                    devices.append(
                        ContainerDevices(
                            pod.namespace,
                            pod.name,
                            container.name,
                            held.resource_name,
                            tuple(held.device_ids),
                        )
                    )
                for dynamic in container.dynamic_resources:
                    # A claim is always in its pod's namespace.
                    if dynamic.claim_namespace != pod.namespace or not is_dns_subdomain(
                        dynamic.claim_name
                    ):
                        continue
                    for resource in dynamic.claim_resources:
                        claims.append(
                            ContainerClaimDevice(
                                pod.namespace,
                                pod.name,
                                container.name,
                                dynamic.claim_name,
                                resource.driver_name,
                                resource.pool_name,
                                resource.device_name,
                            )
                        )
        return PodResourcesListing(tuple(devices), tuple(claims))

    def _acceptable(self, namespace: str, pod: str, container: str) -> bool:
        if valid_names(namespace, pod, container) and pod and container:
            return True
        key = (namespace[:300], pod[:300], container[:300])
        if key not in self._refused and len(self._refused) < 1000:
            self._refused.add(key)
            log.warning(
                "PodResources lists a container named %s/%s/%s, not valid Kubernetes "
                "names: its GPU use is not attributed to it",
                escape(namespace),
                escape(pod),
                escape(container),
            )
        return False

    def close(self) -> None:
        with self._lock:
            if self._channel is not None:
                self._channel.close()
                self._channel = None


#: (container name, resource, device IDs) -> the UID of the pod holding them.
PodUids = Mapping[tuple[str, str, frozenset[str]], str]


class CheckpointReader:
    """`checkpoint_pod_uids` of one file, parsed again only when the file changed."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._stamp: tuple[int, int, int] | None = None
        self._uids: dict[tuple[str, str, frozenset[str]], str] = {}

    def pod_uids(self) -> PodUids:
        """`SourceError` when the file cannot be read (the kubelet has none yet, or it is
        not the kubelet's)."""
        try:
            st = self.path.stat()
        except OSError as err:
            raise SourceError(f"cannot read the kubelet's checkpoint {self.path}: {err}") from err
        stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
        if stamp != self._stamp:
            self._uids = checkpoint_pod_uids(self.path)
            self._stamp = stamp
        return self._uids


def checkpoint_pod_uids(path: Path) -> dict[tuple[str, str, frozenset[str]], str]:
    """The pod UID of each (container, resource, device IDs) in the kubelet's checkpoint."""
    try:
        data = read_regular(path, MAX_CHECKPOINT_BYTES, follow_links=False)
    except NotRegularFile as err:
        raise SourceError(
            f"the kubelet's checkpoint {path} is {err.kind}, not a regular file: not read"
        ) from err
    except OSError as err:
        raise SourceError(
            f"cannot read the kubelet's checkpoint {path} ({err.strerror or err})"
        ) from err
    if len(data) > MAX_CHECKPOINT_BYTES:
        raise SourceError(
            f"the kubelet's checkpoint {path} is over {MAX_CHECKPOINT_BYTES} bytes: not read"
        )
    try:
        entries = json.loads(data)["Data"]["PodDeviceEntries"] or []
        uids: dict[tuple[str, str, frozenset[str]], str] = {}
        for entry in entries:
            ids = entry["DeviceIDs"]
            # v2: device IDs grouped by NUMA node; v1 (before Kubernetes 1.20): a list.
            flat = [i for group in ids.values() for i in group] if isinstance(ids, dict) else ids
            key = (str(entry["ContainerName"]), str(entry["ResourceName"]), frozenset(flat))
            uids[key] = str(entry["PodUID"])
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as err:
        raise SourceError(
            f"{path} is not a kubelet device checkpoint ({type(err).__name__})"
        ) from err
    return uids


__all__ = [
    "CheckpointReader",
    "ContainerClaimDevice",
    "ContainerDevices",
    "PodResourcesClient",
    "PodResourcesListing",
    "PodUids",
    "SourceError",
    "checkpoint_pod_uids",
    "valid_names",
]
