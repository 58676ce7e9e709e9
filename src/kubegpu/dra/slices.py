"""The node's devices as resource.k8s.io/v1 ResourceSlices: what the DRA mode publishes.

Pure functions over the resources the device plugin advertises (`kubegpu.resources`): the
same config picks the same units (MIG strategy, renames, sharing), so one config file
drives both modes. The JSON bodies are spelled as the API server returns them.

Names, as the peers' DRA drivers publish them, so that CEL selectors and DeviceClasses
written for those drivers work unchanged:

- NVIDIA (`gpu.nvidia.com`, kubernetes-sigs/dra-driver-nvidia-gpu): a whole GPU is
  `gpu-<minor>` with `type: gpu`, `uuid`, `productName`, `brand`, `architecture`,
  `cudaComputeCapability`, `driverVersion`, `cudaDriverVersion` (versions as semver),
  `resource.kubernetes.io/pciBusID`, `resource.kubernetes.io/pcieRoot` where known,
  `resource.kubernetes.io/numaNode`, and capacity `memory`. A MIG slice is a device of its
  own, `gpu-<minor>-mig-<profile>-<gi>-<ci>` with `type: mig`, `parentUUID`, `profile` and
  the engine capacities (`multiprocessors`, `copyEngines`, ...). NVIDIA names a slice by
  its placement (profile ID and start); the device model knows its GPU- and
  compute-instance IDs instead, which identify it as uniquely.
- AMD (`gpu.amd.com`, ROCm/k8s-gpu-dra-driver): `gpu-<card>-<render>`, `type: amdgpu`
  or `amdgpu-partition` for a compute partition, `pciAddr` / `parentPciAddr`,
  `cardIndex`, `renderIndex`, `deviceID` / `parentDeviceID`, `productName`,
  `driverVersion`, `driverSrcVersion`, `partitionProfile`; capacity `memory`,
  `computeUnits`, `simdUnits`.

What no peer publishes is under `kubegpu.io/`, so it can never collide with a name the
vendor's driver adds later: `resource` (the device plugin resource name the config gives
the unit, e.g. `nvidia.com/mig-1g.10gb` or a renamed `nvidia.com/gpu.shared`), `index`
(NVIDIA's `3` / `3:1` notation), `nvlinkDomain` and, on shared devices, `sharing`; on
devices sized by memory, `memoryLimit` and `computeLimit` (`kubegpu.dra.sizing`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Required, TypedDict

from kubegpu.config import ClaimSizing
from kubegpu.devices import Fault, Gpu, Health, Inventory, LinkKind, Vendor
from kubegpu.dra.sizing import COMPUTE_LIMIT, MEMORY_LIMIT, mechanisms
from kubegpu.resources import ResourceSpec, SharingKind, Unit, unit_memory_bytes

NVIDIA_DRIVER: Final = "gpu.nvidia.com"
AMD_DRIVER: Final = "gpu.amd.com"
DRIVERS: Final = {Vendor.NVIDIA: NVIDIA_DRIVER, Vendor.AMD: AMD_DRIVER}
API_VERSION: Final = "resource.k8s.io/v1"

#: The prefixes of Kubernetes' standard attributes and of kubegpu's own.
STANDARD: Final = "resource.kubernetes.io/"
KUBEGPU: Final = "kubegpu.io/"

# The API's limits (k8s.io/api resource/v1 types.go, v0.36.2): devices per slice, fewer
# when any device in it carries taints; attributes and capacities per device; the length
# of a string or version value and of an attribute's name after its domain.
MAX_DEVICES: Final = 128
MAX_DEVICES_WITH_TAINTS: Final = 64
MAX_ATTRIBUTES_AND_CAPACITIES: Final = 32
MAX_VALUE_LENGTH: Final = 64
MAX_TAINTS: Final = 16

#: The effect of a health taint: new claims stay off the device, running pods keep it,
#: as the kubelet treats an unhealthy device of a device plugin (and as NVIDIA's driver
#: taints a fatal Xid). NoExecute would evict pods for an Xid their GPU may survive.
TAINT_EFFECT: Final = "NoSchedule"

_MIB: Final = 1024 * 1024
_BINARY: Final = ("", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei")
_DECIMAL: Final = ("", "k", "M", "G", "T", "P", "E")
_NOT_DNS: Final = re.compile(r"[^a-z0-9-]")
_NUMBERS: Final = re.compile(r"\d+")

#: go-nvlib's `GetBrandAsString` spelling of the brands the device model spells as GFD's
#: labels do (`NVIDIA RTX`); NVIDIA's driver publishes the former.
_NVLIB_BRANDS: Final = {
    "GRID": "Grid",
    "Quadro RTX": "QuadroRTX",
    "NVIDIA RTX": "NvidiaRTX",
    "NVIDIA": "Nvidia",
    "GeForce RTX": "GeForceRTX",
    "Titan RTX": "TitanRTX",
}


# -- what a published device is ---------------------------------------------------------
# A device of a ResourceSlice as kubegpu builds it, in the API's spelling (`spec.devices[]`
# of resource.k8s.io/v1): typed dictionaries, because the body goes to the API and is
# compared with the stored slices as JSON, key for key.


#: One attribute: exactly one of its typed values.
class Attribute(TypedDict, total=False):
    string: str
    int: int
    bool: bool
    version: str


class ValidRange(TypedDict, total=False):
    min: Required[str]
    max: str
    step: str


class RequestPolicy(TypedDict):
    """What a request that names no amount takes, and what amounts it may ask for."""

    default: str
    validRange: ValidRange


class Capacity(TypedDict, total=False):
    value: Required[str]
    #: Only on a device several claims share (`allowMultipleAllocations`).
    requestPolicy: RequestPolicy


class Taint(TypedDict, total=False):
    key: Required[str]
    value: str
    effect: Required[str]
    #: Stamped by the API server; carried from the stored slice (`carry_taint_times`).
    timeAdded: str


class Device(TypedDict, total=False):
    name: Required[str]
    attributes: dict[str, Attribute]
    capacity: dict[str, Capacity]
    allowMultipleAllocations: bool
    taints: list[Taint]


@dataclass(frozen=True)
class DraDevice:
    """One published device: the unit it gives a claim, and the resource it comes from."""

    #: The device's name in the slice (`gpu-3`, `gpu-3-mig-1g10gb-9-0`, `gpu-1-128`).
    name: str
    unit: Unit
    #: The resource the device plugin would advertise it under (sharing, MPS limits).
    resource: ResourceSpec

    @property
    def shares(self) -> int:
        """How many claims may hold the device at once: 1 unless time-sliced or MPS."""
        return self.resource.replicas if self.resource.sharing is not SharingKind.NONE else 1


def dra_devices(driver: str, specs: Iterable[ResourceSpec]) -> tuple[DraDevice, ...]:
    """The devices `driver` publishes for these resources, in slice order (GPU index, slot).

    A shared unit (replicas) is one device, not one per replica: its `shares` capacity
    says how many claims it takes. The driver's prepare looks devices up here by name.
    """
    vendor = next((v for v, d in DRIVERS.items() if d == driver), None)
    found: dict[str, DraDevice] = {}
    for spec in specs:
        if spec.vendor is not vendor:
            continue
        for advertised in spec.devices:
            unit = advertised.unit
            name = device_name(unit)
            if name not in found:
                found[name] = DraDevice(name, unit, spec)
    return tuple(sorted(found.values(), key=_order))


def _order(device: DraDevice) -> tuple[int, int, int]:
    mig = device.unit.mig
    return (device.unit.gpu.index, *((mig.gi_id, mig.ci_id) if mig else (-1, -1)))


def device_name(unit: Unit) -> str:
    """The unit's DRA device name, a DNS label, as the vendor's driver names it."""
    gpu = unit.gpu
    if gpu.vendor is Vendor.AMD:
        card = _dev_number(gpu.device_paths, "/dev/dri/card")
        return f"gpu-{gpu.index if card is None else card}-{gpu.minor}"
    if unit.mig is None:
        return f"gpu-{gpu.minor}"
    mig = unit.mig
    profile = _NOT_DNS.sub("-", mig.profile.replace(".", "").lower()).strip("-")
    return f"gpu-{gpu.minor}-mig-{profile}-{mig.gi_id}-{mig.ci_id}"


def _dev_number(paths: Sequence[str], prefix: str) -> int | None:
    for path in paths:
        if path.startswith(prefix) and path[len(prefix) :].isdigit():
            return int(path[len(prefix) :])
    return None


# -- device bodies ----------------------------------------------------------------------


def device_body(
    device: DraDevice,
    inventory: Inventory,
    driver: str,
    *,
    fault: Fault | None = None,
    pcie_roots: Mapping[str, str] | None = None,
) -> Device:
    """One `spec.devices[]` entry: name, attributes, capacity, sharing, health taint.

    `pcie_roots` maps a PCI bus ID to its root complex (`pci0000:16`, read from sysfs by
    the caller): known, it becomes `resource.kubernetes.io/pcieRoot`, which a claim's
    `matchAttribute` can use to keep several GPUs under one root.
    """
    unit = device.unit
    if unit.gpu.vendor is Vendor.AMD:
        attributes, capacity = _amd(unit, inventory)
    else:
        attributes, capacity = _nvidia(unit, inventory)
    gpu = unit.gpu
    root = (pcie_roots or {}).get(gpu.pci_bus_id)
    if root:
        attributes[f"{STANDARD}pcieRoot"] = {"string": root}
    attributes[f"{KUBEGPU}resource"] = {"string": device.resource.name}
    attributes[f"{KUBEGPU}index"] = {"string": unit.index}
    domain = nvlink_domain(gpu, inventory)
    if domain is not None:
        attributes[f"{KUBEGPU}nvlinkDomain"] = {"int": domain}
    body: Device = {"name": device.name, "attributes": attributes}
    if device.shares > 1:
        attributes[f"{KUBEGPU}sharing"] = {"string": device.resource.sharing.value}
        entry = device.resource.shared_by
        sizing = entry.sizing if entry is not None else None
        capacity = _shared(capacity, device.shares, sizing, unit_memory_bytes(unit))
        if sizing is not None:
            memory, compute = mechanisms(device.resource, unit, inventory.memory_limits)
            attributes[MEMORY_LIMIT] = {"string": memory.value}
            attributes[COMPUTE_LIMIT] = {"string": compute.value}
        body["allowMultipleAllocations"] = True
    body["capacity"] = capacity
    if unit.health is Health.UNHEALTHY:
        body["taints"] = [health_taint(driver, fault or Fault())]
    if len(attributes) + len(capacity) > MAX_ATTRIBUTES_AND_CAPACITIES:
        # Built from fixed name lists: reaching the limit is a bug here, not bad input.
        raise ValueError(f"device {device.name}: more than 32 attributes and capacities")
    return body


def _nvidia(unit: Unit, inventory: Inventory) -> tuple[dict[str, Attribute], dict[str, Capacity]]:
    gpu = unit.gpu
    attributes: dict[str, Attribute] = {
        "type": {"string": "gpu" if unit.mig is None else "mig"},
        "uuid": {"string": unit.uuid},
    }
    if unit.mig is not None:
        attributes["parentUUID"] = {"string": gpu.uuid}
        attributes["profile"] = {"string": unit.mig.profile}
    attributes |= {
        "productName": {"string": _fit(gpu.product)},
        "brand": {"string": _NVLIB_BRANDS.get(gpu.brand, gpu.brand or "Unknown")},
        "architecture": {"string": architecture(gpu.compute_capability)},
        "cudaComputeCapability": {"version": "{}.{}.0".format(*gpu.compute_capability)},
    }
    driver_version = semver(inventory.driver_version)
    if driver_version is not None:
        attributes["driverVersion"] = {"version": driver_version}
    if inventory.cuda_driver_version != (0, 0):
        attributes["cudaDriverVersion"] = {
            "version": "{}.{}.0".format(*inventory.cuda_driver_version)
        }
    attributes[f"{STANDARD}pciBusID"] = {"string": gpu.pci_bus_id}
    if gpu.numa_node is not None:
        attributes[f"{STANDARD}numaNode"] = {"int": gpu.numa_node}
    if unit.mig is None:
        return attributes, {"memory": {"value": binary(gpu.memory_mib * _MIB)}}
    mig = unit.mig
    counts = mig.attributes
    capacity: dict[str, Capacity] = {
        "multiprocessors": {
            "value": binary(mig.multiprocessors or counts.get("multiprocessors", 0))
        },
        "copyEngines": {"value": binary(counts.get("engines.copy", 0))},
        "decoders": {"value": binary(counts.get("engines.decoder", 0))},
        "encoders": {"value": binary(counts.get("engines.encoder", 0))},
        "jpegEngines": {"value": binary(counts.get("engines.jpeg", 0))},
        "ofaEngines": {"value": binary(counts.get("engines.ofa", 0))},
        "memory": {"value": binary(mig.memory_mib * _MIB)},
    }
    return attributes, capacity


def _amd(unit: Unit, inventory: Inventory) -> tuple[dict[str, Attribute], dict[str, Capacity]]:
    gpu = unit.gpu
    amd = gpu.amd
    # ROCm publishes a GPU in SPX mode (or one that cannot be partitioned) whole, and every
    # device of a partitioned GPU as a partition carrying its parent's address and ID.
    partitioned = amd is not None and amd.compute_partition not in ("", "spx")
    parent = "parent" if partitioned else ""
    card = _dev_number(gpu.device_paths, "/dev/dri/card")
    attributes: dict[str, Attribute] = {
        "type": {"string": "amdgpu-partition" if partitioned else "amdgpu"},
        ("parentPciAddr" if partitioned else "pciAddr"): {"string": gpu.pci_bus_id},
        "renderIndex": {"int": gpu.minor},
    }
    if card is not None:
        attributes["cardIndex"] = {"int": card}
    if amd is not None:
        attributes[f"{parent}DeviceID" if parent else "deviceID"] = {"string": amd.pci_group}
    # ROCm reads the board's product_name file and joins its words with underscores.
    name = (amd.product_name if amd is not None and amd.product_name else gpu.product).strip()
    attributes["productName"] = {
        "string": _fit(name.replace(" ", "_").replace("(", "").replace(")", ""))
    }
    version = semver(inventory.driver_version)
    if version is not None:
        attributes["driverVersion"] = {"version": version}
    if inventory.amd is not None and inventory.amd.driver_src_version:
        attributes["driverSrcVersion"] = {"string": _fit(inventory.amd.driver_src_version)}
    if amd is not None and amd.compute_partition and amd.memory_partition:
        profile = f"{amd.compute_partition}_{amd.memory_partition}"
        attributes["partitionProfile"] = {"string": profile}
    if not partitioned:
        attributes[f"{STANDARD}pciBusID"] = {"string": gpu.pci_bus_id}
    if gpu.numa_node is not None:
        attributes[f"{STANDARD}numaNode"] = {"int": gpu.numa_node}
    memory = amd.vram_bytes if amd is not None and amd.vram_bytes else gpu.memory_mib * _MIB
    capacity: dict[str, Capacity] = {"memory": {"value": binary(memory)}}
    if amd is not None and amd.simd_count:
        if amd.simd_per_cu:  # KFD says how many SIMDs make a compute unit, or we do not know
            capacity["computeUnits"] = {"value": binary(amd.simd_count // amd.simd_per_cu)}
        capacity["simdUnits"] = {"value": binary(amd.simd_count)}
    return attributes, capacity


def _shared(
    capacity: Mapping[str, Capacity],
    shares: int,
    sizing: ClaimSizing | None = None,
    memory_bytes: int = 0,
) -> dict[str, Capacity]:
    """The capacity of a device `shares` claims may hold at once (time-slicing, MPS).

    `replicas: N` of the config becomes a `shares` capacity of N of which a request takes
    one unless it asks for more: N claims fit, as N pods fit on N replicas of the device
    plugin. Every other capacity of a device with `allowMultipleAllocations` is
    consumable too, and a request that names none would take all of it, so each gets a
    request policy whose default is 0: a claim takes memory (or engines) only when it
    asks for them. This is NVIDIA's `consumableShares: N` layout, so claims written for
    it behave the same.

    A device sized by memory (`sizing`, of `memory_bytes`) differs in two policies: an
    unsized claim takes `defaultMemory` and `defaultShares`, and memory is handed out in
    whole `memoryStep`s from one step up (the scheduler rounds a request up to the next
    step, and refuses one above the largest whole number of steps the device holds), so
    no claim is limited to nothing. The API's rules hold by construction: min + step <=
    capacity (checked with the config, `resources`), default and max whole steps from
    min, default <= max.
    """
    out: dict[str, Capacity] = {}
    for name, entry in capacity.items():
        value = entry["value"]
        policy: RequestPolicy = {"default": "0", "validRange": {"min": "0", "max": value}}
        if name == "memory":
            policy["validRange"]["step"] = "1Mi"  # whole MiB, as NVIDIA asks for
            if sizing is not None:
                step = sizing.step_bytes()
                policy = {
                    "default": binary(sizing.default_bytes(memory_bytes, shares)),
                    "validRange": {
                        "min": binary(step),
                        "max": binary(memory_bytes // step * step),
                        "step": binary(step),
                    },
                }
        out[name] = {"value": value, "requestPolicy": policy}
    count = decimal(shares)
    default = decimal(sizing.default_shares) if sizing is not None else "1"
    out["shares"] = {
        "value": count,
        "requestPolicy": {
            "default": default,
            "validRange": {"min": "1", "max": count, "step": "1"},
        },
    }
    return out


def health_taint(driver: str, fault: Fault) -> Taint:
    """The taint an unhealthy device carries, named as NVIDIA's driver names its own.

    NVIDIA's: `gpu.nvidia.com/xid` with the Xid as value, `gpu.nvidia.com/gpu-lost` for a
    GPU that stopped answering; a toleration written for NVIDIA's driver matches ours.
    ROCm's driver taints nothing; its devices get `gpu.amd.com/unhealthy`.
    `timeAdded` is left to the API server (it stamps new taints; `carry_taint_times`
    keeps the stamp of one that stays).
    """
    if driver != NVIDIA_DRIVER:
        return {"key": f"{driver}/unhealthy", "effect": TAINT_EFFECT}
    if fault.xid is not None:
        return {"key": f"{driver}/xid", "value": str(fault.xid), "effect": TAINT_EFFECT}
    return {"key": f"{driver}/gpu-lost", "effect": TAINT_EFFECT}


# -- slices -----------------------------------------------------------------------------


def build_slices(
    node: str,
    driver: str,
    devices: Sequence[Device],
    *,
    generation: int,
) -> list[dict[str, Any]]:
    """The pool's ResourceSlice bodies: pool = the node's name, `devices` in order.

    One slice while the devices fit (128, or 64 once any device carries a taint), else as
    many as needed, each counting the pool's slices. No devices: no slices. Names are
    left to the API server (`generateName`), as Kubernetes' own slice controller does.
    """
    if not devices:
        return []
    tainted = any(d.get("taints") for d in devices)
    per_slice = MAX_DEVICES_WITH_TAINTS if tainted else MAX_DEVICES
    chunks = [devices[i : i + per_slice] for i in range(0, len(devices), per_slice)]
    return [
        {
            "apiVersion": API_VERSION,
            "kind": "ResourceSlice",
            "metadata": {"generateName": slice_prefix(node, driver)},
            "spec": {
                "driver": driver,
                "nodeName": node,
                "pool": {
                    "name": node,
                    "generation": generation,
                    "resourceSliceCount": len(chunks),
                },
                "devices": [dict(d) for d in chunk],
            },
        }
        for chunk in chunks
    ]


def slice_prefix(node: str, driver: str) -> str:
    """`<node>-<driver>-`, cut so that the name the server completes stays within 253."""
    return f"{node}-{driver}"[: 253 - 6] + "-"


def carry_taint_times(
    devices: Sequence[Device], stored: Iterable[Mapping[str, Any]]
) -> list[Device]:
    """`devices` with each taint's `timeAdded` as the stored slices have it.

    The API server stamps a taint sent without a time with the time of the write; a taint
    that stays (same device, key, value, effect) keeps its first stamp, so an unrelated
    update does not make an old fault look new.
    """
    times: dict[tuple[str, str, str, str], str] = {}
    for obj in stored:
        for device in obj.get("spec", {}).get("devices") or []:
            for taint in device.get("taints") or []:
                if taint.get("timeAdded"):
                    times[_taint_key(device["name"], taint)] = taint["timeAdded"]
    out = []
    for device in devices:
        copy = device.copy()
        if "taints" in device:
            copy["taints"] = [
                _timed(taint, times.get(_taint_key(device["name"], taint)))
                for taint in device["taints"]
            ]
        out.append(copy)
    return out


def _taint_key(device: str, taint: Mapping[str, Any]) -> tuple[str, str, str, str]:
    return (device, taint["key"], taint.get("value", ""), taint["effect"])


def _timed(taint: Taint, stamp: str | None) -> Taint:
    copy = taint.copy()
    if stamp:
        copy["timeAdded"] = stamp
    return copy


# -- values -----------------------------------------------------------------------------


def architecture(capability: tuple[int, int]) -> str:
    """NVML's architecture for a compute capability, as go-nvlib spells it (`Hopper`)."""
    major, minor = capability
    if major == 7:
        return "Turing" if minor >= 5 else "Volta"
    if major == 8:
        return "Ada Lovelace" if minor >= 9 else "Ampere"
    names = {3: "Kepler", 5: "Maxwell", 6: "Pascal", 9: "Hopper", 10: "Blackwell"}
    names |= {12: "Blackwell", 11: "Blackwell"}
    return names.get(major, "Unknown")


def semver(version: str) -> str | None:
    """A driver version as a semantic version: `550.54.15` as is, `535.104.05` as
    `535.104.5`, `12.4` as `12.4.0`; None without a number.

    The API accepts only semver 2.0 (no leading zeros), and NVIDIA's driver versions
    have them: NVIDIA's DRA driver fails on such a version, kubegpu drops the zeros.
    """
    numbers = _NUMBERS.findall(version.split("-")[0])[:3]
    if not numbers:
        return None
    parts = [str(int(n)) for n in numbers] + ["0"] * (3 - len(numbers))
    return ".".join(parts)


def nvlink_domain(gpu: Gpu, inventory: Inventory) -> int | None:
    """The lowest GPU index among the GPUs `gpu` reaches over NVLink, itself included.

    GPUs with the same value are joined by NVLink paths (directly or through NVSwitches);
    `matchAttribute: kubegpu.io/nvlinkDomain` keeps a claim's GPUs in one such domain.
    None for a GPU without NVLink peers.
    """
    if gpu.vendor is not Vendor.NVIDIA:
        return None
    by_uuid = {g.uuid: g for g in inventory.gpus}
    seen = {gpu.uuid}
    todo = [gpu]
    while todo:
        current = todo.pop()
        for link in current.links:
            peer = by_uuid.get(link.peer_uuid)
            if link.kind is LinkKind.NVLINK and peer is not None and peer.uuid not in seen:
                seen.add(peer.uuid)
                todo.append(peer)
    if len(seen) == 1:
        return None
    return min(by_uuid[u].index for u in seen)


def binary(value: int) -> str:
    """A quantity in the API server's canonical binary form: `80Gi`, `81559Mi`, `7`."""
    return _canonical(value, 1024, _BINARY)


def decimal(value: int) -> str:
    """A count in the API server's canonical decimal form: `8`, `1k`."""
    return _canonical(value, 1000, _DECIMAL)


def _canonical(value: int, base: int, suffixes: Sequence[str]) -> str:
    exponent = 0
    while value and value % base == 0 and exponent < len(suffixes) - 1:
        value //= base
        exponent += 1
    return f"{value}{suffixes[exponent]}"


def _fit(text: str) -> str:
    """A string attribute within the API's 64 characters."""
    return text[:MAX_VALUE_LENGTH]


__all__ = [
    "AMD_DRIVER",
    "NVIDIA_DRIVER",
    "Attribute",
    "Capacity",
    "Device",
    "DraDevice",
    "Fault",
    "RequestPolicy",
    "Taint",
    "build_slices",
    "carry_taint_times",
    "device_body",
    "dra_devices",
    "health_taint",
]
