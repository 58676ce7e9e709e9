"""The `kubegpu` command: serve, info, demo, labels, cdi.

Environment variables are read here and nowhere else: every `serve` flag has an env var
twin named as in NVIDIA's plugin (`--mig-strategy` <-> `MIG_STRATEGY`), so DaemonSets
written for NVIDIA's plugin keep working. A flag beats its env var, which beats the config
file, which beats the default. Bad values exit 2 with one line naming the flag or variable.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from kubegpu import __version__
from kubegpu.api import DEVICE_PLUGIN_PATH
from kubegpu.devices import Inventory
from kubegpu.errors import KubegpuError

log = logging.getLogger("kubegpu")

TRUE = {"1", "true", "yes", "on", "t", "y"}
FALSE = {"0", "false", "no", "off", "f", "n"}


def parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in TRUE:
        return True
    if value in FALSE:
        return False
    raise ValueError(f"expected true or false, got {text!r}")


def parse_list(text: str) -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise ValueError("expected a comma-separated list")
    return items


@dataclass(frozen=True)
class Flag:
    """One `serve` option: its flag, env var, and where it lands."""

    flag: str
    env: str
    help: str
    #: Dotted path in the v1 config schema, or None for daemon-only settings.
    path: str | None = None
    kind: str = "str"  # str | bool | list | int | float | choice
    choices: tuple[str, ...] = ()
    default: Any = None

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")

    def convert(self, text: str) -> Any:
        if self.kind == "bool":
            return parse_bool(text)
        if self.kind == "list":
            return parse_list(text)
        if self.kind == "int":
            return int(text)
        if self.kind == "float":
            return float(text)
        if self.kind == "choice" and text not in self.choices:
            raise ValueError(f"invalid choice {text!r} (choose from {', '.join(self.choices)})")
        return text


SERVE_FLAGS: tuple[Flag, ...] = (
    Flag("--config-file", "CONFIG_FILE", "path to a v1 config file (NVIDIA's format)"),
    Flag(
        "--mig-strategy",
        "MIG_STRATEGY",
        "how MIG devices are advertised",
        "flags.migStrategy",
        "choice",
        ("none", "single", "mixed"),
    ),
    Flag(
        "--fail-on-init-error",
        "FAIL_ON_INIT_ERROR",
        "exit 1 when no GPU/NVML is found (false: stay up, advertise nothing)",
        "flags.failOnInitError",
        "bool",
    ),
    Flag(
        "--nvidia-driver-root",
        "NVIDIA_DRIVER_ROOT",
        "root of the driver installation",
        "flags.nvidiaDriverRoot",
    ),
    Flag(
        "--dev-root",
        "NVIDIA_DEV_ROOT",
        "root of the host's /dev nodes (default: driver root)",
        "flags.nvidiaDevRoot",
    ),
    Flag(
        "--pass-device-specs",
        "PASS_DEVICE_SPECS",
        "add /dev device nodes to Allocate answers (runtimes without the NVIDIA hook)",
        "flags.plugin.passDeviceSpecs",
        "bool",
    ),
    Flag(
        "--device-list-strategy",
        "DEVICE_LIST_STRATEGY",
        "envvar, volume-mounts, cdi-annotations, cdi-cri (comma list)",
        "flags.plugin.deviceListStrategy",
        "list",
    ),
    Flag(
        "--device-id-strategy",
        "DEVICE_ID_STRATEGY",
        "how GPUs are named to the runtime",
        "flags.plugin.deviceIDStrategy",
        "choice",
        ("uuid", "index"),
    ),
    Flag(
        "--cdi-annotation-prefix",
        "CDI_ANNOTATION_PREFIX",
        "prefix of CDI annotations",
        "flags.plugin.cdiAnnotationPrefix",
    ),
    Flag(
        "--nvidia-ctk-path",
        "NVIDIA_CTK_PATH",
        "path of nvidia-ctk on the host",
        "flags.plugin.nvidiaCTKPath",
    ),
    Flag(
        "--container-driver-root",
        "CONTAINER_DRIVER_ROOT",
        "where the driver root is mounted in this container",
        "flags.plugin.containerDriverRoot",
    ),
    Flag("--mps-root", "MPS_ROOT", "host directory for MPS pipes and logs", "flags.mpsRoot"),
    Flag(
        "--gds-enabled",
        "GDS_ENABLED",
        "ask the runtime for GPUDirect Storage",
        "flags.gdsEnabled",
        "bool",
    ),
    Flag(
        "--mofed-enabled",
        "MOFED_ENABLED",
        "ask the runtime for MOFED",
        "flags.mofedEnabled",
        "bool",
    ),
    Flag(
        "--gdrcopy-enabled",
        "GDRCOPY_ENABLED",
        "ask the runtime for GDRCopy",
        "flags.gdrcopyEnabled",
        "bool",
    ),
    Flag(
        "--device-discovery-strategy",
        "DEVICE_DISCOVERY_STRATEGY",
        "auto, nvml or tegra",
        "flags.deviceDiscoveryStrategy",
        "choice",
        ("auto", "nvml", "tegra"),
    ),
    Flag(
        "--health-recovery-seconds",
        "HEALTH_RECOVERY_SECONDS",
        "a GPU whose checks pass this long is healthy again (0: never)",
        "flags.health.recoverySeconds",
        "float",
    ),
    Flag(
        "--device-plugin-path",
        "DEVICE_PLUGIN_PATH",
        "the kubelet's device-plugin directory",
        default=DEVICE_PLUGIN_PATH,
    ),
    Flag(
        "--backend",
        "BACKEND",
        "GPU backend",
        kind="choice",
        choices=("auto", "nvml", "amd", "simulated"),
        default="auto",
    ),
    Flag("--simulate", "SIMULATE", "serve a simulated node: a preset name or a YAML file"),
    Flag("--config-dir", "CONFIG_FILE_SRCDIR", "directory of named configs (chart's config.map)"),
    Flag("--default-config", "DEFAULT_CONFIG", "named config used when the node has no label"),
    Flag(
        "--fallback-strategies",
        "FALLBACK_STRATEGIES",
        "named, single, empty (comma list)",
        kind="list",
        default=["named", "single"],
    ),
    Flag("--node-name", "NODE_NAME", "this node's name (for the config label and events)"),
    Flag(
        "--node-label",
        "NODE_LABEL",
        "node label that picks a named config",
        default="nvidia.com/device-plugin.config",
    ),
    Flag(
        "--metrics-port", "METRICS_PORT", "Prometheus /metrics port (0: off)", kind="int", default=0
    ),
    Flag("--metrics-address", "METRICS_ADDRESS", "address for /metrics (default: POD_IP)"),
    Flag(
        "--health-port",
        "HEALTH_PORT",
        "port for /healthz and /readyz (0: off)",
        kind="int",
        default=0,
    ),
    Flag("--health-address", "HEALTH_ADDRESS", "address for probes", default="0.0.0.0"),
    Flag(
        "--with-labels",
        "WITH_LABELS",
        "also write GPU Feature Discovery labels (to flags.gfd.outputFile)",
        kind="bool",
        default=False,
    ),
    Flag(
        "--log-level",
        "LOG_LEVEL",
        "debug, info, warning, error",
        kind="choice",
        choices=("debug", "info", "warning", "error"),
        default="info",
    ),
)


class OneLineParser(argparse.ArgumentParser):
    """Errors as one line naming the argument, not a usage dump."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _add_flags(parser: argparse.ArgumentParser, flags: Sequence[Flag]) -> None:
    for f in flags:
        help_text = f"{f.help} [env {f.env}]"

        def typed(text: str, f: Flag = f) -> Any:
            try:
                return f.convert(text)
            except ValueError as exc:
                raise argparse.ArgumentTypeError(str(exc)) from exc

        if f.kind == "bool":
            # `--flag` alone means true; `--flag=false` as in NVIDIA's urfave/cli flags.
            parser.add_argument(f.flag, nargs="?", const=True, type=typed, help=help_text)
        else:
            parser.add_argument(f.flag, type=typed, help=help_text)


def resolve_flags(
    args: argparse.Namespace, flags: Sequence[Flag], env: Mapping[str, str]
) -> dict[str, Any]:
    """Each flag's value: command line, else env var, else its default (may be None)."""
    values: dict[str, Any] = {}
    for f in flags:
        given = getattr(args, f.dest, None)
        if given is None and env.get(f.env, "") != "":
            try:
                given = f.convert(env[f.env])
            except ValueError as exc:
                raise UsageError(f"environment variable {f.env}: {exc}") from exc
        values[f.dest] = f.default if given is None else given
    return values


class UsageError(KubegpuError):
    """Bad command-line or environment input (exit 2)."""


def overrides_from(values: Mapping[str, Any], flags: Sequence[Flag]) -> dict[str, Any]:
    """Flag/env values that were set, as dotted config paths (they beat the file)."""
    return {f.path: values[f.dest] for f in flags if f.path and values[f.dest] is not None}


# -- serve -----------------------------------------------------------------------------


def cmd_serve(args: argparse.Namespace) -> int:
    from kubegpu.config.source import KubernetesNodeLabels, NamedConfigs
    from kubegpu.daemon import Daemon, DaemonSettings
    from kubegpu.events import NodeEvents

    env = os.environ
    values = resolve_flags(args, SERVE_FLAGS, env)
    _setup_logging(values["log_level"])
    named = None
    if values["config_dir"]:
        node = values["node_name"]
        named = NamedConfigs(
            directory=Path(values["config_dir"]),
            default=values["default_config"],
            fallback_strategies=tuple(values["fallback_strategies"]),
            node_name=node,
            label=values["node_label"],
            labels=KubernetesNodeLabels() if node else None,
        )
    settings = DaemonSettings(
        plugin_dir=Path(values["device_plugin_path"]),
        backend=values["backend"],
        simulate=values["simulate"],
        config_file=Path(values["config_file"]) if values["config_file"] else None,
        overrides=overrides_from(values, SERVE_FLAGS),
        named=named,
        health_env={k: v for k, v in env.items() if k.startswith("DP_")},
        metrics_port=values["metrics_port"],
        metrics_address=values["metrics_address"] or env.get("POD_IP") or "127.0.0.1",
        health_port=values["health_port"],
        health_address=values["health_address"],
        with_labels=values["with_labels"],
    )

    async def main() -> None:
        stop = asyncio.Event()
        events = NodeEvents.from_environment(env, lazy=True)
        daemon = Daemon(settings, events=events)
        loop = asyncio.get_running_loop()
        # Signal handlers only set flags; the daemon does the work on its own schedule.
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        loop.add_signal_handler(signal.SIGHUP, daemon.poke_config)
        await daemon.run(stop)

    asyncio.run(main())
    log.info("stopped cleanly")
    return 0


# -- info ------------------------------------------------------------------------------


def cmd_info(args: argparse.Namespace) -> int:
    from kubegpu.devices import open_backend

    backend = open_backend(args.backend, simulate=args.simulate, driver_root=args.driver_root)
    try:
        inventory = backend.discover()
    finally:
        backend.close()
    print(format_inventory(inventory))
    return 0


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


# -- demo ------------------------------------------------------------------------------


def cmd_demo(args: argparse.Namespace) -> int:
    from kubegpu.demo import run_demo

    return run_demo(preset=args.simulate, keep=args.keep_dir)


# -- main ------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="kubegpu", description="Kubernetes GPU device plugin")
    parser.add_argument("--version", action="version", version=f"kubegpu {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)

    serve = sub.add_parser("serve", help="run the device plugin daemon")
    _add_flags(serve, SERVE_FLAGS)
    serve.set_defaults(func=cmd_serve)

    info = sub.add_parser("info", help="show this node's GPUs as kubegpu sees them")
    info.add_argument("--backend", default="auto", choices=("auto", "nvml", "amd", "simulated"))
    info.add_argument(
        "--simulate",
        default=os.environ.get("SIMULATE"),
        help="a simulated preset name or YAML file [env SIMULATE]",
    )
    info.add_argument(
        "--nvidia-driver-root",
        dest="driver_root",
        default=os.environ.get("NVIDIA_DRIVER_ROOT", "/"),
    )
    info.set_defaults(func=cmd_info)

    demo = sub.add_parser("demo", help="simulated node + plugin + kubelet emulator, end to end")
    demo.add_argument("--simulate", default="h100-8", help="simulated preset (default h100-8)")
    demo.add_argument("--keep-dir", action="store_true", help="keep the temp directory")
    demo.set_defaults(func=cmd_demo)

    for register in _plugins():
        register(sub)
    return parser


def _plugins() -> list[Callable[[Any], None]]:
    from kubegpu import cdi, check, labeller

    return [labeller.register_cli, cdi.register_cli, check.register_cli]


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except UsageError as exc:
        print(f"kubegpu: error: {exc}", file=sys.stderr)
        return 2
    except KubegpuError as exc:
        print(f"kubegpu: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
