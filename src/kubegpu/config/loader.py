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
import difflib
import json
import re
import types
import typing
from collections.abc import Iterator, Mapping, Sequence
from enum import Enum
from pathlib import Path
from typing import Any, Final

import msgspec
from msgspec.structs import FieldInfo

from kubegpu import files
from kubegpu.config import yamlsafe
from kubegpu.config.v1 import (
    SUPPORTED_VERSIONS,
    VERSION,
    Config,
    Invalid,
    UnknownKey,
    read_file_keys,
)
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
        read: Mapping[str, Any] = merged
        try:
            read = read_file_keys(merged)
            # strict: NVIDIA's keys take the types Go's JSON decoder takes (no "true" for a
            # bool, no 2.0 for an int); the readers have already taken kubegpu's lax forms.
            return msgspec.convert(read, Config, strict=True)
        except (UnknownKey, Invalid, msgspec.ValidationError) as exc:
            path, text = describe_error(exc, read)
            blamed = override_source if _overridden(path, overrides) else source
            raise ConfigError(f"{blamed}: {_one_line(_joined(path, text))}") from exc


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
    return json.dumps(config_to_raw(config), separators=(",", ":"), ensure_ascii=False)


def config_to_raw(config: Config, *, nulls: bool = False) -> dict[str, Any]:
    """The file's mapping for `config` (camelCase keys, JSON types); unset (None) keys are
    left out unless `nulls`."""
    raw: dict[str, Any] = _plain(msgspec.to_builtins(config, str_keys=True), nulls)
    return raw


def _plain(value: Any, nulls: bool) -> Any:
    """msgspec's builtins as JSON's types: lists for its tuples, and nulls kept or not."""
    if isinstance(value, dict):
        return {k: _plain(v, nulls) for k, v in value.items() if nulls or v is not None}
    if isinstance(value, list | tuple):
        return [_plain(v, nulls) for v in value]
    return value


# -- errors as one line: the only place that words the schema's and msgspec's errors ---------
#
# msgspec raises one `ValidationError` (the first error) whose only content is its text,
# `<message> - at `$.key.path``: it exposes no structured error (no kind, no path parts,
# no input), so the few message forms it has are matched here, the path is read from
# the text and the value shown is looked up in the mapping it was given.

_AT = re.compile(r"(?P<message>.*) - at (?:`[^`]*` in )?`\$(?P<path>[^`]*)`", re.DOTALL)
_FIELD = re.compile(r"Object (?P<kind>contains unknown|missing required) field `(?P<key>[^`]*)`")
_EXPECTED = re.compile(
    r"Expected `(?P<type>[^`]*)`(?:, got `[^`]*`| (?P<op>[<>]=?) (?P<limit>\S+))"
)
#: How a type error is worded, by msgspec's name of the type expected.
_KINDS: Final = {
    "int": "must be a whole number (got {}); write e.g. 4",
    "bool": "must be true or false (got {}); write true or false",
    "float": "must be a number (got {}); write e.g. 1.5",
    "str": "must be a string (got {}); quote the value",
    "object": "must be a mapping of keys (got {}); write 'key: value' lines under it",
    "array": "must be a list (got {}); write a YAML list, e.g. [a, b]",
}


def describe_error(
    exc: UnknownKey | Invalid | msgspec.ValidationError, read: Mapping[str, Any]
) -> tuple[str, str]:
    """An error's key path and what to say there, `what (got value); what to do`; `read`
    is the mapping msgspec was given, where the value shown is found."""
    if isinstance(exc, UnknownKey):
        return exc.path, _unknown_key(exc.key, exc.valid)
    if isinstance(exc, Invalid):  # a reader's: its path is from the top
        return exc.at, _invalid(exc)
    match = _AT.fullmatch(str(exc))
    message, path = (match["message"], match["path"].removeprefix(".")) if match else (str(exc), "")
    cause = exc.__cause__
    if isinstance(cause, Invalid):  # a model's rule: its path is below the model's
        return _sub_path(path, cause.at), _invalid(cause)
    got = _show(_value_at(read, path))
    if isinstance(cause, ValueError):
        return path, f"value error, {cause} (got {got}); see docs/configuration.md"
    field = _FIELD.fullmatch(message)
    if field is None:
        return path, _describe(message, path, got)
    key = field["key"]
    if field["kind"] == "missing required":
        return _sub_path(path, key), f"required key is missing; add '{key}'"
    return _sub_path(path, key), _unknown_key(key, _keys_at(path))


def _joined(path: str, text: str) -> str:
    return f"{path}: {text}" if path else text


def _sub_path(path: str, at: str) -> str:
    if not at:
        return path
    return f"{path}{at}" if at.startswith("[") or not path else f"{path}.{at}"


def _invalid(exc: Invalid) -> str:
    shown = f" (got {_show(exc.got)})" if exc.has_got else ""
    return f"{exc.message}{shown}; {exc.hint}"


def _describe(message: str, path: str, got: str) -> str:
    expected = _EXPECTED.match(message)
    if expected is not None:
        kind = expected["type"].removesuffix(" | null")
        if expected["op"]:
            op, limit = expected["op"], expected["limit"]
            return f"must be {op} {limit} (got {got}); use a value {op} {limit}"
        if kind in _KINDS:
            return _KINDS[kind].format(got)
    annotation = _annotation_at(path)
    if message.startswith("Invalid enum value"):
        if isinstance(annotation, type) and issubclass(annotation, Enum):
            return (
                f"unknown value (got {got}); use one of: {', '.join(m.value for m in annotation)}"
            )
        if typing.get_origin(annotation) is typing.Literal:
            choices = [repr(c) for c in typing.get_args(annotation)]
            listed = (
                f"{', '.join(choices[:-1])} or {choices[-1]}" if len(choices) > 1 else choices[0]
            )
            return f"input should be {listed} (got {got}); see docs/configuration.md"
    if message == "Number out of range":
        kind = {int: "int", float: "float"}.get(annotation, "")
        if kind:
            return _KINDS[kind].format(got)
    return f"{message[:1].lower()}{message[1:]} (got {got}); see docs/configuration.md"


def _value_at(read: Mapping[str, Any], path: str) -> Any:
    """The value at `flags.plugin.deviceListStrategy[0]` in `read` (None when absent)."""
    node: Any = read
    for key, index in re.findall(r"([^.\[\]]+)|\[(\d+)\]", path):
        try:
            node = node[int(index)] if index else node[key]
        except (KeyError, IndexError, TypeError):
            return None
    return node


def _annotation_at(path: str) -> Any:
    """The type of the field (or list item) at a key path, or None."""
    parts = re.sub(r"\[\d+\]", "", path).split(".")
    annotation = _leaf_annotation(parts)
    item = _item_of(annotation) if path.endswith("]") else None
    found = annotation if item is None else item
    if typing.get_origin(found) is typing.Annotated:
        return typing.get_args(found)[0]
    return found


def _unknown_key(key: str, valid: Sequence[str]) -> str:
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
    return {info.encode_name: info for info in msgspec.structs.fields(model)}


def _keys_at(path: str) -> list[str]:
    """The file keys valid in the mapping at a key path (every model has keys)."""
    model: type = Config
    for part in re.sub(r"\[\d+\]", "", path).split("."):
        if part and part in _fields(model):
            model = _model_in(_fields(model)[part].type) or model
    return list(_fields(model))


def _model_in(annotation: Any) -> type | None:
    """The model inside `X`, `X | None` or `tuple[X, ...]`."""
    if isinstance(annotation, type) and issubclass(annotation, msgspec.Struct):
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
        model = _model_in(field.type)
    return None if field is None else _scalar(field)


def _scalar(field: FieldInfo) -> Any:
    """A field's type without `| None` (a flag sets a value, never a null)."""
    args = [a for a in typing.get_args(field.type) if a is not type(None)]
    if typing.get_origin(field.type) in (typing.Union, types.UnionType) and len(args) == 1:
        return args[0]
    return field.type


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
