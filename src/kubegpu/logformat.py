"""How kubegpu's commands write their log records: `text` for people, `json` for shippers.

`json` is one JSON object a line, which Loki, Elasticsearch and Cloud Logging read as is:
`ts` (RFC 3339 in UTC, to the millisecond), `level` (`debug`, `info`, `warning`, `error`,
`critical`: the values `--log-level` takes), `logger`, `msg`, then each field the call
passed with `extra=` (the daemon's config line passes `origin`, `config_digest` and the
whole `config`), then `exc` with the traceback, when there is one. JSON escapes every
control character and the non-ASCII ones are written as `\\u` escapes, so one record is
one line whatever its strings hold (U+2028, which some readers split on, included).

`text` is the line kubegpu has always written (`2026-01-02 03:04:05,678 INFO
kubegpu.daemon: message`), with the message's line breaks and other unprintable
characters escaped (`kubegpu.untrusted.escape`), so a record is one line there too; only
a traceback, for a person to read, spans lines.

Written over the standard library's `logging.Formatter` and `json`: python-json-logger,
the common library for this, would add a dependency to every node image and about 20 ms of
imports to every command, and each of its defaults that matter here (field names,
`+00:00` timestamps in microseconds, upper-case levels) would have to be overridden.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any, Final, TextIO

from kubegpu.untrusted import escape

__all__ = [
    "FORMATS",
    "JsonFormatter",
    "TextFormatter",
    "error_line",
    "formatter",
    "logs_json",
    "one_line",
    "rfc3339",
]

#: The values of `--log-format` (LOG_FORMAT); the first is the default.
FORMATS: Final = ("text", "json")
TEXT_FORMAT: Final = "%(asctime)s %(levelname)s %(name)s: %(message)s"

#: What every LogRecord carries: anything else on a record came from `extra=`.
_RECORD_FIELDS: Final = frozenset(logging.makeLogRecord({}).__dict__) | {
    "message",
    "asctime",
    "taskName",
}
#: The fields every JSON record starts with; an `extra=` of the same name does not replace them.
_BASE_FIELDS: Final = ("ts", "level", "logger", "msg")


def one_line(text: str) -> str:
    """`text` with line breaks and other unprintable characters escaped, never cut."""
    return text if text.isprintable() else escape(text, limit=len(text))


class TextFormatter(logging.Formatter):
    """The classic line, one line per record up to its traceback."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = one_line(record.message)
        return super().formatMessage(record)


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": rfc3339(record.created),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key not in _RECORD_FIELDS and key not in entry and not key.startswith("_"):
                entry[key] = value
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            entry["exc"] = record.exc_text
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return json.dumps(entry, ensure_ascii=True, separators=(",", ":"), default=str)


def rfc3339(created: float) -> str:
    """A record's time as RFC 3339 in UTC with milliseconds: `2026-01-02T03:04:05.678Z`."""
    seconds = int(created)
    millis = int((created - seconds) * 1000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + f".{millis:03d}Z"


def formatter(fmt: str) -> logging.Formatter:
    """The formatter for a `--log-format` value (`text` or `json`)."""
    if fmt == "json":
        return JsonFormatter()
    if fmt == "text":
        return TextFormatter()
    raise ValueError(f"unknown log format {fmt!r}; use one of: {', '.join(FORMATS)}")


def logs_json() -> bool:
    """Whether this process's log records go out as JSON (a handler of the root logger)."""
    return any(isinstance(h.formatter, JsonFormatter) for h in logging.getLogger().handlers)


def error_line(text: str, stream: TextIO | None = None) -> None:
    """A command's one-line error on stderr: a JSON record at `error` where the logs are
    JSON, so a log shipper reads the line that ends the process as it reads the rest."""
    if logs_json():
        logging.getLogger("kubegpu").error("%s", text)
    else:
        print(text, file=stream or sys.stderr)
