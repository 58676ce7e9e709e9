"""`kubegpu serve`: the device plugin daemon, with NVIDIA's flags and env vars.

`--mode dra` (KUBEGPU_MODE) serves Dynamic Resource Allocation instead, as a DRA kubelet
plugin, with the kubelet directory flags of NVIDIA's DRA driver.

Every option has the env var twin NVIDIA's plugin reads (`--mig-strategy` <->
`MIG_STRATEGY`), so DaemonSets written for NVIDIA's plugin keep working. A flag beats its
env var, which beats the config file (`kubegpu.config.flag_overrides`), which beats the
default. Bad values exit 2 with one line naming the flag or variable.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Callable, Coroutine, Mapping
from pathlib import Path
from typing import Any

import click

from kubegpu.cli import COMMANDS, setup_logging
from kubegpu.cli.options import (
    ADDRESS,
    PLUGIN_DISCOVERY_STRATEGIES,
    PORT,
    TEXT,
    Parsed,
    backend_option,
    bool_option,
    check_absolute,
    check_simulate_backend,
    choice,
    config_file_option,
    config_keys,
    container_driver_root_option,
    dev_root_option,
    device_discovery_strategy_option,
    device_id_strategy_option,
    driver_root_option,
    environment,
    fail_on_init_error_option,
    list_option,
    log_options,
    mig_strategy_option,
    mps_root_option,
    named_config_options,
    nvidia_ctk_path_option,
    option,
    parse_imex_channels,
    simulate_option,
)
from kubegpu.cli.usage import Command, UsageError
from kubegpu.config import (
    AllocationPolicy,
    AmdNamingStrategy,
    HealthFlags,
    flag_overrides,
)
from kubegpu.config.source import named_configs
from kubegpu.daemon import Daemon, DaemonSettings
from kubegpu.errors import ConfigError, KubegpuError
from kubegpu.events import NodeEvents
from kubegpu.health import health_flags_from_env
from kubegpu.kubelet_paths import (
    DEVICE_PLUGIN_PATH,
    KUBELET_SOCKET,
    PLUGINS_DIRECTORY,
    POD_RESOURCES_SOCKET,
    REGISTRAR_DIRECTORY,
)
from kubegpu.mode import Mode
from kubegpu.rpc import MAX_SOCKET_PATH
from kubegpu.usage import DEFAULT_MAX_ROWS

log = logging.getLogger("kubegpu")

__all__ = ["SERVE_KEYS", "check_serve", "plugin_dir", "run_serve", "serve", "serve_notices"]


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"invalid number {text!r}; give seconds, e.g. 60") from None


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"invalid count {text!r}; give a whole number of at least 1")
    return value


def _directory(text: str) -> str:
    if not text.startswith("/"):
        raise ValueError(f"{text!r} is not an absolute path; give the kubelet's directory")
    return text


def check_plugin_path(value: str) -> str:
    if not value:
        raise ValueError(f"empty; give the kubelet's directory, {DEVICE_PLUGIN_PATH}")
    if not value.startswith("/"):
        raise ValueError(f"{value!r} is relative; give an absolute path")
    longest = len(os.fsencode(Path(value) / KUBELET_SOCKET))
    if longest > MAX_SOCKET_PATH:
        raise ValueError(
            f"{value!r} is too long: its socket paths would exceed the {MAX_SOCKET_PATH}-byte "
            f"unix limit; use a shorter directory"
        )
    return value


def check_kubelet_socket(value: str) -> str:
    """kubegpu finds the kubelet's socket in the device-plugin directory, where the kubelet
    also looks for the plugins' sockets; only the directory can move."""
    if not value:
        raise ValueError(
            "empty: kubegpu always registers with the kubelet; drop the setting, or give "
            f"<device-plugin dir>/{KUBELET_SOCKET}"
        )
    if not value.startswith("/") or Path(value).name != KUBELET_SOCKET:
        raise ValueError(
            f"{value!r} must be an absolute path ending in /{KUBELET_SOCKET}; to move the "
            f"device-plugin directory use --device-plugin-path"
        )
    return value


def _mode(text: str) -> Mode:
    return Mode(choice(*Mode)(text))


SERVE_OPTIONS: list[click.Parameter] = [
    option(
        "--mode",
        envvar="KUBEGPU_MODE",
        type=Parsed("mode", _mode),
        default="plugin",
        help="plugin: serve the device plugin API; dra: serve Dynamic Resource Allocation "
        "as a DRA kubelet plugin (gpu.nvidia.com)",
    ),
    option(
        "--kubelet-registrar-directory-path",
        envvar="KUBELET_REGISTRAR_DIRECTORY_PATH",
        type=Parsed("path", _directory),
        default=REGISTRAR_DIRECTORY,
        help="dra: where the kubelet watches for plugin registration sockets",
    ),
    option(
        "--kubelet-plugins-directory-path",
        envvar="KUBELET_PLUGINS_DIRECTORY_PATH",
        type=Parsed("path", _directory),
        default=PLUGINS_DIRECTORY,
        help="dra: the kubelet's plugins directory; the driver keeps dra.sock and its "
        "checkpoint in <it>/<driver>",
    ),
    config_file_option(),
    mig_strategy_option(),
    fail_on_init_error_option(
        help="exit 1 when no GPU/NVML is found (false: stay up, advertise nothing)"
    ),
    driver_root_option(),
    dev_root_option(),
    bool_option(
        "--pass-device-specs",
        envvar="PASS_DEVICE_SPECS",
        config_key="flags.plugin.passDeviceSpecs",
        help="add /dev device nodes to Allocate answers (runtimes without the NVIDIA hook)",
    ),
    list_option(
        "--device-list-strategy",
        envvar="DEVICE_LIST_STRATEGY",
        config_key="flags.plugin.deviceListStrategy",
        help="envvar, volume-mounts, cdi-annotations, cdi-cri (comma list)",
    ),
    device_id_strategy_option(),
    option(
        "--cdi-annotation-prefix",
        envvar="CDI_ANNOTATION_PREFIX",
        type=TEXT,
        config_key="flags.plugin.cdiAnnotationPrefix",
        help="prefix of CDI annotations",
    ),
    nvidia_ctk_path_option(),
    container_driver_root_option("--container-driver-root", "--driver-root-ctr-path"),
    option(
        "--resource-naming-strategy",
        "--resource_naming_strategy",
        "-resource_naming_strategy",
        envvar="RESOURCE_NAMING_STRATEGY",
        type=Parsed("strategy", choice(*AmdNamingStrategy)),
        config_key="flags.plugin.amdResourceNamingStrategy",
        help="AMD devices as amd.com/gpu (single) or one resource per partition mode, "
        "amd.com/cpx_nps4 ... (mixed); ROCm's -resource_naming_strategy",
    ),
    option(
        "--shared-devices-allocation-policy",
        envvar="SHARED_DEVICES_ALLOCATION_POLICY",
        type=Parsed("policy", choice(*AllocationPolicy)),
        config_key="flags.plugin.sharedDevicesAllocationPolicy",
        help="how replicas of shared GPUs are picked for a multi-replica request",
    ),
    list_option(
        "--imex-channel-ids",
        envvar="IMEX_CHANNEL_IDS",
        type=Parsed("ints", parse_imex_channels, whole_env=True),
        config_key="imex.channelIDs",
        help="IMEX channels to inject (comma list of Go integers; only 0 exists)",
    ),
    bool_option(
        "--imex-required",
        envvar="IMEX_REQUIRED",
        config_key="imex.required",
        help="the IMEX channels must exist when the plugin starts",
    ),
    list_option(
        "--cdi-feature-flags",
        envvar="CDI_FEATURE_FLAGS",
        help="NVIDIA's CDI generator options (comma list); accepted, not applied by kubegpu",
    ),
    list_option(
        "--cdi-disable-hooks",
        envvar="CDI_DISABLE_HOOKS",
        help="OCI hooks to leave out of CDI specs (comma list, or all); serve writes none",
    ),
    mps_root_option(),
    bool_option(
        "--gds-enabled",
        envvar="GDS_ENABLED",
        config_key="flags.gdsEnabled",
        help="ask the runtime for GPUDirect Storage",
    ),
    bool_option(
        "--mofed-enabled",
        envvar="MOFED_ENABLED",
        config_key="flags.mofedEnabled",
        help="ask the runtime for MOFED",
    ),
    bool_option(
        "--gdrcopy-enabled",
        envvar="GDRCOPY_ENABLED",
        config_key="flags.gdrcopyEnabled",
        help="ask the runtime for GDRCopy",
    ),
    device_discovery_strategy_option(
        *PLUGIN_DISCOVERY_STRATEGIES, config_key="flags.deviceDiscoveryStrategy"
    ),
    option(
        "--health-recovery-seconds",
        envvar="HEALTH_RECOVERY_SECONDS",
        type=Parsed("seconds", _float),
        config_key="flags.health.recoverySeconds",
        help="a GPU whose checks pass this long is healthy again (0: never)",
    ),
    option(
        "--device-plugin-path",
        envvar="DEVICE_PLUGIN_PATH",
        type=Parsed("path", check_plugin_path),
        default=DEVICE_PLUGIN_PATH,
        help="the kubelet's device-plugin directory",
    ),
    option(
        "--kubelet-socket",
        envvar="KUBELET_SOCKET",
        type=Parsed("path", check_kubelet_socket),
        show_default=DEVICE_PLUGIN_PATH + KUBELET_SOCKET,
        help="the kubelet's registration socket; its directory is the device-plugin directory",
    ),
    bool_option(
        "--handover",
        envvar="HANDOVER",
        default=False,
        show_default="false",
        help="start beside a serve already on the device-plugin directory, take over its "
        "registration and let it drain (zero-gap rolling updates with maxSurge)",
    ),
    backend_option(),
    simulate_option(),
    *named_config_options(node_name_help="this node's name (for the config label and events)"),
    option(
        "--metrics-port",
        envvar="METRICS_PORT",
        type=PORT,
        default=0,
        help="Prometheus /metrics port (0: off)",
    ),
    option(
        "--metrics-address",
        envvar="METRICS_ADDRESS",
        type=ADDRESS,
        show_default=f"POD_IP, else {DaemonSettings.metrics_address}",
        help="address for /metrics",
    ),
    option(
        "--proc-root",
        envvar="PROC_ROOT",
        type=Parsed("path", check_absolute),
        default="/proc",
        help="the host's /proc (mounted at /host/proc by the chart): process cgroups, to "
        "tell which container uses what on the GPUs",
    ),
    option(
        "--pod-resources-socket",
        envvar="POD_RESOURCES_SOCKET",
        type=Parsed("path", check_absolute),
        default=POD_RESOURCES_SOCKET,
        help="the kubelet's PodResources API socket: which container holds which device",
    ),
    option(
        "--usage-max-rows",
        envvar="USAGE_MAX_ROWS",
        type=Parsed("count", _count),
        default=DEFAULT_MAX_ROWS,
        help="per-container GPU rows per scrape at most (each up to 4 series); beyond it the "
        "rows holding the least memory are left out",
    ),
    option(
        "--health-port",
        envvar="HEALTH_PORT",
        type=PORT,
        default=0,
        help="port for /healthz and /readyz (0: off)",
    ),
    option(
        "--health-address",
        envvar="HEALTH_ADDRESS",
        type=ADDRESS,
        default=DaemonSettings.health_address,
        help="address for probes",
    ),
    bool_option(
        "--with-labels",
        envvar="WITH_LABELS",
        default=False,
        show_default="false",
        help="also write GPU Feature Discovery labels (to flags.gfd.outputFile)",
    ),
    *log_options(),
]


@click.pass_context
def _serve(ctx: click.Context, /, **values: Any) -> int:
    return run_serve(values, environment(ctx))


serve = Command(
    "serve",
    params=SERVE_OPTIONS,
    callback=_serve,
    help="Run the device plugin daemon (or, with --mode dra, the DRA kubelet plugin). "
    "Precedence: flag, environment variable, config file, default.",
    short_help=COMMANDS["serve"].summary,
)
#: The dotted config key each serve option overrides, by value name.
SERVE_KEYS = config_keys(serve)


def run_serve(values: Mapping[str, Any], env: Mapping[str, str]) -> int:
    """Run the daemon until SIGTERM/SIGINT; `UsageError` for settings that cannot work."""
    main = _daemon_main(values, env)
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


def _daemon_main(
    values: Mapping[str, Any], env: Mapping[str, str]
) -> Callable[[], Coroutine[Any, Any, None]]:
    """`serve`'s checks, logging and settings; the coroutine function that runs it."""
    check_serve(values, env)
    setup_logging(values["log_level"], values["log_format"])
    named = named_configs(values)
    for notice in serve_notices(values):
        log.warning("%s", notice)
    settings = DaemonSettings(
        plugin_dir=plugin_dir(values),
        mode=values["mode"],
        registrar_dir=Path(values["kubelet_registrar_directory_path"]),
        kubelet_plugins_dir=Path(values["kubelet_plugins_directory_path"]),
        node_name=values.get("node_name") or "",
        backend=values["backend"],
        simulate=values["simulate"],
        config_file=Path(values["config_file"]) if values["config_file"] else None,
        overrides=flag_overrides(values, SERVE_KEYS),
        named=named,
        health_env={k: v for k, v in env.items() if k.startswith("DP_")},
        metrics_port=values["metrics_port"],
        metrics_address=values["metrics_address"]
        or env.get("POD_IP")
        or DaemonSettings.metrics_address,
        health_port=values["health_port"],
        health_address=values["health_address"],
        with_labels=values["with_labels"],
        handover=values["handover"],
        proc_root=Path(values["proc_root"]),
        pod_resources_socket=Path(values["pod_resources_socket"]),
        usage_max_rows=values["usage_max_rows"],
    )

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        # Signals first, before anything that can wait: handlers only set flags, and the
        # daemon abandons whatever it is doing when `stop` is set.
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        events = NodeEvents.from_environment(env, node=values["node_name"], lazy=True)
        daemon = Daemon(settings, events=events)
        loop.add_signal_handler(signal.SIGHUP, daemon.poke_config)
        # A start command can hand these down blocked (the mask survives exec), which
        # would leave SIGTERM unable to stop us and SIGHUP unable to reload: handled now,
        # so let them in (one blocked while ignored is pending, and delivered here).
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGINT, signal.SIGHUP})
        await daemon.run(stop)

    return main


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
    plugin_dir(values)
    if values.get("mode") == Mode.DRA and not values.get("node_name"):
        raise UsageError(
            "--mode dra (KUBEGPU_MODE) needs --node-name (NODE_NAME): the node's "
            "ResourceSlices and DRA pool are named after it; set it from the downward API "
            "(spec.nodeName)"
        )
    if values.get("mode") == Mode.DRA and values.get("handover"):
        raise UsageError(
            "--handover (HANDOVER) works in the device plugin mode only: a DRA driver's "
            "sockets have fixed names the kubelet finds them by; leave it off with --mode dra"
        )
    if values["config_file"] and values["config_dir"]:
        raise UsageError(
            "--config-file (CONFIG_FILE) and --config-dir (CONFIG_FILE_SRCDIR) both given; "
            "use one: a single file, or a directory of named configs"
        )
    check_simulate_backend(values["simulate"], values["backend"], "serves a simulated node")
    try:
        health_flags_from_env(env, HealthFlags())
    except ConfigError as exc:
        raise UsageError(f"environment variable {exc}") from exc
