"""AMD GPUs from sysfs: the KFD topology (compute nodes) joined with DRM devices.

Only files are read, no ROCm library. As in ROCm's plugin, a KFD node
(`/sys/class/kfd/kfd/topology/nodes/<n>`) is a GPU when its `drm_render_minor` is
positive: CPU nodes have 0, and `gpu_id` files are absent from some trees (MI300 in CPX
mode). Every such node is one advertised device, so each compute partition (CPX/DPX/QPX)
is its own device. Its ID is ROCm's: the PCI address of the function that owns the render
node (`0000:c1:00.0`), or the platform device name of a partition (`amdgpu_xcp_12`, under
`/sys/devices/platform`). A render node KFD does not list (the spare `amdgpu_xcp_*` of an
unpartitioned MI300) is not a device. Everything is relative to `root`, so tests run
against checked-in fixture trees.

Health is modest on purpose: a probe checks the device's sysfs directory still exists
(a GPU that fell off the bus disappears from sysfs).
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path

from kubegpu.devices.model import (
    AmdInfo,
    AmdNode,
    Gpu,
    HealthEvent,
    HealthEventKind,
    Inventory,
    Link,
    LinkKind,
    ProcessTable,
    StopFlag,
    Vendor,
)
from kubegpu.errors import InitError

log = logging.getLogger("kubegpu.devices.amd")

KFD_TOPOLOGY = "sys/class/kfd/kfd/topology/nodes"
DRM = "sys/class/drm"
#: Where the amdgpu driver lists the PCI functions it drives (ROCm's enumeration).
AMDGPU_PCI = "sys/module/amdgpu/drivers/pci:amdgpu"
#: Compute partitions beyond the first appear as platform devices.
PLATFORM = "sys/devices/platform"
AMD_VENDOR = "0x1002"
#: KFD io_link type of an xGMI (Infinity Fabric) GPU-to-GPU link.
IOLINK_XGMI = 11
#: KFD io_link type of a PCIe link.
IOLINK_PCIE = 2
_MIB = 1024 * 1024
_BDF = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
#: Product names by PCI device id, for boards whose driver has no `product_name`.
PRODUCTS: Mapping[int, str] = {
    0x738C: "AMD Instinct MI100",
    0x7408: "AMD Instinct MI250X",
    0x740C: "AMD Instinct MI250X/MI250",
    0x740F: "AMD Instinct MI210",
    0x74A1: "AMD Instinct MI300X",
    0x74A2: "AMD Instinct MI308X",
    0x74A5: "AMD Instinct MI325X",
    0x74B5: "AMD Instinct MI300X VF",
    0x744C: "AMD Radeon RX 7900 XTX",
    0x7448: "AMD Radeon PRO W7900",
}


@cache
def marketing_names() -> Mapping[tuple[int, int], str]:
    """(PCI device id, revision) -> marketing name, from libdrm's `amdgpu.ids` as ROCm ships
    it: the name ROCm's labeller gets from libdrm when the driver has no `product_name`."""
    text = resources.files("kubegpu.devices").joinpath("amdgpu.ids").read_text(encoding="utf-8")
    names: dict[tuple[int, int], str] = {}
    for line in text.splitlines():
        fields = [f.strip() for f in line.split(",", 2)]
        if line.startswith("#") or len(fields) != 3:
            continue  # comments and the format version line
        try:
            names[int(fields[0], 16), int(fields[1], 16)] = fields[2]
        except ValueError:
            continue
    return names


def marketing_name(device_id: int, revision: int | None, *, exact: bool = False) -> str:
    """libdrm's name for the device and revision; unless `exact`, else the first name
    listed for the device. `""` when none."""
    names = marketing_names()
    if revision is not None and (device_id, revision) in names:
        return names[device_id, revision]
    if exact:
        return ""
    return next((n for (d, _), n in names.items() if d == device_id), "")


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _int(text: str | None, base: int = 10) -> int | None:
    if text is None:
        return None
    try:
        return int(text, base)
    except ValueError:
        return None


def _properties(path: Path) -> dict[str, int]:
    """A KFD `properties` file: one `name value` pair per line."""
    values: dict[str, int] = {}
    for line in (_read(path) or "").splitlines():
        key, _, value = line.partition(" ")
        number = _int(value.strip())
        if number is not None:
            values[key] = number
    return values


def _minor(name: str, prefix: str) -> int | None:
    return (
        int(name[len(prefix) :])
        if name.startswith(prefix) and name[len(prefix) :].isdigit()
        else None
    )


def pci_group(props: Mapping[str, int]) -> str:
    """ROCm's devID of a KFD node: `domain:bus:device:0`, the same for all its partitions."""
    location = props.get("location_id", 0)
    bus, dev = (location >> 8) & 0xFF, (location >> 3) & 0x1F
    return f"{props.get('domain', 0):04x}:{bus:02x}:{dev:02x}:0"


_FIRMWARE = re.compile(r"(\w+) feature version: (\d+), firmware version: (0x[0-9a-fA-F]+)")


def firmware_info(text: str) -> tuple[tuple[str, int, int], ...]:
    """(name, feature, firmware) per line of debugfs `dri/<card>/amdgpu_firmware_info`.

    ROCm gets these through the libdrm ioctl; its own test checks that debugfs says the
    same, and debugfs needs no libdrm.
    """
    found = []
    for line in text.splitlines():
        match = _FIRMWARE.search(line)
        if match:
            found.append((match[1], int(match[2]), int(match[3], 16)))
    return tuple(found)


@dataclass(frozen=True)
class _Drm:
    """A DRM device: a PCI function the amdgpu driver drives, or a partition's platform device."""

    device_id: str
    path: Path
    pci: bool
    card_minor: int | None
    render_minor: int | None


def _drm_nodes(device: Path) -> tuple[int | None, int | None]:
    card = render = None
    for entry in sorted((device / "drm").glob("*")):
        card = card if card is not None else _minor(entry.name, "card")
        render = render if render is not None else _minor(entry.name, "renderD")
    return card, render


def _pci_address(device: Path) -> str | None:
    for line in (_read(device / "uevent") or "").splitlines():
        if line.startswith("PCI_SLOT_NAME="):
            return line.partition("=")[2].lower()
    name = device.resolve().name.lower()
    return name if _BDF.match(name) else None


class AmdBackend:
    """AMD GPUs (Instinct, Radeon) discovered from the amdgpu driver's sysfs files."""

    name = "amd"

    def __init__(self, root: str = "/", *, poll_seconds: float = 5.0) -> None:
        if not self.present(root):
            raise InitError(
                f"no AMD KFD topology under {Path(root, KFD_TOPOLOGY)}: "
                "load the amdgpu driver or point --sysfs-root at the host's /"
            )
        self.root = Path(root)
        self._poll_seconds = poll_seconds
        #: Device ID -> the sysfs directory whose existence a probe checks.
        self._paths: dict[str, Path] = {}

    @staticmethod
    def present(root: str = "/") -> bool:
        """True when the KFD (ROCm compute) topology exists under `root`."""
        return Path(root, KFD_TOPOLOGY).is_dir()

    def _pci_devices(self) -> dict[str, _Drm]:
        """AMD PCI functions by address, from the driver's list and from the DRM cards."""
        found: dict[str, _Drm] = {}
        candidates: list[tuple[Path, int | None]] = [
            (d, None) for d in sorted(Path(self.root, AMDGPU_PCI).glob("[0-9a-fA-F]*:*"))
        ]
        for card in sorted(Path(self.root, DRM).glob("card[0-9]*")):
            if card.name[4:].isdigit():  # not connectors such as card0-DP-1
                candidates.append((card / "device", int(card.name[4:])))
        for device, card_hint in candidates:
            if _read(device / "vendor") not in (AMD_VENDOR, None):
                continue
            address = _pci_address(device)
            if address is None or address in found:
                continue
            minor, render = _drm_nodes(device)
            minor = minor if minor is not None else card_hint
            found[address] = _Drm(address, device, True, minor, render)
        return found

    def _partitions(self) -> list[_Drm]:
        out = []
        for device in sorted(Path(self.root, PLATFORM).glob("amdgpu_xcp_*")):
            card, render = _drm_nodes(device)
            out.append(_Drm(device.name, device, False, card, render))
        return out

    def _kfd_gpus(self) -> list[tuple[int, Path, dict[str, int]]]:
        nodes = []
        for node in Path(self.root, KFD_TOPOLOGY).iterdir():
            if not node.name.isdigit():
                continue
            props = _properties(node / "properties")
            render = props.get("drm_render_minor")
            if render is None:
                # Old trees without drm_render_minor: fall back to a non-zero gpu_id.
                gpu_id = _int(_read(node / "gpu_id"))
                if not (gpu_id if gpu_id is not None else props.get("gpu_id", 0)):
                    continue
            elif render <= 0:
                continue
            nodes.append((int(node.name), node, props))
        return sorted(nodes, key=lambda n: n[0])

    def discover(self) -> Inventory:
        pci = self._pci_devices()
        by_render = {d.render_minor: d for d in [*pci.values(), *self._partitions()]}
        parents = {address[:-2] + ":0": d for address, d in pci.items()}
        nodes = self._kfd_gpus()
        if not nodes:
            raise InitError(
                f"no AMD GPU in {Path(self.root, KFD_TOPOLOGY)}: "
                "check `rocm-smi` and the amdgpu driver"
            )
        found: list[tuple[int, Path, Gpu]] = []
        taken: set[str] = set()
        for index, (node_id, node, props) in enumerate(nodes):
            gpu = self._gpu(index, node_id, node, props, by_render, parents, taken)
            taken.add(gpu.uuid)
            found.append((node_id, node, gpu))
        uuid_of = {node_id: gpu.uuid for node_id, _, gpu in found}
        gpus = []
        for _, node, gpu in found:
            types, xgmi = self._io_links(node, uuid_of)
            links = []
            for _, _, peer in found:
                if peer.uuid == gpu.uuid:
                    continue
                kind = self._link_kind(gpu, peer, xgmi)
                if kind is not None or peer.uuid in types:
                    links.append(
                        Link(
                            peer.uuid,
                            kind or LinkKind.CROSS_NUMA,
                            xgmi.get(peer.uuid, 1),
                            iolink_type=types.get(peer.uuid),
                        )
                    )
            gpus.append(dataclasses.replace(gpu, links=tuple(links)))
        first = pci[min(pci)].path if pci else None
        return Inventory(
            gpus=tuple(gpus),
            driver_version=self._module_file(first, "version"),
            control_device_paths=("/dev/kfd",) if (self.root / "dev/kfd").exists() else (),
            backend=self.name,
            amd=AmdNode(
                driver_src_version=self._module_file(first, "srcversion"),
                # ROCm asks the first GPU only: a node's GPUs are one model.
                compute_partitioning_supported=first is not None
                and (first / "available_compute_partition").exists(),
                memory_partitioning_supported=first is not None
                and (first / "available_memory_partition").exists(),
            ),
        )

    def _module_file(self, device: Path | None, name: str) -> str:
        """The amdgpu module's `version` or `srcversion`, "" when unreadable.

        ROCm's labeller reads it through the GPU (`/sys/class/drm/card<N>/device/driver/
        module/<name>`); that link leads to `/sys/module/amdgpu`, read when a tree lacks it.
        """
        via_device = _read(device / "driver/module" / name) if device is not None else None
        return via_device or _read(self.root / "sys/module/amdgpu" / name) or ""

    @staticmethod
    def _link_kind(gpu: Gpu, peer: Gpu, xgmi: Mapping[str, int]) -> LinkKind | None:
        if peer.uuid in xgmi:
            return LinkKind.NVLINK
        if gpu.numa_node is not None and peer.numa_node is not None:
            return LinkKind.SAME_NUMA if gpu.numa_node == peer.numa_node else LinkKind.CROSS_NUMA
        return None

    def _gpu(
        self,
        index: int,
        node_id: int,
        node: Path,
        props: dict[str, int],
        by_render: Mapping[int | None, _Drm],
        parents: Mapping[str, _Drm],
        taken: set[str],
    ) -> Gpu:
        render = props.get("drm_render_minor", -1)
        group = pci_group(props)
        drm = by_render.get(render)
        card = drm.card_minor if drm else None
        parent = parents.get(group)
        if drm is not None and drm.pci:
            parent = drm
        pdev = parent.path if parent else None
        kfd_address = self._kfd_address(props)
        if drm is not None:
            device_id = drm.device_id
        elif parent is not None and parent.device_id not in taken:
            device_id = parent.device_id
        else:
            # No DRM files for this render node: the KFD location names it.
            device_id = kfd_address
        if device_id in taken:  # a copied KFD node (ROCm's own test trees have one)
            device_id = f"renderD{render}"
        partition = not (drm.pci if drm is not None else device_id == kfd_address[:-1] + "0")
        bus_id = parent.device_id if parent else kfd_address[:-1] + "0"
        numa = _int(_read(pdev / "numa_node")) if pdev else None
        banks = _properties(node / "mem_banks/0/properties").get("size_in_bytes", 0)
        vram = banks or ((_int(_read(pdev / "mem_info_vram_total")) or 0) if pdev else 0)
        debugfs = self.root / f"sys/kernel/debug/dri/{card}/amdgpu_firmware_info"
        # ROCm labels the PCI function's `device` file and libdrm names the board by it;
        # KFD's copy stands in for a tree without the PCI files.
        device = (_int(_read(pdev / "device"), 16) if pdev else None) or props.get("device_id")
        product_file = (_read(pdev / "product_name") if pdev else None) or ""
        revision = _int(_read(pdev / "revision"), 16) if pdev else None
        # libdrm matches device and revision exactly; without a revision file, the device.
        libdrm = marketing_name(device or 0, revision, exact=revision is not None)
        product = (
            product_file
            or libdrm
            or PRODUCTS.get(device or 0)
            or marketing_name(device or 0, None)
            or f"AMD GPU {device or 0:#06x}"
        )
        target = props.get("gfx_target_version", 0)
        paths = []
        if card is not None:
            paths.append(f"/dev/dri/card{card}")
        if render >= 0:
            paths.append(f"/dev/dri/renderD{render}")
        self._paths[device_id] = drm.path if drm else node

        def lower(name: str) -> str:
            return (_read(pdev / name) or "").lower() if pdev else ""

        return Gpu(
            index=index,
            uuid=device_id,
            minor=render,
            product=product,
            memory_mib=vram // _MIB,
            pci_bus_id=bus_id,
            numa_node=None if numa is None or numa < 0 else numa,
            compute_capability=(target // 10000, (target // 100) % 100),
            vendor=Vendor.AMD,
            device_paths=tuple(paths),
            brand=next((b for b in ("Instinct", "Radeon") if b in product), ""),
            amd=AmdInfo(
                kfd_node=node_id,
                pci_group=group,
                partition=partition,
                compute_partition=lower("current_compute_partition"),
                memory_partition=lower("current_memory_partition"),
                simd_count=props.get("simd_count", 0),
                simd_per_cu=props.get("simd_per_cu", 0),
                device_id=device or 0,
                product_name=product_file,
                marketing_name=libdrm,
                vram_bytes=banks,
                gfx_target_version=target,
                firmware=firmware_info(_read(debugfs) or "") if card is not None else (),
            ),
        )

    @staticmethod
    def _kfd_address(props: Mapping[str, int]) -> str:
        """The render node's PCI function decoded from KFD's location_id (bus:dev.fn)."""
        location = props.get("location_id", 0)
        bus, dev, fn = (location >> 8) & 0xFF, (location >> 3) & 0x1F, location & 0x7
        return f"{props.get('domain', 0):04x}:{bus:02x}:{dev:02x}.{fn}"

    @staticmethod
    def _io_links(node: Path, uuid_of: Mapping[int, str]) -> tuple[dict[str, int], dict[str, int]]:
        """Peer -> KFD link type (p2p_links override io_links, as ROCm reads them) and
        peer -> number of xGMI io_links."""
        types: dict[str, int] = {}
        xgmi: dict[str, int] = {}
        for kind in ("io_links", "p2p_links"):
            for link in sorted((node / kind).glob("*"), key=lambda p: _int(p.name) or 0):
                props = _properties(link / "properties")
                peer = uuid_of.get(props.get("node_to", -1))
                if peer is None or "type" not in props:
                    continue
                types[peer] = props["type"]
                if props["type"] == IOLINK_XGMI and kind == "io_links":
                    xgmi[peer] = xgmi.get(peer, 0) + 1
        for peer, kind_ in types.items():
            if kind_ == IOLINK_XGMI and peer not in xgmi:
                xgmi[peer] = 1
        return types, xgmi

    def probe(self, uuid: str) -> str | None:
        if not self._paths:
            self.discover()
        path = self._paths.get(uuid)
        if path is None:
            return f"{uuid}: not an AMD GPU on this node"
        return None if path.exists() else f"{uuid}: {path} is gone (GPU lost?)"

    def processes(self) -> ProcessTable:
        """None yet. What the kernel offers to build it on: KFD lists each compute process
        under `/sys/class/kfd/kfd/proc/<pid>/` with its VRAM per GPU (`vram_<gpu_id>`), and
        since Linux 5.19 amdgpu reports per-client memory and engine time in
        `/proc/<pid>/fdinfo/<fd>` (`drm-memory-vram`, `drm-engine-gfx`, as `amd-smi process`
        reads them); SM-style utilization would come from the engine-time deltas."""
        return ProcessTable()

    def watch(self, stop: StopFlag, emit: Callable[[HealthEvent], None]) -> None:
        """Poll the devices' sysfs directories; a vanished one is a failed probe."""
        failing: set[str] = set()
        while not stop.wait(self._poll_seconds):
            for uuid in list(self._paths):
                failure = self.probe(uuid)
                if failure is not None and uuid not in failing:
                    emit(HealthEvent(uuid, HealthEventKind.PROBE_FAILED, detail=failure))
                    failing.add(uuid)
                elif failure is None:
                    failing.discard(uuid)

    def close(self) -> None:
        pass
