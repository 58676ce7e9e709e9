"""`amd.com/gpu.*` node labels in the names and formats of ROCm's k8s-node-labeller.

Pure, like `kubegpu.labels`: the AMD backend read the files, this turns an `Inventory`
into labels. Clusters select AMD nodes with `amd.com/gpu.product-name=AMD_Instinct_MI300X`
or `beta.amd.com/gpu.vram.192G`, so the keys and value formats are ROCm's exactly:

* a property with one value on the node: `amd.com/gpu.<kind>=<value>`; with several,
  `amd.com/gpu.<kind>.<value>=<count>` for each instead;
* the `beta.amd.com` variant always writes `beta.amd.com/gpu.<kind>.<value>=<count>`
  and, when the value is unique, `beta.amd.com/gpu.<kind>=<value>` too;
* `firmware` has only the beta counts (`beta.amd.com/gpu.firmware.MEC.fw.352=8`), and the
  node-wide kinds (driver-version, driver-src-version, compute-memory-partition, the two
  `*-partitioning-supported`) only `amd.com/gpu.<kind>=<value>`: ROCm lists their beta keys
  solely to remove stale ones.

ROCm counts every device it advertises, partitions included, for the properties it reads
from KFD (vram, simd-count, cu-count), but only PCI functions for those it reads from the
card's PCI files or the libdrm ioctl (device-id, product-name, family, firmware): a
partition's DRM card has no PCI files. We count the same way, so the counts match.

One difference, documented in docs/migrating-from-rocm.md: ROCm writes a kind only when its
command-line flag is given; kubegpu writes every kind it can read.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping

from kubegpu.devices.model import AmdInfo, Gpu, Inventory, Vendor

PREFIX = "amd.com"
BETA_PREFIX = "beta.amd.com"
#: Every label kind ROCm's labeller knows (its flags), in ROCm's spelling.
KINDS = (
    "family",
    "driver-version",
    "driver-src-version",
    "firmware",
    "device-id",
    "product-name",
    "vram",
    "simd-count",
    "cu-count",
    "compute-memory-partition",
    "compute-partitioning-supported",
    "memory-partitioning-supported",
)
#: The firmware ROCm queries through libdrm (and so labels), in its names.
FIRMWARE = ("VCE", "UVD", "MC", "ME", "PFP", "CE", "RLC", "MEC", "SMC", "SDMA0")
_MIB = 1024 * 1024

#: gfx target versions (KFD `gfx_target_version`) of chips whose libdrm family differs from
#: their generation's usual one: the APUs.
_APU_FAMILIES: Mapping[int, str] = {
    70000: "KV",  # Kaveri
    70003: "KV",  # Kabini/Mullins
    70005: "KV",
    80001: "CZ",  # Carrizo
    80100: "CZ",  # Stoney
    90002: "RV",  # Raven
    90009: "RV",  # Raven2
    90012: "RV",  # Renoir (gfx90c)
    100303: "VGH",  # Van Gogh
    100305: "YC",  # Yellow Carp / Rembrandt
    100306: "GC_10_3_6",
    100307: "GC_10_3_7",
    110003: "GC_11_0_1",  # Phoenix
}
#: The usual family of each gfx major version (dGPUs), as libdrm's AMDGPU_FAMILY_* names.
_FAMILIES: Mapping[int, str] = {
    6: "SI",
    7: "CI",
    8: "VI",
    9: "AI",
    10: "NV",
    11: "GC_11_0_0",
    12: "GC_12_0_0",
}


def family(gfx_target_version: int) -> str | None:
    """libdrm's family name (`AI`, `NV`, `GC_11_0_0`...) for a KFD gfx target version.

    ROCm asks the kernel (AMDGPU_INFO_DEV_INFO); the family is a function of the chip, so
    the gfx target KFD publishes names it without an ioctl. None when unknown.
    """
    if gfx_target_version in _APU_FAMILIES:
        return _APU_FAMILIES[gfx_target_version]
    major, minor = gfx_target_version // 10000, (gfx_target_version // 100) % 100
    if major == 11 and minor == 5:
        return "GC_11_5_0"
    return _FAMILIES.get(major)


def product_label(name: str) -> str:
    """ROCm's product-name value: spaces become `_`, parentheses are dropped."""
    return name.strip().replace(" ", "_").replace("(", "").replace(")", "")


def vram_label(size_in_bytes: int) -> str:
    """KFD memory bank size as ROCm writes it: whole MiB, then GiB rounded, then `G`."""
    mib = size_in_bytes // _MIB
    # Go's math.Round: halves away from zero (Python's round() would go to even).
    return f"{math.floor(mib / 1024 + 0.5)}G"


def counted(kind: str, values: Iterable[str]) -> dict[str, str]:
    """The labels of one counted kind (ROCm's createLabels)."""
    counts = Counter(values)
    labels: dict[str, str] = {}
    for value, count in counts.items():
        labels[f"{BETA_PREFIX}/gpu.{kind}.{value}"] = str(count)
        if len(counts) == 1:
            labels[f"{BETA_PREFIX}/gpu.{kind}"] = value
            labels[f"{PREFIX}/gpu.{kind}"] = value
        else:
            labels[f"{PREFIX}/gpu.{kind}.{value}"] = str(count)
    return labels


def amd_labels(inventory: Inventory) -> dict[str, str]:
    """All `amd.com/gpu.*` and `beta.amd.com/gpu.*` labels for the node's AMD GPUs."""
    devices = [(g, g.amd) for g in inventory.gpus if g.vendor is Vendor.AMD and g.amd]
    if not devices:
        return {}
    pci = [(g, a) for g, a in devices if not a.partition]
    labels: dict[str, str] = {}
    labels |= counted("family", [f for _, a in pci if (f := family(a.gfx_target_version))])
    labels |= counted("device-id", [f"{a.device_id:x}" for _, a in pci if a.device_id])
    labels |= counted("product-name", [product_label(p) for g, a in pci if (p := _product(g, a))])
    labels |= counted("vram", [vram_label(a.vram_bytes) for _, a in devices if a.vram_bytes])
    labels |= counted("simd-count", [str(a.simd_count) for _, a in devices if a.simd_per_cu])
    labels |= counted(
        "cu-count", [str(a.simd_count // a.simd_per_cu) for _, a in devices if a.simd_per_cu]
    )
    labels |= _firmware(a for _, a in pci)
    node = inventory.amd
    labels[f"{PREFIX}/gpu.driver-version"] = inventory.driver_version
    labels[f"{PREFIX}/gpu.driver-src-version"] = node.driver_src_version if node else ""
    partitions = {
        f"{a.compute_partition}_{a.memory_partition}"
        for _, a in devices
        if a.compute_partition and a.memory_partition
    }
    if len(partitions) == 1:  # ROCm labels the mode only on a homogeneous node
        labels[f"{PREFIX}/gpu.compute-memory-partition"] = partitions.pop()
    supported = node.compute_partitioning_supported if node else False
    labels[f"{PREFIX}/gpu.compute-partitioning-supported"] = _bool(supported)
    supported = node.memory_partitioning_supported if node else False
    labels[f"{PREFIX}/gpu.memory-partitioning-supported"] = _bool(supported)
    return labels


def _product(gpu: Gpu, info: AmdInfo) -> str:
    """The driver's product_name, else libdrm's marketing name for the device and revision
    (what ROCm asks libdrm for); empty when neither names the board."""
    return info.product_name or info.marketing_name


def _firmware(infos: Iterable[AmdInfo]) -> dict[str, str]:
    counts: Counter[str] = Counter()
    for info in infos:
        for name, feature, version in info.firmware:
            if name in FIRMWARE:
                counts[f"{name}.feat.{feature}"] += 1
                counts[f"{name}.fw.{version}"] += 1
    return {f"{BETA_PREFIX}/gpu.firmware.{key}": str(n) for key, n in counts.items()}


def _bool(value: bool) -> str:
    return "true" if value else "false"


def rocm_owned_keys(current: Mapping[str, str]) -> set[str]:
    """The labels on a node that ROCm's labeller owns and replaces on every pass.

    Each kind's `amd.com/gpu.<kind>`, and `beta.amd.com/gpu.<kind>` together with the
    `beta.amd.com/gpu.<kind>.<value>` count it names. A node that ran ROCm's labeller
    before kubegpu's keeps none of them stale; other `amd.com/*` labels are not ours.
    """
    owned = set()
    for kind in KINDS:
        key = f"{PREFIX}/gpu.{kind}"
        if key in current:
            owned.add(key)
        beta = f"{BETA_PREFIX}/gpu.{kind}"
        if beta in current:
            owned |= {beta, f"{beta}.{current[beta]}"} & set(current)
    return owned
