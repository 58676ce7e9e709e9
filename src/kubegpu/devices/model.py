"""The vendor-neutral device model every other layer reads.

Backends (NVML, AMD sysfs, the simulated node) fill these frozen dataclasses; nothing
above `kubegpu.devices` ever talks to a vendor library. Hardware facts and health live
together so that one immutable `Inventory` snapshot describes the node at one moment;
health changes produce a new snapshot (`Inventory.with_health`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import NewType, Protocol, runtime_checkable

#: A device ID as advertised to the kubelet (GPU UUID, MIG UUID, `<UUID>::<n>`, or index).
DeviceID = NewType("DeviceID", str)
#: An extended resource name such as `nvidia.com/gpu`.
ResourceName = NewType("ResourceName", str)


class Vendor(StrEnum):
    NVIDIA = "nvidia"
    AMD = "amd"


class Health(StrEnum):
    """The kubelet's two health strings, verbatim."""

    HEALTHY = "Healthy"
    UNHEALTHY = "Unhealthy"


@dataclass(frozen=True)
class Fault:
    """Why a device is unhealthy, as the health monitor saw it: the node-state store keeps
    it beside the health map, so everything that shows health says the same why."""

    #: The Xid that made it unhealthy; None when it failed its probes (or nobody said),
    #: which a DRA taint shows as a lost GPU.
    xid: int | None = None
    #: In words, for logs and the kubelet ("Xid 79 (GPU has fallen off the bus)"); "" when
    #: nobody said.
    reason: str = ""


class LinkKind(StrEnum):
    """How two GPUs reach each other, best first (the nvidia-smi topo names)."""

    NVLINK = "NV"
    SINGLE_SWITCH = "PIX"  # one PCIe switch between them
    MULTI_SWITCH = "PXB"  # several PCIe switches, no host bridge
    HOST_BRIDGE = "PHB"  # through a PCIe host bridge (same CPU)
    SAME_NUMA = "NODE"  # across host bridges within one NUMA node
    CROSS_NUMA = "SYS"  # across the CPU interconnect (QPI/UPI/Infinity Fabric)


@dataclass(frozen=True)
class Link:
    """A connection from one GPU to a peer GPU."""

    peer_uuid: str
    kind: LinkKind
    #: Number of NVLink lanes for `LinkKind.NVLINK`; 1 otherwise.
    count: int = 1
    #: AMD only: the KFD io_link `type` to the peer (11 xGMI, 2 PCIe), None when KFD lists
    #: no link. ROCm's allocator weighs pairs by it, so the AMD scorer needs the raw value.
    iolink_type: int | None = None
    #: NVLink version of the lanes (1 P100 ... 5 B200), which sets their per-link bandwidth;
    #: 0 when unknown or not NVLink.
    nvlink_version: int = 0


@dataclass(frozen=True)
class MigDevice:
    """One MIG slice (a GPU instance + compute instance) of a MIG-enabled GPU."""

    uuid: str
    parent_uuid: str
    #: Index of the parent GPU on the node.
    parent_index: int
    #: GPU instance and compute instance IDs, as in NVIDIA's `i:j` device notation.
    gi_id: int
    ci_id: int
    #: Canonical profile name, e.g. `1g.10gb`, `3g.40gb`, `1g.10gb+me`.
    profile: str
    memory_mib: int
    multiprocessors: int = 0
    #: Extra device nodes that grant access to this slice (`/dev/nvidia-caps/nvidia-capN`).
    device_paths: tuple[str, ...] = ()
    #: Attributes reported by NVML for GFD-style labels (engines, slices).
    attributes: Mapping[str, int] = field(default_factory=dict, hash=False)
    health: Health = Health.HEALTHY
    #: The MIG device's index on its GPU (the slot of nvmlDeviceGetMigDeviceHandleByIndex).
    #: None for backends that have no such slot; the GPU-instance ID stands in then.
    mig_index: int | None = None

    @property
    def index(self) -> str:
        """NVIDIA's `<gpu>:<mig>` index notation: GPU index : MIG device index.

        NVIDIA's plugin (internal/rm) and CDI name a slice `<gpu index>:<MIG device index>`,
        the slot NVML enumerates it in, not its GPU-instance ID: with 7x 1g.5gb the IDs are
        `0:0`..`0:6`, while the GPU-instance IDs are 7..13.
        """
        slot = self.gi_id if self.mig_index is None else self.mig_index
        return f"{self.parent_index}:{slot}"


@dataclass(frozen=True)
class AmdInfo:
    """What the AMD backend knows beyond the vendor-neutral fields (for ROCm-style labels
    and ROCm's allocator). A compute partition (CPX/DPX/QPX) is its own `Gpu` with this set."""

    #: KFD topology node number (`/sys/class/kfd/kfd/topology/nodes/<n>`).
    kfd_node: int
    #: ROCm's "devID": `dddd:bb:dd:0`, the physical GPU every partition of it shares.
    pci_group: str
    #: A compute partition other than the one on the PCI function (`amdgpu_xcp_<n>`).
    partition: bool = False
    #: `current_compute_partition` / `current_memory_partition`, lower case (`cpx`, `nps1`).
    compute_partition: str = ""
    memory_partition: str = ""
    simd_count: int = 0
    simd_per_cu: int = 0
    #: PCI device id (KFD `device_id`), e.g. 0x74a1.
    device_id: int = 0
    #: The driver's `product_name` file verbatim; empty when the board has none.
    product_name: str = ""
    #: libdrm's marketing name for the device and PCI revision (any revision when sysfs has
    #: no `revision` file); empty when unlisted.
    marketing_name: str = ""
    #: KFD `mem_banks/0` size, the memory this device (or partition) owns.
    vram_bytes: int = 0
    gfx_target_version: int = 0
    #: (name, feature version, firmware version) from the driver's amdgpu_firmware_info.
    firmware: tuple[tuple[str, int, int], ...] = ()


@dataclass(frozen=True)
class AmdNode:
    """Node-wide AMD facts for the `amd.com/gpu.*` labels."""

    driver_src_version: str = ""
    compute_partitioning_supported: bool = False
    memory_partitioning_supported: bool = False


@dataclass(frozen=True)
class Gpu:
    """One physical GPU."""

    index: int
    uuid: str
    #: Minor number of its /dev node (`/dev/nvidia<minor>`, `/dev/dri/renderD<minor>`).
    minor: int
    #: Product name as the driver reports it, e.g. `NVIDIA H100 80GB HBM3`.
    product: str
    memory_mib: int
    #: Canonical PCI bus id, `0000:17:00.0`.
    pci_bus_id: str
    #: Kernel NUMA node number, or None when the platform reports none.
    numa_node: int | None
    compute_capability: tuple[int, int]
    vendor: Vendor = Vendor.NVIDIA
    #: Device nodes specific to this GPU.
    device_paths: tuple[str, ...] = ()
    #: MIG mode is on; its slices are in `mig_devices`.
    mig_enabled: bool = False
    mig_capable: bool = False
    mig_devices: tuple[MigDevice, ...] = ()
    links: tuple[Link, ...] = ()
    #: Brand/architecture hints for labels (e.g. `Tesla`, `hopper`); empty when unknown.
    brand: str = ""
    health: Health = Health.HEALTHY
    #: AMD backend details; None for NVIDIA and simulated GPUs.
    amd: AmdInfo | None = None

    def link_to(self, peer_uuid: str) -> Link | None:
        return self._links_by_peer.get(peer_uuid)

    @functools.cached_property
    def _links_by_peer(self) -> dict[str, Link]:
        # Placement asks for many pairs per request; a dict keeps each lookup O(1).
        by_peer: dict[str, Link] = {}
        for link in self.links:
            by_peer.setdefault(link.peer_uuid, link)
        return by_peer


@dataclass(frozen=True)
class Inventory:
    """Everything known about the node's GPUs at one moment."""

    gpus: tuple[Gpu, ...]
    #: Kernel driver version, e.g. `550.54.15`.
    driver_version: str = ""
    #: Highest CUDA version the driver supports, (major, minor); (0, 0) if unknown.
    cuda_driver_version: tuple[int, int] = (0, 0)
    #: Device nodes every container using the vendor's GPUs needs (nvidiactl, uvm, kfd).
    control_device_paths: tuple[str, ...] = ()
    #: Name of the backend that produced this snapshot (`nvml`, `simulated`, `amd`, `null`).
    backend: str = ""
    #: AMD node facts; None unless the AMD backend produced this snapshot.
    amd: AmdNode | None = None
    #: Made up (the simulated backend): the device nodes named are not this host's, so
    #: containers get stand-ins for them (`allocation.SIMULATED_DEVICE_NODE`).
    simulated: bool = False
    #: The driver limits device memory per cgroup (NVML's memory-limit calls, R615 and
    #: later, with cgroup v2): the kernel-enforced limit of a memory-sized claim.
    memory_limits: bool = False

    def gpu(self, uuid: str) -> Gpu:
        for gpu in self.gpus:
            if gpu.uuid == uuid:
                return gpu
        raise KeyError(uuid)

    def mig_devices(self) -> Iterator[MigDevice]:
        for gpu in self.gpus:
            yield from gpu.mig_devices

    def with_health(self, health: Mapping[str, Health]) -> Inventory:
        """A copy where GPUs and MIG slices named by UUID take the given health.

        A MIG slice is unhealthy when it or its parent GPU is (an Xid on the parent
        takes down every slice).
        """

        def mig(m: MigDevice, parent: Health) -> MigDevice:
            own = health.get(m.uuid, Health.HEALTHY)
            bad = Health.UNHEALTHY in (own, parent)
            return dataclasses.replace(m, health=Health.UNHEALTHY if bad else Health.HEALTHY)

        gpus = []
        for g in self.gpus:
            h = health.get(g.uuid, Health.HEALTHY)
            migs = tuple(mig(m, h) for m in g.mig_devices)
            gpus.append(dataclasses.replace(g, health=h, mig_devices=migs))
        return dataclasses.replace(self, gpus=tuple(gpus))


class ProcessKind(StrEnum):
    """Which of the driver's process lists a process is on (one process may be on several)."""

    COMPUTE = "compute"
    GRAPHICS = "graphics"
    #: A client of an MPS server (the server itself is listed as a compute process).
    MPS = "mps"


@dataclass(frozen=True)
class GpuProcess:
    """One process the driver reports running on a GPU or MIG device, with its use of it."""

    #: The process ID in the host's PID namespace (what the driver reports).
    pid: int
    #: The device it runs on: a GPU's UUID, or a MIG device's UUID.
    uuid: str
    kinds: tuple[ProcessKind, ...] = (ProcessKind.COMPUTE,)
    #: Device memory it holds; None where the driver does not say.
    used_memory_bytes: int | None = None
    #: On a MIG device: its GPU instance and compute instance IDs.
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None
    #: Percent of the device's SMs it kept busy over the driver's latest sample (0 when it
    #: has no recent sample); None where the driver keeps no per-process samples (MIG).
    sm_percent: int | None = None
    #: Percent of the time the device's memory was read or written for it; None as above.
    memory_percent: int | None = None


@dataclass(frozen=True)
class ProcessTable:
    """The processes on the node's GPUs at one moment."""

    processes: tuple[GpuProcess, ...] = ()
    #: Devices (UUID) whose process list could not be read, with what failed: their
    #: processes are missing from `processes`, which is not the same as "none".
    failures: Mapping[str, str] = field(default_factory=dict)


@runtime_checkable
class ProcessSource(Protocol):
    """A backend that can list the processes on its GPUs (blocking; call from a thread).

    Every backend has it (the AMD and null backends report none); it is a separate
    protocol so that a test double of `DeviceBackend` need not grow it.
    """

    def processes(self) -> ProcessTable:
        """The processes on every GPU and MIG device now; never raises for one device."""
        ...


class HealthEventKind(StrEnum):
    #: An Xid (or AMD RAS) error was reported for the device.
    XID = "xid"
    #: A probe of the device failed (NVML call error, device lost).
    PROBE_FAILED = "probe-failed"
    #: A probe of the device succeeded.
    PROBE_OK = "probe-ok"
    #: The operator (or a test) declared the device healthy again (simulated node).
    HEALED = "healed"
    #: The device set or a MIG layout changed: the daemon should discover again.
    RECONFIGURED = "reconfigured"


@dataclass(frozen=True)
class HealthEvent:
    """Something a backend observed about one device's health."""

    uuid: str
    kind: HealthEventKind
    xid: int | None = None
    detail: str = ""


class DeviceBackend(Protocol):
    """What the rest of kubegpu needs from a GPU backend.

    `discover` and `probe` are blocking and may be called from a worker thread;
    `watch` blocks until `stop` is set and hands events to `emit` (thread-safe).
    """

    name: str

    def discover(self) -> Inventory:
        """Enumerate the node's GPUs. Raises `InitError` when none can be read."""
        ...

    def probe(self, uuid: str) -> str | None:
        """Check one device; None when it answers normally, else what failed."""
        ...

    def watch(self, stop: StopFlag, emit: Callable[[HealthEvent], None]) -> None:
        """Block, reporting health events, until `stop.is_set()`."""
        ...

    def close(self) -> None: ...


class StopFlag(Protocol):
    """What a backend's watch thread is told to stop with (`kubegpu.devices.stop.Stop`).

    `on_set` lets a watch blocked elsewhere than in `wait` (in `select` on inotify) be
    woken the moment it is told to stop.
    """

    def is_set(self) -> bool: ...

    def wait(self, timeout: float | None = None) -> bool: ...

    def on_set(self, wake: Callable[[], None]) -> Callable[[], None]:
        """Call `wake` (from the setting thread) once set, at once if set; the undo."""
        ...
