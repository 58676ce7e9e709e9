"""The `kubegpu` command: serve, labels, cdi, info, demo, check, config (one module each).

Options are declared once per command with click (`kubegpu.cli.options`), with the env
var names NVIDIA's plugin and GFD read, shown in `--help`. Every mistake is one line on
stderr and exit status 2; a problem with the node is one line and exit status 1; never a
traceback. Commands are imported when run (click's lazy group), so `kubegpu serve` loads
no other command, and `kubegpu --help` and `--version` load none: this module imports only
click and light modules, and `--help` lists each command from `COMMANDS`.

SIGHUP's default action ends the process, and `serve` re-reads its config on it, so a HUP
must never find the default in place. Importing this package ignores it in its first
statement, before it imports anything (the console script `kubegpu` and `python -m
kubegpu.cli` both import it first); `serve` installs its reload handler once its loop runs,
and the other commands get the disposition found here back. What stays open is the
interpreter's own start before this package runs (loading libpython, `site` and its `.pth`
files, the console script's own first lines): tens of milliseconds on a busy node. Only a
start command that ignores HUP before it runs the interpreter closes that window: the
image's and the chart's `env --ignore-signal=HUP kubegpu serve`, the same prefix in a
systemd unit's `ExecStart=` or a hand start.
"""

# The first statement, through the interpreter's built-in `_signal` (set up before any
# Python code runs, so this loads nothing): `signal` would load `enum`, and asking for the
# main thread `threading`, each a few milliseconds more in which a HUP ends the process.
# Only a default disposition is replaced (an ignore or a handler the caller set is theirs),
# and only from the main thread (`_signal.signal` raises ValueError elsewhere). Typeshed
# has no stub for `_signal`; its functions are the ones `signal` re-exports.
import _signal  # type: ignore[import-not-found]

_HUP_IGNORED_HERE = False
if _signal.getsignal(_signal.SIGHUP) == _signal.SIG_DFL:
    try:
        _signal.signal(_signal.SIGHUP, _signal.SIG_IGN)
        _HUP_IGNORED_HERE = True
    except ValueError:
        pass

import os  # noqa: E402
import signal  # noqa: E402
import threading  # noqa: E402

# gRPC's C core logs transport notices (a GOAWAY when the kubelet restarts) at INFO on
# some builds; they are not errors and would read as one. grpc reads this when it loads,
# which the imports below do.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

import importlib  # noqa: E402
import logging  # noqa: E402
import sys  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from typing import Any, Final, NamedTuple  # noqa: E402

import click  # noqa: E402

from kubegpu import __version__, logformat  # noqa: E402
from kubegpu.cli.usage import Group, UsageError, one_line  # noqa: E402
from kubegpu.errors import KubegpuError  # noqa: E402
from kubegpu.kubelet_paths import DEVICE_PLUGIN_PATH, KUBELET_SOCKET  # noqa: E402

__all__ = ["DEVICE_PLUGIN_PATH", "KUBELET_SOCKET", "UsageError", "kubegpu", "main"]

log = logging.getLogger("kubegpu")


class LazyCommand(NamedTuple):
    """A command of `kubegpu`, imported only when it runs."""

    #: `module:object`.
    target: str
    #: Its line in `kubegpu --help` and its `short_help`: the command module reads it from
    #: here, so the listing is written without importing the command, from the same text.
    summary: str


#: Every command, in `--help`'s order.
COMMANDS: Final = {
    "serve": LazyCommand("kubegpu.cli.serve:serve", "run the device plugin daemon"),
    "labels": LazyCommand(
        "kubegpu.cli.labels:labels",
        "label the node with its GPUs (GPU Feature Discovery compatible)",
    ),
    "cdi": LazyCommand("kubegpu.cli.cdi:cdi", "Container Device Interface specs."),
    "info": LazyCommand("kubegpu.cli.info:info", "show this node's GPUs as kubegpu sees them"),
    "demo": LazyCommand(
        "kubegpu.cli.demo:demo", "simulated node + plugin + kubelet emulator, end to end"
    ),
    "check": LazyCommand(
        "kubegpu.cli.check:check",
        "validate a config file offline and show what it would advertise",
    ),
    "config": LazyCommand("kubegpu.cli.config:config", "The config file (version v1)."),
    "top": LazyCommand("kubegpu.cli.top:top", "show which pod uses what on this node's GPUs"),
}


class LazyGroup(Group):
    """A group whose commands are imported on first use; `--help` imports none."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        entry = COMMANDS.get(cmd_name)
        if entry is None:
            return None
        module, _, name = entry.target.partition(":")
        command: click.Command = getattr(importlib.import_module(module), name)
        return command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        # click's own listing asks every command for its short help, importing them all.
        with formatter.section("Commands"):
            formatter.write_dl([(name, entry.summary) for name, entry in COMMANDS.items()])


@click.group(
    "kubegpu",
    cls=LazyGroup,
    help="Kubernetes GPU device plugin.",
    context_settings={"help_option_names": ["-h", "--help"]},
)
@click.version_option(__version__, "--version", prog_name="kubegpu", message="%(prog)s %(version)s")
@click.pass_context
def kubegpu(ctx: click.Context) -> None:
    # Only `serve` handles SIGHUP (it re-reads its config); the rest get it back now.
    if ctx.invoked_subcommand != "serve":
        _set_hup(ctx.meta.get("kubegpu.previous_hup"))


def setup_logging(level: str, fmt: str = "text") -> None:
    """Log records at `level` and above to stderr, as `text` or `json` (`kubegpu.logformat`)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logformat.formatter(fmt))
    threshold = getattr(logging, level.upper())
    logging.basicConfig(level=threshold, handlers=[handler])
    # The HTTP client logs every request at INFO ("HTTP Request: GET ..."): each watch
    # reopened and each slice written would be a line. kubegpu logs what a call meant and
    # every failure itself, so the client's lines show only at debug.
    http = threshold if threshold <= logging.DEBUG else max(threshold, logging.WARNING)
    logging.getLogger("httpx2").setLevel(http)


def main(argv: Sequence[str] | None = None) -> int:
    """Run `kubegpu` with `argv` (default: the process's); the exit status."""
    # Ignored from the import of this package (see the top) until `serve`'s loop handler
    # is in; the disposition to hand back is the one found before that import, if any.
    previous_hup = _set_hup(signal.SIG_IGN)
    if _HUP_IGNORED_HERE and previous_hup is signal.SIG_IGN:
        previous_hup = signal.SIG_DFL
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        with kubegpu.make_context("kubegpu", args) as ctx:
            ctx.meta["kubegpu.previous_hup"] = previous_hup
            result = kubegpu.invoke(ctx)
        return result if isinstance(result, int) else 0
    except click.exceptions.NoArgsIsHelpError as exc:  # `kubegpu`, `kubegpu cdi`: usage
        print(exc.ctx.get_usage(), file=sys.stderr)
        return 2
    except click.exceptions.Exit as exc:  # --help, --version
        return exc.exit_code
    except click.ClickException as exc:
        print(one_line(exc), file=sys.stderr)
        return exc.exit_code
    except click.exceptions.Abort:
        return 130
    except UsageError as exc:
        print(f"kubegpu: error: {exc}", file=sys.stderr)
        return 2
    except KubegpuError as exc:
        logformat.error_line(f"kubegpu: {exc}")
        return 1
    except OSError as exc:  # the environment (a file, a port): one line, never a traceback
        log.debug("environment error", exc_info=True)
        logformat.error_line(f"kubegpu: {exc}")
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
