"""Which pod (and container) a process runs in, from `/proc/<pid>/cgroup`.

The kubelet puts each pod in a cgroup named after its UID, in one of two layouts:

- systemd driver: `/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid>.slice/
  cri-containerd-<id>.scope` (the UID's dashes written as `_`; `crio-<id>.scope` under
  CRI-O, `docker-<id>.scope` under cri-dockerd; Guaranteed pods sit directly under
  `kubepods.slice` as `kubepods-pod<uid>.slice`);
- cgroupfs driver: `/kubepods/burstable/pod<uid>/<id>`.

cgroup v2 has one line (`0::<path>`), v1 one per hierarchy (`4:memory:<path>`); any line
naming a pod counts. Read through a cgroup namespace the path may start with `/..`; the
pod segment is found wherever it is. A static pod's UID is a 32-digit hash, not a UUID.
Hand-written: no maintained Python package knows the kubelet's layouts (dcgm-exporter
does the same with a pattern over containerd's Go parser).

The file is the kernel's, but the tree it is read from is configurable (`/host/proc` in the
chart) and a process may end between listing and reading: every read is bounded, refuses
anything but a regular file (a FIFO would block; `kubegpu.files.read_regular`), and answers
None rather than raise.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from kubegpu.files import read_regular

#: A real cgroup file is a few hundred bytes (v1: one line per hierarchy, a dozen or so).
MAX_CGROUP_BYTES = 64 * 1024

_UID = r"[0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12}|[0-9a-f]{32}"
#: A pod's own segment: `pod<uid>` (cgroupfs) or `kubepods[-<qos>]-pod<uid>.slice` (systemd).
_POD_SEGMENT = re.compile(rf"(?:^|-)pod({_UID})(?:\.slice)?$")
#: A container's segment: `<id>`, `cri-containerd-<id>.scope`, `crio-<id>.scope`, ...
_CONTAINER_SEGMENT = re.compile(r"(?:^|-)([0-9a-f]{64})(?:\.scope)?$")


@dataclass(frozen=True)
class PodCgroup:
    """The pod a process runs in, by UID, and its container's runtime ID if the path has one."""

    pod_uid: str
    container_id: str = ""


def parse_cgroup(text: str) -> PodCgroup | None:
    """The pod of the first line whose path names one; None for a process outside pods."""
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        segments = parts[2].split("/")
        for i, segment in enumerate(segments):
            pod = _POD_SEGMENT.search(segment)
            if pod is None:
                continue
            container = ""
            if i + 1 < len(segments):
                found = _CONTAINER_SEGMENT.search(segments[i + 1])
                container = found.group(1) if found else ""
            return PodCgroup(pod.group(1).replace("_", "-"), container)
    return None


def read_cgroup(proc_root: Path, pid: int) -> PodCgroup | None:
    """`parse_cgroup` of `<proc_root>/<pid>/cgroup`; None when it cannot be read as one."""
    if pid <= 0:
        return None
    try:
        # A string join, not pathlib: this runs for every process at every scrape. Not
        # following a final link: a cgroup file is never one, a planted link leaves the tree.
        data = read_regular(f"{proc_root}/{pid}/cgroup", MAX_CGROUP_BYTES, follow_links=False)
    except OSError:
        return None  # gone (the process ended, ESRCH mid-read), not permitted, not a file
    if len(data) > MAX_CGROUP_BYTES:
        return None
    # Not UTF-8: the patterns are ASCII, so replaced bytes simply never match.
    return parse_cgroup(data.decode("utf-8", errors="replace"))


__all__ = ["MAX_CGROUP_BYTES", "PodCgroup", "parse_cgroup", "read_cgroup"]
