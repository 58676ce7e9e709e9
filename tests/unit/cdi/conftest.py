"""CDI specs (`kubegpu.cdi`): valid per the CDI schema, NVIDIA's names, files under the driver
root, kept in step with the store.

Shared here: the device nodes a CDI runtime injects from a spec, each checked as containerd
checks it (`runtime_device_nodes`), also used by the DRA end-to-end tests.
"""

from __future__ import annotations

import os
import stat
from typing import Any


def runtime_device_nodes(spec: dict[str, Any]) -> list[tuple[str, str]]:
    """(container path, host path) of every device node a CDI runtime injects from `spec`,
    each host path checked as containerd's CDI library does (`fillMissingInfo`: a node
    without `type` and `major` is `lstat`ed at `hostPath`, else `path`, and must be a
    device): AssertionError naming the first one a runtime would refuse."""
    edits = [spec.get("containerEdits", {}), *(d["containerEdits"] for d in spec["devices"])]
    found = []
    for node in (n for e in edits for n in e.get("deviceNodes", [])):
        host = node.get("hostPath") or node["path"]
        if not (node.get("type") and node.get("major")):
            try:
                mode = os.lstat(host).st_mode
            except FileNotFoundError:
                raise AssertionError(f"failed to stat CDI host device {host!r}") from None
            assert stat.S_ISCHR(mode), f"{host} is not a character device"
        found.append((node["path"], host))
    return found
