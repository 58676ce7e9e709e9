"""NVIDIA GPU discovery through NVML: GPUs, MIG slices with their profile names, links.

One GPU misbehaving never takes down discovery of the others: optional fields fall back to
defaults, a GPU whose essential fields fail is reported `Unhealthy`, and a GPU without a
readable UUID is skipped. MIG profile names follow go-nvlib: the profile *ID* a GPU or
compute instance reports is looked up through the profile *indices* that answer it.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from kubegpu.devices.model import Gpu, Health, Inventory, MigDevice
from kubegpu.devices.nvml.links import links
from kubegpu.devices.nvml.names import (
    BRANDS,
    CI_PROFILES,
    GI_PROFILES,
    cuda_version,
    mig_profile_name,
    normalize_bus_id,
)
from kubegpu.devices.nvml.session import Session
from kubegpu.errors import InitError
from kubegpu.nvidia_paths import (
    CONTROL_DEVICES,
    MIG_CAPABILITIES_DIR,
    gpu_device_node,
    mig_cap_node,
)

log = logging.getLogger("kubegpu.devices.nvml")

T = TypeVar("T")

MIB = 1024 * 1024


def discover(s: Session, exists: Callable[[str], bool], backend: str) -> Inventory:
    """Every GPU NVML counts (skipping those without a readable UUID), its MIG slices and
    links, the driver and CUDA versions, and the control device nodes present on the node."""
    nvml = s.nvml
    try:
        count = int(nvml.nvmlDeviceGetCount())
    except s.error as err:
        raise InitError(f"NVML cannot count GPUs ({err}): check that nvidia-smi works") from err
    found: list[tuple[Any, Gpu]] = []
    for index in range(count):
        entry = read_gpu(s, index)
        if entry is not None:
            found.append(entry)
    peer_links = links(s, found)
    gpus = tuple(dataclasses.replace(gpu, links=peer_links.get(gpu.uuid, ())) for _, gpu in found)
    return Inventory(
        gpus=gpus,
        driver_version=str(s.optional(nvml.nvmlSystemGetDriverVersion, default="")),
        cuda_driver_version=cuda_version(
            int(s.optional(nvml.nvmlSystemGetCudaDriverVersion, default=0))
        ),
        control_device_paths=tuple(p for p in CONTROL_DEVICES if exists(p)),
        backend=backend,
    )


def read_gpu(s: Session, index: int) -> tuple[Any, Gpu] | None:
    nvml = s.nvml
    found = s.handle_and_uuid(index)
    if found is None:
        return None
    handle, uuid = found
    problems: list[str] = []

    def essential(label: str, fn: Callable[[Any], T], default: T) -> T:
        try:
            return fn(handle)
        except s.error as err:
            problems.append(f"{label}: {err}")
            return default

    product = str(essential("name", nvml.nvmlDeviceGetName, ""))
    memory_mib = essential("memory", lambda h: int(nvml.nvmlDeviceGetMemoryInfo(h).total) // MIB, 0)
    minor = int(essential("minor number", nvml.nvmlDeviceGetMinorNumber, index))
    bus_id = essential(
        "PCI info", lambda h: normalize_bus_id(nvml.nvmlDeviceGetPciInfo(h).busId), ""
    )
    major_minor = s.optional(nvml.nvmlDeviceGetCudaComputeCapability, handle, default=(0, 0))
    brand_code = s.optional(nvml.nvmlDeviceGetBrand, handle, default=None)
    brand = next(
        (label for const, label in BRANDS.items() if getattr(nvml, const, object()) == brand_code),
        "",
    )
    mig_mode = s.optional(nvml.nvmlDeviceGetMigMode, handle, default=None)
    mig_enabled = mig_mode is not None and mig_mode[0] == nvml.NVML_DEVICE_MIG_ENABLE
    migs = read_migs(s, handle, uuid, index, minor, memory_mib) if mig_enabled else ()
    if problems:
        log.warning("GPU %s (index %d) is unhealthy: %s", uuid, index, "; ".join(problems))
    gpu = Gpu(
        index=index,
        uuid=uuid,
        minor=minor,
        product=product,
        memory_mib=memory_mib,
        pci_bus_id=bus_id,
        numa_node=numa_node(s, handle, bus_id),
        compute_capability=(int(major_minor[0]), int(major_minor[1])),
        device_paths=(gpu_device_node(minor),),
        mig_enabled=mig_enabled,
        mig_capable=mig_mode is not None,
        mig_devices=migs,
        brand=brand,
        health=Health.UNHEALTHY if problems else Health.HEALTHY,
    )
    return handle, gpu


def numa_node(s: Session, handle: Any, bus_id: str) -> int | None:
    """NVML's NUMA node when it knows one, else the kernel's for the PCI device."""
    getter = getattr(s.nvml, "nvmlDeviceGetNumaNodeId", None)
    if getter is not None:
        node = s.optional(getter, handle, default=None)
        if node is not None:
            return None if int(node) < 0 else int(node)
    if not bus_id:
        return None
    path = Path(s.host_root, "sys/bus/pci/devices", bus_id, "numa_node")
    try:
        node = int(path.read_text().strip())
    except (OSError, ValueError):
        return None
    return None if node < 0 else node


def read_migs(
    s: Session, handle: Any, gpu_uuid: str, index: int, minor: int, total_mib: int
) -> tuple[MigDevice, ...]:
    nvml = s.nvml
    migs = []
    # Profile ID -> shape tables, read once per GPU (and per GPU instance for compute
    # profiles) rather than once per slice: up to 18 NVML calls each.
    tables: dict[int | None, dict[int, Any]] = {}
    for slot, mig_handle in s.iter_mig_handles(handle, gpu_uuid):
        try:
            uuid = str(nvml.nvmlDeviceGetUUID(mig_handle))
            gi_id = int(nvml.nvmlDeviceGetGpuInstanceId(mig_handle))
            ci_id = int(nvml.nvmlDeviceGetComputeInstanceId(mig_handle))
            attrs = nvml.nvmlDeviceGetAttributes(mig_handle)
        except s.error as err:
            log.warning(
                "GPU %s: skipping a MIG device whose identity cannot be read (%s)",
                gpu_uuid,
                err,
            )
            continue
        memory_mib = int(attrs.memorySizeMB)
        s.mig_uuids[(gpu_uuid, gi_id, ci_id)] = uuid
        gi_slices, ci_slices, suffix = profile_shape(s, handle, gi_id, ci_id, attrs, tables)
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
                device_paths=mig_caps(s, minor, gi_id, ci_id),
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


def profile_shape(
    s: Session,
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
    nvml = s.nvml
    gi_slices = int(attrs.gpuInstanceSliceCount)
    ci_slices = int(attrs.computeInstanceSliceCount)
    try:
        instance = nvml.nvmlDeviceGetGpuInstanceById(handle, gi_id)
        gi_profile_id = int(nvml.nvmlGpuInstanceGetInfo(instance).profileId)
    except (s.error, AttributeError) as err:
        log.debug("GPU instance %d: profile unreadable (%s)", gi_id, err)
        return gi_slices, ci_slices, ""
    if None not in tables:
        tables[None] = profile_ids(
            s, GI_PROFILES, lambda i: nvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, i)
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
    except (s.error, AttributeError) as err:
        log.debug("compute instance %d/%d: profile unreadable (%s)", gi_id, ci_id, err)
        return gi_slices, ci_slices, suffix
    shared = int(getattr(nvml, "NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED", 0))
    if gi_id not in tables:
        tables[gi_id] = profile_ids(
            s,
            CI_PROFILES,
            lambda i: nvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(instance, i, shared),
        )
    ci_found: int | None = tables[gi_id].get(ci_profile_id)
    return gi_slices, ci_slices if ci_found is None else ci_found, suffix


def profile_ids(s: Session, table: dict[str, T], info: Callable[[int], Any]) -> dict[int, T]:
    """Profile ID -> the table entry of the profile index whose info reports that ID.

    Indices are asked in ascending order and the first match wins, as go-nvlib does.
    """
    indexed = sorted(
        (int(index), shape)
        for const, shape in table.items()
        if (index := getattr(s.nvml, const, None)) is not None
    )
    ids: dict[int, T] = {}
    for index, shape in indexed:
        try:
            found = int(info(index).id)
        except s.error as err:
            # Profiles this GPU does not offer answer NOT_SUPPORTED / INVALID_ARGUMENT.
            log.debug("profile index %d: %s", index, err)
            continue
        ids.setdefault(found, shape)
    return ids


def mig_caps(s: Session, minor: int, gi_id: int, ci_id: int) -> tuple[str, ...]:
    """The /dev/nvidia-caps nodes granting a slice, from the driver's /proc capability files."""
    base = Path(s.host_root, MIG_CAPABILITIES_DIR, f"gpu{minor}/mig/gi{gi_id}")
    paths = []
    for access in (base / "access", base / f"ci{ci_id}" / "access"):
        try:
            text = access.read_text()
        except OSError:
            continue
        for line in text.splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "DeviceFileMinor" and value.strip().isdigit():
                paths.append(mig_cap_node(int(value)))
    return tuple(paths)
