"""Reading config files and applying overrides, with one-line errors naming the key.

Every `ConfigError` raised here reads `<source>: <key.path>: <what is wrong> (got <value>);
<what to do>`, with list indices in the path (`sharing.mps.resources[0].replicas`), so a
log line alone tells an operator which ConfigMap key to fix and how.

Loading is total: any byte string gives a `Config` or one `ConfigError` line, within the
bounds of `kubegpu.config.yamlsafe` (size, depth, aliases, number sizes); an unexpected
exception from a library is still turned into a `ConfigError`, never let through.

Overrides (flag and env values) are dotted key paths merged into the raw file *before*
validation, so a rule spanning both (MPS in the file, `--mps-root` on the command line)
is checked on the effective config, as NVIDIA's plugin does.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Final

from kubegpu.config.schema import Kind, Problem, Problems, field_at, show, to_json
from kubegpu.config.v1 import SUPPORTED_VERSIONS, VERSION, Config
from kubegpu.errors import ConfigError
from kubegpu.gosyntax import GO_FALSE, GO_TRUE

#: How errors caused by an override (rather than the file) name their source.
OVERRIDE_SOURCE: Final = "flag/env"
_MAX_SHOWN: Final = 80


def parse_raw(text: str | bytes, source: str = "<config>") -> dict[str, Any]:
    """YAML (or JSON) text as a plain mapping; an empty document is `{}`."""
    # PyYAML is imported on the first file read: `serve` without a config file never
    # needs it, and start-up pays for every module imported before registering.
    from kubegpu.config import yamlsafe

    with _total(source):
        if isinstance(text, bytes):
            raw = yamlsafe.load_bytes(text, source)
        else:
            raw = yamlsafe.load_text(text, source)
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(
            f"{source}: the top level must be a mapping (got {show(raw)}); "
            f"start the file with 'version: {VERSION}'"
        )
    return raw


def parse_config(text: str | bytes, source: str = "<config>") -> Config:
    """Parse YAML (or JSON) text into a validated `Config`."""
    return build_config(parse_raw(text, source), {}, source=source)


def read_bytes(path: str | Path) -> bytes:
    """A config file's bytes, at most `yamlsafe.MAX_BYTES` (+1, to tell it is too big)."""
    from kubegpu.config import yamlsafe

    p = Path(path)
    try:
        with p.open("rb") as f:
            return f.read(yamlsafe.MAX_BYTES + 1)
    except OSError as exc:
        raise ConfigError(
            f"{p}: cannot read the config file ({exc.strerror}); check the path and mount"
        ) from exc


def load_config(config_file: str | Path | None, overrides: Mapping[str, Any]) -> Config:
    """The effective config: `config_file` (if any) with `overrides` on top, validated once."""
    data = read_bytes(config_file) if config_file is not None else None
    return load_config_bytes(data, overrides, source=str(config_file or "<defaults>"))


def load_config_bytes(data: bytes | None, overrides: Mapping[str, Any], *, source: str) -> Config:
    """As `load_config`, from a file's bytes already read (`None`: no file)."""
    raw = parse_raw(data, source) if data is not None else {}
    return build_config(raw, overrides, source=source)


def build_config(
    raw: Mapping[str, Any],
    overrides: Mapping[str, Any],
    *,
    source: str,
    override_source: str = OVERRIDE_SOURCE,
) -> Config:
    """Validate `raw` with `overrides` merged in; errors in overridden keys blame the flag."""
    with _total(source):
        # As in NVIDIA's loader, a missing, null or empty version reads as v1.
        version = raw.get("version") or VERSION
        if version not in SUPPORTED_VERSIONS:
            # Checked first: a future version's keys would otherwise be reported as typos.
            raise ConfigError(
                f"{source}: version: unsupported config version (got {show(version)}); "
                f"this kubegpu reads version {', '.join(SUPPORTED_VERSIONS)}"
            )
        merged = apply_overrides(raw, overrides)
        try:
            # Files use NVIDIA's camelCase keys only, so `mig_strategy` is a typo.
            return Config.read(merged)
        except Problems as exc:
            path = _first(exc.problems).path
            blamed = override_source if _overridden(path, overrides) else source
            raise ConfigError(f"{blamed}: {_one_line(format_problems(exc))}") from exc


@contextlib.contextmanager
def _total(source: str) -> Iterator[None]:
    """Turn any exception but `ConfigError` into one: a reload must never end the daemon."""
    try:
        yield
    except ConfigError:
        raise
    except (Exception, RecursionError) as exc:  # the last line of defence, by design
        detail = _one_line(str(exc))[:_MAX_SHOWN] or "no detail"
        raise ConfigError(
            f"{source}: cannot read this config ({type(exc).__name__}: {detail}); "
            "fix the file, and report it as a kubegpu bug if it looks valid"
        ) from exc


def _one_line(text: str) -> str:
    """`text` safe for one log line: no newlines, no lone surrogates."""
    return " ".join(text.encode("utf-8", "backslashreplace").decode("utf-8").split())


def apply_overrides(raw: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of `raw` with each dotted path set; comma strings become lists for list keys.

    Env vars and flags are strings, and NVIDIA's list flags take `a,b`; splitting here
    keeps that knowledge out of the CLI.
    """
    out: dict[str, Any] = copy.deepcopy(dict(raw))
    for dotted, value in overrides.items():
        node = out
        *parents, leaf = dotted.split(".")
        for key in parents:
            child = node.get(key)
            if not isinstance(child, dict):
                child = node[key] = {}
            node = child
        field = field_at(Config, dotted.split("."))
        kind = None if field is None else field.key.kind
        item = None if kind is None else kind.item
        if isinstance(value, str) and item is not None:
            value = [part.strip() for part in value.split(",") if part.strip()]
        if isinstance(value, list | tuple) and item is not None:
            value = [_coerce_string(item, v) if isinstance(v, str) else v for v in value]
        elif isinstance(value, str) and kind is not None:
            value = _coerce_string(kind, value)
        node[leaf] = value
    return out


def config_to_json(config: Config) -> str:
    """The effective config as one compact JSON line with the file's camelCase keys."""
    return to_json(config)


def format_problems(exc: Problems) -> str:
    """The first problem as `key.path: what (got value); what to do`, on one line."""
    first = _first(exc.problems)
    path = first.path
    text = f"{path}: {first.text}" if path else first.text
    if len(exc.problems) > 1:
        text += f" [{len(exc.problems) - 1} more error(s) after this one]"
    return text.replace("\n", " ")


def _first(problems: list[Problem]) -> Problem:
    """The problem to show: an unknown key first, as a typo also makes a key look missing."""
    return next((p for p in problems if p.unknown), problems[0])


#: The spellings Go's strconv.ParseBool (and so NVIDIA's flags and env vars) accepts.
_GO_BOOLS: Final = {**dict.fromkeys(GO_TRUE, True), **dict.fromkeys(GO_FALSE, False)}


def _coerce_string(kind: Kind, value: str) -> Any:
    """An env/flag string as the bool or int its key takes (the schema is strict about
    types in files, as NVIDIA's JSON decoding is); left as is when it does not parse, so
    validation reports it against the flag."""
    if kind.scalar is bool:
        return _GO_BOOLS.get(value.strip(), value)
    if kind.scalar is int:
        try:
            return int(value.strip())
        except ValueError:
            return value
    return value


def _overridden(path: str, overrides: Mapping[str, Any]) -> bool:
    plain = path.split("[", 1)[0]
    return any(plain == key or plain.startswith(f"{key}.") for key in overrides)
