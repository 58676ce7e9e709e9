"""The `kubegpu` command: serve, info, demo, labels, cdi.

Environment variables are read here and nowhere else: every `serve` flag has an env var
twin named as in NVIDIA's plugin (`--mig-strategy` <-> `MIG_STRATEGY`), so DaemonSets
written for NVIDIA's plugin keep working. A flag beats its env var, which beats the config
file, which beats the default. Bad values exit 2 with one line naming the flag or variable.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from kubegpu import __version__
from kubegpu.errors import ConfigError, KubegpuError
from kubegpu.gosyntax import parse_bool, parse_go_int

if TYPE_CHECKING:
    from kubegpu.devices import Inventory

# asyncio, grpc (kubegpu.api) and the backends are imported where used: importing this
# module is all that happens before `main` ignores SIGHUP, so it is kept light.

#: The kubelet's device-plugin directory and its socket (as `kubegpu.api` has them).
DEVICE_PLUGIN_PATH = "/var/lib/kubelet/device-plugins/"
KUBELET_SOCKET = "kubelet.sock"

log = logging.getLogger("kubegpu")


def parse_list(text: str) -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise ValueError("expected a comma-separated list")
    return items


def parse_int_list(text: str) -> list[int]:
    """NVIDIA's IntSliceFlag: comma-separated integers, each trimmed."""
    return [parse_go_int(part.strip()) for part in text.split(",")]


@dataclass(frozen=True)
class Flag:
    """One `serve` option: its flag, env var, and where it lands."""

    flag: str
    env: str
    help: str
    #: Dotted path in the v1 config schema, or None for daemon-only settings.
    path: str | None = None
    kind: str = "str"  # str | bool | list | intlist | int | float | choice
    choices: tuple[str, ...] = ()
    default: Any = None
    #: Other names of the flag (NVIDIA's `Aliases`, or kubegpu's older name).
    aliases: tuple[str, ...] = ()
    #: Every env var read, in NVIDIA's precedence order (the first one set wins), when
    #: there is more than `env`.
    env_names: tuple[str, ...] = ()

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")

    @property
    def envs(self) -> tuple[str, ...]:
        return self.env_names or (self.env,)

    @property
    def repeatable(self) -> bool:
        """List flags add up when repeated (`--x=a --x=b`), as urfave/cli slice flags do."""
        return self.kind in ("list", "intlist")

    def convert(self, text: str) -> Any:
        value = self._parse(text)
        check = VALIDATORS.get(self.dest)
        if check is not None:
            check(value)
        return value

    def _parse(self, text: str) -> Any:
        if self.kind == "bool":
            return parse_bool(text)
        if self.kind == "list":
            return parse_list(text)
        if self.kind == "intlist":
            return parse_int_list(text)
        if self.kind == "int":
            return int(text)
        if self.kind == "float":
            return float(text)
        if self.kind == "choice" and text not in self.choices:
            raise ValueError(f"invalid choice {text!r} (choose from {', '.join(self.choices)})")
        return text


# -- value checks, one per flag that needs more than its kind --------------------------

#: sun_path holds 108 bytes with its NUL; the kubelet's own socket must fit in the directory.
MAX_SOCKET_PATH = 107
_LABEL_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


def check_port(value: int) -> None:
    if not 0 <= value <= 65535:
        raise ValueError(f"port {value} is out of range; use 1-65535, or 0 for off")


def check_plugin_path(value: str) -> None:
    if not value:
        raise ValueError("empty; give the kubelet's directory, /var/lib/kubelet/device-plugins")
    if not value.startswith("/"):
        raise ValueError(f"{value!r} is relative; give an absolute path")
    longest = len(os.fsencode(Path(value) / KUBELET_SOCKET))
    if longest > MAX_SOCKET_PATH:
        raise ValueError(
            f"{value!r} is too long: its socket paths would exceed the {MAX_SOCKET_PATH}-byte "
            f"unix limit; use a shorter directory"
        )


def check_simulate(value: str) -> None:
    if not value:
        raise ValueError("empty; name a preset or a node description YAML file")


def check_absolute(value: str) -> None:
    if not value.startswith("/"):
        raise ValueError(f"{value!r} is not an absolute path; give one (e.g. /run/nvidia/mps)")


def check_label_key(value: str) -> None:
    """A Kubernetes label key: `[prefix/]name`, prefix a DNS subdomain."""
    prefix, _, name = value.rpartition("/")
    if (
        not _LABEL_NAME.fullmatch(name)
        or (prefix and (len(prefix) > 253 or not _DNS_SUBDOMAIN.fullmatch(prefix)))
        or ("/" in value and not prefix)
    ):
        raise ValueError(
            f"{value!r} is not a Kubernetes label key ([prefix/]name, e.g. "
            f"nvidia.com/device-plugin.config)"
        )


def check_imex_channels(value: list[int]) -> None:
    if value not in ([], [0]):
        raise ValueError(
            f"{value} is not a supported channel list; only IMEX channel 0 exists, use 0"
        )


def check_kubelet_socket(value: str) -> None:
    """kubegpu finds the kubelet's socket in the device-plugin directory, where the kubelet
    also looks for the plugins' sockets; only the directory can move."""
    if not value:
        raise ValueError(
            "empty: kubegpu always registers with the kubelet; drop the setting, or give "
            "<device-plugin dir>/kubelet.sock"
        )
    if not value.startswith("/") or Path(value).name != KUBELET_SOCKET:
        raise ValueError(
            f"{value!r} must be an absolute path ending in /{KUBELET_SOCKET}; to move the "
            f"device-plugin directory use --device-plugin-path"
        )


#: Checks on a flag's value after its kind is parsed, by `Flag.dest`; each raises
#: ValueError with what is wrong and what to do, for the flag and its env var alike.
VALIDATORS: dict[str, Callable[[Any], None]] = {
    "metrics_port": check_port,
    "health_port": check_port,
    "device_plugin_path": check_plugin_path,
    "simulate": check_simulate,
    "mps_root": check_absolute,
    "node_label": check_label_key,
    "imex_channel_ids": check_imex_channels,
    "kubelet_socket": check_kubelet_socket,
}


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
        aliases=("--driver-root",),
    ),
    Flag(
        "--dev-root",
        "NVIDIA_DEV_ROOT",
        "root of the host's /dev nodes (default: driver root)",
        "flags.nvidiaDevRoot",
        aliases=("--nvidia-dev-root",),
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
        "path of nvidia-ctk (or nvidia-cdi-hook) on the host, for CDI hooks",
        "flags.plugin.nvidiaCTKPath",
        aliases=("--nvidia-cdi-hook-path",),
        env_names=("NVIDIA_CDI_HOOK_PATH", "NVIDIA_CTK_PATH"),
    ),
    Flag(
        "--container-driver-root",
        "CONTAINER_DRIVER_ROOT",
        "where the driver root is mounted in this container",
        "flags.plugin.containerDriverRoot",
        aliases=("--driver-root-ctr-path",),
        env_names=("DRIVER_ROOT_CTR_PATH", "CONTAINER_DRIVER_ROOT"),
    ),
    Flag(
        "--shared-devices-allocation-policy",
        "SHARED_DEVICES_ALLOCATION_POLICY",
        "how replicas of shared GPUs are picked for a multi-replica request",
        "flags.plugin.sharedDevicesAllocationPolicy",
        "choice",
        ("distributed", "packed"),
    ),
    Flag(
        "--imex-channel-ids",
        "IMEX_CHANNEL_IDS",
        "IMEX channels to inject (comma list; only 0 exists)",
        "imex.channelIDs",
        "intlist",
    ),
    Flag(
        "--imex-required",
        "IMEX_REQUIRED",
        "the IMEX channels must exist when the plugin starts",
        "imex.required",
        "bool",
    ),
    Flag(
        "--cdi-feature-flags",
        "CDI_FEATURE_FLAGS",
        "NVIDIA's CDI generator options (comma list); accepted, not applied by kubegpu",
        kind="list",
    ),
    Flag(
        "--cdi-disable-hooks",
        "CDI_DISABLE_HOOKS",
        "OCI hooks to leave out of CDI specs (comma list, or all); kubegpu's serve writes none",
        kind="list",
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
        "--kubelet-socket",
        "KUBELET_SOCKET",
        "the kubelet's registration socket; its directory is the device-plugin directory",
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
        help_text = f"{f.help} [env {', '.join(f.envs)}]"
        names = (f.flag, *f.aliases)

        def typed(text: str, f: Flag = f) -> Any:
            try:
                return f.convert(text)
            except ValueError as exc:
                raise argparse.ArgumentTypeError(str(exc)) from exc

        if f.kind == "bool":
            # `--flag` alone means true; `--flag=false` as in NVIDIA's urfave/cli flags.
            parser.add_argument(
                *names, dest=f.dest, nargs="?", const=True, type=typed, help=help_text
            )
        elif f.repeatable:
            parser.add_argument(*names, dest=f.dest, action="append", type=typed, help=help_text)
        else:
            parser.add_argument(*names, dest=f.dest, type=typed, help=help_text)


def env_value(f: Flag, env: Mapping[str, str]) -> tuple[str, str] | None:
    """The env var that sets `f` and its text: NVIDIA's first name that is set wins.

    An empty value counts as unset (a templated manifest's `value: ""`), except for a
    boolean, where NVIDIA's urfave/cli reads an empty variable as false.
    """
    for name in f.envs:
        if name in env and (env[name] != "" or f.kind == "bool"):
            return name, env[name]
    return None


def resolve_flags(
    args: argparse.Namespace, flags: Sequence[Flag], env: Mapping[str, str]
) -> dict[str, Any]:
    """Each flag's value: command line, else env var, else its default (may be None)."""
    values: dict[str, Any] = {}
    for f in flags:
        given = getattr(args, f.dest, None)
        if given is not None and f.repeatable:
            given = [item for part in given for item in part]
        found = env_value(f, env) if given is None else None
        if found is not None:
            name, text = found
            try:
                given = False if f.kind == "bool" and text == "" else f.convert(text)
            except ValueError as exc:
                raise UsageError(f"environment variable {name}: {exc}") from exc
        values[f.dest] = f.default if given is None else given
    return values


class UsageError(KubegpuError):
    """Bad command-line or environment input (exit 2)."""


def overrides_from(values: Mapping[str, Any], flags: Sequence[Flag]) -> dict[str, Any]:
    """Flag/env values that were set, as dotted config paths (they beat the file)."""
    return {f.path: values[f.dest] for f in flags if f.path and values[f.dest] is not None}


# -- serve -----------------------------------------------------------------------------


def cmd_serve(args: argparse.Namespace) -> int:
    import asyncio

    from kubegpu.config.source import KubernetesNodeLabels, NamedConfigs
    from kubegpu.daemon import Daemon, DaemonSettings
    from kubegpu.events import NodeEvents

    env = os.environ
    values = resolve_flags(args, SERVE_FLAGS, env)
    check_serve(values, env)
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
    for notice in serve_notices(values):
        log.warning("%s", notice)
    settings = DaemonSettings(
        plugin_dir=plugin_dir(values),
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
        loop = asyncio.get_running_loop()
        # Signals first, before anything that can wait: handlers only set flags, and the
        # daemon abandons whatever it is doing when `stop` is set.
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        events = NodeEvents.from_environment(env, lazy=True)
        daemon = Daemon(settings, events=events)
        loop.add_signal_handler(signal.SIGHUP, daemon.poke_config)
        await daemon.run(stop)

    try:
        asyncio.run(main())
    except BaseExceptionGroup as group:
        # A root task's own error (one line) rather than the task group's traceback.
        first = _first_leaf(group)
        if isinstance(first, KubegpuError):
            raise first from group
        raise
    log.info("stopped cleanly")
    return 0


def _first_leaf(group: BaseExceptionGroup[BaseException]) -> BaseException:
    first = group.exceptions[0]
    return _first_leaf(first) if isinstance(first, BaseExceptionGroup) else first


def serve_notices(values: Mapping[str, Any]) -> list[str]:
    """Settings NVIDIA's plugin takes that kubegpu accepts but does not act on."""
    notices = []
    if values.get("cdi_feature_flags"):
        notices.append(
            f"--cdi-feature-flags (CDI_FEATURE_FLAGS) {','.join(values['cdi_feature_flags'])}: "
            f"options of NVIDIA's CDI generator, not used by kubegpu's CDI specs; ignored"
        )
    return notices


def plugin_dir(values: Mapping[str, Any]) -> Path:
    """The device-plugin directory: `--device-plugin-path`, or the directory of NVIDIA's
    `--kubelet-socket` when only that moved it."""
    chosen = Path(values.get("device_plugin_path") or DEVICE_PLUGIN_PATH)
    socket = values.get("kubelet_socket")
    if socket is None:
        return chosen
    from_socket = Path(socket).parent
    if chosen == from_socket:
        return chosen
    if chosen != Path(DEVICE_PLUGIN_PATH):
        raise UsageError(
            f"--kubelet-socket (KUBELET_SOCKET) {socket} is not in --device-plugin-path "
            f"(DEVICE_PLUGIN_PATH) {chosen}; the kubelet keeps both in "
            f"one directory: drop one of them"
        )
    try:
        check_plugin_path(str(from_socket))
    except ValueError as exc:
        raise UsageError(f"--kubelet-socket (KUBELET_SOCKET): {exc}") from exc
    return from_socket


def check_serve(values: Mapping[str, Any], env: Mapping[str, str]) -> None:
    """Combinations that cannot mean anything; `UsageError` names both sides."""
    from kubegpu.config.v1 import HealthFlags
    from kubegpu.health import health_flags_from_env

    plugin_dir(values)
    if values["config_file"] and values["config_dir"]:
        raise UsageError(
            "--config-file (CONFIG_FILE) and --config-dir (CONFIG_FILE_SRCDIR) both given; "
            "use one: a single file, or a directory of named configs"
        )
    if values["simulate"] and values["backend"] not in ("auto", "simulated"):
        raise UsageError(
            f"--simulate (SIMULATE) serves a simulated node but --backend (BACKEND) is "
            f"{values['backend']!r}; drop one of them"
        )
    try:
        health_flags_from_env(env, HealthFlags())
    except ConfigError as exc:
        raise UsageError(f"environment variable {exc}") from exc


# -- info ------------------------------------------------------------------------------


def cmd_info(args: argparse.Namespace) -> int:
    from kubegpu.devices import open_backend

    if args.simulate is not None:
        try:
            check_simulate(args.simulate)
        except ValueError as exc:
            raise UsageError(f"--simulate: {exc}") from exc
        if args.backend not in ("auto", "simulated"):
            raise UsageError(
                f"--simulate shows a simulated node but --backend is {args.backend!r}; "
                f"drop one of them"
            )
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

    # No abbreviations (`--mig` for `--mig-strategy`): NVIDIA's Go flags take none.
    serve = sub.add_parser("serve", help="run the device plugin daemon", allow_abbrev=False)
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
    # SIGHUP's default action kills the process; `serve` re-reads its config on it, so
    # ignore it from the first line (imports take ~0.2 s) until the loop's handler is in.
    previous_hup = _set_hup(signal.SIG_IGN)
    # gRPC's C core logs transport notices (a GOAWAY when the kubelet restarts) at INFO on
    # some builds; they are not errors and would read as one. grpc reads this at import.
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    parser = build_parser()
    args = parser.parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    if func is not cmd_serve:
        _set_hup(previous_hup)
    try:
        return func(args)
    except UsageError as exc:
        print(f"kubegpu: error: {exc}", file=sys.stderr)
        return 2
    except KubegpuError as exc:
        print(f"kubegpu: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # the environment (a file, a port): one line, never a traceback
        log.debug("environment error", exc_info=True)
        print(f"kubegpu: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    finally:
        _set_hup(previous_hup)


def _set_hup(handler: Any) -> Any:
    """Install a SIGHUP disposition; the previous one (None outside the main thread)."""
    if threading.current_thread() is not threading.main_thread() or handler is None:
        return None
    return signal.signal(signal.SIGHUP, handler)


if __name__ == "__main__":
    sys.exit(main())
