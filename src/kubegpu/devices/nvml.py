"""NVIDIA GPUs through NVML (nvidia-ml-py, imported as `pynvml`).

This module is the only place that calls NVML and the only place `pynvml.NVMLError` is
seen: `open` and `discover` raise `InitError`/`DeviceError`, `probe` returns the failure
text and `watch` turns failures into health events. One GPU misbehaving never takes down
discovery of the others: optional fields fall back to defaults, a GPU whose essential
fields fail is reported `Unhealthy`, and a GPU without a readable UUID is skipped.

The `nvml` module is injectable (`kubegpu.testing.FakeNvml`), as are the roots of /dev and
/sys, so everything here runs in unit tests without a GPU.
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import logging
import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

from kubegpu.devices.model import (
    Gpu,
    Health,
    HealthEvent,
    HealthEventKind,
    Inventory,
    Link,
    LinkKind,
    MigDevice,
    StopFlag,
)
from kubegpu.errors import InitError

log = logging.getLogger("kubegpu.devices.nvml")

T = TypeVar("T")

LIBRARY = "libnvidia-ml.so.1"
#: Where distributions and the GPU operator's driver container put NVML, relative to a root.
LIBRARY_DIRS = (
    "usr/lib64",
    "usr/lib/x86_64-linux-gnu",
    "usr/lib/aarch64-linux-gnu",
    "usr/lib",
    "lib64",
    "lib/x86_64-linux-gnu",
    "lib/aarch64-linux-gnu",
    "lib",
)
#: NVIDIA's list and order (internal/rm/nvml_manager.go); each kept only where it exists.
CONTROL_DEVICES = (
    "/dev/nvidiactl",
    "/dev/nvidia-uvm",
    "/dev/nvidia-uvm-tools",
    "/dev/nvidia-modeset",
)
#: Xid the driver logs for an uncorrectable (double-bit) ECC error.
XID_DOUBLE_BIT_ECC = 48
_NO_ID = 0xFFFFFFFF
_MIB = 1024 * 1024
_MAX_BACKOFF_S = 30.0

# GPU-instance profile *indices* (`NVML_GPU_INSTANCE_PROFILE_*`, the argument of
# nvmlDeviceGetGpuInstanceProfileInfo) -> (GPU slices, name suffix), as NVIDIA's go-nvlib
# names them (pkg/nvlib/device/mig_profile.go). The driver reports a GPU instance's profile
# by *ID* (19 for 1g on A100/H100, 15 for 1g with two memory slices, ...), which is found by
# asking each index for its ID. Names are looked up on the module so older pynvml releases
# without some of them still work.
_GI_PROFILES = {
    "NVML_GPU_INSTANCE_PROFILE_1_SLICE": (1, ""),
    "NVML_GPU_INSTANCE_PROFILE_2_SLICE": (2, ""),
    "NVML_GPU_INSTANCE_PROFILE_3_SLICE": (3, ""),
    "NVML_GPU_INSTANCE_PROFILE_4_SLICE": (4, ""),
    "NVML_GPU_INSTANCE_PROFILE_6_SLICE": (6, ""),
    "NVML_GPU_INSTANCE_PROFILE_7_SLICE": (7, ""),
    "NVML_GPU_INSTANCE_PROFILE_8_SLICE": (8, ""),
    "NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1": (1, "+me"),
    "NVML_GPU_INSTANCE_PROFILE_2_SLICE_REV1": (2, "+me"),
    "NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2": (1, ""),
    "NVML_GPU_INSTANCE_PROFILE_1_SLICE_GFX": (1, "+gfx"),
    "NVML_GPU_INSTANCE_PROFILE_2_SLICE_GFX": (2, "+gfx"),
    "NVML_GPU_INSTANCE_PROFILE_3_SLICE_GFX": (3, "+gfx"),
    "NVML_GPU_INSTANCE_PROFILE_4_SLICE_GFX": (4, "+gfx"),
    "NVML_GPU_INSTANCE_PROFILE_1_SLICE_NO_ME": (1, "-me"),
    "NVML_GPU_INSTANCE_PROFILE_2_SLICE_NO_ME": (2, "-me"),
    "NVML_GPU_INSTANCE_PROFILE_1_SLICE_ALL_ME": (1, "+me.all"),
    "NVML_GPU_INSTANCE_PROFILE_2_SLICE_ALL_ME": (2, "+me.all"),
}
# Compute-instance profile indices -> compute slices (same scheme, go-nvlib's switch).
_CI_PROFILES = {
    "NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE": 1,
    "NVML_COMPUTE_INSTANCE_PROFILE_2_SLICE": 2,
    "NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE": 3,
    "NVML_COMPUTE_INSTANCE_PROFILE_4_SLICE": 4,
    "NVML_COMPUTE_INSTANCE_PROFILE_6_SLICE": 6,
    "NVML_COMPUTE_INSTANCE_PROFILE_7_SLICE": 7,
    "NVML_COMPUTE_INSTANCE_PROFILE_8_SLICE": 8,
    "NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE_REV1": 1,
    "NVML_COMPUTE_INSTANCE_PROFILE_7_SLICE_NVL": 7,
}
_BRANDS = {
    "NVML_BRAND_QUADRO": "Quadro",
    "NVML_BRAND_TESLA": "Tesla",
    "NVML_BRAND_NVS": "NVS",
    "NVML_BRAND_GRID": "GRID",
    "NVML_BRAND_GEFORCE": "GeForce",
    "NVML_BRAND_TITAN": "Titan",
    "NVML_BRAND_QUADRO_RTX": "Quadro RTX",
    "NVML_BRAND_NVIDIA_RTX": "NVIDIA RTX",
    "NVML_BRAND_NVIDIA": "NVIDIA",
    "NVML_BRAND_GEFORCE_RTX": "GeForce RTX",
    "NVML_BRAND_TITAN_RTX": "Titan RTX",
}
_TOPOLOGY = {
    "NVML_TOPOLOGY_INTERNAL": LinkKind.SINGLE_SWITCH,
    "NVML_TOPOLOGY_SINGLE": LinkKind.SINGLE_SWITCH,
    "NVML_TOPOLOGY_MULTIPLE": LinkKind.MULTI_SWITCH,
    "NVML_TOPOLOGY_HOSTBRIDGE": LinkKind.HOST_BRIDGE,
    "NVML_TOPOLOGY_NODE": LinkKind.SAME_NUMA,
    "NVML_TOPOLOGY_SYSTEM": LinkKind.CROSS_NUMA,
}


def _nvlink_version(reported: int, compute_capability: tuple[int, int]) -> int:
    """The NVLink generation (1..5) from NVML's answer, else from the architecture."""
    if 1 <= reported <= 5:
        return reported
    return {6: 1, 7: 2, 8: 3, 9: 4, 10: 5}.get(compute_capability[0], 0)


def _switched_lanes(mine: collections.Counter[str], theirs: collections.Counter[str]) -> int:
    """NVLink lanes two GPUs can use through the NVSwitches both reach: the fewer of the
    two sides' links into those switches. Unnamed switches ("") are assumed shared only
    when neither GPU names any switch (one NVSwitch domain, as on one HGX board)."""
    if not mine or not theirs:
        return 0
    named = (set(mine) | set(theirs)) - {""}
    if not named:
        return min(mine[""], theirs[""])
    shared = (set(mine) & set(theirs)) - {""}
    return min(sum(mine[s] for s in shared), sum(theirs[s] for s in shared))


def find_library(driver_root: str) -> Path | None:
    """The first `libnvidia-ml.so.1` under the usual library directories of `driver_root`."""
    for directory in LIBRARY_DIRS:
        candidate = Path(driver_root, directory, LIBRARY)
        if candidate.exists():
            return candidate
    return None


def normalize_bus_id(raw: bytes | str) -> str:
    """NVML's `00000000:17:00.0` (bytes or str) -> the kernel's `0000:17:00.0`."""
    text = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
    text = text.strip("\x00 ").lower()
    parts = text.split(":")
    if len(parts) != 3:
        return text
    try:
        domain = int(parts[0], 16)
    except ValueError:
        return text
    return f"{domain:04x}:{parts[1]}:{parts[2]}"


def cuda_version(value: int) -> tuple[int, int]:
    """NVML's integer CUDA version (12040) -> (12, 4)."""
    return (value // 1000, (value % 1000) // 10)


def mig_profile_name(
    gi_slices: int, ci_slices: int, memory_mib: int, total_mib: int, suffix: str = ""
) -> str:
    """The canonical MIG profile name (`1g.10gb`, `1c.3g.40gb`, `1g.10gb+me`).

    Slices report a little less memory than their name says, so the size is the slice's
    share of the whole GPU rounded up to eighths, times the GPU's memory in whole GB
    rounded up, rounded half away from zero: go-nvlib's getMigMemorySizeGB.
    """
    if total_mib > 0:
        eighths = math.ceil(memory_mib / total_mib * 8 - 1e-9) / 8
        memory_gb = math.floor(eighths * math.ceil(total_mib / 1024) + 0.5)
    else:
        memory_gb = math.floor(memory_mib / 1024 + 0.5)
    name = f"{gi_slices}g.{memory_gb}gb{suffix}"
    if 0 < ci_slices < gi_slices:
        name = f"{ci_slices}c.{name}"
    return name


def _missing_library(driver_root: str) -> str:
    # Env names, not flags: every command (serve, labels, info, check, cdi) reads these.
    return (
        f"NVML library {LIBRARY} not found under {driver_root}: install the NVIDIA driver, "
        "or give its root (NVIDIA_DRIVER_ROOT on the host, CONTAINER_DRIVER_ROOT where a "
        "container mounts it)"
    )


def _init_message(nvml: ModuleType, err: Any, driver_root: str) -> str:
    """What to tell the operator when nvmlInit fails, by error code."""
    code = getattr(err, "value", None)
    if code == nvml.NVML_ERROR_LIBRARY_NOT_FOUND:
        return _missing_library(driver_root)
    if code == nvml.NVML_ERROR_DRIVER_NOT_LOADED:
        return "NVIDIA kernel driver is not loaded: load it (modprobe nvidia) or run on a GPU node"
    if code == nvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH:
        return (
            "NVML library and NVIDIA kernel driver versions differ: "
            "reboot the node or reinstall the driver"
        )
    if code == nvml.NVML_ERROR_NO_PERMISSION:
        return (
            "no permission to use NVML: run the plugin privileged or give it access to /dev/nvidia*"
        )
    return f"nvmlInit failed ({err}): check that nvidia-smi works on the node"


class NvmlBackend:
    """NVIDIA GPUs, MIG slices, NVLink/PCIe topology and Xid health events via NVML."""

    name = "nvml"

    def __init__(
        self,
        nvml: ModuleType,
        *,
        dev_root: str = "/",
        host_root: str = "/",
        exists: Callable[[str], bool] | None = None,
        wait_timeout_ms: int = 1000,
        layout_check_seconds: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._nvml = nvml
        self._error: Any = nvml.NVMLError
        self._dev_root = dev_root
        #: Where /sys and /proc of the host are mounted (NUMA fallback, MIG capabilities).
        self._host_root = host_root
        self._exists = exists or (lambda path: Path(dev_root, path.lstrip("/")).exists())
        self._wait_timeout_ms = wait_timeout_ms
        self._layout_check_seconds = layout_check_seconds
        self._clock = clock
        #: (GPU UUID, GI id, CI id) -> MIG UUID, refreshed by discover and layout checks.
        self._mig_uuids: dict[tuple[str, int, int], str] = {}
        self._closed = False

    @classmethod
    def open(
        cls,
        driver_root: str = "/",
        nvml: ModuleType | None = None,
        *,
        dev_root: str | None = None,
        host_root: str = "/",
        load_library: Callable[[str], object] = ctypes.CDLL,
        exists: Callable[[str], bool] | None = None,
        wait_timeout_ms: int = 1000,
        layout_check_seconds: float = 10.0,
    ) -> NvmlBackend:
        """Initialise NVML; raise `InitError` saying what is missing when it cannot start.

        With a driver root other than `/` the library is loaded from that tree (the GPU
        operator's driver container) rather than from the loader's search path.
        """
        if nvml is None:
            import pynvml

            nvml = pynvml
        module: Any = nvml  # pynvml keeps the loaded library in a module global
        if driver_root not in ("", "/"):
            library = find_library(driver_root)
            if library is None:
                raise InitError(_missing_library(driver_root))
            if getattr(nvml, "nvmlLib", None) is None:
                try:
                    module.nvmlLib = load_library(str(library))
                except OSError as err:
                    raise InitError(
                        f"cannot load {library} ({err}): check the driver under {driver_root}"
                    ) from err
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as err:
            raise InitError(_init_message(nvml, err, driver_root or "/")) from err
        backend = cls(
            nvml,
            dev_root=dev_root or driver_root or "/",
            host_root=host_root,
            exists=exists,
            wait_timeout_ms=wait_timeout_ms,
            layout_check_seconds=layout_check_seconds,
        )
        try:
            count = int(nvml.nvmlDeviceGetCount())
        except nvml.NVMLError as err:
            backend.close()
            raise InitError(f"NVML cannot count GPUs ({err}): check that nvidia-smi works") from err
        if count == 0:
            backend.close()
            raise InitError("NVML found no GPUs: check `nvidia-smi -L` on the node and the driver")
        return backend

    # -- discovery ------------------------------------------------------------------

    def discover(self) -> Inventory:
        nvml = self._nvml
        try:
            count = int(nvml.nvmlDeviceGetCount())
        except self._error as err:
            raise InitError(f"NVML cannot count GPUs ({err}): check that nvidia-smi works") from err
        found: list[tuple[Any, Gpu]] = []
        for index in range(count):
            entry = self._read_gpu(index)
            if entry is not None:
                found.append(entry)
        links = self._links(found)
        gpus = tuple(dataclasses.replace(gpu, links=links.get(gpu.uuid, ())) for _, gpu in found)
        return Inventory(
            gpus=gpus,
            driver_version=str(self._optional(nvml.nvmlSystemGetDriverVersion, default="")),
            cuda_driver_version=cuda_version(
                int(self._optional(nvml.nvmlSystemGetCudaDriverVersion, default=0))
            ),
            control_device_paths=tuple(p for p in CONTROL_DEVICES if self._exists(p)),
            backend=self.name,
        )

    def _optional(self, fn: Callable[..., T], *args: Any, default: T) -> T:
        """Call an NVML function whose failure only costs an optional field."""
        try:
            return fn(*args)
        except self._error as err:
            log.debug("%s%r failed: %s", getattr(fn, "__name__", fn), args[1:], err)
            return default

    def _handle_and_uuid(self, index: int) -> tuple[Any, str] | None:
        try:
            handle = self._nvml.nvmlDeviceGetHandleByIndex(index)
            return handle, str(self._nvml.nvmlDeviceGetUUID(handle))
        except self._error as err:
            log.warning("skipping GPU %d: cannot read its UUID (%s)", index, err)
            return None

    def _read_gpu(self, index: int) -> tuple[Any, Gpu] | None:
        nvml = self._nvml
        found = self._handle_and_uuid(index)
        if found is None:
            return None
        handle, uuid = found
        problems: list[str] = []

        def essential(label: str, fn: Callable[[Any], T], default: T) -> T:
            try:
                return fn(handle)
            except self._error as err:
                problems.append(f"{label}: {err}")
                return default

        product = str(essential("name", nvml.nvmlDeviceGetName, ""))
        memory_mib = essential(
            "memory", lambda h: int(nvml.nvmlDeviceGetMemoryInfo(h).total) // _MIB, 0
        )
        minor = int(essential("minor number", nvml.nvmlDeviceGetMinorNumber, index))
        bus_id = essential(
            "PCI info", lambda h: normalize_bus_id(nvml.nvmlDeviceGetPciInfo(h).busId), ""
        )
        major_minor = self._optional(
            nvml.nvmlDeviceGetCudaComputeCapability, handle, default=(0, 0)
        )
        brand_code = self._optional(nvml.nvmlDeviceGetBrand, handle, default=None)
        brand = next(
            (
                label
                for const, label in _BRANDS.items()
                if getattr(nvml, const, object()) == brand_code
            ),
            "",
        )
        mig_mode = self._optional(nvml.nvmlDeviceGetMigMode, handle, default=None)
        mig_enabled = mig_mode is not None and mig_mode[0] == nvml.NVML_DEVICE_MIG_ENABLE
        migs = self._read_migs(handle, uuid, index, minor, memory_mib) if mig_enabled else ()
        if problems:
            log.warning("GPU %s (index %d) is unhealthy: %s", uuid, index, "; ".join(problems))
        gpu = Gpu(
            index=index,
            uuid=uuid,
            minor=minor,
            product=product,
            memory_mib=memory_mib,
            pci_bus_id=bus_id,
            numa_node=self._numa_node(handle, bus_id),
            compute_capability=(int(major_minor[0]), int(major_minor[1])),
            device_paths=(f"/dev/nvidia{minor}",),
            mig_enabled=mig_enabled,
            mig_capable=mig_mode is not None,
            mig_devices=migs,
            brand=brand,
            health=Health.UNHEALTHY if problems else Health.HEALTHY,
        )
        return handle, gpu

    def _numa_node(self, handle: Any, bus_id: str) -> int | None:
        """NVML's NUMA node when it knows one, else the kernel's for the PCI device."""
        getter = getattr(self._nvml, "nvmlDeviceGetNumaNodeId", None)
        if getter is not None:
            node = self._optional(getter, handle, default=None)
            if node is not None:
                return None if int(node) < 0 else int(node)
        if not bus_id:
            return None
        path = Path(self._host_root, "sys/bus/pci/devices", bus_id, "numa_node")
        try:
            node = int(path.read_text().strip())
        except (OSError, ValueError):
            return None
        return None if node < 0 else node

    def _iter_mig_handles(self, handle: Any, gpu_uuid: str) -> Iterator[tuple[int, Any]]:
        """(MIG device index, handle) for each populated slot of a GPU."""
        count = int(self._optional(self._nvml.nvmlDeviceGetMaxMigDeviceCount, handle, default=0))
        for slot in range(count):
            try:
                yield slot, self._nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
            except self._error as err:
                if err.value not in (
                    self._nvml.NVML_ERROR_NOT_FOUND,
                    self._nvml.NVML_ERROR_INVALID_ARGUMENT,
                ):
                    log.warning("GPU %s: cannot read MIG device %d (%s)", gpu_uuid, slot, err)

    def _read_migs(
        self, handle: Any, gpu_uuid: str, index: int, minor: int, total_mib: int
    ) -> tuple[MigDevice, ...]:
        nvml = self._nvml
        migs = []
        # Profile ID -> shape tables, read once per GPU (and per GPU instance for compute
        # profiles) rather than once per slice: up to 18 NVML calls each.
        tables: dict[int | None, dict[int, Any]] = {}
        for slot, mig_handle in self._iter_mig_handles(handle, gpu_uuid):
            try:
                uuid = str(nvml.nvmlDeviceGetUUID(mig_handle))
                gi_id = int(nvml.nvmlDeviceGetGpuInstanceId(mig_handle))
                ci_id = int(nvml.nvmlDeviceGetComputeInstanceId(mig_handle))
                attrs = nvml.nvmlDeviceGetAttributes(mig_handle)
            except self._error as err:
                log.warning(
                    "GPU %s: skipping a MIG device whose identity cannot be read (%s)",
                    gpu_uuid,
                    err,
                )
                continue
            memory_mib = int(attrs.memorySizeMB)
            self._mig_uuids[(gpu_uuid, gi_id, ci_id)] = uuid
            gi_slices, ci_slices, suffix = self._profile_shape(handle, gi_id, ci_id, attrs, tables)
            profile = mig_profile_name(gi_slices, ci_slices, memory_mib, total_mib, suffix)
            migs.append(
                MigDevice(
                    uuid=uuid,
                    parent_uuid=gpu_uuid,
                    parent_index=index,
                    mig_index=slot,
                    gi_id=gi_id,
                    ci_id=ci_id,
                    profile=profile,
                    memory_mib=memory_mib,
                    multiprocessors=int(attrs.multiprocessorCount),
                    device_paths=self._mig_caps(minor, gi_id, ci_id),
                    # Keys are the suffixes of NVIDIA's GFD labels (nvidia.com/mig-<p>.<key>).
                    attributes={
                        "multiprocessors": int(attrs.multiprocessorCount),
                        "slices.gi": int(attrs.gpuInstanceSliceCount),
                        "slices.ci": int(attrs.computeInstanceSliceCount),
                        "engines.copy": int(attrs.sharedCopyEngineCount),
                        "engines.decoder": int(attrs.sharedDecoderCount),
                        "engines.encoder": int(attrs.sharedEncoderCount),
                        "engines.jpeg": int(attrs.sharedJpegCount),
                        "engines.ofa": int(attrs.sharedOfaCount),
                    },
                )
            )
        return tuple(sorted(migs, key=lambda m: (m.gi_id, m.ci_id)))

    def _profile_shape(
        self,
        handle: Any,
        gi_id: int,
        ci_id: int,
        attrs: Any,
        tables: dict[int | None, dict[int, Any]],
    ) -> tuple[int, int, str]:
        """(GPU slices, compute slices, suffix) of a slice, from its profile IDs.

        As go-nvlib does: the GPU instance reports a profile *ID*; the profile *index*
        (`NVML_GPU_INSTANCE_PROFILE_*`) whose info carries that ID gives the slices and the
        `+me`/`-me`/`+me.all`/`+gfx` attribute, and likewise for the compute instance.
        When the instance or its profiles cannot be read, the slice counts of the device
        attributes stand, without a suffix.
        """
        nvml = self._nvml
        gi_slices = int(attrs.gpuInstanceSliceCount)
        ci_slices = int(attrs.computeInstanceSliceCount)
        try:
            instance = nvml.nvmlDeviceGetGpuInstanceById(handle, gi_id)
            gi_profile_id = int(nvml.nvmlGpuInstanceGetInfo(instance).profileId)
        except (self._error, AttributeError) as err:
            log.debug("GPU instance %d: profile unreadable (%s)", gi_id, err)
            return gi_slices, ci_slices, ""
        if None not in tables:
            tables[None] = self._profile_ids(
                _GI_PROFILES, lambda i: nvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, i)
            )
        gi_shape: tuple[int, str] | None = tables[None].get(gi_profile_id)
        if gi_shape is None:
            log.warning(
                "GPU instance %d: profile ID %d matches no known GPU-instance profile; "
                "naming it from its slice counts",
                gi_id,
                gi_profile_id,
            )
            return gi_slices, ci_slices, ""
        gi_slices, suffix = gi_shape
        try:
            compute = nvml.nvmlGpuInstanceGetComputeInstanceById(instance, ci_id)
            ci_profile_id = int(nvml.nvmlComputeInstanceGetInfo(compute).profileId)
        except (self._error, AttributeError) as err:
            log.debug("compute instance %d/%d: profile unreadable (%s)", gi_id, ci_id, err)
            return gi_slices, ci_slices, suffix
        shared = int(getattr(nvml, "NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED", 0))
        if gi_id not in tables:
            tables[gi_id] = self._profile_ids(
                _CI_PROFILES,
                lambda i: nvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(instance, i, shared),
            )
        ci_found: int | None = tables[gi_id].get(ci_profile_id)
        return gi_slices, ci_slices if ci_found is None else ci_found, suffix

    def _profile_ids(self, table: dict[str, T], info: Callable[[int], Any]) -> dict[int, T]:
        """Profile ID -> the table entry of the profile index whose info reports that ID.

        Indices are asked in ascending order and the first match wins, as go-nvlib does.
        """
        indexed = sorted(
            (int(index), shape)
            for const, shape in table.items()
            if (index := getattr(self._nvml, const, None)) is not None
        )
        ids: dict[int, T] = {}
        for index, shape in indexed:
            try:
                found = int(info(index).id)
            except self._error as err:
                # Profiles this GPU does not offer answer NOT_SUPPORTED / INVALID_ARGUMENT.
                log.debug("profile index %d: %s", index, err)
                continue
            ids.setdefault(found, shape)
        return ids

    def _mig_caps(self, minor: int, gi_id: int, ci_id: int) -> tuple[str, ...]:
        """The /dev/nvidia-caps nodes granting a slice, from the driver's /proc capability files."""
        base = Path(self._host_root, f"proc/driver/nvidia/capabilities/gpu{minor}/mig/gi{gi_id}")
        paths = []
        for access in (base / "access", base / f"ci{ci_id}" / "access"):
            try:
                text = access.read_text()
            except OSError:
                continue
            for line in text.splitlines():
                key, _, value = line.partition(":")
                if key.strip() == "DeviceFileMinor" and value.strip().isdigit():
                    paths.append(f"/dev/nvidia-caps/nvidia-cap{int(value)}")
        return tuple(paths)

    def _links(self, found: list[tuple[Any, Gpu]]) -> dict[str, tuple[Link, ...]]:
        """NVLink lanes per peer (direct, or through the NVSwitches both reach), else the
        PCIe relation.

        Each active link's remote says where it goes: a GPU (a direct lane to it) or an
        NVSwitch, named by its PCI bus ID. Two GPUs talk over switches only through switches
        they both reach (two NVSwitch boards in one node share none), and only when NVML's
        NVLink P2P status does not say otherwise and their fabric cliques (where reported)
        match. Links that are down count for nothing.
        """
        nvml = self._nvml
        by_bus = {gpu.pci_bus_id: gpu.uuid for _, gpu in found if gpu.pci_bus_id}
        direct: dict[str, collections.Counter[str]] = {}
        switches: dict[str, collections.Counter[str]] = {}
        version: dict[str, int] = {}
        switch_type = getattr(nvml, "NVML_NVLINK_DEVICE_TYPE_SWITCH", object())
        for handle, gpu in found:
            peers: collections.Counter[str] = collections.Counter()
            via: collections.Counter[str] = collections.Counter()
            for link in range(int(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18))):
                try:
                    active = (
                        nvml.nvmlDeviceGetNvLinkState(handle, link) == nvml.NVML_FEATURE_ENABLED
                    )
                except self._error as err:
                    # No NVLink at all, or past the last link: stop asking.
                    if link == 0 or err.value == nvml.NVML_ERROR_INVALID_ARGUMENT:
                        break
                    continue
                if not active:
                    continue
                if gpu.uuid not in version:
                    get_version = getattr(nvml, "nvmlDeviceGetNvLinkVersion", None)
                    reported = (
                        self._optional(get_version, handle, link, default=0) if get_version else 0
                    )
                    version[gpu.uuid] = _nvlink_version(reported, gpu.compute_capability)
                kind = self._optional(
                    nvml.nvmlDeviceGetNvLinkRemoteDeviceType, handle, link, default=None
                )
                remote = self._optional(
                    nvml.nvmlDeviceGetNvLinkRemotePciInfo, handle, link, default=None
                )
                remote_bus = normalize_bus_id(remote.busId) if remote else ""
                if kind == switch_type:
                    via[remote_bus] += 1  # "" when the switch cannot be named
                    continue
                peer_uuid = by_bus.get(remote_bus)
                if peer_uuid is not None and peer_uuid != gpu.uuid:
                    peers[peer_uuid] += 1
            direct[gpu.uuid] = peers
            switches[gpu.uuid] = via
        cliques = {gpu.uuid: self._clique(handle) for handle, gpu in found}
        levels = {getattr(nvml, const, None): kind for const, kind in _TOPOLOGY.items()}
        links: dict[str, tuple[Link, ...]] = {}
        for handle, gpu in found:
            own = []
            for peer_handle, peer in found:
                if peer.uuid == gpu.uuid:
                    continue
                lanes = direct[gpu.uuid][peer.uuid]
                switched = _switched_lanes(switches[gpu.uuid], switches[peer.uuid])
                if switched and self._nvlink_p2p(handle, peer_handle, cliques, gpu, peer):
                    lanes += switched
                if lanes:
                    v = min(version.get(gpu.uuid, 0), version.get(peer.uuid, 0)) or max(
                        version.get(gpu.uuid, 0), version.get(peer.uuid, 0)
                    )
                    own.append(Link(peer.uuid, LinkKind.NVLINK, lanes, nvlink_version=v))
                    continue
                level = self._optional(
                    nvml.nvmlDeviceGetTopologyCommonAncestor, handle, peer_handle, default=None
                )
                if level in levels:
                    own.append(Link(peer.uuid, levels[level]))
            links[gpu.uuid] = tuple(own)
        return links

    def _clique(self, handle: Any) -> tuple[bytes, int] | None:
        """(cluster UUID, clique ID) once the GPU's fabric registration completed; None
        where NVML reports no fabric (no NVLink fabric manager, older drivers)."""
        nvml = self._nvml
        struct = getattr(nvml, "c_nvmlGpuFabricInfo_t", None)
        if struct is None or not hasattr(nvml, "nvmlDeviceGetGpuFabricInfo"):
            return None
        info = struct()
        try:
            nvml.nvmlDeviceGetGpuFabricInfo(handle, ctypes.byref(info))
        except self._error:
            return None
        if info.state != getattr(nvml, "NVML_GPU_FABRIC_STATE_COMPLETED", 3) or info.status:
            return None
        return bytes(info.clusterUuid), int(info.cliqueId)

    def _nvlink_p2p(
        self,
        handle: Any,
        peer_handle: Any,
        cliques: dict[str, tuple[bytes, int] | None],
        gpu: Gpu,
        peer: Gpu,
    ) -> bool:
        """Whether two GPUs behind NVSwitches can use NVLink with each other."""
        nvml = self._nvml
        mine, theirs = cliques.get(gpu.uuid), cliques.get(peer.uuid)
        if mine is not None and theirs is not None and mine != theirs:
            return False
        index = getattr(nvml, "NVML_P2P_CAPS_INDEX_NVLINK", None)
        if index is None or not hasattr(nvml, "nvmlDeviceGetP2PStatus"):
            return True
        status = self._optional(
            nvml.nvmlDeviceGetP2PStatus, handle, peer_handle, index, default=None
        )
        # No answer keeps the switch-based verdict; an answer other than OK overrides it.
        return status is None or status == getattr(nvml, "NVML_P2P_STATUS_OK", 0)

    # -- health -----------------------------------------------------------------------

    def probe(self, uuid: str) -> str | None:
        """A cheap NVML round trip: the handle by UUID and its memory info."""
        try:
            handle = self._nvml.nvmlDeviceGetHandleByUUID(uuid)
            self._nvml.nvmlDeviceGetMemoryInfo(handle)
        except self._error as err:
            return f"{uuid}: {err}"
        return None

    def watch(self, stop: StopFlag, emit: Callable[[HealthEvent], None]) -> None:
        """Forward Xid/ECC events until `stop` is set; report failures as events, never raise."""
        nvml = self._nvml
        event_set: Any = None
        watched: dict[str, Any] = {}
        backoff = 1.0
        layout = self._mig_layout()
        next_layout_check = self._clock() + self._layout_check_seconds
        try:
            while not stop.is_set():
                if event_set is None:
                    event_set, watched = self._register(emit, watched)
                    if event_set is None:
                        stop.wait(backoff)
                        backoff = min(backoff * 2, _MAX_BACKOFF_S)
                        continue
                try:
                    data = nvml.nvmlEventSetWait_v2(event_set, self._wait_timeout_ms)
                except self._error as err:
                    if err.value != nvml.NVML_ERROR_TIMEOUT:
                        log.warning(
                            "waiting for NVML events failed (%s); retrying in %.0fs", err, backoff
                        )
                        # Free first: a fresh set is registered after the back-off.
                        self._free(event_set)
                        event_set = None
                        for uuid in watched:
                            emit(
                                HealthEvent(
                                    uuid, HealthEventKind.PROBE_FAILED, detail=f"event wait: {err}"
                                )
                            )
                        stop.wait(backoff)
                        backoff = min(backoff * 2, _MAX_BACKOFF_S)
                else:
                    backoff = 1.0
                    self._dispatch(data, watched, emit)
                if self._clock() >= next_layout_check:
                    next_layout_check = self._clock() + self._layout_check_seconds
                    layout = self._check_layout(layout, emit)
        finally:
            if event_set is not None:
                self._free(event_set)

    def _free(self, event_set: Any) -> None:
        try:
            self._nvml.nvmlEventSetFree(event_set)
        except self._error as err:
            log.debug("nvmlEventSetFree failed: %s", err)

    def _register(
        self, emit: Callable[[HealthEvent], None], previous: dict[str, Any]
    ) -> tuple[Any, dict[str, Any]]:
        """A new event set with every GPU that supports Xid/ECC events registered."""
        nvml = self._nvml
        wanted = (
            nvml.nvmlEventTypeXidCriticalError
            | nvml.nvmlEventTypeDoubleBitEccError
            | nvml.nvmlEventTypeSingleBitEccError
        )
        try:
            event_set = nvml.nvmlEventSetCreate()
            count = int(nvml.nvmlDeviceGetCount())
        except self._error as err:
            log.warning("cannot create an NVML event set (%s)", err)
            for uuid in previous:
                emit(HealthEvent(uuid, HealthEventKind.PROBE_FAILED, detail=f"event set: {err}"))
            return None, previous
        watched: dict[str, Any] = {}
        for index in range(count):
            found = self._handle_and_uuid(index)
            if found is None:
                continue
            handle, uuid = found
            watched[uuid] = handle
            try:
                mask = wanted & int(nvml.nvmlDeviceGetSupportedEventTypes(handle))
                if not mask:
                    raise nvml.NVMLError(nvml.NVML_ERROR_NOT_SUPPORTED)
                nvml.nvmlDeviceRegisterEvents(handle, mask, event_set)
            except self._error as err:
                if err.value == nvml.NVML_ERROR_NOT_SUPPORTED:
                    log.info("GPU %s does not report Xid events; relying on probes", uuid)
                else:
                    log.warning("GPU %s: cannot register for health events (%s)", uuid, err)
                    emit(
                        HealthEvent(
                            uuid, HealthEventKind.PROBE_FAILED, detail=f"register events: {err}"
                        )
                    )
        return event_set, watched

    def _dispatch(
        self, data: Any, watched: dict[str, Any], emit: Callable[[HealthEvent], None]
    ) -> None:
        nvml = self._nvml
        event_type = int(data.eventType)
        if event_type & nvml.nvmlEventTypeXidCriticalError:
            xid = int(data.eventData)
        elif event_type & nvml.nvmlEventTypeDoubleBitEccError:
            xid = XID_DOUBLE_BIT_ECC
        else:
            # Single-bit ECC errors are corrected by the hardware: not a health problem.
            log.debug("ignoring NVML event type %#x", event_type)
            return
        uuid = None
        if data.device:
            uuid = self._optional(nvml.nvmlDeviceGetUUID, data.device, default=None)
        if uuid is None:
            # An event without a device concerns them all, as NVIDIA's plugin treats it.
            for gpu_uuid in watched:
                emit(
                    HealthEvent(
                        gpu_uuid, HealthEventKind.XID, xid=xid, detail="event without a device"
                    )
                )
            return
        gi_id, ci_id = int(data.gpuInstanceId), int(data.computeInstanceId)
        if gi_id != _NO_ID and ci_id != _NO_ID:
            key = (str(uuid), gi_id, ci_id)
            if key not in self._mig_uuids and uuid in watched:
                self._scan_migs(watched[uuid], str(uuid))
            uuid = self._mig_uuids.get(key, uuid)
        emit(HealthEvent(str(uuid), HealthEventKind.XID, xid=xid))

    def _scan_migs(self, handle: Any, gpu_uuid: str) -> frozenset[str]:
        """The MIG UUIDs of one GPU (raises NVMLError), refreshing the (gi, ci) map."""
        nvml = self._nvml
        try:
            mode = nvml.nvmlDeviceGetMigMode(handle)
        except self._error as err:
            if err.value == nvml.NVML_ERROR_NOT_SUPPORTED:
                return frozenset()
            raise
        if mode[0] != nvml.NVML_DEVICE_MIG_ENABLE:
            return frozenset()
        uuids = set()
        for _, mig_handle in self._iter_mig_handles(handle, gpu_uuid):
            uuid = str(nvml.nvmlDeviceGetUUID(mig_handle))
            gi_id = int(nvml.nvmlDeviceGetGpuInstanceId(mig_handle))
            ci_id = int(nvml.nvmlDeviceGetComputeInstanceId(mig_handle))
            self._mig_uuids[(gpu_uuid, gi_id, ci_id)] = uuid
            uuids.add(uuid)
        return frozenset(uuids)

    def _mig_layout(self) -> dict[str, frozenset[str] | None]:
        """GPU UUID -> its MIG UUIDs (None when unreadable this time)."""
        try:
            count = int(self._nvml.nvmlDeviceGetCount())
        except self._error:
            return {}
        layout: dict[str, frozenset[str] | None] = {}
        for index in range(count):
            found = self._handle_and_uuid(index)
            if found is None:
                continue
            handle, uuid = found
            try:
                layout[uuid] = self._scan_migs(handle, uuid)
            except self._error as err:
                log.debug("GPU %s: MIG layout unreadable (%s)", uuid, err)
                layout[uuid] = None
        return layout

    def _check_layout(
        self, old: dict[str, frozenset[str] | None], emit: Callable[[HealthEvent], None]
    ) -> dict[str, frozenset[str] | None]:
        new = self._mig_layout()
        absent = object()
        for uuid in sorted(old.keys() | new.keys()):
            if uuid in new and new[uuid] is None:
                # Unreadable now: not evidence of a change; keep the last known layout.
                if uuid in old:
                    new[uuid] = old[uuid]
                continue
            if uuid in new and uuid in old and old[uuid] is None:
                continue
            if old.get(uuid, absent) != new.get(uuid, absent):
                log.info("GPU %s: MIG layout or GPU set changed", uuid)
                emit(HealthEvent(uuid, HealthEventKind.RECONFIGURED))
        return new

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._nvml.nvmlShutdown()
        except self._error as err:
            log.debug("nvmlShutdown failed: %s", err)
