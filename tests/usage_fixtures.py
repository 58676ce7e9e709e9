"""A node for the GPU usage tests: a fake /proc tree, the kubelet's device checkpoint, and
pods declared to a fake PodResources API, all consistent with one device allocation."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

MIB = 1024 * 1024


def pod_uid(n: int) -> str:
    return f"{n:08x}-0000-4000-8000-{n:012x}"


def container_id(n: int) -> str:
    return f"{n:064x}"


def cgroup_line(uid: str, container: str) -> str:
    """cgroup v2 of a container, as the kubelet's systemd driver and containerd name it."""
    return (
        f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod"
        f"{uid.replace('-', '_')}.slice/cri-containerd-{container}.scope\n"
    )


@dataclass
class ProcTree:
    """A fake `/proc` holding only `<pid>/cgroup` files."""

    root: Path

    def put(self, pid: int, text: str | bytes) -> Path:
        directory = self.root / str(pid)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / "cgroup"
        path.write_bytes(text.encode() if isinstance(text, str) else text)
        return path

    def in_pod(self, pid: int, uid: str, n: int = 1) -> None:
        self.put(pid, cgroup_line(uid, container_id(n)))

    def fifo(self, pid: int) -> None:
        (self.root / str(pid)).mkdir(parents=True, exist_ok=True)
        os.mkfifo(self.root / str(pid) / "cgroup")


@dataclass
class KubeletCheckpoint:
    """The kubelet's `kubelet_internal_checkpoint` (v2 layout), written on every `add`."""

    path: Path
    entries: list[dict[str, object]] = field(default_factory=list)

    def add(self, uid: str, container: str, resource: str, device_ids: list[str]) -> None:
        self.entries.append(
            {
                "PodUID": uid,
                "ContainerName": container,
                "ResourceName": resource,
                "DeviceIDs": {"-1": device_ids},
                "AllocResp": "",
            }
        )
        self.save()

    def save(self) -> None:
        data = {"PodDeviceEntries": self.entries, "RegisteredDevices": {}}
        self.path.write_text(json.dumps({"Data": data, "Checksum": 0}))
