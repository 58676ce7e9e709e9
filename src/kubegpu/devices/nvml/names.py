"""Pure NVML vocabulary: bus IDs, CUDA versions, MIG profile names and the profile tables.

No NVML call is made here; the tables map `pynvml` constant *names* to what they mean, so
discovery can look them up on whichever `pynvml` (or fake) it is given.
"""

from __future__ import annotations

import math

# GPU-instance profile *indices* (`NVML_GPU_INSTANCE_PROFILE_*`, the argument of
# nvmlDeviceGetGpuInstanceProfileInfo) -> (GPU slices, name suffix), as NVIDIA's go-nvlib
# names them (pkg/nvlib/device/mig_profile.go). The driver reports a GPU instance's profile
# by *ID* (19 for 1g on A100/H100, 15 for 1g with two memory slices, ...), which is found by
# asking each index for its ID. Names are looked up on the module so older pynvml releases
# without some of them still work.
GI_PROFILES = {
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
CI_PROFILES = {
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
# nvmlDeviceGetBrand codes -> the brand names NVIDIA's GFD labels use.
BRANDS = {
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
