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
import dataclasses
import difflib
import json
import types
import typing
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import pydantic
from pydantic.fields import FieldInfo

from kubegpu import files
from kubegpu.config import yamlsafe
from kubegpu.config.v1 import CONFIG_ADAPTER, SUPPORTED_VERSIONS, VERSION, Config
from kubegpu.errors import ConfigError
from kubegpu.gosyntax import GO_FALSE, GO_TRUE

#: How errors caused by an override (rather than the file) name their source.
OVERRIDE_SOURCE: Final = "flag/env"
_MAX_SHOWN: Final = 80


def parse_raw(text: str | bytes, source: str = "<config>") -> dict[str, Any]:
    """YAML (or JSON) text as a plain mapping; an empty document is `{}`."""
    # PyYAML is imported on the first file read: `serve` without a config file never
    # needs it, and start-up pays for every module imported before registering.
    with _total(source):
        if isinstance(text, bytes):
            raw = yamlsafe.load_bytes(text, source)
        else:
            raw = yamlsafe.load_text(text, source)
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(
            f"{source}: the top level must be a mapping (got {_show(raw)}); "
            f"start the file with 'version: {VERSION}'"
        )
    return raw


def parse_config(text: str | bytes, source: str = "<config>") -> Config:
    """Parse YAML (or JSON) text into a validated `Config`."""
    return build_config(parse_raw(text, source), {}, source=source)


def read_bytes(path: str | Path) -> bytes:
    """A config file's bytes, at most `yamlsafe.MAX_BYTES` (+1, to tell it is too big).

    Only a regular file is read (through links, as a ConfigMap mount has them): a FIFO
    would block the reader until some writer came, and a device such as /dev/urandom
    never ends and never reads the same twice (`kubegpu.files.read_regular`).
    """
    p = Path(path)
    try:
        return files.read_regular(p, yamlsafe.MAX_BYTES)
    except files.NotRegularFile as exc:
        raise ConfigError(
            f"{p}: the config file is not a regular file ({exc.kind}); "
            "point --config-file at a file"
        ) from exc
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
                f"{source}: version: unsupported config version (got {_show(version)}); "
                f"this kubegpu reads version {', '.join(SUPPORTED_VERSIONS)}"
            )
        merged = apply_overrides(raw, overrides)
        try:
            # by_name=False: files use NVIDIA's camelCase keys only, so `mig_strategy` is a typo.
            return CONFIG_ADAPTER.validate_python(merged, by_name=False)
        except pydantic.ValidationError as exc:
            path = _error_path(_first(exc.errors()))
            blamed = override_source if _overridden(path, overrides) else source
            raise ConfigError(f"{blamed}: {_one_line(format_validation_error(exc))}") from exc


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
            if child is None:
                child = node[key] = {}
            elif not isinstance(child, dict):
                # The file gave this section the wrong type: leave it for validation to
                # refuse, as `kubegpu check` does, rather than let a flag replace it.
                break
            node = child
        else:
            _set(node, dotted, leaf, value)
    return out


def _set(node: dict[str, Any], dotted: str, leaf: str, value: Any) -> None:
    """`node[leaf] = value`, a flag's string read as the key's type (lists split on ',')."""
    annotation = _leaf_annotation(dotted.split("."))
    item = _item_of(annotation)
    if isinstance(value, str) and item is not None:
        value = [part.strip() for part in value.split(",") if part.strip()]
    if isinstance(value, list | tuple) and item is not None:
        value = [_coerce_string(item, v) if isinstance(v, str) else v for v in value]
    elif isinstance(value, str) and annotation is not None:
        value = _coerce_string(annotation, value)
    node[leaf] = value


def config_to_json(config: Config) -> str:
    """The effective config as one compact JSON line with the file's camelCase keys."""
    raw = CONFIG_ADAPTER.dump_python(config, by_alias=True, exclude_none=True)
    return json.dumps(raw, separators=(",", ":"), ensure_ascii=False)


def config_to_raw(config: Config, *, nulls: bool = False) -> dict[str, Any]:
    """The file's mapping for `config` (camelCase keys, JSON types); unset (None) keys are
    left out unless `nulls`."""
    raw: dict[str, Any] = CONFIG_ADAPTER.dump_python(
        config, mode="json", by_alias=True, exclude_none=not nulls
    )
    return raw


# -- pydantic's errors as one line: the only place that knows pydantic's error types ----------


def format_validation_error(exc: pydantic.ValidationError) -> str:
    """The first error as `key.path: what (got value); what to do`, on one line."""
    errors = exc.errors()
    first = _first(errors)
    path = _error_path(first)
    text = f"{path}: {_describe(first, path)}" if path else _describe(first, path)
    if len(errors) > 1:
        text += f" [{len(errors) - 1} more error(s) after this one]"
    return text.replace("\n", " ")


_UNKNOWN_KEY: Final = ("extra_forbidden", "unexpected_keyword_argument")


def _first(errors: Sequence[Any]) -> Any:
    """The error to show: an unknown key first, as a typo also makes a key look missing."""
    return next((e for e in errors if e["type"] in _UNKNOWN_KEY), errors[0])


def _error_path(err: Mapping[str, Any]) -> str:
    """`flags.plugin.deviceListStrategy[0]`: the key path an operator edits."""
    text = ""
    for part in err["loc"]:
        if isinstance(part, int):
            text += f"[{part}]"
        elif part.startswith(("function-", "literal[", "tuple[", "int")) or "[" in part:
            continue  # pydantic's union/validator tags are not keys
        else:
            text += f".{part}" if text else part
    at = (err.get("ctx") or {}).get("at", "")
    if at:
        text += at if at.startswith("[") or not text else f".{at}"
    return text


def _describe(err: Mapping[str, Any], path: str) -> str:
    kind = err["type"]
    ctx = err.get("ctx") or {}
    got = err.get("input")
    if kind == "kubegpu":
        shown = f" (got {_show(ctx['got'])})" if "got" in ctx else ""
        return f"{ctx['message']}{shown}; {ctx['hint']}"
    if kind in _UNKNOWN_KEY:
        return _unknown_key(err["loc"])
    if kind in ("missing", "missing_argument"):
        return f"required key is missing; add '{path.rsplit('.', 1)[-1]}'"
    if kind == "enum":
        choices = ", ".join(v.strip("'") for v in str(ctx.get("expected", "")).split("'")[1::2])
        return f"unknown value (got {_show(got)}); use one of: {choices}"
    if kind == "finite_number":  # only whole-number keys refuse NaN and infinity
        return f"input should be a finite number (got {_show(got)}); write e.g. 4"
    if kind.startswith("int_"):
        return f"must be a whole number (got {_show(got)}); write e.g. 4"
    if kind.startswith("bool_"):
        return f"must be true or false (got {_show(got)}); write true or false"
    if kind.startswith("float_"):
        return f"must be a number (got {_show(got)}); write e.g. 1.5"
    if kind.startswith("string_"):
        return f"must be a string (got {_show(got)}); quote the value"
    if kind in ("dataclass_type", "dataclass_args_type", "model_type", "dict_type"):
        return f"must be a mapping of keys (got {_show(got)}); write 'key: value' lines under it"
    if kind in ("tuple_type", "list_type"):
        return f"must be a list (got {_show(got)}); write a YAML list, e.g. [a, b]"
    bounds = {"greater_than_equal": ">=", "greater_than": ">"}
    if kind in bounds:
        limit = next(iter(ctx.values()))
        return (
            f"must be {bounds[kind]} {limit} (got {_show(got)}); use a value {bounds[kind]} {limit}"
        )
    msg = str(err["msg"])
    return f"{msg[:1].lower()}{msg[1:]} (got {_show(got)}); see docs/configuration.md"


def _unknown_key(loc: Sequence[Any]) -> str:
    key = str(loc[-1])
    valid = _keys_at(loc[:-1])
    by_lower = {v.lower().replace("_", ""): v for v in valid}
    guess = by_lower.get(key.lower().replace("_", ""))
    if guess is None:
        close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
        guess = close[0] if close else None
    if guess is not None:
        return f"unknown key {key!r}; did you mean {guess!r}?"
    return f"unknown key {key!r}; valid keys here: {', '.join(valid)}"


# -- the models' fields by file key ---------------------------------------------------------


def _fields(model: type) -> dict[str, FieldInfo]:
    """A model's fields by their file key (`deviceIDStrategy`)."""
    fields: dict[str, FieldInfo] = model.__pydantic_fields__  # type: ignore[attr-defined]
    return {info.alias or name: info for name, info in fields.items()}


def _keys_at(loc: Sequence[Any]) -> list[str]:
    """The file keys valid in the mapping at `loc` (every model has keys)."""
    model: type = Config
    for part in loc:
        if isinstance(part, str):
            model = _model_in(_fields(model)[part].annotation) or model
    return list(_fields(model))


def _model_in(annotation: Any) -> type | None:
    """The model inside `X`, `X | None` or `tuple[X, ...]`."""
    if dataclasses.is_dataclass(annotation) and isinstance(annotation, type):
        return annotation
    for arg in typing.get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def _leaf_annotation(parts: Sequence[str]) -> Any:
    """The type of the field at a dotted key path, or None when there is no such field."""
    model: type | None = Config
    field = None
    for part in parts:
        if model is None:
            return None
        field = _fields(model).get(part)
        if field is None:
            return None
        model = _model_in(field.annotation)
    return None if field is None else _scalar(field)


def _scalar(field: FieldInfo) -> Any:
    """A field's type without `| None` (a flag sets a value, never a null)."""
    args = [a for a in typing.get_args(field.annotation) if a is not type(None)]
    if typing.get_origin(field.annotation) in (typing.Union, types.UnionType) and len(args) == 1:
        return args[0]
    return field.annotation


def _item_of(annotation: Any) -> Any:
    """The item type of a list key (`tuple[X, ...]`), or None for other keys."""
    if typing.get_origin(annotation) is tuple:
        return typing.get_args(annotation)[0]
    return None


#: The spellings Go's strconv.ParseBool (and so NVIDIA's flags and env vars) accepts.
_GO_BOOLS: Final = {**dict.fromkeys(GO_TRUE, True), **dict.fromkeys(GO_FALSE, False)}


def _coerce_string(annotation: Any, value: str) -> Any:
    """An env/flag string as the bool or int its key takes (the schema is strict about
    types in files, as NVIDIA's JSON decoding is); left as is when it does not parse, so
    validation reports it against the flag."""
    if typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    if annotation is bool:
        return _GO_BOOLS.get(value.strip(), value)
    if annotation is int:
        try:
            return int(value.strip())
        except ValueError:
            return value
    return value


def _overridden(path: str, overrides: Mapping[str, Any]) -> bool:
    plain = path.split("[", 1)[0]
    return any(plain == key or plain.startswith(f"{key}.") for key in overrides)


def _show(value: Any) -> str:
    """A value as the operator wrote it (YAML-ish), short and on one line."""
    if isinstance(value, str):
        text = repr(value)
    elif value is None or isinstance(value, bool | int | float | list | tuple | dict):
        text = json.dumps(value, default=str, ensure_ascii=False)
    else:
        text = repr(value)
    text = text.replace("\n", " ")
    return text if len(text) <= _MAX_SHOWN else f"{text[: _MAX_SHOWN - 1]}…"
