"""Facts about the host machine itself, read from sysfs (GFD's `gpu.machine` label)."""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger("kubegpu.devices.host")


def read_machine_type(path: str) -> str:
    """The DMI product name, trimmed; `unknown` when no file is set or it is unreadable.

    The path is the config's `machineTypeFile` (default /sys/class/dmi/id/product_name,
    GFD's `--machine-type-file`). As GFD: an empty file gives an empty value (labels
    sanitise it later).
    """
    if not path:
        return "unknown"
    try:
        return Path(path).read_text(encoding="utf-8", errors="replace").strip()
    except OSError as exc:
        log.warning("cannot read machine type from %s: %s", path, exc.strerror)
        return "unknown"
