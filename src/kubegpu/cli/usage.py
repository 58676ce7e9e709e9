"""What every command's parsing shares, and all that `kubegpu --version` and `--help` load.

Usage lines as argparse wrote them, the usage error (exit 2) and click's errors as one
line. Only click and `kubegpu.errors` are imported here: the top-level command imports this
module, and the option declarations (`kubegpu.cli.options`), which need the config schema
and the GPU backends, are imported only by the commands that run.
"""

from __future__ import annotations

import click

from kubegpu.errors import KubegpuError


class UsageError(KubegpuError):
    """Bad command-line or environment input (exit 2)."""


def one_line(exc: click.ClickException) -> str:
    """A click error as one line naming the command: `kubegpu serve: error: ...`."""
    ctx = getattr(exc, "ctx", None)
    where = ctx.command_path if ctx is not None else "kubegpu"
    return f"{where}: error: {' '.join(exc.format_message().split())}"


class OneLineMixin:
    """Usage lines as argparse wrote them (`usage: kubegpu ...`)."""

    def format_usage(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        pieces = self.collect_usage_pieces(ctx)  # type: ignore[attr-defined]
        formatter.write_usage(ctx.command_path, " ".join(pieces), prefix="usage: ")


class Command(OneLineMixin, click.Command):
    pass


class Group(OneLineMixin, click.Group):
    pass
