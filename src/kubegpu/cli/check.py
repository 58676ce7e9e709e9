"""`kubegpu check CONFIG`: validate a config offline, as `serve` would (`kubegpu.check`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from kubegpu.check import run_check
from kubegpu.cli import COMMANDS
from kubegpu.cli.options import (
    backend_option,
    container_driver_root_option,
    driver_root_option,
    files_root,
    mps_root_option,
    simulate_option,
)
from kubegpu.cli.usage import Command
from kubegpu.config import flag_overrides


def _check(config: Path, **values: Any) -> int:
    return run_check(
        config,
        overrides=flag_overrides(values, CHECK_KEYS),
        simulate=values["simulate"],
        backend=values["backend"],
        driver_root=files_root(values),
    )


check = Command(
    "check",
    params=[
        click.Argument(["config"], type=click.Path(path_type=Path)),
        simulate_option(help="a simulated node: a preset name or a node YAML file"),
        backend_option(),
        driver_root_option(),
        container_driver_root_option("--container-driver-root", "--driver-root-ctr-path"),
        # As serve takes it (NVIDIA's chart sets MPS_ROOT from mps.root): a config with
        # sharing.mps is valid only with a root, from the file or from here.
        mps_root_option(),
    ],
    callback=_check,
    help="Validate CONFIG (the config file, as mounted from the ConfigMap) exactly as "
    "'serve' loads it (with --mps-root/MPS_ROOT on top, as serve takes it), then print the "
    "resources and device counts it would advertise on this node or a simulated one.",
    short_help=COMMANDS["check"].summary,
)

#: The config keys check's options set on top of the file, by value name: the MPS root
#: alone (a config with sharing.mps needs one, and NVIDIA's chart gives it as MPS_ROOT);
#: the driver-root options only say where to load the driver from, as in `info`.
CHECK_KEYS = {"mps_root": "flags.mpsRoot"}
