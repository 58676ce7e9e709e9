"""A simulated GPU node: presets or a YAML description, with fault injection.

It lets the whole plugin (and a real kubelet, with `kubegpu serve --simulate`) run on a
machine without GPUs, and lets tests and operators break GPUs on purpose. UUIDs are
deterministic (uuid5 of the node name and index), so restarts keep device IDs stable.

Node file format (`docs/simulated-node.md` has the long version)::

    name: lab-node            # seeds the UUIDs; default: the file name without .yaml
    driver_version: "550.54.15"
    cuda_version: "12.4"
    interconnect: nvlink      # nvlink (full mesh) or a PCIe relation: PIX, PXB, PHB, NODE
    nvlinks: 18               # lanes per GPU pair when interconnect is nvlink
    defaults: {product: NVIDIA H100 80GB HBM3, memory_mib: 81559, compute_capability: "9.0"}
    gpus:                     # one entry per GPU (or `count: N` to repeat an entry)
      - numa_node: 0
        mig: [3g.40gb, 2g.20gb]   # MIG enabled with these slices (needs mig_capable: true)
        healthy: false            # probes fail with `probe_error` (or a default text)
        xid: 79                   # inject this Xid (again whenever the value changes)

GPU keys: product, memory_mib, compute_capability, multiprocessors, brand, numa_node,
pci_bus_id, uuid, mig_capable, mig, healthy, probe_error, xid, count, processes (each
`{pid, memory_mib, type, sm_util, mem_util, mig}`, `mig` the slot of a MIG slice), and the fabric:
nvlinks ({peer index: lanes}), nvswitch (domain name), nvswitch_links, links_down
({peer: n} or {nvswitch: n}), pcie_switch, pcie_host_bridge. Cross-NUMA pairs are always
`SYS` on PCIe. While watching, a file-backed node re-reads the file when inotify
says it changed, so editing `xid`, `healthy` or `mig` injects faults into a running daemon.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import threading
import uuid as uuidlib
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from kubegpu.devices.model import (
    Gpu,
    GpuProcess,
    Health,
    HealthEvent,
    HealthEventKind,
    Inventory,
    Link,
    LinkKind,
    MigDevice,
    ProcessKind,
    ProcessTable,
    StopFlag,
)
from kubegpu.errors import DeviceError
from kubegpu.nvidia_paths import REQUIRED_CONTROL_DEVICES, gpu_device_node, mig_cap_node
from kubegpu.watch import BlockingPathWatch

log = logging.getLogger("kubegpu.devices.simulated")

PRESETS = (
    "h100-8",
    "a10g-4",
    "t4-1",
    "a100-40gb-mig",
    "h100-mig",
    "dgx1-v100",
    "hgx-h100",
    "hgx-h100-2x8",
)
#: Where the presets' YAML files are (each `<name>.yaml`).
PRESET_DIR = Path(__file__).with_name("presets")
#: The presets are files we ship, read with libyaml's parser where PyYAML has it (~3 ms
#: less of a simulated start); a node file from a user goes through PyYAML's own safe
#: loader, whose errors the fuzz tests hold to one line.
PRESET_LOADER: type[yaml.SafeLoader] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
#: How often a file-backed node checks its file where inotify is unavailable (the fallback).
POLL_SECONDS = 0.2
_UUID_NS = uuidlib.UUID("0b6f3f0e-8f5e-4c1a-9a57-6b5d2f4c9e21")
_PROFILE_RE = re.compile(r"^(?:(\d+)c\.)?(\d+)g\.(\d+)gb(\+me|\+me\.all|-me|\+gfx)?$")
_TOP_KEYS = {
    "name",
    "driver_version",
    "cuda_version",
    "interconnect",
    "nvlinks",
    "nvlink_version",
    "defaults",
    "gpus",
}
_GPU_KEYS = {
    "product",
    "memory_mib",
    "compute_capability",
    "multiprocessors",
    "brand",
    "numa_node",
    "pci_bus_id",
    "uuid",
    "mig_capable",
    "mig",
    "healthy",
    "probe_error",
    "xid",
    "count",
    "nvlinks",
    "links_down",
    "nvswitch",
    "nvswitch_links",
    "pcie_switch",
    "pcie_host_bridge",
    "processes",
}
_PROCESS_KEYS = {"pid", "memory_mib", "type", "sm_util", "mem_util", "mig"}
#: The process types of the simulated NVML (`compute+graphics` is on both lists).
_PROCESS_TYPES = {
    "compute": (ProcessKind.COMPUTE,),
    "graphics": (ProcessKind.GRAPHICS,),
    "mps": (ProcessKind.MPS,),
    "compute+graphics": (ProcessKind.COMPUTE, ProcessKind.GRAPHICS),
}
#: As the simulated NVML's table: at most this many processes per GPU.
MAX_PROCESSES = 512
#: The `links_down` key for links into the GPU's NVSwitch domain.
_SWITCH = "nvswitch"
_PCIE = {kind.value: kind for kind in LinkKind if kind is not LinkKind.NVLINK}


@dataclass(frozen=True)
class ProcessSpec:
    """A process running on a simulated GPU (or on one of its MIG slices)."""

    pid: int
    memory_mib: int = 0
    kinds: tuple[ProcessKind, ...] = (ProcessKind.COMPUTE,)
    sm_util: int = 0
    mem_util: int = 0
    #: The MIG slice (its slot in the GPU's `mig` list) it runs on; None: the whole GPU.
    mig: int | None = None


@dataclass(frozen=True)
class GpuSpec:
    """One GPU of a node description."""

    product: str = "NVIDIA H100 80GB HBM3"
    memory_mib: int = 81559
    compute_capability: tuple[int, int] = (9, 0)
    multiprocessors: int = 132
    brand: str = "NVIDIA"
    numa_node: int | None = 0
    pci_bus_id: str | None = None
    uuid: str | None = None
    mig_capable: bool = False
    #: MIG profiles when MIG is enabled; None when it is off.
    mig: tuple[str, ...] | None = None
    healthy: bool = True
    probe_error: str | None = None
    xid: int | None = None
    #: NVLink lanes to peer GPUs by index: ((peer, lanes), ...), direct wiring (DGX-1).
    nvlinks: tuple[tuple[int, int], ...] = ()
    #: Lanes that are down: ((peer index, n), ...); peer -1 = links into the NVSwitches.
    links_down: tuple[tuple[int, int], ...] = ()
    #: NVSwitch domain (any name): GPUs of one domain reach each other through switches.
    nvswitch: str | None = None
    nvswitch_links: int = 18
    #: PCIe switch and host bridge (any numbers): same switch is PIX, same bridge PHB.
    pcie_switch: int | None = None
    pcie_host_bridge: int | None = None
    processes: tuple[ProcessSpec, ...] = ()

    def down(self, peer: int) -> int:
        return sum(n for p, n in self.links_down if p == peer)

    def static(self) -> GpuSpec:
        """The hardware facts only (what a change of needs rediscovery)."""
        return dataclasses.replace(
            self, mig=None, healthy=True, probe_error=None, xid=None, processes=()
        )


@dataclass(frozen=True)
class NodeSpec:
    name: str
    gpus: tuple[GpuSpec, ...]
    driver_version: str = "550.54.15"
    cuda_version: tuple[int, int] = (12, 4)
    interconnect: str = "PHB"
    nvlinks: int = 18
    #: NVLink generation (1..5); None: from the GPUs' compute capability.
    nvlink_version: int | None = None


#: Bounds on a node description: a file is hand-written or generated for a test, so
#: anything past these is a mistake (or an attack), refused before it costs memory.
MAX_FILE_BYTES = 1 << 20
MAX_GPUS = 256
_MAX_TEXT = 256
_INT_RANGES = {
    "memory_mib": (1, 1 << 24),
    "multiprocessors": (1, 4096),
    "xid": (0, 1 << 16),
    "numa_node": (0, 1023),
    "count": (1, MAX_GPUS),
    "nvlinks": (0, 64),
    "nvswitch_links": (0, 64),
    "lanes": (0, 64),
    "peer": (0, MAX_GPUS - 1),
    "pcie_switch": (0, 1 << 16),
    "pcie_host_bridge": (0, 1 << 16),
    "nvlink_version": (1, 5),
    "pid": (1, (1 << 22)),
    "sm_util": (0, 100),
    "mem_util": (0, 100),
    "mig": (0, 7),
}


def _text(value: Any, where: str) -> str:
    """A scalar as text; a list or mapping here is a mistake, and expanding one is costly."""
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise DeviceError(f"{where}: expected text, got {type(value).__name__}")
    text = str(value)
    if len(text) > _MAX_TEXT or not text.isprintable():
        raise DeviceError(f"{where}: expected printable text of at most {_MAX_TEXT} characters")
    return text


def _int(value: Any, key: str, where: str) -> int:
    low, high = _INT_RANGES[key]
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise DeviceError(f"{where}.{key}: expected a whole number, got {type(value).__name__}")
    try:
        number = int(value) if isinstance(value, int) or len(value) <= 12 else None
    except ValueError:
        number = None
    if number is None or not low <= number <= high:
        raise DeviceError(f"{where}.{key}: expected a whole number from {low} to {high}")
    return number


def _version(value: Any, where: str) -> tuple[int, int]:
    if isinstance(value, list | tuple) and len(value) == 2:
        parts = [_text(v, where) for v in value]
    else:
        parts = _text(value, where).split(".")
    if len(parts) != 2 or not all(p.isdigit() and len(p) <= 4 for p in parts):
        raise DeviceError(f'{where}: {value!r} is not a version like "9.0"')
    return (int(parts[0]), int(parts[1]))


def parse_profile(profile: str, where: str = "mig") -> tuple[int, int, int]:
    """`1g.10gb` / `1c.3g.40gb` / `1g.10gb+me` -> (GI slices, CI slices, GB)."""
    match = _PROFILE_RE.match(profile)
    if match is None or not 1 <= int(match.group(2)) <= 8:
        raise DeviceError(f"{where}: {profile!r} is not a MIG profile like 1g.10gb or 1c.3g.40gb")
    ci_text, gi_text, gb_text, _ = match.groups()
    gi = int(gi_text)
    return gi, int(ci_text) if ci_text else gi, int(gb_text)


def _check_layout(gpu: GpuSpec, profiles: tuple[str, ...], where: str) -> None:
    if not gpu.mig_capable:
        raise DeviceError(f"{where}: {gpu.product} is not MIG-capable; set mig_capable: true")
    parsed = [parse_profile(p, where) for p in profiles]
    if sum(gi for gi, _, _ in parsed) > 7:
        raise DeviceError(
            f"{where}: {list(profiles)} needs more than the 7 compute slices of a GPU"
        )
    if sum(gb for _, _, gb in parsed) * 1024 > gpu.memory_mib * 1.05:
        raise DeviceError(f"{where}: {list(profiles)} needs more memory than {gpu.memory_mib} MiB")


def _gpu_spec(entry: Any, defaults: Mapping[str, Any], where: str) -> tuple[GpuSpec, int]:
    if not isinstance(entry, Mapping):
        raise DeviceError(f"{where}: expected a mapping of GPU fields")
    merged = {**defaults, **entry}
    unknown = sorted(str(key) for key in set(merged) - _GPU_KEYS)
    if unknown:
        raise DeviceError(
            f"{where}: unknown key {unknown[0]!r}; known: {', '.join(sorted(_GPU_KEYS))}"
        )
    fields: dict[str, Any] = {}
    for key in ("product", "brand", "pci_bus_id", "uuid", "probe_error"):
        if merged.get(key) is not None:
            fields[key] = _text(merged[key], f"{where}.{key}")
    for key in ("memory_mib", "multiprocessors", "xid", "nvswitch_links"):
        if merged.get(key) is not None:
            fields[key] = _int(merged[key], key, where)
    for key in ("pcie_switch", "pcie_host_bridge"):
        if merged.get(key) is not None:
            fields[key] = _int(merged[key], key, where)
    if merged.get("nvswitch") is not None:
        fields["nvswitch"] = _text(merged["nvswitch"], f"{where}.nvswitch")
    if merged.get("nvlinks") is not None:
        fields["nvlinks"] = _per_peer(merged["nvlinks"], f"{where}.nvlinks", switch=False)
    if merged.get("links_down") is not None:
        fields["links_down"] = _per_peer(merged["links_down"], f"{where}.links_down", switch=True)
    if merged.get("processes") is not None:
        fields["processes"] = _processes(merged["processes"], f"{where}.processes")
    if "numa_node" in merged:
        numa = merged["numa_node"]
        fields["numa_node"] = None if numa is None else _int(numa, "numa_node", where)
    for key in ("mig_capable", "healthy"):
        if key in merged:
            if not isinstance(merged[key], bool):
                raise DeviceError(f"{where}.{key}: expected true or false, got {merged[key]!r}")
            fields[key] = merged[key]
    count = _int(merged.get("count", 1), "count", where)
    if "compute_capability" in merged:
        fields["compute_capability"] = _version(
            merged["compute_capability"], f"{where}.compute_capability"
        )
    if merged.get("mig") is not None:
        if not isinstance(merged["mig"], list) or len(merged["mig"]) > 8:
            raise DeviceError(f"{where}.mig: expected a list of profiles like [1g.10gb, 3g.40gb]")
        fields["mig"] = tuple(_text(p, f"{where}.mig") for p in merged["mig"])
    gpu = GpuSpec(**fields)
    if gpu.mig is not None:
        _check_layout(gpu, gpu.mig, f"{where}.mig")
    return gpu, count


def _processes(value: Any, where: str) -> tuple[ProcessSpec, ...]:
    if not isinstance(value, list) or len(value) > MAX_PROCESSES:
        raise DeviceError(
            f"{where}: expected a list of at most {MAX_PROCESSES} processes like "
            f"[{{pid: 4242, memory_mib: 6144, sm_util: 40}}]"
        )
    found = []
    for i, entry in enumerate(value):
        at = f"{where}[{i}]"
        if not isinstance(entry, Mapping) or "pid" not in entry:
            raise DeviceError(f"{at}: expected a mapping with a pid, like {{pid: 4242}}")
        unknown = sorted(str(key) for key in set(entry) - _PROCESS_KEYS)
        if unknown:
            raise DeviceError(
                f"{at}: unknown key {unknown[0]!r}; known: {', '.join(sorted(_PROCESS_KEYS))}"
            )
        kind = _text(entry.get("type", "compute"), f"{at}.type")
        if kind not in _PROCESS_TYPES:
            raise DeviceError(f"{at}.type: {kind!r} is not one of {', '.join(_PROCESS_TYPES)}")
        mig = entry.get("mig")
        found.append(
            ProcessSpec(
                pid=_int(entry["pid"], "pid", at),
                # 0 MiB is a process that holds no memory yet; the GPU's bounds otherwise.
                memory_mib=(
                    0
                    if entry.get("memory_mib", 0) == 0
                    else _int(entry["memory_mib"], "memory_mib", at)
                ),
                kinds=_PROCESS_TYPES[kind],
                sm_util=_int(entry.get("sm_util", 0), "sm_util", at),
                mem_util=_int(entry.get("mem_util", 0), "mem_util", at),
                mig=None if mig is None else _int(mig, "mig", at),
            )
        )
    return tuple(found)


def _per_peer(value: Any, where: str, *, switch: bool) -> tuple[tuple[int, int], ...]:
    """`{peer index: lanes}` (and, for links_down, `nvswitch: n`) as sorted pairs."""
    if not isinstance(value, Mapping) or len(value) > MAX_GPUS:
        hint = "{1: 2, 3: 1}" + (" or {nvswitch: 2}" if switch else "")
        raise DeviceError(f"{where}: expected a mapping of peer GPU index to lanes, like {hint}")
    pairs: dict[int, int] = {}
    for peer, lanes in value.items():
        index = -1 if switch and peer == _SWITCH else _int(peer, "peer", f"{where} key")
        pairs[index] = pairs.get(index, 0) + _int(lanes, "lanes", f"{where}[{peer}]")
    return tuple(sorted(pairs.items()))


def _check_peers(gpus: list[GpuSpec], source: str) -> None:
    for index, gpu in enumerate(gpus):
        for key, pairs in (("nvlinks", gpu.nvlinks), ("links_down", gpu.links_down)):
            for peer, _ in pairs:
                if peer == index or peer >= len(gpus):
                    raise DeviceError(
                        f"{source}: gpus[{index}].{key}: peer {peer} is not another GPU "
                        f"(indices 0-{len(gpus) - 1}, counted after `count` expands)"
                    )


def parse_node(data: Any, name: str, source: str) -> NodeSpec:
    """Validate a node description; errors name the file and the field."""
    if not isinstance(data, Mapping):
        raise DeviceError(f"{source}: expected a mapping with a `gpus` list")
    unknown = sorted(str(key) for key in set(data) - _TOP_KEYS)
    if unknown:
        raise DeviceError(
            f"{source}: unknown key {unknown[0]!r}; known: {', '.join(sorted(_TOP_KEYS))}"
        )
    entries = data.get("gpus")
    if not isinstance(entries, list) or not entries:
        raise DeviceError(f"{source}: `gpus` must be a non-empty list")
    defaults = data.get("defaults") or {}
    if not isinstance(defaults, Mapping):
        raise DeviceError(f"{source}: `defaults` must be a mapping of GPU fields")
    gpus: list[GpuSpec] = []
    for i, entry in enumerate(entries):
        gpu, count = _gpu_spec(entry, defaults, f"{source}: gpus[{i}]")
        if len(gpus) + count > MAX_GPUS:
            raise DeviceError(f"{source}: more than {MAX_GPUS} GPUs; describe a smaller node")
        gpus.extend([gpu] * count)
    _check_peers(gpus, source)
    version = data.get("nvlink_version")
    interconnect = _text(data.get("interconnect", "PHB"), f"{source}: interconnect")
    if interconnect != "nvlink" and interconnect not in _PCIE:
        raise DeviceError(
            f"{source}: interconnect {interconnect!r} is not nvlink or one of {', '.join(_PCIE)}"
        )
    return NodeSpec(
        name=_text(data.get("name", name), f"{source}: name"),
        gpus=tuple(gpus),
        driver_version=_text(data.get("driver_version", "550.54.15"), f"{source}: driver_version"),
        cuda_version=_version(data.get("cuda_version", "12.4"), f"{source}: cuda_version"),
        interconnect=interconnect,
        nvlinks=_int(data.get("nvlinks", 18), "nvlinks", source),
        nvlink_version=None if version is None else _int(version, "nvlink_version", source),
    )


def _read(path: Path) -> NodeSpec:
    try:
        raw = path.read_bytes()
        if len(raw) > MAX_FILE_BYTES:
            raise DeviceError(
                f"simulated node {path} is larger than {MAX_FILE_BYTES} bytes; "
                f"describe the node with `count:` and `defaults:` instead"
            )
        data = yaml.safe_load(raw.decode("utf-8"))
    except RecursionError as err:
        raise DeviceError(f"simulated node {path} is nested too deeply to read") from err
    except UnicodeDecodeError as err:
        raise DeviceError(
            f"simulated node {path} is not text (byte {err.start} is not UTF-8); "
            f"give a YAML node description or a preset name"
        ) from err
    except (OSError, yaml.YAMLError, ValueError, TypeError, OverflowError) as err:
        # YAML errors span lines (problem, context, a caret); one line is enough here.
        # PyYAML's constructors raise the others for scalars Python refuses (4,301 digits).
        raise DeviceError(
            f"cannot read simulated node {path}: {' '.join(str(err).split())}"
        ) from err
    return parse_node(data, path.stem, str(path))


#: NVLink generation by compute capability major (Pascal 1 ... Blackwell 5).
_NVLINK_BY_MAJOR = {6: 1, 7: 2, 8: 3, 9: 4, 10: 5}


def _wired(gpu: GpuSpec) -> bool:
    return bool(gpu.nvlinks) or gpu.nvswitch is not None


def _lanes(spec: NodeSpec, a: int, b: int) -> int:
    """Active NVLink lanes between GPUs a and b: direct wiring (declared on either side),
    the node-wide mesh for GPUs without wiring of their own, and the NVSwitch domain both
    are in; links that are down subtract."""
    ga, gb = spec.gpus[a], spec.gpus[b]
    direct = max(dict(ga.nvlinks).get(b, 0), dict(gb.nvlinks).get(a, 0))
    if not direct and spec.interconnect == "nvlink" and not (_wired(ga) or _wired(gb)):
        direct = spec.nvlinks
    direct = max(0, direct - max(ga.down(b), gb.down(a)))
    switched = 0
    if ga.nvswitch is not None and ga.nvswitch == gb.nvswitch:
        switched = max(0, min(ga.nvswitch_links - ga.down(-1), gb.nvswitch_links - gb.down(-1)))
    return direct + switched


def _pcie(spec: NodeSpec, a: GpuSpec, b: GpuSpec) -> LinkKind:
    """The PCIe relation: NUMA first (across nodes is always SYS), then the GPUs' own
    switch and host bridge, else the node-wide `interconnect`."""
    if a.numa_node != b.numa_node:
        return LinkKind.CROSS_NUMA
    if a.pcie_switch is not None and a.pcie_switch == b.pcie_switch:
        return LinkKind.SINGLE_SWITCH
    if a.pcie_host_bridge is not None and a.pcie_host_bridge == b.pcie_host_bridge:
        return LinkKind.HOST_BRIDGE
    placed = (a.pcie_switch, a.pcie_host_bridge, b.pcie_switch, b.pcie_host_bridge)
    if any(x is not None for x in placed) or spec.interconnect == "nvlink":
        return LinkKind.SAME_NUMA
    return _PCIE[spec.interconnect]


class SimulatedBackend:
    """A node of simulated NVIDIA GPUs; thread-safe fault injection for tests and demos."""

    name = "simulated"

    def __init__(self, spec: NodeSpec, path: Path | None = None) -> None:
        self._spec = spec
        self._path = path
        self._stamp = self._file_stamp()
        self._lock = threading.RLock()
        self._pending: deque[HealthEvent] = deque()
        self._mig: dict[int, tuple[str, ...] | None] = {i: g.mig for i, g in enumerate(spec.gpus)}
        self._probe_errors: dict[str, str] = {}
        #: GPU index -> its running processes: the file's, then started and stopped ones.
        self._procs: dict[int, tuple[ProcessSpec, ...]] = {
            i: g.processes for i, g in enumerate(spec.gpus)
        }
        #: The watch threads' waits, interrupted by every injection.
        self._waiters: set[BlockingPathWatch] = set()
        with self._lock:
            for index, gpu in enumerate(spec.gpus):
                self._initial_faults(index, gpu)

    def _initial_faults(self, index: int, gpu: GpuSpec) -> None:
        """Faults written in the file before the node started are reported on the first watch."""
        if not gpu.healthy:
            self._fail(index, gpu.probe_error or self._default_fault())
        if gpu.xid is not None:
            self._pending.append(
                HealthEvent(self._uuid(index), HealthEventKind.XID, gpu.xid, "node file")
            )

    @classmethod
    def load(cls, spec: str) -> SimulatedBackend:
        """A preset by name (see `PRESETS`) or a node description file."""
        if spec in PRESETS:
            # The presets are package files beside this module (pyproject's package-data).
            text = (PRESET_DIR / f"{spec}.yaml").read_text(encoding="utf-8")
            return cls(parse_node(yaml.load(text, Loader=PRESET_LOADER), spec, f"preset {spec}"))
        path = Path(spec)
        if not path.is_file():
            raise DeviceError(
                f"simulated node {spec!r} is neither a preset ({', '.join(PRESETS)}) nor a file"
            )
        return cls(_read(path), path)

    # -- model ------------------------------------------------------------------------

    def _uuid(self, index: int) -> str:
        gpu = self._spec.gpus[index]
        return gpu.uuid or f"GPU-{uuidlib.uuid5(_UUID_NS, f'{self._spec.name}/{index}')}"

    def _default_fault(self) -> str:
        return f"marked unhealthy in {self._path or 'the node description'}"

    def _migs(self, index: int, gpu_uuid: str) -> tuple[MigDevice, ...]:
        gpu = self._spec.gpus[index]
        sms_per_slice = max(2, (gpu.multiprocessors // 7) // 2 * 2)
        migs = []
        for slot, profile in enumerate(self._mig.get(index) or ()):
            gi_slices, ci_slices, gb = parse_profile(profile)
            gi_id = slot + 1
            cap = 3 + index * 150 + gi_id * 9  # plausible /dev/nvidia-caps minors
            migs.append(
                MigDevice(
                    uuid=f"MIG-{uuidlib.uuid5(_UUID_NS, f'{gpu_uuid}/{slot}/{profile}')}",
                    parent_uuid=gpu_uuid,
                    parent_index=index,
                    mig_index=slot,
                    gi_id=gi_id,
                    ci_id=0,
                    profile=profile,
                    memory_mib=min(int(gb * 1024 * 0.97), gpu.memory_mib),
                    multiprocessors=sms_per_slice * ci_slices,
                    device_paths=(mig_cap_node(cap), mig_cap_node(cap + 1)),
                    attributes={
                        "multiprocessors": sms_per_slice * ci_slices,
                        "slices.gi": gi_slices,
                        "slices.ci": ci_slices,
                        "engines.copy": gi_slices,
                        "engines.decoder": gi_slices // 2 or (1 if "+me" in profile else 0),
                        "engines.encoder": 0,
                        "engines.jpeg": 1 if gi_slices == 7 or "+me" in profile else 0,
                        "engines.ofa": 1 if gi_slices == 7 or "+me" in profile else 0,
                    },
                )
            )
        return tuple(migs)

    def _links(self, index: int, uuids: list[str]) -> tuple[Link, ...]:
        spec = self._spec
        own = spec.gpus[index]
        links = []
        for peer_index, peer_uuid in enumerate(uuids):
            if peer_index == index:
                continue
            peer = spec.gpus[peer_index]
            lanes = _lanes(spec, index, peer_index)
            if lanes > 0:
                version = spec.nvlink_version or _NVLINK_BY_MAJOR.get(own.compute_capability[0], 0)
                links.append(Link(peer_uuid, LinkKind.NVLINK, lanes, nvlink_version=version))
            else:
                links.append(Link(peer_uuid, _pcie(spec, own, peer)))
        return tuple(links)

    def discover(self) -> Inventory:
        with self._lock:
            spec = self._spec
            uuids = [self._uuid(i) for i in range(len(spec.gpus))]
            gpus = []
            for index, gpu in enumerate(spec.gpus):
                uuid = uuids[index]
                gpus.append(
                    Gpu(
                        index=index,
                        uuid=uuid,
                        minor=index,
                        product=gpu.product,
                        memory_mib=gpu.memory_mib,
                        pci_bus_id=(
                            gpu.pci_bus_id or f"0000:{0x18 + 0x10 * index:02x}:00.0"
                        ).lower(),
                        numa_node=gpu.numa_node,
                        compute_capability=gpu.compute_capability,
                        device_paths=(gpu_device_node(index),),
                        mig_enabled=self._mig.get(index) is not None,
                        mig_capable=gpu.mig_capable,
                        mig_devices=self._migs(index, uuid),
                        links=self._links(index, uuids),
                        brand=gpu.brand,
                        health=Health.UNHEALTHY if uuid in self._probe_errors else Health.HEALTHY,
                    )
                )
            return Inventory(
                gpus=tuple(gpus),
                driver_version=spec.driver_version,
                cuda_driver_version=spec.cuda_version,
                control_device_paths=REQUIRED_CONTROL_DEVICES,
                backend=self.name,
                simulated=True,
            )

    # -- fault injection (any thread) ---------------------------------------------------

    def _index(self, gpu: int | str) -> int:
        """A GPU index from an index, a GPU UUID, or a MIG UUID (its parent)."""
        count = len(self._spec.gpus)
        if isinstance(gpu, int):
            if 0 <= gpu < count:
                return gpu
        else:
            for index in range(count):
                uuid = self._uuid(index)
                if gpu == uuid or any(m.uuid == gpu for m in self._migs(index, uuid)):
                    return index
        raise DeviceError(f"simulated node has no GPU {gpu!r} (GPUs 0-{count - 1} or a UUID)")

    def _target(self, gpu: int | str) -> str:
        index = self._index(gpu)
        return gpu if isinstance(gpu, str) else self._uuid(index)

    def _push(self, event: HealthEvent) -> None:
        self._pending.append(event)
        for waiter in self._waiters:
            waiter.interrupt()

    def inject_xid(self, gpu: int | str, xid: int) -> None:
        """Report Xid `xid` on a GPU (index or UUID) or MIG slice (UUID)."""
        with self._lock:
            self._push(HealthEvent(self._target(gpu), HealthEventKind.XID, xid, "injected"))

    def _fail(self, gpu: int | str, message: str) -> None:
        uuid = self._target(gpu)
        self._probe_errors[uuid] = message
        self._push(HealthEvent(uuid, HealthEventKind.PROBE_FAILED, detail=message))

    def fail_probe(self, gpu: int | str, message: str) -> None:
        """Make probes of the device fail with `message` (and report it at once)."""
        with self._lock:
            self._fail(gpu, message)

    def clear_fault(self, gpu: int | str) -> None:
        """Probes pass again, silently: a transient fault the health probes should notice."""
        with self._lock:
            self._probe_errors.pop(self._target(gpu), None)

    def heal(self, gpu: int | str) -> None:
        """Probes pass again; the device (and a GPU's MIG slices) are declared healthy."""
        with self._lock:
            uuid = self._target(gpu)
            targets = [uuid]
            if isinstance(gpu, int) or uuid.startswith("GPU-"):
                targets += [
                    m.uuid for m in self._migs(self._index(gpu), self._uuid(self._index(gpu)))
                ]
            for target in targets:
                self._probe_errors.pop(target, None)
                self._push(HealthEvent(target, HealthEventKind.HEALED, detail="healed"))

    def set_mig_layout(self, gpu: int | str, profiles: list[str]) -> None:
        """Repartition a GPU (`[]`: MIG on, no slices); the next discover shows it."""
        with self._lock:
            index = self._index(gpu)
            where = f"GPU {index}"
            _check_layout(self._spec.gpus[index], tuple(profiles), where)
            self._mig[index] = tuple(profiles)
            self._push(HealthEvent(self._uuid(index), HealthEventKind.RECONFIGURED))

    def start_process(
        self,
        gpu: int | str,
        pid: int,
        memory_mib: int = 0,
        *,
        kind: str = "compute",
        sm_util: int = 0,
        mem_util: int = 0,
        mig: int | None = None,
    ) -> None:
        """A process starts on a GPU (index or UUID), or on its MIG slice in slot `mig`."""
        entry = {"pid": pid, "memory_mib": memory_mib, "type": kind}
        entry |= {"sm_util": sm_util, "mem_util": mem_util, "mig": mig}
        (process,) = _processes([{k: v for k, v in entry.items() if v is not None}], "process")
        with self._lock:
            index = self._index(gpu)
            self._procs[index] = (*self._procs.get(index, ()), process)

    def stop_process(self, pid: int) -> None:
        """The process ends, on every GPU it ran on."""
        with self._lock:
            for index, running in self._procs.items():
                self._procs[index] = tuple(p for p in running if p.pid != pid)

    def processes(self) -> ProcessTable:
        """The running processes, as the NVML backend reports them: a process on a MIG
        slice carries its instance IDs and no utilization (NVML keeps none for MIG)."""
        with self._lock:
            found = []
            for index in range(len(self._spec.gpus)):
                uuid = self._uuid(index)
                migs = self._migs(index, uuid) if self._mig.get(index) is not None else ()
                for p in self._procs.get(index, ()):
                    found.extend(_reported(p, uuid, migs))
            return ProcessTable(tuple(found))

    # -- health -----------------------------------------------------------------------

    def probe(self, uuid: str) -> str | None:
        with self._lock:
            try:
                index = self._index(uuid)
            except DeviceError as err:
                return str(err)
            return self._probe_errors.get(uuid) or self._probe_errors.get(self._uuid(index))

    def watch(self, stop: StopFlag, emit: Callable[[HealthEvent], None]) -> None:
        """Deliver injected events as they happen; re-read a node file when it changes.

        The thread sleeps until something happens: an injection interrupts its wait, an
        edit of the node file wakes it through inotify, and setting `stop` interrupts it.
        """
        waiter = BlockingPathWatch(
            lambda: [] if self._path is None else [self._path],
            poll_interval=POLL_SECONDS,
            name=f"simulated node file {self._path}",
        )
        with self._lock:
            self._waiters.add(waiter)
        forget = stop.on_set(waiter.interrupt)
        try:
            while not stop.is_set():
                with self._lock:
                    events = list(self._pending)
                    self._pending.clear()
                for event in events:
                    emit(event)
                if self._path is not None:
                    self._reload_if_changed()
                with self._lock:
                    if self._pending:
                        continue
                if not stop.is_set():
                    waiter.wait()
        finally:
            forget()
            with self._lock:
                self._waiters.discard(waiter)
            waiter.close()

    def close(self) -> None:
        """Nothing to release: watches end with their stop flag."""

    # -- node file ----------------------------------------------------------------------

    def _file_stamp(self) -> tuple[int, int, int, int] | None:
        if self._path is None:
            return None
        try:
            stat = self._path.stat()
        except OSError:
            return None
        return (stat.st_ino, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_size)

    def _reload_if_changed(self) -> None:
        stamp = self._file_stamp()
        # Empty: a writer truncated it and has not written yet (inotify reports both steps).
        if stamp is None or stamp == self._stamp or self._path is None or stamp[3] == 0:
            return
        self._stamp = stamp
        try:
            new = _read(self._path)
        except DeviceError as err:
            log.warning("ignoring the edit of %s: %s", self._path, err)
            return
        with self._lock:
            self._apply(new)

    def _apply(self, new: NodeSpec) -> None:
        """Turn the differences between the running node and its edited file into events."""
        old = self._spec
        old_uuids = {self._uuid(i) for i in range(len(old.gpus))}
        structural = dataclasses.replace(old, gpus=tuple(g.static() for g in old.gpus)) != (
            dataclasses.replace(new, gpus=tuple(g.static() for g in new.gpus))
        )
        self._spec = new
        if structural:
            for index, gpu in enumerate(new.gpus):
                self._mig[index] = gpu.mig
            for uuid in sorted(old_uuids | {self._uuid(i) for i in range(len(new.gpus))}):
                self._push(HealthEvent(uuid, HealthEventKind.RECONFIGURED))
        for index, gpu in enumerate(new.gpus):
            before = old.gpus[index] if index < len(old.gpus) else GpuSpec()
            if gpu.xid is not None and gpu.xid != before.xid:
                self._push(
                    HealthEvent(self._uuid(index), HealthEventKind.XID, gpu.xid, "node file")
                )
            if not gpu.healthy and (before.healthy or gpu.probe_error != before.probe_error):
                self._fail(index, gpu.probe_error or self._default_fault())
            elif gpu.healthy and not before.healthy:
                self._probe_errors.pop(self._uuid(index), None)
                self._push(
                    HealthEvent(self._uuid(index), HealthEventKind.HEALED, detail="node file")
                )
            if gpu.processes != before.processes:
                self._procs[index] = gpu.processes
            if not structural and gpu.mig != before.mig:
                self._mig[index] = gpu.mig
                self._push(HealthEvent(self._uuid(index), HealthEventKind.RECONFIGURED))


def _reported(p: ProcessSpec, uuid: str, migs: tuple[MigDevice, ...]) -> list[GpuProcess]:
    """How NVML reports `p` on GPU `uuid` with slices `migs` (none while MIG is off)."""
    memory = p.memory_mib * 1024 * 1024
    if p.mig is None:
        if migs:  # MIG is on: a whole-GPU process cannot run (the simulated NVML refuses it)
            return []
        return [
            GpuProcess(
                p.pid, uuid, p.kinds, memory, sm_percent=p.sm_util, memory_percent=p.mem_util
            )
        ]
    slot = next((m for m in migs if m.mig_index == p.mig), None)
    if slot is None:  # no such slice (MIG off or another layout)
        return []
    return [GpuProcess(p.pid, slot.uuid, p.kinds, memory, slot.gi_id, slot.ci_id)]


__all__ = [
    "PRESETS",
    "GpuSpec",
    "NodeSpec",
    "ProcessSpec",
    "SimulatedBackend",
    "parse_node",
    "parse_profile",
]
