"""The DRA manager's claim-info cache and its checkpoint `dra_manager_state`.

Written from the kubelet's `pkg/kubelet/cm/dra/claiminfo.go` (ClaimInfo, claimInfoCache),
`pkg/kubelet/cm/dra/state/types.go` (ClaimInfoState, DriverState, Device) and
`pkg/kubelet/cm/dra/checkpoint/checkpoint.go` (NewCheckpoint, VerifyChecksum). The file is
byte-for-byte the kubelet's layout: `{"Data": "<JSON of CheckpointData>", "Checksum": <CRC-32
IEEE of Data>}`, where `CheckpointData` is `{"kind": "DRACheckpoint", "apiVersion":
"checkpoint.dra.kubelet.k8s.io/v1", "Entries": [...]}` and each entry spells its fields as
Go's encoding/json does (a `sets.Set` is an object of empty objects, nil slices are `null`).
Devices carry `ShareID` as kubelets with consumable capacity (1.34+) write it; an older
kubelet's file, without the field, reads the same.

What survives a restart is only this state: a claim read back from the checkpoint is *not*
prepared (`newClaimInfoFromState` sets `prepared: false`), so the next PrepareResources for a
pod that uses it calls NodePrepareResources again; drivers must make that idempotent.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubegpu.kubelet.model import CheckpointError

#: The checkpoint's file name in the kubelet's root directory (manager.go).
STATE_FILE = "dra_manager_state"
KIND = "DRACheckpoint"
API_VERSION = "checkpoint.dra.kubelet.k8s.io/v1"


@dataclass(frozen=True)
class PreparedDevice:
    """One device a driver prepared for a claim (`state.Device`)."""

    pool_name: str
    device_name: str
    request_names: tuple[str, ...] = ()
    cdi_device_ids: tuple[str, ...] = ()
    #: Set for a share of a device with consumable capacity (`Device.share_id`, 1.34+).
    share_id: str | None = None


@dataclass
class ClaimInfo:
    """What the kubelet knows of one ResourceClaim on the node (`ClaimInfo`)."""

    claim_uid: str
    claim_name: str
    namespace: str
    #: UIDs of the pods that use the claim; the claim is unprepared when the last one goes.
    pod_uids: set[str] = field(default_factory=set)
    #: Driver name -> the devices it prepared. Every driver with an allocation result has an
    #: entry, even before (or without) devices.
    driver_state: dict[str, list[PreparedDevice]] = field(default_factory=dict)
    #: Not checkpointed: a restored claim must be prepared again.
    prepared: bool = False

    @property
    def key(self) -> tuple[str, str]:
        return (self.namespace, self.claim_name)

    def cdi_devices(self, request_name: str = "") -> list[str]:
        """CDI IDs for one request of the claim (`cdiDevicesAsList`).

        A device with no request names, or an empty `request_name`, counts for every request.
        """
        return [
            cdi
            for devices in self.driver_state.values()
            for dev in devices
            if not request_name or not dev.request_names or request_name in dev.request_names
            for cdi in dev.cdi_device_ids
        ]


class ClaimInfoCache:
    """Claims keyed by namespace/name, with the checkpoint they are synced to."""

    def __init__(self, state_dir: Path) -> None:
        self.path = Path(state_dir) / STATE_FILE
        self._claims: dict[tuple[str, str], ClaimInfo] = {}

    def __iter__(self) -> Iterator[ClaimInfo]:
        return iter(list(self._claims.values()))

    def __len__(self) -> int:
        return len(self._claims)

    def load(self) -> None:
        """Replace the cache with the checkpoint (`newClaimInfoCache`: GetOrCreate).

        A missing file is created empty, as the kubelet's checkpointer does; a corrupt one
        raises `CheckpointError` (the kubelet then refuses to start).
        """
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            self._claims = {}
            self.sync()
            return
        except OSError as exc:
            raise CheckpointError(f"cannot read DRA checkpoint {self.path}: {exc}") from exc
        self._claims = {c.key: c for c in decode(text)}

    def get(self, name: str, namespace: str) -> ClaimInfo | None:
        return self._claims.get((namespace, name))

    def add(self, info: ClaimInfo) -> None:
        self._claims[info.key] = info

    def delete(self, name: str, namespace: str) -> None:
        self._claims.pop((namespace, name), None)

    def claim_names_for_pod(self, pod_uid: str) -> list[str]:
        return [c.claim_name for c in self._claims.values() if pod_uid in c.pod_uids]

    def has_pod_reference(self, pod_uid: str) -> bool:
        return any(pod_uid in c.pod_uids for c in self._claims.values())

    def sync(self) -> None:
        """Write the whole cache (`syncToCheckpoint`), atomically (temp file + rename)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(encode(list(self._claims.values())))
        tmp.replace(self.path)


def _go_json(value: Any) -> str:
    """JSON as Go's encoding/json writes it: compact, UTF-8, HTML characters escaped."""
    text = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    for char, escaped in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026")):
        text = text.replace(char, escaped)
    return text.replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")


def _entry(info: ClaimInfo) -> dict[str, Any]:
    return {
        "ClaimUID": info.claim_uid,
        "ClaimName": info.claim_name,
        "Namespace": info.namespace,
        # sets.Set[string] is map[string]struct{}: Go writes the keys sorted.
        "PodUIDs": {uid: {} for uid in sorted(info.pod_uids)},
        "DriverState": {
            driver: {
                "Devices": [
                    {
                        "PoolName": d.pool_name,
                        "DeviceName": d.device_name,
                        "ShareID": d.share_id,
                        "RequestNames": list(d.request_names) or None,
                        "CDIDeviceIDs": list(d.cdi_device_ids) or None,
                    }
                    for d in devices
                ]
                or None
            }
            for driver, devices in sorted(info.driver_state.items())
        },
    }


def encode(claims: list[ClaimInfo]) -> str:
    """The checkpoint file's bytes (`NewCheckpoint` + `MarshalCheckpoint`)."""
    data = _go_json(
        {"kind": KIND, "apiVersion": API_VERSION, "Entries": [_entry(c) for c in claims]}
    )
    return _go_json({"Data": data, "Checksum": zlib.crc32(data.encode())})


def decode(text: str) -> list[ClaimInfo]:
    """Claims from a checkpoint file (`UnmarshalCheckpoint`, `GetClaimInfoStateList`)."""
    try:
        doc = json.loads(text)
        data = doc["Data"]
        expected = zlib.crc32(data.encode())
        if doc["Checksum"] != expected:
            raise CheckpointError(
                f"DRA checkpoint is corrupted: checksum {doc['Checksum']} != {expected}; "
                "drain the node and remove the DRA state file"
            )
        claims = []
        for raw in json.loads(data)["Entries"] or []:
            claims.append(
                ClaimInfo(
                    claim_uid=raw["ClaimUID"],
                    claim_name=raw["ClaimName"],
                    namespace=raw["Namespace"],
                    pod_uids=set(raw["PodUIDs"] or {}),
                    driver_state={
                        driver: [
                            PreparedDevice(
                                pool_name=d["PoolName"],
                                device_name=d["DeviceName"],
                                request_names=tuple(d.get("RequestNames") or ()),
                                cdi_device_ids=tuple(d.get("CDIDeviceIDs") or ()),
                                share_id=d.get("ShareID"),
                            )
                            for d in (ds.get("Devices") or [])
                        ]
                        for driver, ds in (raw["DriverState"] or {}).items()
                    },
                )
            )
    except CheckpointError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(
            f"DRA checkpoint is corrupted ({exc!r}); drain the node and remove the DRA state file"
        ) from exc
    return claims
