"""`kubegpu check CONFIG`: validate a config offline, as `serve` would (`kubegpu.check`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from kubegpu.check import run_check
from kubegpu.cli.options import (
    Command,
    backend_option,
    container_driver_root_option,
    driver_root_option,
    files_root,
    simulate_option,
)


def _check(config: Path, **values: Any) -> int:
    return run_check(
        config,
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
    ],
    callback=_check,
    help="Validate CONFIG (the config file, as mounted from the ConfigMap) exactly as "
    "'serve' loads it, then print the resources and device counts it would advertise on "
    "this node or a simulated one.",
    short_help="validate a config file offline and show what it would advertise",
)
