"""Option declarations shared by every `kubegpu` command, on click.

Each option is declared once, with the env var names NVIDIA's plugin and GFD read
(`envvar=`, the first one set wins) and shown in `--help` with its default. Values are
read as NVIDIA's Go flags read them: `parse_bool` and `parse_go_int` from
`kubegpu.gosyntax`, a bare boolean flag is true, a boolean env var set to `""` is false,
any other env var set to `""` is unset. A bad value is one `UsageError` line naming the
flag, or the env var it came from, and what to do.

`parse` runs a command's options over an argv and an explicit environment (the seam the
tests and `labels_main` use); `kubegpu.cli.main` runs the same options over `os.environ`.
"""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final, get_args

import click

from kubegpu.cli.usage import UsageError as UsageError  # what check_simulate_backend raises
from kubegpu.config import Config, DeviceIDStrategy, MigStrategy, config_to_raw
from kubegpu.config.names import DEFAULT_NODE_LABEL, is_label_key, parse_go_duration
from kubegpu.config.settings import driver_files_root
from kubegpu.config.v1 import DeviceDiscoveryStrategy
from kubegpu.devices import BACKENDS
from kubegpu.gosyntax import parse_bool, parse_go_int
from kubegpu.logformat import FORMATS as LOG_FORMATS

#: Where the environment to read is kept in `click.Context.meta` (os.environ when absent).
ENV_KEY = "kubegpu.environ"
_USED_KEY = "kubegpu.envvar."
#: The config with every default: what `--help` shows for an option over a config key.
DEFAULTS: Final = Config()
#: NVIDIA's device discovery strategies (the plugin's; GFD's add `vfio`).
PLUGIN_DISCOVERY_STRATEGIES: Final[tuple[str, ...]] = get_args(DeviceDiscoveryStrategy)


# -- value parsers: each raises ValueError saying what is wrong and what to do -----------


def parse_list(text: str) -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise ValueError("expected a comma-separated list")
    return items


def parse_int_list(text: str) -> list[int]:
    """NVIDIA's IntSliceFlag: comma-separated integers, each trimmed."""
    return [parse_go_int(part.strip()) for part in text.split(",")]


def parse_port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"invalid port {text!r}; use 1-65535, or 0 for off") from None
    if not 0 <= value <= 65535:
        raise ValueError(f"port {value} is out of range; use 1-65535, or 0 for off")
    return value


_HOST_LABEL = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9]{0,61}[A-Za-z0-9])?")


def parse_listen_address(text: str) -> str:
    """An IP address (`[::1]` taken as `::1`) or a host name to listen on.

    Checked here because the event loop's resolver raises a codec error, not an OSError,
    on a malformed name (`a..b`), which would reach the operator as a traceback.
    """
    host = text[1:-1] if text.startswith("[") and text.endswith("]") else text
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    labels = host.removesuffix(".").split(".")
    if len(host) <= 253 and all(_HOST_LABEL.fullmatch(label) for label in labels):
        return host
    raise ValueError(
        f"{text!r} is not an IP address or host name; give one of this node's addresses, "
        "e.g. 0.0.0.0 for every address"
    )


def parse_go_duration_text(text: str) -> str:
    """GFD's `--sleep-interval`: Go's time.ParseDuration (`60s`, `1h30m`, a bare `0`) or
    `infinite`, kept as written (the config file's key takes the same text)."""
    try:
        parse_go_duration(text)
    except ValueError:
        raise ValueError(
            f"invalid duration {text!r}; use e.g. 60s, 5m, 1h30m, 0 or infinite"
        ) from None
    return text


def choice(*choices: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in choices:
            raise ValueError(f"invalid choice {text!r} (choose from {', '.join(choices)})")
        return text

    return parse


def check_simulate(value: str) -> str:
    if not value:
        raise ValueError("empty; name a preset or a node description YAML file")
    return value


def check_absolute(value: str) -> str:
    if not value.startswith("/"):
        raise ValueError(f"{value!r} is not an absolute path; give one (e.g. /run/nvidia/mps)")
    return value


def check_label_key(value: str) -> str:
    """A Kubernetes label key: `[prefix/]name`, prefix a DNS subdomain."""
    if not is_label_key(value):
        raise ValueError(
            f"{value!r} is not a Kubernetes label key ([prefix/]name, e.g. {DEFAULT_NODE_LABEL})"
        )
    return value


def parse_imex_channels(text: str) -> list[int]:
    value = parse_int_list(text)
    if value not in ([], [0]):
        raise ValueError(
            f"{value} is not a supported channel list; only IMEX channel 0 exists, use 0"
        )
    return value


# -- click types and the option class ---------------------------------------------------


class Parsed(click.ParamType[Any]):
    """A click type from a parse function that raises ValueError (one line, with a fix)."""

    def __init__(self, name: str, parse: Callable[[str], Any], *, whole_env: bool = False) -> None:
        self.name = name
        self._parse = parse
        # A list option's env var is one comma list, not click's whitespace-split values.
        self._whole_env = whole_env

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if not isinstance(value, str):
            return value  # a default, already typed
        try:
            return self._parse(value)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)

    def split_envvar_value(self, rv: str) -> Sequence[str]:
        return [rv] if self._whole_env else super().split_envvar_value(rv)


GO_BOOL = Parsed("boolean", parse_bool)
TEXT = Parsed("text", str)
PATH = Parsed("path", str)
LIST = Parsed("list", parse_list, whole_env=True)
PORT = Parsed("port", parse_port)
ADDRESS = Parsed("address", parse_listen_address)
GO_DURATION = Parsed("duration", parse_go_duration_text)


class EnvOption(click.Option):
    """An option read from the flag, else NVIDIA's env vars (first set wins), else default.

    `config_key` is the dotted config-file key the value overrides (None: a daemon-only
    setting); see `kubegpu.config.flag_overrides`. `--help` shows that key's default in
    the config unless `show_default` says otherwise.
    """

    def __init__(
        self,
        decls: Sequence[str],
        *,
        envvar: str | Sequence[str],
        config_key: str | None = None,
        **attrs: Any,
    ) -> None:
        shown = config_default(config_key) if config_key else None
        attrs.setdefault("show_default", True if shown is None else shown)
        attrs.setdefault("show_envvar", True)
        attrs.setdefault("default", None)
        envs = [envvar] if isinstance(envvar, str) else list(envvar)
        super().__init__(list(decls), envvar=envs, **attrs)
        self.config_key = config_key

    @property
    def envs(self) -> tuple[str, ...]:
        """Every env var read, in precedence order (the first one set wins)."""
        return tuple(self.envvar or ())

    @property
    def is_go_bool(self) -> bool:
        return self.type is GO_BOOL

    def resolve_envvar_value(self, ctx: click.Context) -> str | None:
        env = environment(ctx)
        for name in self.envs:
            text = env.get(name)
            # Empty is unset (a templated manifest's `value: ""`), except for a boolean,
            # which NVIDIA's urfave/cli reads as false.
            if text is None or (text == "" and not self.is_go_bool):
                continue
            ctx.meta[_USED_KEY + (self.name or "")] = name
            return "false" if text == "" else text
        return None

    def handle_parse_result(
        self, ctx: click.Context, opts: Mapping[str, Any], args: list[str]
    ) -> tuple[Any, list[str]]:
        try:
            return super().handle_parse_result(ctx, opts, args)
        except click.BadParameter as exc:
            raise click.UsageError(f"{self.source(ctx)}: {exc.message}", ctx) from exc

    def source(self, ctx: click.Context) -> str:
        """What set the value: the flag's names, or `environment variable NAME`."""
        if ctx.get_parameter_source(self.name or "") is click.core.ParameterSource.ENVIRONMENT:
            return f"environment variable {ctx.meta.get(_USED_KEY + (self.name or ''))}"
        return "/".join(self.opts)


def option(*decls: str, envvar: str | Sequence[str], **attrs: Any) -> EnvOption:
    """One option: `--help` shows its env vars and default."""
    return EnvOption(decls, envvar=envvar, **attrs)


def bool_option(*decls: str, envvar: str | Sequence[str], **attrs: Any) -> EnvOption:
    """A Go boolean: `--flag` alone is true, `--flag=false` as with urfave/cli."""
    return option(*decls, envvar=envvar, type=GO_BOOL, flag_value="true", is_flag=False, **attrs)


def list_option(
    *decls: str, envvar: str | Sequence[str], type: Parsed = LIST, **attrs: Any
) -> EnvOption:
    """A comma list that adds up when repeated, as urfave/cli slice flags do."""
    return option(*decls, envvar=envvar, type=type, multiple=True, callback=_flatten, **attrs)


def _flatten(ctx: click.Context, param: click.Parameter, value: Any) -> list[Any] | None:
    items = [item for part in value or () for item in part]
    return items or None


def environment(ctx: click.Context) -> Mapping[str, str]:
    """The environment this invocation reads (tests pass their own through `parse`)."""
    env: Mapping[str, str] | None = ctx.meta.get(ENV_KEY)
    return os.environ if env is None else env


def env_options(command: click.Command) -> list[EnvOption]:
    return [p for p in command.params if isinstance(p, EnvOption)]


def parse(command: click.Command, argv: Sequence[str], env: Mapping[str, str]) -> dict[str, Any]:
    """The values `command` gets from `argv` and `env`; `click.UsageError` when bad."""
    return dict(_context(command, argv, env).params)


def given(command: click.Command, argv: Sequence[str], env: Mapping[str, str]) -> set[str]:
    """The names of the values `argv` or `env` set (not left to their default)."""
    ctx = _context(command, argv, env)
    given_by = (click.core.ParameterSource.COMMANDLINE, click.core.ParameterSource.ENVIRONMENT)
    return {name for name in ctx.params if ctx.get_parameter_source(name) in given_by}


def _context(command: click.Command, argv: Sequence[str], env: Mapping[str, str]) -> click.Context:
    root = click.Context(command, info_name="kubegpu")
    root.meta[ENV_KEY] = env
    return command.make_context(command.name, list(argv), parent=root)


# -- options several commands share: one declaration, one meaning ----------------------


def driver_root_option() -> EnvOption:
    """The host's driver root, in every command: NVIDIA's `--nvidia-driver-root`
    (`--driver-root`). Its files are read where it is mounted (`--container-driver-root`)."""
    return option(
        "--nvidia-driver-root",
        "--driver-root",
        "driver_root",
        envvar="NVIDIA_DRIVER_ROOT",
        type=PATH,
        config_key="flags.nvidiaDriverRoot",
        help="root of the driver installation on the host",
    )


def container_driver_root_option(*decls: str) -> EnvOption:
    """Where the host's driver root is mounted in this container (NVIDIA's names)."""
    return option(
        *decls,
        "container_driver_root",
        envvar=("DRIVER_ROOT_CTR_PATH", "CONTAINER_DRIVER_ROOT"),
        type=PATH,
        config_key="flags.plugin.containerDriverRoot",
        help="where the host's driver root is mounted in this container",
    )


def simulate_option(**attrs: Any) -> EnvOption:
    attrs.setdefault("help", "serve a simulated node: a preset name or a YAML file")
    return option(
        "--simulate", envvar="SIMULATE", type=Parsed("preset|file", check_simulate), **attrs
    )


def backend_option() -> EnvOption:
    return option(
        "--backend",
        envvar="BACKEND",
        type=Parsed("backend", choice(*BACKENDS)),
        default="auto",
        help="GPU backend: " + ", ".join(BACKENDS),
    )


def _envs(name: str, gfd: bool) -> tuple[str, ...]:
    """NVIDIA's env var for a flag; GFD reads its `GFD_` twin first (cmd/gpu-feature-discovery)."""
    return ("GFD_" + name, name) if gfd else (name,)


def config_default(key: str) -> str | None:
    """The default of the dotted config `key` as `--help` shows it (None: it has none)."""
    value: Any = config_to_raw(DEFAULTS)
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return ",".join(map(str, value))
    return None if value is None else str(value)


def _layered(key: str, config_key: str | None) -> dict[str, Any]:
    """A flag over a config key has no default of its own: `--help` shows the config's
    default in parentheses ("the config file's value, else this"). A command without a
    config file (`cdi generate`) takes the config's default (at `key`) as its own."""
    if config_key is None:
        return {"default": config_default(key)}
    return {"config_key": config_key}


def config_file_option(*, gfd: bool = False) -> EnvOption:
    return option(
        "--config-file",
        envvar=_envs("CONFIG_FILE", gfd),
        type=PATH,
        help="a v1 config file (NVIDIA's)",
    )


def mig_strategy_option(*, gfd: bool = False) -> EnvOption:
    return option(
        "--mig-strategy",
        envvar=_envs("MIG_STRATEGY", gfd),
        type=Parsed("strategy", choice(*MigStrategy)),
        config_key="flags.migStrategy",
        help="how MIG devices are advertised: none, single or mixed",
    )


def fail_on_init_error_option(*, gfd: bool = False, help: str) -> EnvOption:
    """`help` says what failing means for the command (exit, or keep running without GPUs)."""
    return bool_option(
        "--fail-on-init-error",
        envvar=_envs("FAIL_ON_INIT_ERROR", gfd),
        config_key="flags.failOnInitError",
        help=help,
    )


def mps_root_option(*, absolute: bool = True) -> EnvOption:
    # `labels` has always taken any path here (the config's own check still applies).
    check = Parsed("path", check_absolute) if absolute else PATH
    return option(
        "--mps-root",
        envvar="MPS_ROOT",
        type=check,
        config_key="flags.mpsRoot",
        help="host directory for MPS pipes and logs"
        + (" (absolute)" if absolute else "; the config needs it when sharing.mps is set"),
    )


def device_discovery_strategy_option(*choices: str, config_key: str | None) -> EnvOption:
    """NVIDIA's strategy (how GPUs are found: NVML, Tegra's CSV files, VFIO), with the
    values the peer command accepts: the plugin's auto/nvml/tegra, GFD's adds vfio. Not
    kubegpu's backend (`--backend`; `cdi generate` names that one differently)."""
    return option(
        "--device-discovery-strategy",
        envvar="DEVICE_DISCOVERY_STRATEGY",
        type=Parsed("strategy", choice(*choices)),
        config_key=config_key,
        show_default=config_default("flags.deviceDiscoveryStrategy"),
        help=f"NVIDIA's device discovery strategy: {', '.join(choices)} (kubegpu's is --backend)",
    )


def dev_root_option(*, config_key: str | None = "flags.nvidiaDevRoot") -> EnvOption:
    return option(
        "--dev-root",
        "--nvidia-dev-root",
        envvar="NVIDIA_DEV_ROOT",
        type=PATH,
        config_key=config_key,
        show_default="the driver root",
        help="root of the host's /dev nodes",
    )


def device_id_strategy_option(
    *, config_key: str | None = "flags.plugin.deviceIDStrategy"
) -> EnvOption:
    return option(
        "--device-id-strategy",
        envvar="DEVICE_ID_STRATEGY",
        type=Parsed("strategy", choice(*DeviceIDStrategy)),
        help="how GPUs are named to the runtime: uuid or index",
        **_layered("flags.plugin.deviceIDStrategy", config_key),
    )


def nvidia_ctk_path_option(
    *,
    config_key: str | None = "flags.plugin.nvidiaCTKPath",
    help: str = "path of nvidia-ctk (or nvidia-cdi-hook) on the host, for CDI hooks",
) -> EnvOption:
    """Without a config key (`cdi generate`) it has no default: unset writes no hooks."""
    defaults = _layered("flags.plugin.nvidiaCTKPath", config_key) if config_key else {}
    return option(
        "--nvidia-ctk-path",
        "--nvidia-cdi-hook-path",
        envvar=("NVIDIA_CDI_HOOK_PATH", "NVIDIA_CTK_PATH"),
        type=PATH,
        help=help,
        **defaults,
    )


def log_options() -> list[click.Parameter]:
    """How a command that runs for a while logs: `--log-level` and `--log-format`, the same
    in every such command (`serve`, `labels`, `cdi generate`); `kubegpu.logformat`."""
    return [
        option(
            "--log-level",
            envvar="LOG_LEVEL",
            type=Parsed("level", choice("debug", "info", "warning", "error")),
            default="info",
            help="debug, info, warning, error",
        ),
        option(
            "--log-format",
            envvar="LOG_FORMAT",
            type=Parsed("format", choice(*LOG_FORMATS)),
            default=LOG_FORMATS[0],
            help="text (a line for people) or json (one object a line, for log shippers)",
        ),
    ]


def named_config_options(*, node_name_help: str) -> list[click.Parameter]:
    """The named-config selection (NVIDIA's config-manager settings), the same for `serve`
    and `labels` so the labeller picks the config the plugin picks; `node_name_help`
    says what else the command uses the node's name for."""
    return [
        option(
            "--config-dir",
            envvar="CONFIG_FILE_SRCDIR",
            type=PATH,
            help="directory of named configs (the chart's config.map); the node label picks one",
        ),
        option(
            "--default-config",
            envvar="DEFAULT_CONFIG",
            type=TEXT,
            help="named config used when the node has no label",
        ),
        list_option(
            "--fallback-strategies",
            envvar="FALLBACK_STRATEGIES",
            show_default="named,single",
            help="named, single, empty (comma list) when the node has no label",
        ),
        option("--node-name", envvar="NODE_NAME", type=TEXT, help=node_name_help),
        option(
            "--node-label",
            envvar="NODE_LABEL",
            type=Parsed("key", check_label_key),
            default=DEFAULT_NODE_LABEL,
            help="node label that picks a named config",
        ),
    ]


def config_keys(command: click.Command) -> dict[str, str]:
    """Each option's config-file key, by value name (for `kubegpu.config.flag_overrides`)."""
    return {o.name: o.config_key for o in env_options(command) if o.name and o.config_key}


def files_root(
    values: Mapping[str, Any], host: str | None = None, container: str | None = None
) -> str:
    """Where this process reads the driver's files: `--container-driver-root` when given
    (the user says where the host's root is mounted), else as `serve` picks it from
    `--nvidia-driver-root` (`host`, `container`: the config's values, for unset flags)."""
    if values.get("container_driver_root"):
        return str(values["container_driver_root"])
    flags = DEFAULTS.flags
    return driver_files_root(
        values.get("driver_root") or host or flags.nvidia_driver_root,
        container or flags.plugin.container_driver_root,
    )


def check_simulate_backend(simulate: str | None, backend: str, what: str) -> None:
    if simulate is not None and backend not in ("auto", "simulated"):
        raise UsageError(
            f"--simulate (SIMULATE) {what} but --backend (BACKEND) is {backend!r}; drop one of them"
        )
