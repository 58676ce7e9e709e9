"""The `kubegpu` command: serve, labels, cdi, info, demo, check, config (one module each).

Options are declared once per command with click (`kubegpu.cli.options`), with the env
var names NVIDIA's plugin and GFD read, shown in `--help`. Every mistake is one line on
stderr and exit status 2; a problem with the node is one line and exit status 1; never a
traceback. Commands are imported when run (click's lazy group), so `kubegpu serve` loads
no other command. Importing this package ignores SIGHUP before anything else loads.
"""

from __future__ import annotations

# SIGHUP's default action kills the process, and `serve` re-reads its config on it: ignore
# it before any other import (click and logging alone take tens of ms) so that a HUP sent
# while the process starts never kills it. `main` hands the disposition found here back.
import signal
import threading

_HUP_BEFORE = (
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    if threading.current_thread() is threading.main_thread()
    and signal.getsignal(signal.SIGHUP) is signal.SIG_DFL
    else None
)

import os  # noqa: E402

# gRPC's C core logs transport notices (a GOAWAY when the kubelet restarts) at INFO on
# some builds; they are not errors and would read as one. grpc reads this when it loads,
# which the imports below do.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

import importlib  # noqa: E402
import logging  # noqa: E402
import sys  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from typing import Any  # noqa: E402

import click  # noqa: E402

from kubegpu import __version__  # noqa: E402
from kubegpu.api import DEVICE_PLUGIN_PATH, KUBELET_SOCKET  # noqa: E402
from kubegpu.cli.options import Group, UsageError, one_line  # noqa: E402
from kubegpu.errors import KubegpuError  # noqa: E402

__all__ = ["DEVICE_PLUGIN_PATH", "KUBELET_SOCKET", "UsageError", "kubegpu", "main"]

log = logging.getLogger("kubegpu")

#: Each command's module and object, imported only when the command runs (or `--help`).
COMMANDS = {
    "serve": "kubegpu.cli.serve:serve",
    "labels": "kubegpu.cli.labels:labels",
    "cdi": "kubegpu.cli.cdi:cdi",
    "info": "kubegpu.cli.info:info",
    "demo": "kubegpu.cli.demo:demo",
    "check": "kubegpu.cli.check:check",
    "config": "kubegpu.cli.config:config",
    "top": "kubegpu.cli.top:top",
}


class LazyGroup(Group):
    """A group whose commands are imported on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        target = COMMANDS.get(cmd_name)
        if target is None:
            return None
        module, _, name = target.partition(":")
        command: click.Command = getattr(importlib.import_module(module), name)
        return command


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


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run `kubegpu` with `argv` (default: the process's); the exit status."""
    # Ignored from the import of this package (see the top) until `serve`'s loop handler
    # is in; the disposition to hand back is the one found before that import, if any.
    previous_hup = _set_hup(signal.SIG_IGN)
    if _HUP_BEFORE is not None and previous_hup is signal.SIG_IGN:
        previous_hup = _HUP_BEFORE
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
