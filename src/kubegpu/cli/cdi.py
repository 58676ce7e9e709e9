"""`kubegpu cdi generate`: write the CDI spec for this node's GPUs (`kubegpu.cdi`)."""

from __future__ import annotations

import stat
import sys
from pathlib import Path
from typing import Any

import click

from kubegpu import cdi as spec
from kubegpu import devices
from kubegpu.cli import COMMANDS, setup_logging
from kubegpu.cli.options import (
    TEXT,
    container_driver_root_option,
    dev_root_option,
    device_id_strategy_option,
    driver_root_option,
    files_root,
    log_options,
    nvidia_ctk_path_option,
    option,
    simulate_option,
)
from kubegpu.cli.usage import Command, Group
from kubegpu.errors import KubegpuError


def run_generate(values: dict[str, Any]) -> int:
    """Discover, build the spec, write it; `KubegpuError` when the node or file fails."""
    setup_logging(values.get("log_level") or "info", values.get("log_format") or "text")
    host = values["driver_root"] or "/"
    local_root = files_root(values)
    output = values["output"]
    # Errors go to `kubegpu.cli.main`'s one boundary (one line, exit 1); only a failed
    # write gets its own words, naming the file.
    backend = devices.open_backend(
        values["device_discovery_strategy"], simulate=values["simulate"], driver_root=local_root
    )
    try:
        inventory = backend.discover()
    finally:
        backend.close()
    written = spec.generate_spec(
        inventory,
        driver_root=host,
        container_driver_root=local_root,
        device_id_strategy=values["device_id_strategy"],
        dev_root=values["dev_root"],
        nvidia_ctk_path=values["nvidia_ctk_path"],
    )
    if output == "-":
        sys.stdout.write(spec.dump(written, values["format"]))
        return 0
    out = Path(output)
    _refuse_to_replace_a_special_file(out)
    try:
        spec.write_spec(written, str(out.parent), out.name, format=values["format"])
    except OSError as e:
        raise KubegpuError(f"cannot write {output}: {e}") from e
    return 0


def _refuse_to_replace_a_special_file(out: Path) -> None:
    """The spec is written beside `out` and renamed over it, which replaces whatever `out`
    names: run as root, `-o /dev/null` would turn the node's /dev/null into a file. Only a
    regular file (or nothing) is replaced; a device, FIFO or directory is refused."""
    try:
        mode = out.stat().st_mode
    except FileNotFoundError:
        return
    except OSError as e:
        raise KubegpuError(f"cannot write {out}: {e.strerror or e}") from e
    if not stat.S_ISREG(mode):
        raise KubegpuError(
            f"cannot write {out}: it is not a regular file, and writing the spec would replace "
            "it; name a file, or use -o - and redirect the output"
        )


GENERATE_OPTIONS: list[click.Parameter] = [
    click.Option(
        ["--output", "-o"], default="-", show_default=True, help="file to write, or - for stdout"
    ),
    click.Option(
        ["--format"], type=click.Choice(["json", "yaml"]), default="json", show_default=True
    ),
    driver_root_option(),
    container_driver_root_option("--container-driver-root", "--driver-root-ctr-path"),
    dev_root_option(config_key=None),
    device_id_strategy_option(config_key=None),
    # Not NVIDIA's --device-discovery-strategy (how the plugin finds GPUs): here it has
    # always picked kubegpu's backend, and keeps its name and values for existing scripts.
    option(
        "--device-discovery-strategy",
        envvar="DEVICE_DISCOVERY_STRATEGY",
        type=TEXT,
        default="auto",
        help="kubegpu's backend (as --backend elsewhere): auto, nvml, simulated",
    ),
    simulate_option(help="simulated node: preset name or YAML file"),
    nvidia_ctk_path_option(
        config_key=None, help="host path of nvidia-ctk; adds an ldcache update hook"
    ),
    *log_options(),
]

generate = Command(
    "generate",
    params=GENERATE_OPTIONS,
    callback=lambda **values: run_generate(values),
    help="Generate a CDI spec (kind k8s.device-plugin.nvidia.com/gpu).",
    short_help="write the CDI spec for this node's GPUs",
)
cdi = Group("cdi", commands=[generate], help=COMMANDS["cdi"].summary)
