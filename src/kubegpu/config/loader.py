"""Reading config files and applying overrides, with one-line errors naming the key."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pydantic
import yaml

from kubegpu.config.v1 import VERSION, Config
from kubegpu.errors import ConfigError


def parse_config(text: str, source: str = "<config>") -> Config:
    """Parse YAML (or JSON) text into a validated `Config`."""
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: not valid YAML ({_yaml_reason(exc)}); fix the syntax") from exc
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a mapping with 'version: {VERSION}' at the top")
    return _validate(raw, source)


def load_file(path: str | Path) -> Config:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"config file {p}: cannot read it ({exc.strerror}); check the path") from exc
    return parse_config(text, str(p))


def resolve(base: Config | None, overrides: Mapping[str, Any], source: str = "<flags>") -> Config:
    """`base` with each dotted-path override (`flags.migStrategy`) applied, validated."""
    raw: dict[str, Any] = (base or Config()).model_dump(by_alias=True, mode="json")
    for dotted, value in overrides.items():
        node = raw
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return _validate(raw, source)


def _validate(raw: dict[str, Any], source: str) -> Config:
    version = raw.get("version", VERSION)
    if version != VERSION:
        raise ConfigError(
            f"{source}: version: unknown config version {version!r}; this kubegpu reads 'v1'"
        )
    try:
        return Config.model_validate(raw)
    except pydantic.ValidationError as exc:
        raise ConfigError(f"{source}: {format_validation_error(exc)}") from exc


def format_validation_error(exc: pydantic.ValidationError) -> str:
    """The first error as `key.path: message (got value)`; one line."""
    err = exc.errors()[0]
    path = ".".join(str(p) for p in err["loc"] if not str(p).startswith("function-"))
    msg = err["msg"]
    if err["type"] == "extra_forbidden":
        msg = "unknown key"
    got = err.get("input")
    shown = "" if isinstance(got, dict | list) else f" (got {got!r})"
    more = f"; and {len(exc.errors()) - 1} more error(s)" if len(exc.errors()) > 1 else ""
    return f"{path}: {msg}{shown}{more}"


def _yaml_reason(exc: yaml.YAMLError) -> str:
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or "syntax error"
    if mark is not None:
        return f"{problem} at line {mark.line + 1}, column {mark.column + 1}"
    return str(problem)
