"""Public fakes for testing code that uses kubegpu, without a GPU.

`FakeNvml` is a module object shaped like `pynvml`: the same function names and
signatures, the real `pynvml` constants and `NVMLError` classes (so `err.value` codes and
`except pynvml.NVMLError_NotSupported` work unchanged), and returns with the attribute
names of pynvml's ctypes structures (including `busId` as bytes). Pass it to
`NvmlBackend.open(nvml=fake)`; the backend cannot tell it from the real library.

    fake = FakeNvml()
    gpu = fake.add_gpu("NVIDIA A100-SXM4-40GB", memory_mib=40536, mig_capable=True)
    gpu.add_mig("3g.20gb"); gpu.add_mig("2g.10gb")
    fake.fail("nvmlDeviceGetMemoryInfo", pynvml.NVML_ERROR_GPU_IS_LOST, gpu=0)
    fake.emit_xid(0, 79)
    gpu.migs[0].add_process(4242, used_mib=6144)          # a process on a MIG slice
    fake.gpus[1].add_process(4343, used_mib=2048, kind="mps", sm_util=40)

Builders are plain mutable objects: tests change them between calls to model hot-plug,
MIG reconfiguration or a GPU falling off the bus. Faults NVML can be in: a GPU lost
(`gpu.lost`), a GPU whose calls hang (`gpu.hang`, a `threading.Event` they wait for), a reset
still pending (`gpu.recovery_action`, `gpu.rows_pending`, `gpu.pages_pending`), and the
driver unloaded under the process (`unload_driver`, then `load_driver`: NVML must be
initialised again, as after a real driver reload).

`FakePodResources` serves the kubelet's PodResources API (`List`) on a unix socket from
containers a test declares, for code that attributes GPU use to pods.

The other two fakes a user of kubegpu needs are re-exported here: `KubeletEmulator` (a
faithful kubelet device manager over real sockets) and `SimulatedBackend` (a GPU node
from a preset or YAML file, with fault injection).
"""

from __future__ import annotations

import re
import threading
import time
import types
import uuid as uuidlib
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import grpc
import pynvml

from kubegpu.api import add_pod_resources_servicer, podresources_pb2, podresources_pb2_grpc

_NO_ID = 0xFFFFFFFF
_MIB = 1024 * 1024
_UUID_NS = uuidlib.UUID("6c1b9a9e-3f4d-4b8e-9f57-2b7c4a1d0e11")
_PROFILE_RE = re.compile(r"^(?:(\d+)c\.)?(\d+)g\.(\d+)gb(\+me|\+me\.all|-me|\+gfx)?$")
#: GPU-instance profiles: (GPU slices, suffix) -> (profile index, profile ID). As on a real
#: driver the index (`NVML_GPU_INSTANCE_PROFILE_*`, what nvmlDeviceGetGpuInstanceProfileInfo
#: takes) and the ID (what a GPU instance reports, `nvidia-smi mig -lgip`) differ: the IDs of
#: the A100/H100 table are the driver's (1g 19, 1g+me 20, 2g 14, 3g 9, 4g 5, 7g 0); the
#: others, not seen on those GPUs, get distinct IDs of our own choosing (30 and up).
_GI_PROFILES = {
    (1, ""): (pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE, 19),
    (2, ""): (pynvml.NVML_GPU_INSTANCE_PROFILE_2_SLICE, 14),
    (3, ""): (pynvml.NVML_GPU_INSTANCE_PROFILE_3_SLICE, 9),
    (4, ""): (pynvml.NVML_GPU_INSTANCE_PROFILE_4_SLICE, 5),
    (7, ""): (pynvml.NVML_GPU_INSTANCE_PROFILE_7_SLICE, 0),
    (8, ""): (pynvml.NVML_GPU_INSTANCE_PROFILE_8_SLICE, 30),
    (6, ""): (pynvml.NVML_GPU_INSTANCE_PROFILE_6_SLICE, 31),
    (1, "+me"): (pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1, 20),
    (2, "+me"): (pynvml.NVML_GPU_INSTANCE_PROFILE_2_SLICE_REV1, 32),
    (1, "+gfx"): (pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_GFX, 33),
    (2, "+gfx"): (pynvml.NVML_GPU_INSTANCE_PROFILE_2_SLICE_GFX, 34),
    (4, "+gfx"): (pynvml.NVML_GPU_INSTANCE_PROFILE_4_SLICE_GFX, 35),
    (1, "-me"): (pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_NO_ME, 36),
    (2, "-me"): (pynvml.NVML_GPU_INSTANCE_PROFILE_2_SLICE_NO_ME, 37),
    (1, "+me.all"): (pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_ALL_ME, 38),
    (2, "+me.all"): (pynvml.NVML_GPU_INSTANCE_PROFILE_2_SLICE_ALL_ME, 39),
}
#: Compute-instance profiles: compute slices -> (profile index, profile ID); a real driver's
#: compute-instance IDs happen to equal the indices (`nvidia-smi mig -lcip`).
_CI_PROFILES = {
    1: (pynvml.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE, 0),
    2: (pynvml.NVML_COMPUTE_INSTANCE_PROFILE_2_SLICE, 1),
    3: (pynvml.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE, 2),
    4: (pynvml.NVML_COMPUTE_INSTANCE_PROFILE_4_SLICE, 3),
    7: (pynvml.NVML_COMPUTE_INSTANCE_PROFILE_7_SLICE, 4),
    8: (pynvml.NVML_COMPUTE_INSTANCE_PROFILE_8_SLICE, 5),
    6: (pynvml.NVML_COMPUTE_INSTANCE_PROFILE_6_SLICE, 6),
}
#: What NVML reports as supported events on a datacenter GPU.
DEFAULT_EVENTS = (
    pynvml.nvmlEventTypeXidCriticalError
    | pynvml.nvmlEventTypeDoubleBitEccError
    | pynvml.nvmlEventTypeSingleBitEccError
)


def _nvml_bus_id(bus_id: str) -> bytes:
    """`0000:17:00.0` -> NVML's `00000000:17:00.0` (8-digit domain, upper-case), as bytes."""
    domain, rest = bus_id.split(":", 1)
    return f"{int(domain, 16):08X}:{rest.upper()}".encode()


@dataclass
class PciInfo:
    """Mirrors `pynvml.nvmlPciInfo_t`."""

    busId: bytes
    busIdLegacy: bytes
    domain: int
    bus: int
    device: int
    pciDeviceId: int
    pciSubSystemId: int = 0


@dataclass
class Memory:
    """Mirrors `pynvml.c_nvmlMemory_t` (bytes)."""

    total: int
    free: int
    used: int


@dataclass
class DeviceAttributes:
    """Mirrors `pynvml.c_nvmlDeviceAttributes`."""

    multiprocessorCount: int
    sharedCopyEngineCount: int
    sharedDecoderCount: int
    sharedEncoderCount: int
    sharedJpegCount: int
    sharedOfaCount: int
    gpuInstanceSliceCount: int
    computeInstanceSliceCount: int
    memorySizeMB: int


@dataclass
class GpuInstanceInfo:
    """Mirrors `pynvml.c_nvmlGpuInstanceInfo_t` (placement left out)."""

    device: FakeGpu
    id: int
    profileId: int


@dataclass
class ProfileInfo:
    """The fields of `c_nvmlGpuInstanceProfileInfo_v2_t` / compute-instance profile info read."""

    id: int
    sliceCount: int


@dataclass
class ComputeInstanceInfo:
    """Mirrors `pynvml.c_nvmlComputeInstanceInfo_t` (placement left out)."""

    device: FakeGpu
    gpuInstance: FakeMig
    id: int
    profileId: int


@dataclass
class ProcessInfo:
    """Mirrors `pynvml.c_nvmlProcessInfo_v3_t` as pynvml returns it (`usedGpuMemory` None
    when the driver says NVML_VALUE_NOT_AVAILABLE)."""

    pid: int
    usedGpuMemory: int | None
    gpuInstanceId: int = _NO_ID
    computeInstanceId: int = _NO_ID


@dataclass
class ProcessUtilizationSample:
    """Mirrors `pynvml.c_nvmlProcessUtilizationSample_t`."""

    pid: int
    timeStamp: int
    smUtil: int
    memUtil: int
    encUtil: int = 0
    decUtil: int = 0


@dataclass
class ProcessUtilizationInfo:
    """Mirrors `pynvml.c_nvmlProcessUtilizationInfo_v1_t`."""

    timeStamp: int
    pid: int
    smUtil: int
    memUtil: int
    encUtil: int = 0
    decUtil: int = 0
    jpgUtil: int = 0
    ofaUtil: int = 0


def _now_us() -> int:
    return int(time.time() * 1_000_000)


@dataclass(eq=False)
class FakeProcess:
    """A process on a GPU or MIG device, as the driver lists it."""

    pid: int
    #: Device memory in MiB; None: the driver does not say (NVML_VALUE_NOT_AVAILABLE).
    used_mib: int | None = 0
    #: `compute`, `graphics`, `mps` (an MPS client) or `compute+graphics`.
    kind: str = "compute"
    sm_util: int = 0
    mem_util: int = 0
    #: When the driver took its latest utilization sample of it (µs, wall clock).
    sample_us: int = field(default_factory=_now_us)

    def set_util(self, sm_util: int, mem_util: int = 0, *, at_us: int | None = None) -> None:
        """A new utilization sample (stamped now unless `at_us`)."""
        self.sm_util, self.mem_util = sm_util, mem_util
        self.sample_us = _now_us() if at_us is None else at_us


def _add_process(
    processes: list[FakeProcess],
    pid: int,
    used_mib: int | None,
    kind: str,
    sm_util: int,
    mem_util: int,
) -> FakeProcess:
    if not set(kind.split("+")) <= {"compute", "graphics", "mps"}:
        raise ValueError(f"bad process kind {kind!r}: compute, graphics, mps or compute+graphics")
    process = FakeProcess(pid, used_mib, kind, sm_util, mem_util)
    processes.append(process)
    return process


@dataclass
class EventData:
    """Mirrors `pynvml.c_nvmlEventData_t`; `device` is None for a NULL device handle."""

    device: FakeGpu | None
    eventType: int
    eventData: int
    gpuInstanceId: int = _NO_ID
    computeInstanceId: int = _NO_ID


@dataclass(eq=False)
class FakeMig:
    """A MIG device handle and its builder."""

    parent: FakeGpu
    uuid: str
    gi_id: int
    ci_id: int
    gi_slices: int
    ci_slices: int
    memory_mib: int
    multiprocessors: int
    gi_profile_id: int
    ci_profile_id: int = 0
    #: Shared engines: copy, decoder, encoder, jpeg, ofa.
    engines: tuple[int, int, int, int, int] = (1, 0, 0, 0, 0)
    processes: list[FakeProcess] = field(default_factory=list)

    def add_process(
        self,
        pid: int,
        used_mib: int | None = 0,
        *,
        kind: str = "compute",
        sm_util: int = 0,
        mem_util: int = 0,
    ) -> FakeProcess:
        """A process running on this MIG device (the driver keeps no utilization samples
        on MIG devices, so `sm_util` is never reported)."""
        return _add_process(self.processes, pid, used_mib, kind, sm_util, mem_util)


@dataclass(eq=False)
class FakeGpu:
    """A physical GPU handle and its builder."""

    index: int
    name: str
    uuid: str
    minor: int
    memory_mib: int
    pci_bus_id: str
    numa_node: int | None
    compute_capability: tuple[int, int]
    brand: int = pynvml.NVML_BRAND_NVIDIA
    #: None: MIG not supported; else [current, pending] mode.
    mig_mode: list[int] | None = None
    migs: list[FakeMig] = field(default_factory=list)
    #: One entry per NVLink: remote bus id (`0000:18:00.0`) or `switch`; None = inactive.
    nvlinks: list[str | None] | None = None
    supported_events: int = DEFAULT_EVENTS
    #: Every call on this handle fails with NVML_ERROR_GPU_IS_LOST.
    lost: bool = False
    #: Every call on this handle blocks until the event is set (a GPU that stopped answering).
    hang: threading.Event | None = None
    #: nvmlGpuRecoveryAction_t the driver reports (NVML_FI_DEV_GET_GPU_RECOVERY_ACTION).
    recovery_action: int = pynvml.NVML_GPU_RECOVERY_ACTION_NONE
    #: Rows waiting for a reset to be remapped (nvmlDeviceGetRemappedRows' isPending).
    rows_pending: bool = False
    #: Pages waiting for a reset to be retired (nvmlDeviceGetRetiredPagesPendingStatus).
    pages_pending: bool = False
    #: Processes on the whole GPU (those on its MIG devices are the MIGs' own).
    processes: list[FakeProcess] = field(default_factory=list)

    def add_process(
        self,
        pid: int,
        used_mib: int | None = 0,
        *,
        kind: str = "compute",
        sm_util: int = 0,
        mem_util: int = 0,
    ) -> FakeProcess:
        """A process running on the whole GPU, with its memory and utilization."""
        return _add_process(self.processes, pid, used_mib, kind, sm_util, mem_util)

    def stop_process(self, pid: int) -> None:
        """The process ends: gone from the GPU and from its MIG devices."""
        self.processes[:] = [p for p in self.processes if p.pid != pid]
        for mig in self.migs:
            mig.processes[:] = [p for p in mig.processes if p.pid != pid]

    def enable_mig(self) -> FakeGpu:
        self.mig_mode = [pynvml.NVML_DEVICE_MIG_ENABLE, pynvml.NVML_DEVICE_MIG_ENABLE]
        return self

    def add_mig(
        self,
        profile: str,
        *,
        memory_mib: int | None = None,
        multiprocessors: int | None = None,
        gi_id: int | None = None,
        ci_id: int = 0,
        engines: tuple[int, int, int, int, int] = (1, 0, 0, 0, 0),
    ) -> FakeMig:
        """Add a MIG device named like `1g.10gb`, `1c.3g.40gb` or `1g.10gb+me` (enables MIG)."""
        match = _PROFILE_RE.match(profile)
        if match is None:
            raise ValueError(f"bad MIG profile {profile!r}: expected e.g. 1g.10gb or 1c.3g.40gb")
        ci_text, gi_text, gb_text, suffix = match.groups()
        gi_slices = int(gi_text)
        ci_slices = int(ci_text) if ci_text else gi_slices
        if self.mig_mode is None or self.mig_mode[0] != pynvml.NVML_DEVICE_MIG_ENABLE:
            self.enable_mig()
        if gi_id is None:
            gi_id = max((m.gi_id for m in self.migs), default=0) + 1
        if (gi_slices, suffix or "") not in _GI_PROFILES or ci_slices not in _CI_PROFILES:
            raise ValueError(f"MIG profile {profile!r} has no NVML profile to simulate it with")
        profile_id = _GI_PROFILES[gi_slices, suffix or ""][1]
        mig = FakeMig(
            parent=self,
            uuid=f"MIG-{uuidlib.uuid5(_UUID_NS, f'{self.uuid}/{gi_id}/{ci_id}')}",
            gi_id=gi_id,
            ci_id=ci_id,
            gi_slices=gi_slices,
            ci_slices=ci_slices,
            # Slightly under the nominal size, as real slices are.
            memory_mib=memory_mib if memory_mib is not None else int(int(gb_text) * 1024 * 0.97),
            multiprocessors=multiprocessors if multiprocessors is not None else 14 * ci_slices,
            gi_profile_id=profile_id,
            ci_profile_id=_CI_PROFILES[ci_slices][1],
            engines=engines,
        )
        self.migs.append(mig)
        return mig


class _FakeEventSet:
    def __init__(self) -> None:
        self.registered: dict[FakeGpu, int] = {}
        self.queue: deque[EventData] = deque()
        self.freed = False


_CONSTANT_PREFIXES = ("NVML_", "nvmlEventType", "NVMLError", "nvmlClocksEvent")


class FakeNvml(types.ModuleType):
    """A stand-in for the `pynvml` module backed by in-memory GPUs."""

    NVMLError = pynvml.NVMLError

    def __init__(self, driver_version: str = "550.54.15", cuda_driver_version: int = 12040) -> None:
        super().__init__("pynvml")
        for name in dir(pynvml):
            if name.startswith(_CONSTANT_PREFIXES):
                setattr(self, name, getattr(pynvml, name))
        self.driver_version = driver_version
        self.cuda_driver_version = cuda_driver_version
        self.gpus: list[FakeGpu] = []
        #: An NVML error code that nvmlInit raises (e.g. NVML_ERROR_DRIVER_NOT_LOADED).
        self.init_error: int | None = None
        #: Set by the backend when it loads the library from a driver root.
        self.nvmlLib: Any = None
        self.initialized = False
        self.shutdowns = 0
        self.inits = 0
        self.driver_loaded = True
        #: Explicit topology levels between GPU pairs (by index); default from NUMA nodes.
        self.topology: dict[frozenset[int], int] = {}
        self._failures: dict[tuple[str, int | None], int] = {}
        self._wait_errors: deque[int] = deque()
        self._event_sets: list[_FakeEventSet] = []
        self._cond = threading.Condition()

    # -- builders -------------------------------------------------------------------

    def add_gpu(
        self,
        name: str = "NVIDIA H100 80GB HBM3",
        *,
        memory_mib: int = 81559,
        compute_capability: tuple[int, int] = (9, 0),
        numa_node: int | None = 0,
        pci_bus_id: str | None = None,
        uuid: str | None = None,
        minor: int | None = None,
        brand: int = pynvml.NVML_BRAND_NVIDIA,
        mig_capable: bool = False,
    ) -> FakeGpu:
        index = len(self.gpus)
        gpu = FakeGpu(
            index=index,
            name=name,
            uuid=uuid or f"GPU-{uuidlib.uuid5(_UUID_NS, f'{name}/{index}')}",
            minor=index if minor is None else minor,
            memory_mib=memory_mib,
            pci_bus_id=pci_bus_id or f"0000:{0x17 + index * 0x10:02x}:00.0",
            numa_node=numa_node,
            compute_capability=compute_capability,
            brand=brand,
            mig_mode=[0, 0] if mig_capable else None,
        )
        self.gpus.append(gpu)
        return gpu

    def connect_nvlink(self, a: int, b: int, links: int) -> None:
        """Add `links` active NVLinks between GPUs `a` and `b` (both directions)."""
        for src, dst in ((a, b), (b, a)):
            gpu = self.gpus[src]
            gpu.nvlinks = (gpu.nvlinks or []) + [self.gpus[dst].pci_bus_id] * links

    def connect_nvswitch(self, links: int) -> None:
        """Give every GPU `links` active NVLinks to NVSwitches (an HGX board)."""
        for gpu in self.gpus:
            gpu.nvlinks = ["switch"] * links

    def fail(self, function: str, code: int, gpu: int | None = None) -> None:
        """Make `function` raise NVMLError(code), for one GPU (by index) or for all."""
        self._failures[(function, gpu)] = code

    def unfail(self, function: str, gpu: int | None = None) -> None:
        self._failures.pop((function, gpu), None)

    def unload_driver(self) -> None:
        """The kernel driver goes away: every call fails with NVML_ERROR_DRIVER_NOT_LOADED,
        event sets are gone, and NVML stays uninitialised until `nvmlInit` after `load_driver`.
        """
        with self._cond:
            self.driver_loaded = False
            self.initialized = False
            for event_set in self._event_sets:
                event_set.freed = True
            self._event_sets.clear()
            self._cond.notify_all()

    def load_driver(self) -> None:
        """The driver is back; calls fail with NVML_ERROR_UNINITIALIZED until `nvmlInit`."""
        with self._cond:
            self.driver_loaded = True
            self._cond.notify_all()

    def fail_wait(self, code: int, times: int = 1) -> None:
        """Make the next `times` event waits raise NVMLError(code)."""
        with self._cond:
            self._wait_errors.extend([code] * times)
            self._cond.notify_all()

    def emit_event(
        self,
        gpu: int | None,
        event_type: int,
        data: int,
        *,
        gpu_instance_id: int = _NO_ID,
        compute_instance_id: int = _NO_ID,
    ) -> None:
        """Deliver an event to every event set registered for it; `gpu=None`: no device."""
        device = None if gpu is None else self.gpus[gpu]
        event = EventData(device, event_type, data, gpu_instance_id, compute_instance_id)
        with self._cond:
            for event_set in self._event_sets:
                if device is None:
                    wanted = bool(event_set.registered)
                else:
                    wanted = bool(event_set.registered.get(device, 0) & event_type)
                if wanted:
                    event_set.queue.append(event)
            self._cond.notify_all()

    def emit_xid(self, gpu: int | None, xid: int, *, mig: FakeMig | None = None) -> None:
        ids = {}
        if mig is not None:
            ids = {"gpu_instance_id": mig.gi_id, "compute_instance_id": mig.ci_id}
        self.emit_event(gpu, pynvml.nvmlEventTypeXidCriticalError, xid, **ids)

    def wait_registered(self, count: int, timeout: float = 5.0) -> bool:
        """Block until `count` GPUs are registered for events (a watcher has started)."""
        with self._cond:
            return self._cond.wait_for(lambda: len(self._registered()) >= count, timeout)

    def registered(self) -> dict[str, int]:
        with self._cond:
            return self._registered()

    def _registered(self) -> dict[str, int]:
        """UUID -> event mask of every registration in live event sets."""
        return {
            g.uuid: mask
            for s in self._event_sets
            if not s.freed
            for g, mask in s.registered.items()
        }

    # -- internals ------------------------------------------------------------------

    def _check(self, function: str, handle: FakeGpu | FakeMig | None = None) -> None:
        if not self.driver_loaded:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
        if not self.initialized:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)
        gpu = handle.parent if isinstance(handle, FakeMig) else handle
        if gpu is not None and gpu.hang is not None:
            gpu.hang.wait()
        if gpu is not None and gpu.lost:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        for key in ((function, None if gpu is None else gpu.index), (function, None)):
            if key in self._failures:
                raise pynvml.NVMLError(self._failures[key])

    def _gpu(self, function: str, handle: Any) -> FakeGpu:
        self._check(function, handle)
        if not isinstance(handle, FakeGpu):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return handle

    def _link(self, function: str, device: Any, link: int) -> str:
        gpu = self._gpu(function, device)
        if gpu.nvlinks is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if not 0 <= link < len(gpu.nvlinks):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        remote = gpu.nvlinks[link]
        if remote is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return remote

    @staticmethod
    def _pci(bus_id: str) -> PciInfo:
        raw = _nvml_bus_id(bus_id)
        _, bus, dev_fn = bus_id.split(":")
        return PciInfo(
            raw, raw, int(bus_id.split(":")[0], 16), int(bus, 16), int(dev_fn[:2], 16), 0x233010DE
        )

    # -- the pynvml API (names and signatures as in pynvml) --------------------------

    def nvmlInit(self) -> None:
        self.nvmlInitWithFlags(0)

    def nvmlInitWithFlags(self, flags: int) -> None:
        if not self.driver_loaded:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
        if self.init_error is not None:
            raise pynvml.NVMLError(self.init_error)
        self.initialized = True
        self.inits += 1

    def nvmlShutdown(self) -> None:
        self._check("nvmlShutdown")
        self.shutdowns += 1
        self.initialized = False

    def nvmlSystemGetDriverVersion(self) -> str:
        self._check("nvmlSystemGetDriverVersion")
        return self.driver_version

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        self._check("nvmlSystemGetCudaDriverVersion")
        return self.cuda_driver_version

    def nvmlSystemGetCudaDriverVersion_v2(self) -> int:
        return self.nvmlSystemGetCudaDriverVersion()

    def nvmlDeviceGetCount(self) -> int:
        self._check("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeGpu:
        self._check("nvmlDeviceGetHandleByIndex")
        if not 0 <= index < len(self.gpus):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        gpu = self.gpus[index]
        self._check("nvmlDeviceGetHandleByIndex", gpu)
        return gpu

    def nvmlDeviceGetHandleByUUID(self, uuid: str | bytes) -> FakeGpu | FakeMig:
        self._check("nvmlDeviceGetHandleByUUID")
        wanted = uuid.decode() if isinstance(uuid, bytes) else uuid
        for gpu in self.gpus:
            if gpu.uuid == wanted:
                self._check("nvmlDeviceGetHandleByUUID", gpu)
                return gpu
            for mig in gpu.migs:
                if mig.uuid == wanted:
                    self._check("nvmlDeviceGetHandleByUUID", gpu)
                    return mig
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)

    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        self._check("nvmlDeviceGetUUID", handle)
        return str(handle.uuid)

    def nvmlDeviceGetName(self, handle: Any) -> str:
        self._check("nvmlDeviceGetName", handle)
        if isinstance(handle, FakeMig):
            return f"{handle.parent.name} MIG {handle.gi_slices}g.{handle.memory_mib // 1024}gb"
        return str(handle.name)

    def nvmlDeviceGetIndex(self, handle: Any) -> int:
        return self._gpu("nvmlDeviceGetIndex", handle).index

    def nvmlDeviceGetMinorNumber(self, handle: Any) -> int:
        return self._gpu("nvmlDeviceGetMinorNumber", handle).minor

    def nvmlDeviceGetMemoryInfo(self, handle: Any, version: int | None = None) -> Memory:
        self._check("nvmlDeviceGetMemoryInfo", handle)
        total = int(handle.memory_mib) * _MIB
        return Memory(total=total, free=total - 512 * _MIB, used=512 * _MIB)

    def nvmlDeviceGetPciInfo(self, handle: Any) -> PciInfo:
        return self._pci(self._gpu("nvmlDeviceGetPciInfo", handle).pci_bus_id)

    def nvmlDeviceGetPciInfo_v3(self, handle: Any) -> PciInfo:
        return self.nvmlDeviceGetPciInfo(handle)

    def nvmlDeviceGetNumaNodeId(self, handle: Any) -> int:
        gpu = self._gpu("nvmlDeviceGetNumaNodeId", handle)
        return -1 if gpu.numa_node is None else gpu.numa_node

    def nvmlDeviceGetCudaComputeCapability(self, handle: Any) -> tuple[int, int]:
        self._check("nvmlDeviceGetCudaComputeCapability", handle)
        gpu = handle.parent if isinstance(handle, FakeMig) else handle
        major, minor = gpu.compute_capability
        return (major, minor)

    def nvmlDeviceGetBrand(self, handle: Any) -> int:
        return self._gpu("nvmlDeviceGetBrand", handle).brand

    def nvmlDeviceGetMigMode(self, device: Any) -> list[int]:
        gpu = self._gpu("nvmlDeviceGetMigMode", device)
        if gpu.mig_mode is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return list(gpu.mig_mode)

    def nvmlDeviceGetMaxMigDeviceCount(self, device: Any) -> int:
        gpu = self._gpu("nvmlDeviceGetMaxMigDeviceCount", device)
        return 0 if gpu.mig_mode is None else 7

    def nvmlDeviceGetMigDeviceHandleByIndex(self, device: Any, index: int) -> FakeMig:
        gpu = self._gpu("nvmlDeviceGetMigDeviceHandleByIndex", device)
        if gpu.mig_mode is None or gpu.mig_mode[0] != pynvml.NVML_DEVICE_MIG_ENABLE:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if not 0 <= index < len(gpu.migs):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
        return gpu.migs[index]

    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, migDevice: Any) -> FakeGpu:
        self._check("nvmlDeviceGetDeviceHandleFromMigDeviceHandle", migDevice)
        if not isinstance(migDevice, FakeMig):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return migDevice.parent

    def _mig(self, function: str, device: Any) -> FakeMig:
        self._check(function, device)
        if not isinstance(device, FakeMig):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return device

    def nvmlDeviceGetGpuInstanceId(self, device: Any) -> int:
        return self._mig("nvmlDeviceGetGpuInstanceId", device).gi_id

    def nvmlDeviceGetComputeInstanceId(self, device: Any) -> int:
        return self._mig("nvmlDeviceGetComputeInstanceId", device).ci_id

    def nvmlDeviceGetAttributes(self, device: Any) -> DeviceAttributes:
        mig = self._mig("nvmlDeviceGetAttributes", device)
        copy, dec, enc, jpeg, ofa = mig.engines
        return DeviceAttributes(
            mig.multiprocessors,
            copy,
            dec,
            enc,
            jpeg,
            ofa,
            mig.gi_slices,
            mig.ci_slices,
            mig.memory_mib,
        )

    def nvmlDeviceGetAttributes_v2(self, device: Any) -> DeviceAttributes:
        return self.nvmlDeviceGetAttributes(device)

    def nvmlDeviceGetGpuInstanceById(self, device: Any, gpuInstanceId: int) -> FakeMig:
        gpu = self._gpu("nvmlDeviceGetGpuInstanceById", device)
        for mig in gpu.migs:
            if mig.gi_id == gpuInstanceId:
                return mig
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)

    def nvmlGpuInstanceGetInfo(self, gpuInstance: Any) -> GpuInstanceInfo:
        mig = self._mig("nvmlGpuInstanceGetInfo", gpuInstance)
        return GpuInstanceInfo(device=mig.parent, id=mig.gi_id, profileId=mig.gi_profile_id)

    def nvmlDeviceGetGpuInstanceProfileInfo(
        self, device: Any, profile: int, version: int = 2
    ) -> ProfileInfo:
        """Info of a profile *index*; profiles this simulation lacks answer NOT_SUPPORTED."""
        self._gpu("nvmlDeviceGetGpuInstanceProfileInfo", device)
        if not 0 <= profile < pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        for (slices, _), (index, profile_id) in _GI_PROFILES.items():
            if index == profile:
                return ProfileInfo(id=profile_id, sliceCount=slices)
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)

    def nvmlGpuInstanceGetComputeInstanceById(
        self, gpuInstance: Any, computeInstanceId: int
    ) -> FakeMig:
        instance = self._mig("nvmlGpuInstanceGetComputeInstanceById", gpuInstance)
        for mig in instance.parent.migs:
            if mig.gi_id == instance.gi_id and mig.ci_id == computeInstanceId:
                return mig
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)

    def nvmlComputeInstanceGetInfo(self, computeInstance: Any) -> ComputeInstanceInfo:
        mig = self._mig("nvmlComputeInstanceGetInfo", computeInstance)
        return ComputeInstanceInfo(
            device=mig.parent, gpuInstance=mig, id=mig.ci_id, profileId=mig.ci_profile_id
        )

    def nvmlGpuInstanceGetComputeInstanceProfileInfo(
        self, gpuInstance: Any, profile: int, engProfile: int, version: int = 2
    ) -> ProfileInfo:
        instance = self._mig("nvmlGpuInstanceGetComputeInstanceProfileInfo", gpuInstance)
        if not 0 <= profile < pynvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        for slices, (index, profile_id) in _CI_PROFILES.items():
            if index == profile and slices <= instance.gi_slices:
                return ProfileInfo(id=profile_id, sliceCount=slices)
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)

    def nvmlDeviceGetNvLinkState(self, device: Any, link: int) -> int:
        try:
            self._link("nvmlDeviceGetNvLinkState", device, link)
        except pynvml.NVMLError as err:
            if err.value == pynvml.NVML_ERROR_NOT_SUPPORTED and device.nvlinks is not None:
                return int(pynvml.NVML_FEATURE_DISABLED)
            raise
        return int(pynvml.NVML_FEATURE_ENABLED)

    def nvmlDeviceGetNvLinkRemotePciInfo(self, device: Any, link: int) -> PciInfo:
        remote = self._link("nvmlDeviceGetNvLinkRemotePciInfo", device, link)
        return self._pci("0000:c0:00.0" if remote == "switch" else remote)

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, handle: Any, link: int) -> int:
        remote = self._link("nvmlDeviceGetNvLinkRemoteDeviceType", handle, link)
        if remote == "switch":
            return int(pynvml.NVML_NVLINK_DEVICE_TYPE_SWITCH)
        return int(pynvml.NVML_NVLINK_DEVICE_TYPE_GPU)

    def nvmlDeviceGetTopologyCommonAncestor(self, device1: Any, device2: Any) -> int:
        a = self._gpu("nvmlDeviceGetTopologyCommonAncestor", device1)
        b = self._gpu("nvmlDeviceGetTopologyCommonAncestor", device2)
        level = self.topology.get(frozenset((a.index, b.index)))
        if level is not None:
            return level
        if a.numa_node == b.numa_node:
            return int(pynvml.NVML_TOPOLOGY_NODE)
        return int(pynvml.NVML_TOPOLOGY_SYSTEM)

    def nvmlDeviceGetFieldValues(self, handle: Any, fieldIds: list[int]) -> Any:
        """Answers NVML_FI_DEV_GET_GPU_RECOVERY_ACTION; other fields report NOT_SUPPORTED."""
        gpu = self._gpu("nvmlDeviceGetFieldValues", handle)
        values = (pynvml.c_nvmlFieldValue_t * len(fieldIds))()
        for value, field_id in zip(values, fieldIds, strict=True):
            value.fieldId = field_id
            if field_id == pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION:
                value.nvmlReturn = pynvml.NVML_SUCCESS
                value.valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
                value.value.uiVal = gpu.recovery_action
            else:
                value.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
        return values

    def nvmlDeviceGetRemappedRows(self, device: Any) -> tuple[int, int, int, int]:
        gpu = self._gpu("nvmlDeviceGetRemappedRows", device)
        return (0, 0, int(gpu.rows_pending), 0)

    def nvmlDeviceGetRetiredPagesPendingStatus(self, device: Any) -> int:
        gpu = self._gpu("nvmlDeviceGetRetiredPagesPendingStatus", device)
        return int(pynvml.NVML_FEATURE_ENABLED if gpu.pages_pending else 0)

    def _running(self, function: str, handle: Any, kind: str) -> list[ProcessInfo]:
        """As NVML: a MIG handle lists its own processes, a GPU handle also its MIGs'."""
        self._check(function, handle)
        found: list[tuple[FakeProcess, FakeMig | None]]
        if isinstance(handle, FakeMig):
            found = [(p, handle) for p in handle.processes]
        elif isinstance(handle, FakeGpu):
            found = [(p, None) for p in handle.processes]
            found += [(p, m) for m in handle.migs for p in m.processes]
        else:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return [
            ProcessInfo(
                pid=p.pid,
                usedGpuMemory=None if p.used_mib is None else p.used_mib * _MIB,
                gpuInstanceId=_NO_ID if m is None else m.gi_id,
                computeInstanceId=_NO_ID if m is None else m.ci_id,
            )
            for p, m in found
            if kind in p.kind.split("+")
        ]

    def nvmlDeviceGetComputeRunningProcesses(self, handle: Any) -> list[ProcessInfo]:
        return self._running("nvmlDeviceGetComputeRunningProcesses", handle, "compute")

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: Any) -> list[ProcessInfo]:
        return self._running("nvmlDeviceGetGraphicsRunningProcesses", handle, "graphics")

    def nvmlDeviceGetMPSComputeRunningProcesses(self, handle: Any) -> list[ProcessInfo]:
        return self._running("nvmlDeviceGetMPSComputeRunningProcesses", handle, "mps")

    def _samples(self, function: str, handle: Any, since: int) -> list[FakeProcess]:
        """Processes with a sample newer than `since`: NOT_SUPPORTED on MIG, NOT_FOUND if none."""
        self._check(function, handle)
        if isinstance(handle, FakeMig) or (
            isinstance(handle, FakeGpu)
            and handle.mig_mode is not None
            and handle.mig_mode[0] == pynvml.NVML_DEVICE_MIG_ENABLE
        ):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        gpu = self._gpu(function, handle)
        found = [p for p in gpu.processes if (p.sm_util or p.mem_util) and p.sample_us > int(since)]
        if not found:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
        return found

    def nvmlDeviceGetProcessUtilization(
        self, handle: Any, timeStamp: int
    ) -> list[ProcessUtilizationSample]:
        found = self._samples("nvmlDeviceGetProcessUtilization", handle, timeStamp)
        return [ProcessUtilizationSample(p.pid, p.sample_us, p.sm_util, p.mem_util) for p in found]

    def nvmlDeviceGetProcessesUtilizationInfo(
        self, handle: Any, timeStamp: int
    ) -> list[ProcessUtilizationInfo]:
        found = self._samples("nvmlDeviceGetProcessesUtilizationInfo", handle, timeStamp)
        return [ProcessUtilizationInfo(p.sample_us, p.pid, p.sm_util, p.mem_util) for p in found]

    def nvmlEventSetCreate(self) -> _FakeEventSet:
        self._check("nvmlEventSetCreate")
        event_set = _FakeEventSet()
        with self._cond:
            self._event_sets.append(event_set)
        return event_set

    def nvmlDeviceGetSupportedEventTypes(self, handle: Any) -> int:
        return self._gpu("nvmlDeviceGetSupportedEventTypes", handle).supported_events

    def nvmlDeviceRegisterEvents(self, handle: Any, eventTypes: int, eventSet: Any) -> None:
        gpu = self._gpu("nvmlDeviceRegisterEvents", handle)
        if not eventTypes & gpu.supported_events or eventTypes & ~gpu.supported_events:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        with self._cond:
            eventSet.registered[gpu] = eventSet.registered.get(gpu, 0) | eventTypes
            self._cond.notify_all()

    def nvmlEventSetWait_v2(self, eventSet: Any, timeoutms: int) -> EventData:
        self._check("nvmlEventSetWait_v2")
        with self._cond:
            self._cond.wait_for(
                lambda: bool(eventSet.queue or self._wait_errors or eventSet.freed),
                timeoutms / 1000,
            )
            if eventSet.freed:
                # The driver went away under the wait (see unload_driver).
                raise pynvml.NVMLError(
                    pynvml.NVML_ERROR_DRIVER_NOT_LOADED
                    if not self.driver_loaded
                    else pynvml.NVML_ERROR_UNINITIALIZED
                )
            if self._wait_errors:
                raise pynvml.NVMLError(self._wait_errors.popleft())
            if eventSet.queue:
                event: EventData = eventSet.queue.popleft()
                return event
        raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)

    def nvmlEventSetWait(self, eventSet: Any, timeoutms: int) -> EventData:
        return self.nvmlEventSetWait_v2(eventSet, timeoutms)

    def nvmlEventSetFree(self, eventSet: Any) -> None:
        with self._cond:
            eventSet.freed = True
            if eventSet in self._event_sets:
                self._event_sets.remove(eventSet)


class FakePodResources(podresources_pb2_grpc.PodResourcesListerServicer):
    """The kubelet's PodResources `List` on a unix socket, answering what a test declares.

        with FakePodResources(tmp_path / "kubelet.sock") as kubelet:
            kubelet.add("ml", "train-0", "main", "nvidia.com/gpu", ["GPU-..."])
            kubelet.add_claim("ml", "infer-0", "main", "gpu-claim", "gpu.nvidia.com",
                              "node-a", "gpu-3")

    `fail` makes `List` answer with that gRPC status code until cleared (None).
    """

    def __init__(self, socket: Path) -> None:
        self.socket = socket
        self.pods: dict[tuple[str, str], podresources_pb2.PodResources] = {}
        self.fail: grpc.StatusCode | None = None
        self.calls = 0
        self._lock = threading.Lock()
        self._server = grpc.server(ThreadPoolExecutor(2))
        add_pod_resources_servicer(self, self._server)
        self._server.add_insecure_port(f"unix://{socket}")

    def _container(
        self, namespace: str, pod: str, container: str
    ) -> podresources_pb2.ContainerResources:
        entry = self.pods.setdefault(
            (namespace, pod), podresources_pb2.PodResources(name=pod, namespace=namespace)
        )
        for existing in entry.containers:
            if existing.name == container:
                return existing
        added: podresources_pb2.ContainerResources = entry.containers.add(name=container)
        return added

    def add(
        self, namespace: str, pod: str, container: str, resource: str, device_ids: list[str]
    ) -> None:
        """A container holding device plugin devices of `resource`."""
        with self._lock:
            held = self._container(namespace, pod, container)
            held.devices.add(resource_name=resource, device_ids=device_ids)

    def add_claim(
        self,
        namespace: str,
        pod: str,
        container: str,
        claim: str,
        driver: str,
        pool: str,
        device: str,
    ) -> None:
        """A container using one device of a DRA claim (in the pod's namespace)."""
        with self._lock:
            used = self._container(namespace, pod, container).dynamic_resources.add(
                claim_name=claim, claim_namespace=namespace
            )
            used.claim_resources.add(driver_name=driver, pool_name=pool, device_name=device)

    def remove_pod(self, namespace: str, pod: str) -> None:
        with self._lock:
            self.pods.pop((namespace, pod), None)

    def List(
        self, request: podresources_pb2.ListPodResourcesRequest, context: grpc.ServicerContext
    ) -> podresources_pb2.ListPodResourcesResponse:
        with self._lock:
            self.calls += 1
            if self.fail is not None:
                context.abort(self.fail, "injected failure")
            return podresources_pb2.ListPodResourcesResponse(pod_resources=list(self.pods.values()))

    def __enter__(self) -> FakePodResources:
        self._server.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._server.stop(None)


from kubegpu.devices.simulated import SimulatedBackend  # noqa: E402 - re-export
from kubegpu.kubelet import KubeletEmulator  # noqa: E402 - re-export

__all__ = [
    "DEFAULT_EVENTS",
    "ComputeInstanceInfo",
    "DeviceAttributes",
    "EventData",
    "FakeGpu",
    "FakeMig",
    "FakeNvml",
    "FakePodResources",
    "FakeProcess",
    "GpuInstanceInfo",
    "KubeletEmulator",
    "Memory",
    "PciInfo",
    "ProcessInfo",
    "ProcessUtilizationInfo",
    "ProcessUtilizationSample",
    "ProfileInfo",
    "SimulatedBackend",
]
