"""`kubegpu labels`: GPU Feature Discovery's job, with GFD's flags and env vars.

The options are GFD's (`cmd/gpu-feature-discovery/main.go`), with its env var names in
its precedence order (`GFD_MIG_STRATEGY` before `MIG_STRATEGY`), plus the named-config
settings `kubegpu serve` takes, so the labeller says what the plugin advertises. The
labelling itself is `kubegpu.labeller`; this module picks the sink and runs the loop.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import click

from kubegpu import logformat
from kubegpu.cli import COMMANDS, setup_logging
from kubegpu.cli.options import (
    GO_DURATION,
    PATH,
    PLUGIN_DISCOVERY_STRATEGIES,
    TEXT,
    backend_option,
    bool_option,
    config_file_option,
    config_keys,
    container_driver_root_option,
    device_discovery_strategy_option,
    driver_root_option,
    environment,
    fail_on_init_error_option,
    files_root,
    log_options,
    mig_strategy_option,
    mps_root_option,
    named_config_options,
    option,
    parse,
    simulate_option,
)
from kubegpu.cli.usage import Command, UsageError, one_line
from kubegpu.config import Config, GfdFlags, flag_overrides
from kubegpu.config.source import ConfigSource, NamedConfigs, NodeLabels
from kubegpu.errors import ConfigError, InitError, KubegpuError
from kubegpu.kube import Kube, KubeError, default_client
from kubegpu.labeller import (
    FeatureFileSink,
    LabelSink,
    LiveConfig,
    NodeFeatureSink,
    NodePatchSink,
    config_loader,
    discoverer,
    named_configs,
    owner_references,
    parse_duration,
    read_machine_type,
    run_until_signalled,
)

log = logging.getLogger("kubegpu.labeller")

SERVICE_ACCOUNT_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
#: GFD's accepted device discovery strategies (cmd/gpu-feature-discovery validateFlags).
DISCOVERY_STRATEGIES = (*PLUGIN_DISCOVERY_STRATEGIES, "vfio")

LABELS_OPTIONS: list[click.Parameter] = [
    bool_option(
        "--oneshot",
        envvar="GFD_ONESHOT",
        config_key="flags.gfd.oneshot",
        help="label once and exit",
    ),
    bool_option(
        "--no-timestamp",
        envvar="GFD_NO_TIMESTAMP",
        config_key="flags.gfd.noTimestamp",
        help="leave out nvidia.com/gfd.timestamp (labels then change only when the GPUs do)",
    ),
    option(
        "--sleep-interval",
        envvar="GFD_SLEEP_INTERVAL",
        type=GO_DURATION,
        config_key="flags.gfd.sleepInterval",
        help="time between labellings (a Go duration); 'infinite' labels once and keeps running",
    ),
    option(
        "--output-file",
        "--output",
        "-o",
        envvar="GFD_OUTPUT_FILE",
        type=PATH,
        config_key="flags.gfd.outputFile",
        help="NFD features.d file to write; '-' for stdout",
    ),
    bool_option(
        "--force-output",
        envvar="KUBEGPU_FORCE_OUTPUT",
        default=False,
        show_default="false",
        help="replace the output file even if it is not a labels file (it is refused otherwise)",
    ),
    option(
        "--machine-type-file",
        envvar="GFD_MACHINE_TYPE_FILE",
        type=PATH,
        config_key="flags.gfd.machineTypeFile",
        help="file with the machine type for nvidia.com/gpu.machine",
    ),
    bool_option(
        "--use-node-feature-api",
        envvar=("GFD_USE_NODE_FEATURE_API", "USE_NODE_FEATURE_API"),
        config_key="flags.gfd.useNodeFeatureAPI",
        help="publish an NFD NodeFeature object instead of a file",
    ),
    bool_option(
        "--node-patch",
        envvar="GFD_NODE_PATCH",
        show_default="false",
        help="patch the Node's labels directly (no NFD needed)",
    ),
    mig_strategy_option(gfd=True),
    fail_on_init_error_option(
        gfd=True, help="exit when no GPU can be read (false: keep labelling without GPU labels)"
    ),
    config_file_option(gfd=True),
    device_discovery_strategy_option(*DISCOVERY_STRATEGIES, config_key=None),
    mps_root_option(absolute=False),
    simulate_option(
        help="use the simulated backend: a preset name (t4-1, h100-8, ...) or a YAML path"
    ),
    *named_config_options(
        node_name_help="this node's name (NodeFeature, patch, the named-config label)"
    ),
    option(
        "--namespace",
        envvar="NAMESPACE",
        type=TEXT,
        show_default="POD_NAMESPACE, the pod's own",
        help="namespace of the NodeFeature object",
    ),
    option(
        "--pod-name",
        envvar="POD_NAME",
        type=TEXT,
        help="this pod's name, to make its DaemonSet own the NodeFeature object",
    ),
    backend_option(),
    driver_root_option(),
    # GFD's names for it; `kubegpu serve` and the others take both as well.
    container_driver_root_option("--driver-root-ctr-path", "--container-driver-root"),
    option(
        "--sysfs-root",
        envvar="KUBEGPU_SYSFS_ROOT",
        type=PATH,
        show_default="/",
        help="root under which sys/bus/pci is read (for gpu.present and gpu.mode)",
    ),
    *log_options(),
]


@click.pass_context
def _labels(ctx: click.Context, /, **values: Any) -> int:
    return run_labels(values, environ=environment(ctx))


labels = Command(
    "labels",
    params=LABELS_OPTIONS,
    callback=_labels,
    help="Label this node with its GPUs, in GPU Feature Discovery's label names. "
    "Precedence: flag, environment variable, config file, default.",
    short_help=COMMANDS["labels"].summary,
)
#: The dotted config key each labels option overrides, by value name.
LABELS_KEYS = config_keys(labels)


def labels_main(
    argv: Sequence[str],
    *,
    environ: Mapping[str, str] | None = None,
    api_factory: Callable[[], Kube] | None = None,
    node_labels: NodeLabels | None = None,
) -> int:
    """`kubegpu labels ARGV` in `environ`: 0 on success, 1 on a runtime failure, 2 on bad
    flags or config. `api_factory` and `node_labels` replace the Kubernetes API (tests)."""
    env = os.environ if environ is None else environ
    try:
        values = parse(labels, argv, env)
    except click.ClickException as exc:
        print(one_line(exc), file=sys.stderr)
        return 2
    return run_labels(values, environ=env, api_factory=api_factory, node_labels=node_labels)


def run_labels(
    values: Mapping[str, Any],
    *,
    environ: Mapping[str, str],
    api_factory: Callable[[], Kube] | None = None,
    node_labels: NodeLabels | None = None,
) -> int:
    """Label with parsed `values` (from `parse` or click).

    With `--config-dir` the config is the named one `kubegpu serve` picks for this node
    (node label, then fallbacks), followed live, so the replica and `-SHARED` labels say
    what the device plugin advertises.
    """
    setup_logging(values.get("log_level") or "info", values.get("log_format") or "text")
    try:
        overrides = flag_overrides(values, LABELS_KEYS)
        named = named_configs(values, node_labels)
    except ConfigError as exc:
        logformat.error_line(f"kubegpu labels: {exc}")
        return 2
    try:
        return asyncio.run(
            _label(values, overrides, named, environ, api_factory or _connected_client)
        )
    except (UsageError, ConfigError) as exc:
        logformat.error_line(f"kubegpu labels: {exc}")
        return 2
    except InitError as exc:
        # GFD's default too; its other answer, labels without the GPU ones, is one flag away.
        logformat.error_line(
            f"kubegpu labels: {exc}; to label without GPU labels (as GFD), "
            "set --fail-on-init-error=false (GFD_FAIL_ON_INIT_ERROR)"
        )
        return 1
    except KubegpuError as exc:
        logformat.error_line(f"kubegpu labels: {exc}")
        return 1


async def _label(
    values: Mapping[str, Any],
    overrides: Mapping[str, Any],
    named: NamedConfigs | None,
    env: Mapping[str, str],
    api_factory: Callable[[], Kube],
) -> int:
    live: LiveConfig | None = None
    load_config: Callable[[], Config]
    if named is not None:
        config_file = values.get("config_file")
        live = LiveConfig(
            ConfigSource(
                config_file=Path(config_file) if config_file else None,
                overrides=overrides,
                named=named,
            )
        )
        load_config = live
        cfg = await live.start()
    else:
        load_config = config_loader(values.get("config_file"), overrides)
        cfg = load_config()
    try:
        gfd = cfg.flags.gfd
        # The config has checked and normalised the interval already (no error here).
        interval = None if gfd.oneshot else parse_duration(gfd.sleep_interval)
        sink = _make_sink(values, gfd, values.get("node_name"), env, api_factory)
        machine_file = gfd.machine_type_file
        sysfs_root = values.get("sysfs_root") or "/"
        driver_root = files_root(
            values, cfg.flags.nvidia_driver_root, cfg.flags.plugin.container_driver_root
        )
        await run_until_signalled(
            discoverer(
                values.get("backend") or "auto",
                simulate=values.get("simulate"),
                driver_root=driver_root,
                sysfs_root=sysfs_root,
            ),
            load_config,
            sink,
            interval=interval,
            machine_type=lambda: read_machine_type(machine_file),
            timestamps=not gfd.no_timestamp,
            sysfs_root=sysfs_root,
        )
    finally:
        if live is not None:
            await live.close()
    return 0


def _make_sink(
    values: Mapping[str, Any],
    gfd: GfdFlags,
    node_name: str | None,
    environ: Mapping[str, str],
    api_factory: Callable[[], Kube],
) -> LabelSink:
    if gfd.use_node_feature_api and values.get("node_patch"):
        raise UsageError("--node-patch: cannot be combined with --use-node-feature-api")
    if not (gfd.use_node_feature_api or values.get("node_patch")):
        return FeatureFileSink(gfd.output_file, force=bool(values.get("force_output")))
    flag = "--use-node-feature-api" if gfd.use_node_feature_api else "--node-patch"
    if not node_name:
        raise UsageError(f"--node-name: required with {flag} (set NODE_NAME from spec.nodeName)")
    if gfd.use_node_feature_api:
        namespace = values.get("namespace") or _namespace(environ)
        if not namespace:
            raise UsageError(
                "--use-node-feature-api: no namespace; set POD_NAMESPACE "
                "(downward API metadata.namespace)"
            )
        api = api_factory()
        try:
            owners = owner_references(api, namespace, values.get("pod_name"))
        except KubeError as exc:  # as GFD: label anyway, just without owners
            log.warning("NodeFeature will have no owner (garbage collection off): %s", exc)
            owners = []
        return NodeFeatureSink(api, node_name, namespace, owners)
    return NodePatchSink(api_factory(), node_name)


def _connected_client() -> Kube:
    """The process's Kubernetes client, configured now: no credentials fail at start."""
    return default_client().connect()


def _namespace(environ: Mapping[str, str]) -> str | None:
    for var in ("POD_NAMESPACE", "KUBERNETES_NAMESPACE"):
        if environ.get(var):
            return environ[var]
    try:
        return Path(SERVICE_ACCOUNT_NAMESPACE).read_text(encoding="utf-8").strip() or None
    except OSError:
        return None
