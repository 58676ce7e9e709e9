"""Node labels in GPU Feature Discovery's names and formats, from one `Inventory`.

Pure: the labeller (`kubegpu.labeller`) hands in the clock and what `kubegpu.devices`
read (the machine type from `devices.host`; PCI presence, classes and config spaces
from `devices.pci`). Keeping the exact GFD keys and value formats matters more than
elegance here: clusters select nodes with `nvidia.com/gpu.product=Tesla-T4` or
`nvidia.com/gpu.family=ampere`, and switching plugins must not silently unschedule
their pods.

Differences from GFD, all deliberate: with several GPU models on a node, GFD labels
whichever model its map iteration ends on (full GPUs win over MIG-enabled ones); we
label the most common model among the full GPUs (ties: the lowest GPU index).
`nvidia.com/gpu.present` is set from the PCI bus, so a node whose driver is broken
still attracts the DaemonSets that can say what is wrong.

kubegpu's own labels, under `kubegpu.io/`, come only with a config GFD cannot express (GPUs
sized by memory), so GFD's label set stays exactly GFD's otherwise.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence

from kubegpu.config.names import qualify_resource_name
from kubegpu.config.v1 import Config, MigStrategy, ReplicatedResource, SharingStrategy
from kubegpu.devices.model import Gpu, Inventory, MigDevice, Vendor
from kubegpu.devices.pci import CONFIG_SPACE_SIZE
from kubegpu.errors import ConfigError
from kubegpu.resources import ComputeLimit, MemoryLimit, build_resources, mechanisms, sized

PREFIX = "nvidia.com"
GPU_RESOURCE = f"{PREFIX}/gpu"
PRESENT_LABEL = f"{PREFIX}/gpu.present"
#: What holds a sized claim's limits on this node (the device attributes' values).
MEMORY_LIMIT_LABEL = "kubegpu.io/gpu.memory-limit"
COMPUTE_LIMIT_LABEL = "kubegpu.io/gpu.compute-limit"
# Weakest first: a node label is a promise for every sized GPU on the node.
_MEMORY_STRENGTH = (MemoryLimit.NONE, MemoryLimit.MPS_PINNED, MemoryLimit.NVML_CGROUP)
_COMPUTE_STRENGTH = (ComputeLimit.NONE, ComputeLimit.MPS_THREADS)

#: PCI class codes (sysfs `class`) → GFD's `gpu.mode` values.
PCI_CLASS_MODES = {"0x030000": "graphics", "0x030200": "compute"}

#: MIG attribute label suffixes, in GFD's names; values default to 0 when unknown.
MIG_ATTRIBUTES = (
    "memory",
    "multiprocessors",
    "slices.gi",
    "slices.ci",
    "engines.copy",
    "engines.decoder",
    "engines.encoder",
    "engines.jpeg",
    "engines.ofa",
)

_UNSAFE = re.compile(r"[^A-Za-z0-9\-_. ]")
# `1g.10gb`, `1g.10gb+me`, `1c.3g.20gb`: the slice counts are in the profile name.
_PROFILE = re.compile(r"^(?:(?P<ci>\d+)c\.)?(?P<gi>\d+)g\.")
# Brands/products whose display engine is off (PCI class 3D controller) in practice.
_DATACENTER = re.compile(
    r"tesla|datacenter|\b(?:[ABHLV]\d{1,3}[A-Z]?|GH\d+|GB\d+|B\d{3}|A\d{2}G?|L\d{1,2}S?)\b",
    re.IGNORECASE,
)
_GRAPHICS = re.compile(r"geforce|quadro|titan|\brtx\b|nvs", re.IGNORECASE)


def sanitise(name: str) -> str:
    """A label-safe product name: GFD drops odd characters and joins words with `-`."""
    return "-".join(_UNSAFE.sub("", name).split())


def family(major: int, minor: int) -> str:
    """Architecture name for a CUDA compute capability, as GFD's `gpu.family` spells it."""
    if major == 7:
        return "volta" if minor < 5 else "turing"
    if major == 8:
        return "ada-lovelace" if minor >= 9 else "ampere"
    names = {1: "tesla", 2: "fermi", 3: "kepler", 5: "maxwell", 6: "pascal", 9: "hopper"}
    # Blackwell is split over 10.x and 12.x; GFD leaves 11.x undefined.
    names |= {10: "blackwell", 12: "blackwell", 13: "rubin"}
    return names.get(major, "undefined")


def gpu_mode(gpus: Iterable[Gpu], pci_classes: Mapping[str, str] | None = None) -> str:
    """`compute`, `graphics` or `unknown`, from every GPU's PCI class, as GFD does.

    GFD says `unknown` unless all GPUs share one class (3D controller = compute, VGA =
    graphics). Where the labeller could not read a GPU's class we fall back to its brand
    and product name, which is right for the datacenter and GeForce/Quadro lines.
    """
    classes = pci_classes or {}
    modes: set[str] = set()
    codes: set[str] = set()
    for gpu in gpus:
        code = classes.get(gpu.pci_bus_id.lower())
        if code is not None:
            code = code.strip().lower()[:8]
            codes.add(code)
            modes.add(PCI_CLASS_MODES.get(code, "unknown"))
        else:
            modes.add(_mode_hint(gpu))
    if len(codes) > 1 or len(modes) != 1:
        return "unknown"
    return modes.pop()


def _mode_hint(gpu: Gpu) -> str:
    hint = f"{gpu.brand} {gpu.product}"
    if _GRAPHICS.search(hint):
        return "graphics"
    if _DATACENTER.search(hint):
        return "compute"
    return "unknown"


_PCI_STATUS = 0x06
_PCI_STATUS_CAP_LIST = 0x10
_PCI_CAP_POINTER = 0x34
_PCI_CAP_VENDOR_SPECIFIC = 0x09
# A vGPU's vendor capability carries "VF" at bytes 3-4, then records (id, length, data);
# record 0 holds the host driver's version and branch, 10 NUL-padded bytes each.
_VGPU_SIGNATURE = b"VF"
_VGPU_RECORDS = 5
_VGPU_FIELD = 10


def vendor_capability(config: bytes) -> bytes | None:
    """The PCI vendor-specific capability (id 0x09) of a config space, if it has one."""
    if len(config) < CONFIG_SPACE_SIZE or not config[_PCI_STATUS] & _PCI_STATUS_CAP_LIST:
        return None
    seen: set[int] = set()
    pos = config[_PCI_CAP_POINTER]
    while pos and pos not in seen and pos + 2 < len(config):
        seen.add(pos)
        cap_id, following, length = config[pos], config[pos + 1], config[pos + 2]
        if cap_id == 0xFF:  # a broken chain
            return None
        if cap_id == _PCI_CAP_VENDOR_SPECIFIC:
            return config[pos : pos + length]
        pos = following
    return None


def vgpu_host_driver(capability: bytes) -> tuple[str, str] | None:
    """(host driver version, branch) from a vGPU capability; None if not a vGPU's."""
    if capability[3:5] != _VGPU_SIGNATURE:
        return None
    pos = _VGPU_RECORDS
    while pos < len(capability) and capability[pos] != 0:
        step = capability[pos + 1] if pos + 1 < len(capability) else 0
        if step == 0:
            return None
        pos += step
    data = pos + 2
    if pos >= len(capability) or data + 2 * _VGPU_FIELD > len(capability):
        return None  # a vGPU whose host did not say which driver it runs

    def text(at: int) -> str:
        return capability[at : at + _VGPU_FIELD].strip(b"\x00").decode("ascii", "replace")

    return text(data), text(data + _VGPU_FIELD)


def vgpu_labels(configs: Iterable[bytes]) -> dict[str, str]:
    """`vgpu.present`, and the host driver's version and branch when this is a vGPU guest."""
    hosts = []
    for config in configs:
        capability = vendor_capability(config)
        if capability is not None and capability[3:5] == _VGPU_SIGNATURE:
            hosts.append(vgpu_host_driver(capability))
    labels = {f"{PREFIX}/vgpu.present": _bool(bool(hosts))}
    for host in hosts:
        if host is not None:
            labels[f"{PREFIX}/vgpu.host-driver-version"] = host[0]
            labels[f"{PREFIX}/vgpu.host-driver-branch"] = host[1]
    return labels


def gpu_labels(
    inventory: Inventory,
    config: Config,
    *,
    machine_type: str | None,
    timestamp: int | None,
    present: bool | None = None,
    pci_classes: Mapping[str, str] | None = None,
    pci_configs: Sequence[bytes] | None = None,
) -> dict[str, str]:
    """All `nvidia.com/*` labels for the node, and `limit_labels`.

    `machine_type` None leaves out `gpu.machine`; `timestamp` None leaves out
    `gfd.timestamp` (`--no-timestamp`). `present` is the PCI scan's answer (None: no
    scan); readable NVIDIA GPUs mark the node present either way. `pci_configs` are the
    NVIDIA PCI functions' config spaces, for the `vgpu.*` labels (None: not readable,
    and then GFD writes no `vgpu.*` labels either).

    Raises `ConfigError` when the config asks for MPS on a node with MIG enabled:
    GFD refuses that too, and a label saying `mps.capable=false` would hide why the
    device plugin serves nothing.
    """
    labels: dict[str, str] = {}
    gpus = tuple(g for g in inventory.gpus if g.vendor is Vendor.NVIDIA)
    if present or gpus:  # GPUs we can read are present even if the PCI scan missed them
        labels[PRESENT_LABEL] = "true"
    if gpus:
        if machine_type is not None:
            labels[f"{PREFIX}/gpu.machine"] = sanitise(machine_type)
        labels.update(_version_labels(inventory))
        labels[f"{PREFIX}/mig.capable"] = _bool(any(g.mig_capable for g in gpus))
        labels[f"{PREFIX}/mps.capable"] = _bool(_mps_capable(gpus, config))
        labels.update(_full_gpu_labels(gpus, config))
        strategy = config.flags.mig_strategy
        if strategy is not MigStrategy.NONE:
            labels[f"{PREFIX}/mig.strategy"] = strategy.value
            if strategy is MigStrategy.SINGLE:
                labels.update(_mig_single_labels(gpus, config))
            else:
                labels.update(_mig_mixed_labels(gpus, config))
        labels[f"{PREFIX}/gpu.mode"] = gpu_mode(gpus, pci_classes)
        labels.update(limit_labels(inventory, config))
    if pci_configs is not None:
        labels.update(vgpu_labels(pci_configs))
    if timestamp is not None:
        labels[f"{PREFIX}/gfd.timestamp"] = str(timestamp)
    return labels


def limit_labels(inventory: Inventory, config: Config) -> dict[str, str]:
    """`kubegpu.io/gpu.memory-limit` and `gpu.compute-limit`: the mechanisms that hold a
    sized claim's limits (`kubegpu.resources.mechanisms`, as on the DRA devices), none
    without a sized GPU. `inventory.memory_limits` is the discovery's probe of the kernel
    path, as the slices get it. Where GPUs differ (MIG slices have no kernel path) the
    weakest is labelled, since a pod selecting the node may land on any of them."""
    strategies = (config.sharing.mps, config.sharing.time_slicing)
    if not any(e.sizing is not None for s in strategies if s for e in s.resources):
        return {}
    found = {
        mechanisms(resource, device.unit, inventory.memory_limits)
        for resource in build_resources(inventory, config)
        if sized(resource)
        for device in resource.devices
    }
    if not found:
        return {}
    memory = min((m for m, _ in found), key=_MEMORY_STRENGTH.index)
    compute = min((c for _, c in found), key=_COMPUTE_STRENGTH.index)
    return {MEMORY_LIMIT_LABEL: memory.value, COMPUTE_LIMIT_LABEL: compute.value}


def _mps_capable(gpus: tuple[Gpu, ...], config: Config) -> bool:
    if _strategy(config) != "mps":
        return False
    mig = [str(g.index) for g in gpus if g.mig_enabled]
    if mig:
        raise ConfigError(
            f"sharing.mps: MPS cannot share MIG-enabled GPUs (MIG is on for GPU "
            f"{', '.join(mig)}); disable MIG on them or use sharing.timeSlicing"
        )
    return True


def _bool(value: bool) -> str:
    return "true" if value else "false"


def _version_labels(inventory: Inventory) -> dict[str, str]:
    """Driver and CUDA versions, new names and the deprecated ones GFD still writes."""
    labels: dict[str, str] = {}
    parts = inventory.driver_version.strip().split(".")
    if 2 <= len(parts) <= 3 and all(p.isdigit() for p in parts):
        major, minor = parts[0], parts[1]
        rev = parts[2] if len(parts) == 3 else ""
        labels |= {
            f"{PREFIX}/cuda.driver-version.major": major,
            f"{PREFIX}/cuda.driver-version.minor": minor,
            f"{PREFIX}/cuda.driver-version.revision": rev,
            f"{PREFIX}/cuda.driver-version.full": inventory.driver_version.strip(),
            f"{PREFIX}/cuda.driver.major": major,
            f"{PREFIX}/cuda.driver.minor": minor,
            f"{PREFIX}/cuda.driver.rev": rev,
        }
    cuda_major, cuda_minor = inventory.cuda_driver_version
    if (cuda_major, cuda_minor) != (0, 0):
        labels |= {
            f"{PREFIX}/cuda.runtime-version.major": str(cuda_major),
            f"{PREFIX}/cuda.runtime-version.minor": str(cuda_minor),
            f"{PREFIX}/cuda.runtime-version.full": f"{cuda_major}.{cuda_minor}",
            f"{PREFIX}/cuda.runtime.major": str(cuda_major),
            f"{PREFIX}/cuda.runtime.minor": str(cuda_minor),
        }
    return labels


def _strategy(config: Config) -> str:
    """The sharing strategy in force: the first of MPS, time-slicing that makes more than
    one replica of anything (GFD's rule; `replicas: 1` shares nothing)."""
    if _replicates(config.sharing.mps):
        return "mps"
    if _replicates(config.sharing.time_slicing):
        return "time-slicing"
    return "none"


def _replicates(strategy: SharingStrategy | None) -> bool:
    return strategy is not None and any(r.replicas > 1 for r in strategy.resources)


def _active(config: Config) -> SharingStrategy | None:
    """The strategy whose entries label the resources: MPS whenever it is set, as GFD."""
    return config.sharing.mps if config.sharing.mps is not None else config.sharing.time_slicing


def _replicated(config: Config, resource: str) -> ReplicatedResource | None:
    strategy = _active(config)
    if strategy is None:
        return None
    return next((r for r in strategy.resources if _qualified(r.name) == resource), None)


def _qualified(name: str) -> str:
    """`gpu` means `nvidia.com/gpu`, as in NVIDIA's config (and `kubegpu serve`)."""
    try:
        return qualify_resource_name(name)
    except ValueError:  # the config loader refuses these; never a match here
        return name


def _renamed(config: Config, entry: ReplicatedResource) -> bool:
    """A renamed resource keeps its plain product name (`renameByDefault` renames all)."""
    strategy = _active(config)
    return bool(entry.rename) or (strategy is not None and strategy.rename_by_default)


def _selects(entry: ReplicatedResource, ids: Iterable[tuple[str, ...]]) -> bool:
    """Whether the entry's `devices` selects any of the devices (each given by its IDs)."""
    devices = entry.devices
    if devices == "all":
        return True
    if isinstance(devices, int):
        return devices > 0
    wanted = {str(d) for d in devices}
    return any(wanted.intersection(names) for names in ids)


def _base(
    resource: str,
    config: Config | None,
    count: int,
    product_parts: Iterable[str],
    ids: Iterable[tuple[str, ...]],
) -> dict[str, str]:
    """product, count, replicas and sharing-strategy for one resource name.

    `config` None means the resource cannot be shared (MIG-enabled full GPUs): GFD
    writes `replicas=0` for those.
    """
    entry = _replicated(config, resource) if config is not None else None
    if entry is not None and not _selects(entry, ids):
        entry = None
    replicas = 0 if config is None else (entry.replicas if entry and entry.replicas > 0 else 1)
    shared = entry is not None and entry.replicas > 1
    parts = [sanitise(p) for p in product_parts if p]
    if shared and entry is not None and config is not None and not _renamed(config, entry):
        parts.append("SHARED")
    strategy = _strategy(config) if config is not None and shared else "none"
    return {
        f"{resource}.product": "-".join(parts),
        f"{resource}.count": str(count),
        f"{resource}.replicas": str(replicas),
        f"{resource}.sharing-strategy": strategy,
    }


def _gpu_ids(gpu: Gpu) -> tuple[str, ...]:
    return (gpu.uuid, str(gpu.index))


def _full_gpu_labels(gpus: tuple[Gpu, ...], config: Config) -> dict[str, str]:
    """`gpu.product/count/...` for one model: full GPUs win over MIG-enabled ones (GFD
    lets their labels override), then the most common model, ties to the lowest index."""
    full = [g for g in gpus if not g.mig_enabled]
    counts = Counter(g.product for g in gpus)
    candidates = Counter(g.product for g in full) if full else counts
    # Counter keeps first-seen order, so ties go to the lowest index.
    product = max(candidates, key=lambda name: counts[name])
    full_of_model = [g for g in full if g.product == product]
    # Memory and architecture come from a full GPU: a MIG-enabled one may report none.
    source = (full_of_model or [g for g in gpus if g.product == product])[0]
    labels = _base(
        GPU_RESOURCE,
        config if full_of_model else None,
        counts[product],
        [product],
        [_gpu_ids(g) for g in full_of_model],
    )
    if source.memory_mib:
        labels[f"{GPU_RESOURCE}.memory"] = str(source.memory_mib)
    major, minor = source.compute_capability
    if major:
        labels[f"{GPU_RESOURCE}.family"] = family(major, minor)
        labels[f"{GPU_RESOURCE}.compute.major"] = str(major)
        labels[f"{GPU_RESOURCE}.compute.minor"] = str(minor)
    return labels


def _mig_attributes(resource: str, mig: MigDevice) -> dict[str, str]:
    values = dict.fromkeys(MIG_ATTRIBUTES, 0)
    values["memory"] = mig.memory_mib
    values["multiprocessors"] = mig.multiprocessors
    match = _PROFILE.match(mig.profile)
    if match:
        values["slices.gi"] = int(match["gi"])
        values["slices.ci"] = int(match["ci"] or match["gi"])
    values.update({k: v for k, v in mig.attributes.items() if k in values})
    return {f"{resource}.{name}": str(value) for name, value in values.items()}


def _by_profile(gpus: tuple[Gpu, ...]) -> dict[str, list[tuple[Gpu, MigDevice]]]:
    profiles: dict[str, list[tuple[Gpu, MigDevice]]] = {}
    for gpu in gpus:
        if gpu.mig_enabled:
            for mig in gpu.mig_devices:
                profiles.setdefault(mig.profile, []).append((gpu, mig))
    return profiles


def _mig_ids(mig: MigDevice) -> tuple[str, ...]:
    return (mig.uuid, mig.index)


def _mig_single_labels(gpus: tuple[Gpu, ...], config: Config) -> dict[str, str]:
    """Under `single` every GPU must be MIG-enabled with one profile; else `-MIG-INVALID`."""
    enabled = [g for g in gpus if g.mig_enabled]
    if not enabled:
        return {}  # no MIG anywhere: the same as `none`
    profiles = _by_profile(gpus)
    if any(not g.mig_devices for g in enabled) or len(enabled) != len(gpus) or len(profiles) != 1:
        # GFD's "invalid" set: these keys replace the full-GPU ones; family and compute
        # labels of the full GPUs stay. sharing-strategy is empty, not "none".
        return {
            f"{GPU_RESOURCE}.product": f"{sanitise(enabled[0].product)}-MIG-INVALID",
            f"{GPU_RESOURCE}.count": "0",
            f"{GPU_RESOURCE}.replicas": "0",
            f"{GPU_RESOURCE}.sharing-strategy": "",
            f"{GPU_RESOURCE}.memory": "0",
        }
    ((profile, members),) = profiles.items()
    parent, sample = members[0]
    labels = _base(
        GPU_RESOURCE,
        config,
        len(members),
        [parent.product, "MIG", profile],
        [_mig_ids(m) for _, m in members],
    )
    return labels | _mig_attributes(GPU_RESOURCE, sample)


def _mig_mixed_labels(gpus: tuple[Gpu, ...], config: Config) -> dict[str, str]:
    labels: dict[str, str] = {}
    for profile, members in sorted(_by_profile(gpus).items()):
        resource = f"{PREFIX}/mig-{profile}"
        parent, sample = members[0]
        labels |= _base(
            resource,
            config,
            len(members),
            [parent.product, "MIG", profile],
            [_mig_ids(m) for _, m in members],
        )
        labels |= _mig_attributes(resource, sample)
    return labels
