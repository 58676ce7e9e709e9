"""`kubegpu info`: this node's GPUs as kubegpu sees them."""

from __future__ import annotations

from typing import Any

import click

from kubegpu import devices
from kubegpu.cli import COMMANDS
from kubegpu.cli.options import (
    backend_option,
    check_simulate_backend,
    container_driver_root_option,
    driver_root_option,
    files_root,
    simulate_option,
)
from kubegpu.cli.usage import Command
from kubegpu.devices import Inventory


def _info(**values: Any) -> int:
    check_simulate_backend(values["simulate"], values["backend"], "shows a simulated node")
    backend = devices.open_backend(
        values["backend"], simulate=values["simulate"], driver_root=files_root(values)
    )
    try:
        inventory = backend.discover()
    finally:
        backend.close()
    click.echo(format_inventory(inventory))
    return 0


info = Command(
    "info",
    params=[
        backend_option(),
        simulate_option(help="show a simulated node: a preset name or a YAML file"),
        driver_root_option(),
        container_driver_root_option("--container-driver-root", "--driver-root-ctr-path"),
    ],
    callback=_info,
    help="Show this node's GPUs as kubegpu sees them.",
    short_help=COMMANDS["info"].summary,
)


def format_inventory(inventory: Inventory) -> str:
    rows = [("IDX", "UUID", "PRODUCT", "MEMORY", "PCI", "NUMA", "CC", "MIG", "HEALTH")]
    for g in inventory.gpus:
        mig = f"{len(g.mig_devices)} slices" if g.mig_enabled else ("off" if g.mig_capable else "-")
        rows.append(
            (
                str(g.index),
                g.uuid,
                g.product,
                f"{g.memory_mib} MiB",
                g.pci_bus_id,
                "-" if g.numa_node is None else str(g.numa_node),
                ".".join(map(str, g.compute_capability)),
                mig,
                str(g.health),
            )
        )
        for m in g.mig_devices:
            rows.append(
                (
                    "",
                    f"  {m.uuid}",
                    f"  MIG {m.profile} ({m.index})",
                    f"{m.memory_mib} MiB",
                    "",
                    "",
                    "",
                    "",
                    str(m.health),
                )
            )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    head = (
        f"backend: {inventory.backend}   driver: {inventory.driver_version or 'unknown'}   "
        f"CUDA: {'.'.join(map(str, inventory.cuda_driver_version))}   GPUs: {len(inventory.gpus)}"
    )
    return "\n".join([head, *lines])
