"""AMD GPUs from sysfs: the KFD topology (compute nodes) joined with DRM cards.

Only files are read, no ROCm library: `/sys/class/kfd/kfd/topology/nodes/*` lists the
GPUs the compute driver exposes (`gpu_id` != 0; CPU nodes have 0) and
`/sys/class/drm/card*/device` adds PCI identity, memory and NUMA. Everything is relative to
`root`, so tests run against checked-in fixture trees (`tests/fixtures/amd-*`).

Health is modest on purpose: a probe checks the device's sysfs directory still exists
(a GPU that fell off the bus disappears from sysfs).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from kubegpu.devices.model import (
    Gpu,
    HealthEvent,
    HealthEventKind,
    Inventory,
    Link,
    LinkKind,
    StopFlag,
    Vendor,
)
from kubegpu.errors import InitError

log = logging.getLogger("kubegpu.devices.amd")

KFD_TOPOLOGY = "sys/class/kfd/kfd/topology/nodes"
DRM = "sys/class/drm"
AMD_VENDOR = "0x1002"
#: KFD io_link type of an xGMI (Infinity Fabric) GPU-to-GPU link.
IOLINK_XGMI = 11
_MIB = 1024 * 1024
#: Product names by PCI device id, for boards whose driver has no `product_name`.
PRODUCTS: Mapping[int, str] = {
    0x738C: "AMD Instinct MI100",
    0x7408: "AMD Instinct MI250X",
    0x740C: "AMD Instinct MI250X/MI250",
    0x740F: "AMD Instinct MI210",
    0x74A1: "AMD Instinct MI300X",
    0x74A5: "AMD Instinct MI325X",
    0x74B5: "AMD Instinct MI300X VF",
    0x744C: "AMD Radeon RX 7900 XTX",
    0x7448: "AMD Radeon PRO W7900",
}


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


@dataclass(frozen=True)
class _Card:
    card_minor: int
    render_minor: int
    device: Path


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
        #: UUID -> the sysfs directory whose existence a probe checks.
        self._paths: dict[str, Path] = {}

    @staticmethod
    def present(root: str = "/") -> bool:
        """True when the KFD (ROCm compute) topology exists under `root`."""
        return Path(root, KFD_TOPOLOGY).is_dir()

    def _cards(self) -> dict[int, _Card]:
        """AMD DRM cards by render-node minor."""
        cards: dict[int, _Card] = {}
        for card in sorted(Path(self.root, DRM).glob("card[0-9]*")):
            if not card.name[4:].isdigit():
                continue  # connectors such as card0-DP-1
            device = card / "device"
            if _read(device / "vendor") != AMD_VENDOR:
                continue
            renders = [p.name for p in (device / "drm").glob("renderD[0-9]*")]
            if not renders:
                continue
            render = int(renders[0][len("renderD") :])
            cards[render] = _Card(int(card.name[4:]), render, device)
        return cards

    def _kfd_gpus(self) -> list[tuple[int, Path, dict[str, int]]]:
        nodes = []
        for node in Path(self.root, KFD_TOPOLOGY).iterdir():
            if not node.name.isdigit():
                continue
            props = _properties(node / "properties")
            gpu_id = _int(_read(node / "gpu_id"))
            if gpu_id is None:
                gpu_id = props.get("gpu_id", 0)
            if gpu_id:
                nodes.append((int(node.name), node, props))
        return sorted(nodes, key=lambda n: n[0])

    def discover(self) -> Inventory:
        cards = self._cards()
        nodes = self._kfd_gpus()
        if not nodes:
            raise InitError(
                f"no AMD GPU in {Path(self.root, KFD_TOPOLOGY)}: "
                "check `rocm-smi` and the amdgpu driver"
            )
        found: list[tuple[int, Path, Gpu]] = []
        for index, (node_id, node, props) in enumerate(nodes):
            gpu = self._gpu(index, node, props, cards)
            found.append((node_id, node, gpu))
        uuid_of = {node_id: gpu.uuid for node_id, _, gpu in found}
        gpus = []
        for _, node, gpu in found:
            xgmi = self._xgmi_peers(node, uuid_of)
            links = []
            for _, _, peer in found:
                if peer.uuid == gpu.uuid:
                    continue
                if peer.uuid in xgmi:
                    links.append(Link(peer.uuid, LinkKind.NVLINK, xgmi[peer.uuid]))
                elif gpu.numa_node is not None and peer.numa_node is not None:
                    same = gpu.numa_node == peer.numa_node
                    links.append(
                        Link(peer.uuid, LinkKind.SAME_NUMA if same else LinkKind.CROSS_NUMA)
                    )
            gpus.append(dataclasses.replace(gpu, links=tuple(links)))
        return Inventory(
            gpus=tuple(gpus),
            driver_version=_read(self.root / "sys/module/amdgpu/version") or "",
            control_device_paths=("/dev/kfd",) if (self.root / "dev/kfd").exists() else (),
            backend=self.name,
        )

    def _gpu(self, index: int, node: Path, props: dict[str, int], cards: dict[int, _Card]) -> Gpu:
        render = props.get("drm_render_minor", -1)
        card = cards.get(render)
        device = card.device if card else None
        bus_id = self._bus_id(device, props)
        unique = _read(device / "unique_id") if device else None
        if not unique and props.get("unique_id"):
            unique = f"{props['unique_id']:x}"
        uuid = f"AMD-{unique or bus_id}"
        numa = _int(_read(device / "numa_node")) if device else None
        vram = _int(_read(device / "mem_info_vram_total")) if device else None
        device_id = props.get("device_id") or (
            _int(_read(device / "device"), 16) if device else None
        )
        product = (_read(device / "product_name") if device else None) or PRODUCTS.get(
            device_id or 0, f"AMD GPU {device_id or 0:#06x}"
        )
        target = props.get("gfx_target_version", 0)
        paths = [f"/dev/dri/card{card.card_minor}"] if card else []
        if render >= 0:
            paths.append(f"/dev/dri/renderD{render}")
        self._paths[uuid] = device or node
        return Gpu(
            index=index,
            uuid=uuid,
            minor=render,
            product=product,
            memory_mib=(vram or 0) // _MIB,
            pci_bus_id=bus_id,
            numa_node=None if numa is None or numa < 0 else numa,
            compute_capability=(target // 10000, (target // 100) % 100),
            vendor=Vendor.AMD,
            device_paths=tuple(paths),
            brand=next((b for b in ("Instinct", "Radeon") if b in product), ""),
        )

    @staticmethod
    def _bus_id(device: Path | None, props: dict[str, int]) -> str:
        """From the card's uevent, else decoded from KFD's location_id (bus:dev.fn)."""
        if device is not None:
            for line in (_read(device / "uevent") or "").splitlines():
                if line.startswith("PCI_SLOT_NAME="):
                    return line.partition("=")[2].lower()
        location = props.get("location_id", 0)
        bus, dev, fn = location >> 8, (location >> 3) & 0x1F, location & 0x7
        return f"{props.get('domain', 0):04x}:{bus:02x}:{dev:02x}.{fn}"

    @staticmethod
    def _xgmi_peers(node: Path, uuid_of: Mapping[int, str]) -> dict[str, int]:
        peers: dict[str, int] = {}
        for link in sorted((node / "io_links").glob("*")):
            props = _properties(link / "properties")
            peer = uuid_of.get(props.get("node_to", -1))
            if props.get("type") == IOLINK_XGMI and peer is not None:
                peers[peer] = peers.get(peer, 0) + 1
        return peers

    def probe(self, uuid: str) -> str | None:
        if not self._paths:
            self.discover()
        path = self._paths.get(uuid)
        if path is None:
            return f"{uuid}: not an AMD GPU on this node"
        return None if path.exists() else f"{uuid}: {path} is gone (GPU lost?)"

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
