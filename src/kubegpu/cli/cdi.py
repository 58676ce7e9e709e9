"""`kubegpu cdi generate`: write the CDI spec for this node's GPUs (`kubegpu.cdi`)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from kubegpu.cli.options import (
    PATH,
    TEXT,
    Command,
    Group,
    Parsed,
    choice,
    container_driver_root_option,
    driver_root_option,
    files_root,
    option,
    simulate_option,
)
from kubegpu.errors import KubegpuError


def run_generate(values: dict[str, Any]) -> int:
    """Discover, build the spec, write it; 1 with one line when the node or file fails."""
    from kubegpu import cdi as spec
    from kubegpu.devices import open_backend

    host = values["driver_root"] or "/"
    local_root = files_root(values)
    output = values["output"]
    try:
        backend = open_backend(
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
        else:
            out = Path(output)
            spec.write_spec(written, str(out.parent), out.name, format=values["format"])
    except KubegpuError as e:
        print(f"kubegpu cdi generate: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"kubegpu cdi generate: cannot write {output}: {e}", file=sys.stderr)
        return 1
    return 0


GENERATE_OPTIONS: list[click.Parameter] = [
    click.Option(
        ["--output", "-o"], default="-", show_default=True, help="file to write, or - for stdout"
    ),
    click.Option(
        ["--format"], type=click.Choice(["json", "yaml"]), default="json", show_default=True
    ),
    driver_root_option(),
    container_driver_root_option("--container-driver-root", "--driver-root-ctr-path"),
    option(
        "--dev-root",
        "--nvidia-dev-root",
        envvar="NVIDIA_DEV_ROOT",
        type=PATH,
        show_default="the driver root",
        help="host root of the /dev nodes",
    ),
    option(
        "--device-id-strategy",
        envvar="DEVICE_ID_STRATEGY",
        type=Parsed("strategy", choice("uuid", "index")),
        default="uuid",
        help="name devices by UUID or index",
    ),
    option(
        "--device-discovery-strategy",
        envvar="DEVICE_DISCOVERY_STRATEGY",
        type=TEXT,
        default="auto",
        help="backend: auto, nvml, simulated",
    ),
    simulate_option(help="simulated node: preset name or YAML file"),
    option(
        "--nvidia-ctk-path",
        "--nvidia-cdi-hook-path",
        envvar=("NVIDIA_CDI_HOOK_PATH", "NVIDIA_CTK_PATH"),
        type=PATH,
        help="host path of nvidia-ctk; adds an ldcache update hook",
    ),
]

generate = Command(
    "generate",
    params=GENERATE_OPTIONS,
    callback=lambda **values: run_generate(values),
    help="Generate a CDI spec (kind k8s.device-plugin.nvidia.com/gpu).",
    short_help="write the CDI spec for this node's GPUs",
)
cdi = Group("cdi", commands=[generate], help="Container Device Interface specs.")
