"""Log records as text or JSON (`--log-format`, LOG_FORMAT): one record, one line."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import pytest

from kubegpu import logformat
from kubegpu.cli import setup_logging
from kubegpu.cli.cdi import generate
from kubegpu.cli.labels import labels
from kubegpu.cli.options import parse
from kubegpu.cli.serve import serve

RFC3339_MS_UTC = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z")


def record(msg: str, *args: object, **extra: Any) -> logging.LogRecord:
    rec = logging.makeLogRecord(
        {"name": "kubegpu.daemon", "levelno": logging.WARNING, "levelname": "WARNING"}
    )
    rec.msg, rec.args = msg, args or None
    rec.__dict__.update(extra)
    return rec


def as_json(rec: logging.LogRecord) -> dict[str, Any]:
    line = logformat.JsonFormatter().format(rec)
    assert "\n" not in line and line.isascii()
    value: dict[str, Any] = json.loads(line)
    return value


def test_a_json_record_has_the_fields_an_operator_filters_on() -> None:
    entry = as_json(record("advertising %s: %d device(s)", "nvidia.com/gpu", 8))
    assert list(entry) == ["ts", "level", "logger", "msg"]
    assert RFC3339_MS_UTC.fullmatch(entry["ts"]), entry["ts"]
    assert entry["level"] == "warning"
    assert entry["logger"] == "kubegpu.daemon"
    assert entry["msg"] == "advertising nvidia.com/gpu: 8 device(s)"


def test_the_timestamp_is_utc_to_the_millisecond() -> None:
    assert logformat.rfc3339(0.0) == "1970-01-01T00:00:00.000Z"
    assert logformat.rfc3339(1_700_000_000.1239) == "2023-11-14T22:13:20.123Z"


def test_extras_become_fields_and_never_replace_the_base_ones() -> None:
    entry = as_json(
        record("config", origin="file /etc/c.yaml", config={"flags": {"migStrategy": "mixed"}})
    )
    assert entry["origin"] == "file /etc/c.yaml"
    assert entry["config"] == {"flags": {"migStrategy": "mixed"}}
    clash = record("real", msg_extra=1)
    clash.__dict__["ts"] = "forged"
    entry = as_json(clash)
    assert entry["ts"] != "forged" and entry["msg_extra"] == 1


def test_a_value_json_cannot_hold_is_written_as_text() -> None:
    assert as_json(record("x", path=Path("/run/cdi")))["path"] == "/run/cdi"


@pytest.mark.parametrize(
    "text", ["two\nlines", "cr\rhere", "\x1b[31mred", "line\u2028sep", "rtl\u202eoverride"]
)
def test_a_json_record_is_one_line_whatever_the_message_holds(text: str) -> None:
    assert as_json(record("got %s", text))["msg"] == f"got {text}"


def test_a_traceback_goes_in_exc_on_the_same_line() -> None:
    try:
        raise ValueError("boom")
    except ValueError:
        rec = record("failed")
        rec.exc_info = sys.exc_info()
    entry = as_json(rec)
    assert entry["exc"].startswith("Traceback") and "ValueError: boom" in entry["exc"]


def test_a_text_record_is_the_classic_line_with_its_message_on_one_line() -> None:
    line = logformat.TextFormatter().format(record("got %s", "two\nlines\x1b"))
    assert re.fullmatch(
        r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} WARNING kubegpu\.daemon: got two\\nlines\\x1b",
        line,
    ), line


def test_an_unknown_format_is_refused() -> None:
    with pytest.raises(ValueError, match="json"):
        logformat.formatter("yaml")


@pytest.mark.parametrize("command", [serve, labels, generate], ids=lambda c: c.name)
def test_every_long_running_command_takes_the_log_format_and_level(
    command: click.Command,
) -> None:
    assert parse(command, [], {})["log_format"] == "text"
    assert parse(command, ["--log-format", "json"], {})["log_format"] == "json"
    values = parse(command, [], {"LOG_FORMAT": "json", "LOG_LEVEL": "debug"})
    assert (values["log_format"], values["log_level"]) == ("json", "debug")
    with pytest.raises(click.UsageError, match="LOG_FORMAT"):
        parse(command, [], {"LOG_FORMAT": "yaml"})


@pytest.fixture
def json_root() -> Iterator[list[str]]:
    """The root logger writing JSON into a list, as `--log-format json` sets it up."""
    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, rec: logging.LogRecord) -> None:
            lines.append(self.format(rec))

    handler = Collect()
    handler.setFormatter(logformat.JsonFormatter())
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        yield lines
    finally:
        root.removeHandler(handler)


def test_the_line_that_ends_a_command_is_a_json_record_when_logs_are_json(
    json_root: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    logformat.error_line("kubegpu: config.yaml: flags.migStrategi: unknown key")
    (line,) = json_root
    entry = json.loads(line)
    assert entry["level"] == "error" and entry["logger"] == "kubegpu"
    assert entry["msg"] == "kubegpu: config.yaml: flags.migStrategi: unknown key"
    assert capsys.readouterr().err == ""


def test_the_line_that_ends_a_command_is_plain_text_otherwise(
    capsys: pytest.CaptureFixture[str],
) -> None:
    logformat.error_line("kubegpu: no GPU")
    assert capsys.readouterr().err == "kubegpu: no GPU\n"


def test_a_command_that_fails_with_json_logs_says_why_in_a_json_record(tmp_path: Path) -> None:
    cdi = [sys.executable, "-m", "kubegpu.cli", "cdi", "generate"]
    done = subprocess.run(
        [*cdi, "--device-discovery-strategy=nvml", f"--nvidia-driver-root={tmp_path}/none"],
        capture_output=True,
        text=True,
        timeout=120,
        env={"LOG_FORMAT": "json", "PATH": "/usr/bin:/bin"},
        check=False,
    )
    assert done.returncode == 1
    assert done.stdout == ""
    (line,) = done.stderr.splitlines()
    entry = json.loads(line)
    assert entry["level"] == "error" and "NVML" in entry["msg"], entry


def test_labels_logs_json_on_stderr_and_prints_the_labels_on_stdout(tmp_path: Path) -> None:
    labels_once = [sys.executable, "-m", "kubegpu.cli", "labels", "--oneshot", "-o", "-"]
    done = subprocess.run(
        [*labels_once, "--simulate", "t4-1", "--sysfs-root", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env={"LOG_FORMAT": "json", "PATH": "/usr/bin:/bin"},
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "nvidia.com/gpu.product=Tesla-T4" in done.stdout.splitlines()
    records = [json.loads(line) for line in done.stderr.splitlines()]
    assert {"logger": "kubegpu.labeller", "level": "info"}.items() <= records[-1].items()
    assert records[-1]["msg"].startswith("published ")


@pytest.mark.parametrize(
    ("level", "http_lines"), [("info", False), ("warning", False), ("debug", True)]
)
def test_the_http_clients_line_per_request_shows_only_at_debug(
    level: str, http_lines: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each watch reopened and each slice written was an INFO line of the HTTP client's."""
    root, client = logging.getLogger(), logging.getLogger("httpx2")
    monkeypatch.setattr(root, "handlers", [])
    monkeypatch.setattr(root, "level", root.level)
    monkeypatch.setattr(client, "level", client.level)
    setup_logging(level)
    assert client.isEnabledFor(logging.INFO) is http_lines
    assert client.isEnabledFor(logging.WARNING)
