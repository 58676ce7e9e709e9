"""`kubegpu demo`: a simulated node, the plugin and the kubelet emulator, end to end."""

from __future__ import annotations

import click

from kubegpu.cli import COMMANDS
from kubegpu.cli.usage import Command
from kubegpu.demo import run_demo


def _demo(simulate: str, keep_dir: bool) -> int:
    return run_demo(preset=simulate, keep=keep_dir)


demo = Command(
    "demo",
    params=[
        click.Option(["--simulate"], default="h100-8", show_default=True, help="simulated preset"),
        click.Option(["--keep-dir"], is_flag=True, help="keep the temp directory"),
    ],
    callback=_demo,
    help="A simulated node, the plugin and the kubelet emulator, end to end.",
    short_help=COMMANDS["demo"].summary,
)
