"""`kubegpu top`: which pod uses what on this node's GPUs, as a table that refreshes.

It reads the daemon's own `/metrics` (the `kubegpu_container_gpu_*` families), so the table
is what Prometheus sees, and it needs no access to the driver or /proc: run it in the
kubegpu pod (`kubectl exec ds/kubegpu -- kubegpu top`), where METRICS_PORT (and
METRICS_ADDRESS or POD_IP) say where that is, or give `--url`.
"""

from __future__ import annotations

import shutil
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import click
from prometheus_client.parser import text_string_to_metric_families

from kubegpu.cli import COMMANDS
from kubegpu.cli.options import Parsed, environment, option
from kubegpu.cli.usage import Command, UsageError
from kubegpu.errors import KubegpuError
from kubegpu.metrics import UNATTRIBUTED, USAGE_LABELS

#: The largest /metrics answer read (a node's answer is tens of KiB).
MAX_BODY_BYTES = 32 * 1024 * 1024
_USED = "kubegpu_container_gpu_memory_used_bytes"
_LIMIT = "kubegpu_container_gpu_memory_limit_bytes"
_SM = "kubegpu_container_gpu_sm_utilization_percent"
_UP = "kubegpu_usage_source_up"
_HEADER = ("GPU", "SLICE", "POD", "CONTAINER", "USED", "LIMIT", "USED%", "SM%")
#: Waits between refreshes (a seam for tests, which replace it).
pause = time.sleep


@dataclass
class Row:
    labels: Mapping[str, str]
    used: float = 0.0
    limit: float | None = None
    sm: float | None = None


@dataclass
class Reading:
    rows: list[Row]
    #: Source -> readable at this scrape.
    sources: dict[str, bool]
    hostname: str = ""


def default_url(env: Mapping[str, str]) -> str | None:
    """The daemon's /metrics as its own environment gives it; None when metrics are off."""
    port = env.get("METRICS_PORT", "")
    if not port.isdigit() or int(port) == 0:
        return None
    host = env.get("METRICS_ADDRESS") or env.get("POD_IP") or "127.0.0.1"
    if host in ("0.0.0.0", "::"):
        host = "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}/metrics"


def fetch(url: str, timeout: float) -> str:
    """The exposition text at `url`; `KubegpuError` (one line) when it cannot be read."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as answer:
            body: bytes = answer.read(MAX_BODY_BYTES + 1)
    except (urllib.error.URLError, OSError, ValueError) as err:
        reason = getattr(err, "reason", err)
        raise KubegpuError(
            f"cannot read {url}: {reason}; is `kubegpu serve` running with --metrics-port?"
        ) from err
    if len(body) > MAX_BODY_BYTES:
        raise KubegpuError(f"{url} answered more than {MAX_BODY_BYTES} bytes; not kubegpu's")
    return body.decode("utf-8", errors="replace")


def parse(text: str) -> Reading:
    """The per-container rows and source states of one /metrics text."""
    rows: dict[tuple[str, ...], Row] = {}
    sources: dict[str, bool] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == _UP:
                    sources[sample.labels.get("source", "")] = sample.value == 1
                    continue
                if sample.name not in (_USED, _LIMIT, _SM):
                    continue
                key = tuple(sample.labels.get(label, "") for label in USAGE_LABELS)
                row = rows.setdefault(key, Row(dict(zip(USAGE_LABELS, key, strict=True))))
                if sample.name == _USED:
                    row.used = sample.value
                elif sample.name == _LIMIT:
                    row.limit = sample.value
                else:
                    row.sm = sample.value
    except ValueError as err:
        raise KubegpuError(f"the metrics are not Prometheus text ({err})") from err
    hostname = next((r.labels["Hostname"] for r in rows.values() if r.labels["Hostname"]), "")
    return Reading(list(rows.values()), sources, hostname)


def size(value: float | None) -> str:
    if value is None:
        return "-"
    if value >= 1 << 30:
        return f"{value / (1 << 30):.1f} GiB"
    return f"{value / (1 << 20):.0f} MiB"


def _pod(labels: Mapping[str, str]) -> str:
    namespace, pod, claim = labels["namespace"], labels["pod"], labels["dra_claim_name"]
    if not namespace:
        return pod or UNATTRIBUTED
    if not pod:
        return f"{namespace}/claim:{claim}"
    return f"{namespace}/{pod}"


def table(reading: Reading) -> str:
    """The rows as an aligned table, with a line saying what was (not) read."""
    lines: list[tuple[str, ...]] = [_HEADER]
    for row in reading.rows:
        labels = row.labels
        slice_ = f"{labels['GPU_I_PROFILE']} gi{labels['GPU_I_ID']}" if labels["GPU_I_ID"] else "-"
        share = "-" if not row.limit else f"{100 * row.used / row.limit:.0f}%"
        lines.append(
            (
                labels["gpu"] or labels["UUID"],
                slice_,
                _pod(labels),
                labels["container"] or "-",
                size(row.used),
                size(row.limit),
                share,
                "-" if row.sm is None else f"{row.sm:.0f}",
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(_HEADER))]
    body = [
        "  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in lines
    ]
    down = sorted(name for name, ok in reading.sources.items() if not ok)
    head = f"node {reading.hostname or '?'}: {len(reading.rows)} row(s)"
    if down:
        head += f"; not read: {', '.join(down)} (see the daemon's log)"
    if len(lines) == 1:
        body.append("(no GPU allocations or processes)")
    return "\n".join([head, *body])


def _run(url: str, interval: float, once: bool, timeout: float) -> int:
    if once:
        click.echo(table(parse(fetch(url, timeout))))
        return 0
    clear = sys.stdout.isatty()
    try:
        while True:
            try:
                text = table(parse(fetch(url, timeout)))
            except KubegpuError as err:  # keep refreshing: the daemon may be restarting
                text = f"kubegpu: {err}"
            stamp = time.strftime("%H:%M:%S")
            if clear:
                columns = shutil.get_terminal_size().columns
                text = "\n".join(line[:columns] for line in text.splitlines())
                click.echo("\x1b[H\x1b[2J", nl=False)
            click.echo(f"{stamp}  every {interval:g}s, Ctrl-C to stop\n{text}\n")
            pause(interval)
    except KeyboardInterrupt:
        return 0


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value < 1e6:
        raise ValueError(f"{text!r} is not a positive number of seconds, e.g. 2")
    return value


@click.pass_context
def _top(ctx: click.Context, /, **values: Any) -> int:
    url = values["url"] or default_url(environment(ctx))
    if url is None:
        raise UsageError(
            "no metrics to read: give --url (http://<pod IP>:<metrics port>/metrics), or run "
            "in the kubegpu pod, where METRICS_PORT says where they are"
        )
    if not url.startswith(("http://", "https://")):
        raise UsageError(f"--url {url!r}: give an http:// or https:// URL")
    return _run(url, values["interval"], values["once"], values["timeout"])


top = Command(
    "top",
    params=[
        option(
            "--url",
            envvar="KUBEGPU_METRICS_URL",
            default=None,
            show_default="from METRICS_PORT and METRICS_ADDRESS or POD_IP",
            help="the daemon's /metrics",
        ),
        click.Option(
            ["--interval"],
            type=Parsed("seconds", _seconds),
            default=2.0,
            show_default=True,
            help="seconds between refreshes",
        ),
        click.Option(["--once"], is_flag=True, help="print one table and exit (for scripts)"),
        click.Option(
            ["--timeout"],
            type=Parsed("seconds", _seconds),
            default=10.0,
            show_default=True,
            help="seconds per read",
        ),
    ],
    callback=_top,
    help="Show which pod uses what on this node's GPUs: memory used against the "
    "allocation's limit, and SM utilization, per GPU, MIG slice and container. Reads the "
    "daemon's /metrics.",
    short_help=COMMANDS["top"].summary,
)
