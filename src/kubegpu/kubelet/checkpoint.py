"""`kubelet_internal_checkpoint`: what survives a kubelet restart.

The layout is the kubelet's (checkpoint v2, `devicemanager/checkpoint`): pod device entries
with devices grouped per NUMA node and the base64 `AllocResp`, plus the devices registered
per resource, and a checksum. The kubelet's checksum hashes a Go object dump; ours is
FNV-1a 32 over the canonical JSON of `Data`, which gives the same protection (a corrupt or
hand-edited file is refused) without pretending to be byte-compatible.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubegpu.api import pb
from kubegpu.kubelet.model import CheckpointError

CHECKPOINT_FILE = "kubelet_internal_checkpoint"


@dataclass(frozen=True)
class PodDevicesEntry:
    """Devices of one resource given to one container, with the plugin's answer."""

    pod: str
    container: str
    resource: str
    device_ids: tuple[str, ...]
    #: NUMA node of each device at allocation time (-1: none), for the per-NUMA grouping.
    numa: tuple[int, ...]
    response: pb.ContainerAllocateResponse


@dataclass(frozen=True)
class Checkpoint:
    entries: tuple[PodDevicesEntry, ...] = ()
    registered: dict[str, tuple[str, ...]] | None = None


def _fnv1a32(data: bytes) -> int:
    h = 0x811C9DC5
    for byte in data:
        h ^= byte
        h = (h * 0x01000193) & 0xFFFFFFFF
    return h


def _checksum(data: dict[str, Any]) -> int:
    return _fnv1a32(json.dumps(data, sort_keys=True, separators=(",", ":")).encode())


def encode(checkpoint: Checkpoint) -> str:
    entries = []
    for e in checkpoint.entries:
        per_numa: dict[str, list[str]] = {}
        for dev, node in zip(e.device_ids, e.numa, strict=True):
            per_numa.setdefault(str(node), []).append(dev)
        entries.append(
            {
                "PodUID": e.pod,
                "ContainerName": e.container,
                "ResourceName": e.resource,
                "DeviceIDs": per_numa,
                # The kubelet keeps device order inside AllocResp implicitly; we keep it explicit
                # so a restored Allocation lists devices in the order they were allocated.
                "DeviceOrder": list(e.device_ids),
                "AllocResp": base64.b64encode(e.response.SerializeToString()).decode(),
            }
        )
    registered = {k: list(v) for k, v in sorted((checkpoint.registered or {}).items())}
    data: dict[str, Any] = {"PodDeviceEntries": entries, "RegisteredDevices": registered}
    return json.dumps({"Data": data, "Checksum": _checksum(data)}, indent=1)


def decode(text: str) -> Checkpoint:
    try:
        doc = json.loads(text)
        data = doc["Data"]
        if doc["Checksum"] != _checksum(data):
            raise CheckpointError("checkpoint is corrupted: checksum mismatch")
        entries = []
        for raw in data["PodDeviceEntries"]:
            numa_of = {dev: int(node) for node, devs in raw["DeviceIDs"].items() for dev in devs}
            order = raw.get("DeviceOrder") or sorted(numa_of)
            entries.append(
                PodDevicesEntry(
                    pod=raw["PodUID"],
                    container=raw["ContainerName"],
                    resource=raw["ResourceName"],
                    device_ids=tuple(order),
                    numa=tuple(numa_of.get(d, -1) for d in order),
                    response=pb.ContainerAllocateResponse.FromString(
                        base64.b64decode(raw["AllocResp"])
                    ),
                )
            )
        registered = {k: tuple(v) for k, v in data["RegisteredDevices"].items()}
    except CheckpointError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"checkpoint is corrupted: {exc!r}") from exc
    return Checkpoint(tuple(entries), registered)


def load(path: Path) -> Checkpoint | None:
    """The checkpoint at `path`, or None when there is none yet (first start)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: {exc}") from exc
    return decode(text)


def save(path: Path, checkpoint: Checkpoint) -> None:
    """Write atomically (temp file + rename) so a crash never leaves half a checkpoint."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(encode(checkpoint))
    tmp.replace(path)
