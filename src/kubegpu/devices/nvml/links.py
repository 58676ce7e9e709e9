"""NVLink and PCIe links between GPUs, as NVML reports them (lanes per peer, NVSwitch domains).

Two GPUs talk over NVSwitches only through switches they both reach and only when NVML's
P2P status and their fabric cliques agree; otherwise their PCIe relation stands.
"""

from __future__ import annotations

import collections
import ctypes
from typing import Any

from kubegpu.devices.model import Gpu, Link, LinkKind
from kubegpu.devices.nvml.names import normalize_bus_id
from kubegpu.devices.nvml.session import Session

TOPOLOGY = {
    "NVML_TOPOLOGY_INTERNAL": LinkKind.SINGLE_SWITCH,
    "NVML_TOPOLOGY_SINGLE": LinkKind.SINGLE_SWITCH,
    "NVML_TOPOLOGY_MULTIPLE": LinkKind.MULTI_SWITCH,
    "NVML_TOPOLOGY_HOSTBRIDGE": LinkKind.HOST_BRIDGE,
    "NVML_TOPOLOGY_NODE": LinkKind.SAME_NUMA,
    "NVML_TOPOLOGY_SYSTEM": LinkKind.CROSS_NUMA,
}


def nvlink_version(reported: int, compute_capability: tuple[int, int]) -> int:
    """The NVLink generation (1..5) from NVML's answer, else from the architecture."""
    if 1 <= reported <= 5:
        return reported
    return {6: 1, 7: 2, 8: 3, 9: 4, 10: 5}.get(compute_capability[0], 0)


def switched_lanes(mine: collections.Counter[str], theirs: collections.Counter[str]) -> int:
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


def links(s: Session, found: list[tuple[Any, Gpu]]) -> dict[str, tuple[Link, ...]]:
    """NVLink lanes per peer (direct, or through the NVSwitches both reach), else the
    PCIe relation.

    Each active link's remote says where it goes: a GPU (a direct lane to it) or an
    NVSwitch, named by its PCI bus ID. Two GPUs talk over switches only through switches
    they both reach (two NVSwitch boards in one node share none), and only when NVML's
    NVLink P2P status does not say otherwise and their fabric cliques (where reported)
    match. Links that are down count for nothing.
    """
    nvml = s.nvml
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
                active = nvml.nvmlDeviceGetNvLinkState(handle, link) == nvml.NVML_FEATURE_ENABLED
            except s.error as err:
                # No NVLink at all, or past the last link: stop asking.
                if link == 0 or err.value == nvml.NVML_ERROR_INVALID_ARGUMENT:
                    break
                continue
            if not active:
                continue
            if gpu.uuid not in version:
                get_version = getattr(nvml, "nvmlDeviceGetNvLinkVersion", None)
                reported = s.optional(get_version, handle, link, default=0) if get_version else 0
                version[gpu.uuid] = nvlink_version(reported, gpu.compute_capability)
            kind = s.optional(nvml.nvmlDeviceGetNvLinkRemoteDeviceType, handle, link, default=None)
            remote = s.optional(nvml.nvmlDeviceGetNvLinkRemotePciInfo, handle, link, default=None)
            remote_bus = normalize_bus_id(remote.busId) if remote else ""
            if kind == switch_type:
                via[remote_bus] += 1  # "" when the switch cannot be named
                continue
            peer_uuid = by_bus.get(remote_bus)
            if peer_uuid is not None and peer_uuid != gpu.uuid:
                peers[peer_uuid] += 1
        direct[gpu.uuid] = peers
        switches[gpu.uuid] = via
    cliques = {gpu.uuid: clique(s, handle) for handle, gpu in found}
    levels = {getattr(nvml, const, None): kind for const, kind in TOPOLOGY.items()}
    links: dict[str, tuple[Link, ...]] = {}
    for handle, gpu in found:
        own = []
        for peer_handle, peer in found:
            if peer.uuid == gpu.uuid:
                continue
            lanes = direct[gpu.uuid][peer.uuid]
            switched = switched_lanes(switches[gpu.uuid], switches[peer.uuid])
            if switched and nvlink_p2p(s, handle, peer_handle, cliques, gpu, peer):
                lanes += switched
            if lanes:
                v = min(version.get(gpu.uuid, 0), version.get(peer.uuid, 0)) or max(
                    version.get(gpu.uuid, 0), version.get(peer.uuid, 0)
                )
                own.append(Link(peer.uuid, LinkKind.NVLINK, lanes, nvlink_version=v))
                continue
            level = s.optional(
                nvml.nvmlDeviceGetTopologyCommonAncestor, handle, peer_handle, default=None
            )
            if level in levels:
                own.append(Link(peer.uuid, levels[level]))
        links[gpu.uuid] = tuple(own)
    return links


def clique(s: Session, handle: Any) -> tuple[bytes, int] | None:
    """(cluster UUID, clique ID) once the GPU's fabric registration completed; None
    where NVML reports no fabric (no NVLink fabric manager, older drivers)."""
    nvml = s.nvml
    struct = getattr(nvml, "c_nvmlGpuFabricInfo_t", None)
    if struct is None or not hasattr(nvml, "nvmlDeviceGetGpuFabricInfo"):
        return None
    info = struct()
    try:
        nvml.nvmlDeviceGetGpuFabricInfo(handle, ctypes.byref(info))
    except s.error:
        return None
    if info.state != getattr(nvml, "NVML_GPU_FABRIC_STATE_COMPLETED", 3) or info.status:
        return None
    return bytes(info.clusterUuid), int(info.cliqueId)


def nvlink_p2p(
    s: Session,
    handle: Any,
    peer_handle: Any,
    cliques: dict[str, tuple[bytes, int] | None],
    gpu: Gpu,
    peer: Gpu,
) -> bool:
    """Whether two GPUs behind NVSwitches can use NVLink with each other."""
    nvml = s.nvml
    mine, theirs = cliques.get(gpu.uuid), cliques.get(peer.uuid)
    if mine is not None and theirs is not None and mine != theirs:
        return False
    index = getattr(nvml, "NVML_P2P_CAPS_INDEX_NVLINK", None)
    if index is None or not hasattr(nvml, "nvmlDeviceGetP2PStatus"):
        return True
    status = s.optional(nvml.nvmlDeviceGetP2PStatus, handle, peer_handle, index, default=None)
    # No answer keeps the switch-based verdict; an answer other than OK overrides it.
    return status is None or status == getattr(nvml, "NVML_P2P_STATUS_OK", 0)
