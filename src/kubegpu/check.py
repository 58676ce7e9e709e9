"""`kubegpu check CONFIG`: validate a config offline, as `serve` would, and show the result.

The same loader (`load_config`) and the same device-list builder (`build_resources`,
with the kubelet's message-size check) as the daemon, so "check passes" means "serve
starts with it" on that node. Without a GPU at hand, `--simulate PRESET|FILE` shows what
a node of that shape would advertise, which is how a ConfigMap is tested in CI.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from kubegpu.config import Config, load_config
from kubegpu.config.show import config_to_yaml
from kubegpu.devices import Inventory, open_backend
from kubegpu.errors import ConfigError, InitError
from kubegpu.resources import ResourceSpec, build_resources


def format_resources(specs: Sequence[ResourceSpec], inventory: Inventory) -> str:
    """One line per resource: name, device count, sharing, replicas per unit."""
    head = f"node: {inventory.backend}, {len(inventory.gpus)} GPU(s)"
    if not specs:
        return f"{head}\nno resources would be advertised"
    rows = [("RESOURCE", "DEVICES", "HEALTHY", "SHARING", "REPLICAS")]
    for spec in specs:
        rows.append(
            (
                spec.name,
                str(len(spec.devices)),
                str(spec.healthy_count),
                str(spec.sharing),
                str(spec.replicas),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    return "\n".join([head, *lines])


def run_check(
    path: Path,
    *,
    overrides: Mapping[str, Any] | None = None,
    simulate: str | None,
    backend: str = "auto",
    driver_root: str = "/",
    out: TextIO | None = None,
    err: TextIO | None = None,
) -> int:
    """Exit status: 0 valid (and what it advertises), 1 with one line saying what is wrong.

    `overrides` are the flag and env values by dotted config key (`flags.mpsRoot` from
    `--mps-root`/`MPS_ROOT`), applied on top of the file as `serve` applies them."""
    # Looked up per call, not bound at import: tests and callers swap sys.stdout.
    out = out or sys.stdout
    err = err or sys.stderr
    try:
        config = load_config(path, overrides or {})
    except ConfigError as exc:
        print(f"kubegpu: {exc}", file=err)
        return 1
    try:
        devices = open_backend(backend, simulate=simulate, driver_root=driver_root)
        try:
            inventory = devices.discover()
        finally:
            devices.close()
    except InitError as exc:
        print(
            f"kubegpu: no node to check the device list on ({exc}); "
            "pass --simulate PRESET|FILE to see what it would advertise",
            file=err,
        )
        print(format_effective(path, config), file=out)
        return 0
    try:
        specs = build_resources(inventory, config)  # as serve would, ConfigError if not
    except ConfigError as exc:
        print(f"kubegpu: {path}: {exc}", file=err)
        return 1
    print(format_effective(path, config), file=out)
    print(format_resources(specs, inventory), file=out)
    return 0


def format_effective(path: Path, config: Config) -> str:
    """`PATH: valid`, then the effective config as YAML under a comment line: from that
    line to the blank line after it, the output is a config file that loads as `config`."""
    return (
        f"{path}: valid\n"
        "# effective config (the file with every default filled in):\n"
        f"{config_to_yaml(config)}"
    )
