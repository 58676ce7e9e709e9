"""A small validator for config files: frozen dataclasses whose fields say their file key.

The config is a value (`Config`, a tree of frozen dataclasses, as DESIGN.md wants); this
module reads a raw mapping (from YAML) into one, collecting every problem with its key
path. It exists instead of pydantic because `serve` pays for each module it imports before
registering with the kubelet, and pydantic with a built schema was ~90 ms and ~12 MiB of a
150 ms / 50 MiB start-up budget (docs/performance.md, "A config schema without pydantic").

How a model reads its mapping, in order (the semantics the v1 schema was written to):
1. `Model._before(data)` may rewrite the raw mapping (NVIDIA's spellings, defaults that
   depend on where a model sits); `key: null` is "not set" unless the key is in
   `Model._null_is_error`.
2. Each field in definition order: its `before` hook on the raw value, then its `Kind`
   (the type: strict bool/int as Go's JSON decoding is, enums, lists, nested models),
   then its `after` hook. Every failing field is reported, not only the first.
3. Keys that are no field are reported ("unknown key", with the closest valid key).
4. Only when all of that passed, `Model._check(self)` (rules spanning several fields).

Python code constructs models by field name (`Flags(mig_strategy=MigStrategy.MIXED)`);
that is trusted, typed code and is not validated. Files go through `validate`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Iterable
from enum import Enum
from typing import Any, ClassVar, Final, TypeVar

T = TypeVar("T")
M = TypeVar("M", bound="Model")

#: A key path as written in the file: mapping keys and list indices.
Loc = tuple[str | int, ...]

_MAX_SHOWN: Final = 80


class _NoValue:
    """Marks "nothing to show" apart from a real `None` value."""


_NO_VALUE: Final = _NoValue()


def show(value: Any) -> str:
    """A value as the operator wrote it (YAML-ish), short and on one line."""
    if isinstance(value, str):
        text = repr(value)
    elif value is None or isinstance(value, bool | int | float | list | tuple | dict):
        text = json.dumps(value, default=str, ensure_ascii=False)
    else:
        text = repr(value)
    text = text.replace("\n", " ")
    return text if len(text) <= _MAX_SHOWN else f"{text[: _MAX_SHOWN - 1]}…"


class Invalid(Exception):
    """One problem with a value: `text` is what follows `key.path: ` in the error line.

    `at` extends the path below where it was raised (`[2]`, `resources[0].name`).
    """

    def __init__(self, text: str, *, at: str = "") -> None:
        super().__init__(text)
        self.text = text
        self.at = at


def invalid(message: str, hint: str, *, at: str = "", got: Any = _NO_VALUE) -> Invalid:
    """A problem the loader prints as `<path><at>: <message> (got <got>); <hint>`."""
    shown = "" if isinstance(got, _NoValue) else f" (got {show(got)})"
    return Invalid(f"{message}{shown}; {hint}", at=at)


@dataclasses.dataclass(frozen=True)
class Problem:
    loc: Loc
    text: str
    at: str = ""
    #: An unknown key: shown first, as a typo also makes the key it meant look missing.
    unknown: bool = False

    @property
    def path(self) -> str:
        """`flags.plugin.deviceListStrategy[0]`: the key path an operator edits."""
        text = ""
        for part in self.loc:
            text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else part)
        if self.at:
            text += self.at if self.at.startswith("[") or not text else f".{self.at}"
        return text


class Problems(Exception):
    """Every problem found in one mapping, in the order they were found."""

    def __init__(self, problems: list[Problem]) -> None:
        super().__init__(problems[0].text)
        self.problems = problems


# -- kinds: what a field's value may be -----------------------------------------------------


class Kind:
    """Checks and converts one raw value; raises `Invalid` (or `Problems` for nested ones)."""

    #: For list kinds, the kind of an item (flag/env overrides split `a,b` for these).
    item: Kind | None = None
    #: The Python type a flag/env string converts to before validation (bool, int), if any.
    scalar: type | None = None
    #: The model this kind reads (itself, in a list, or optional), for key-path lookups.
    model: type[Model] | None = None

    def __call__(self, value: Any, loc: Loc) -> Any:
        raise NotImplementedError


class _Scalar(Kind):
    def __init__(self, check: Callable[[Any], Any], scalar: type | None = None) -> None:
        self._check = check
        self.scalar = scalar

    def __call__(self, value: Any, loc: Loc) -> Any:
        return self._check(value)


def _type_error(what: str, fix: str) -> Callable[[Any], Invalid]:
    return lambda value: Invalid(f"must be {what} (got {show(value)}); {fix}")


_not_bool = _type_error("true or false", "write true or false")
_not_int = _type_error("a whole number", "write e.g. 4")
_not_float = _type_error("a number", "write e.g. 1.5")
_not_str = _type_error("a string", "quote the value")


def _strict_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    raise _not_bool(value)


#: The words a lax bool reads (the spellings pydantic took for the v1 schema's `disabled`).
_BOOL_WORDS: Final = {
    **dict.fromkeys(("1", "on", "t", "true", "y", "yes"), True),
    **dict.fromkeys(("0", "off", "f", "false", "n", "no"), False),
}


def _lax_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float) and value in (0, 1):
        return bool(value)
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    if isinstance(value, str) and value.lower() in _BOOL_WORDS:
        return _BOOL_WORDS[value.lower()]
    raise _not_bool(value)


def _strict_int(value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise _not_int(value)


def _ascii_number(value: Any) -> str | None:
    """A string or bytes as plain ASCII text, stripped; None for anything else."""
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    if isinstance(value, str) and value.isascii():
        return value.strip()
    return None


def _lax_int(value: Any) -> int:
    """An int; also a bool, an integral float, or a number written as a string."""
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise Invalid(f"input should be a finite number (got {show(value)}); write e.g. 4")
        if value.is_integer() and -(2**63) <= value < 2**63:  # pydantic's i64 bound, kept
            return int(value)
        raise _not_int(value)
    text = _ascii_number(value)
    if text is not None:
        try:
            return int(text)
        except ValueError:
            pass
        try:
            number = float(text)
        except ValueError:
            raise _not_int(value) from None
        if math.isfinite(number) and number.is_integer() and "." in text and "e" not in text:
            return int(number)
    raise _not_int(value)


def _lax_float(value: Any) -> float:
    """A float; also an int or bool, or a number written as a string."""
    if isinstance(value, int | float):
        try:
            return float(value)
        except OverflowError:
            raise _not_float(value) from None
    text = _ascii_number(value)
    if text is not None:
        try:
            return float(text)
        except ValueError:
            pass
    raise _not_float(value)


def _str(value: Any) -> str:
    if isinstance(value, Enum) and isinstance(value, str):
        return str(value.value)
    if isinstance(value, str):
        return value
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            pass
    raise _not_str(value)


STRICT_BOOL: Final[Kind] = _Scalar(_strict_bool, bool)
LAX_BOOL: Final[Kind] = _Scalar(_lax_bool, bool)
STRICT_INT: Final[Kind] = _Scalar(_strict_int, int)
LAX_INT: Final[Kind] = _Scalar(_lax_int, int)
LAX_FLOAT: Final[Kind] = _Scalar(_lax_float)
STR: Final[Kind] = _Scalar(_str)
#: A value its field's `before` hook has already checked and converted.
AS_IS: Final[Kind] = _Scalar(lambda value: value)


def one_of(enum: type[Enum]) -> Kind:
    """A member of `enum`, written as its value."""
    by_value = {m.value: m for m in enum}
    choices = ", ".join(str(m.value) for m in enum)

    def check(value: Any) -> Any:
        if isinstance(value, enum):
            return value
        if isinstance(value, str) and value in by_value:
            return by_value[value]
        raise Invalid(f"unknown value (got {show(value)}); use one of: {choices}")

    return _Scalar(check)


def literal(*choices: str) -> Kind:
    """One of a few fixed strings."""
    listed = ", ".join(repr(c) for c in choices[:-1])
    expected = f"{listed} or {choices[-1]!r}" if listed else repr(choices[-1])

    def check(value: Any) -> Any:
        if isinstance(value, str) and value in choices:
            return value
        raise Invalid(f"input should be {expected} (got {show(value)}); see docs/configuration.md")

    return _Scalar(check)


def at_least(kind: Kind, limit: float, *, strictly: bool = False) -> Kind:
    """`kind`, then a lower bound (`>= limit`, or `> limit`)."""
    sign = ">" if strictly else ">="

    def check(value: Any) -> Any:
        number = kind(value, ())
        if not (number > limit if strictly else number >= limit):
            raise Invalid(f"must be {sign} {limit} (got {show(value)}); use a value {sign} {limit}")
        return number

    return _Scalar(check, kind.scalar)


class ListOf(Kind):
    """A YAML list (read as a tuple) whose items are each `item`."""

    def __init__(self, item: Kind) -> None:
        self.item = self._each = item
        self.model = item.model

    def __call__(self, value: Any, loc: Loc) -> Any:
        if not isinstance(value, list | tuple):
            raise Invalid(f"must be a list (got {show(value)}); write a YAML list, e.g. [a, b]")
        out: list[Any] = []
        problems: list[Problem] = []
        for i, entry in enumerate(value):
            try:
                out.append(self._each(entry, (*loc, i)))
            except Invalid as exc:
                problems.append(Problem((*loc, i), exc.text, exc.at))
            except Problems as exc:
                problems += exc.problems
        if problems:
            raise Problems(problems)
        return tuple(out)


class Optional(Kind):
    """`kind`, or null."""

    def __init__(self, kind: Kind) -> None:
        self._kind = kind
        self.item = kind.item
        self.scalar = kind.scalar
        self.model = kind.model

    def __call__(self, value: Any, loc: Loc) -> Any:
        return None if value is None else self._kind(value, loc)


class Nested(Kind):
    """A mapping read as the model `model`."""

    def __init__(self, model: type[Model]) -> None:
        self._model = self.model = model

    def __call__(self, value: Any, loc: Loc) -> Any:
        if isinstance(value, self._model):
            return value
        return self._model.read(value, loc)


# -- models ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Key:
    """How one field is written in the file and checked."""

    kind: Kind
    alias: str = ""
    before: Callable[[Any], Any] | None = None
    after: Callable[[Any], Any] | None = None


def key(
    default: T,
    kind: Kind,
    *,
    alias: str = "",
    before: Callable[[Any], Any] | None = None,
    after: Callable[[Any], Any] | None = None,
) -> T:
    """A field with a default; `alias` when NVIDIA's key is not the camelCase of its name."""
    spec = Key(kind, alias, before, after)
    field: T = dataclasses.field(default=default, metadata={"key": spec})
    return field


def required(
    kind: Kind,
    *,
    before: Callable[[Any], Any] | None = None,
    after: Callable[[Any], Any] | None = None,
) -> Any:
    """A field the file must give."""
    return dataclasses.field(metadata={"key": Key(kind, "", before, after)})


def camel(name: str) -> str:
    """`device_id_strategy` → `deviceIdStrategy` (the file's spelling, unless aliased)."""
    first, *rest = name.split("_")
    return first + "".join(part[:1].upper() + part[1:] for part in rest)


@dataclasses.dataclass(frozen=True)
class _Field:
    name: str
    alias: str
    key: Key
    default: Any  # dataclasses.MISSING when required


class Model:
    """Base of the config's frozen dataclasses (each subclass is a `@dataclass`)."""

    #: Keys whose explicit `null` is an error rather than "not set".
    _null_is_error: ClassVar[frozenset[str]] = frozenset()
    #: Each model's fields, read once (a reload reads a config many times over).
    _fields_cache: ClassVar[dict[type, tuple[_Field, ...]]] = {}

    @classmethod
    def _before(cls, data: dict[str, Any]) -> dict[str, Any]:
        """Rewrite the raw mapping before its fields are read (NVIDIA's spellings); no
        checks here: a field's hooks report a bad value with its key."""
        return data

    def _check(self) -> None:
        """Rules across fields, once every field is valid; raise `Invalid`."""

    @classmethod
    def file_keys(cls) -> tuple[_Field, ...]:
        """The fields as the file spells them, in definition order."""
        found = Model._fields_cache.get(cls)
        if found is None:
            found = tuple(
                _Field(
                    f.name,
                    f.metadata["key"].alias or camel(f.name),
                    f.metadata["key"],
                    f.default,
                )
                for f in dataclasses.fields(cls)  # type: ignore[arg-type]
            )
            Model._fields_cache[cls] = found
        return found

    @classmethod
    def field_for(cls, alias: str) -> _Field | None:
        return next((f for f in cls.file_keys() if f.alias == alias), None)

    @classmethod
    def read(cls: type[M], data: Any, loc: Loc = ()) -> M:
        """`data` (a raw mapping) as this model; `Problems` lists everything wrong."""
        if not isinstance(data, dict):
            raise Problems([Problem(loc, _not_mapping(data))])
        data = cls._before(data)
        data = {k: v for k, v in data.items() if v is not None or k in cls._null_is_error}
        values: dict[str, Any] = {}
        problems: list[Problem] = []
        for field in cls.file_keys():
            here = (*loc, field.alias)
            if field.alias not in data:
                if field.default is dataclasses.MISSING:
                    problems.append(Problem(here, f"required key is missing; add '{field.alias}'"))
                continue
            try:
                values[field.name] = _read_field(field.key, data[field.alias], here)
            except Invalid as exc:
                problems.append(Problem(here, exc.text, exc.at))
            except Problems as exc:
                problems += exc.problems
        names = [f.alias for f in cls.file_keys()]
        problems += [
            Problem((*loc, str(k)), _unknown_key(str(k), names), unknown=True)
            for k in data
            if k not in names
        ]
        if problems:
            raise Problems(problems)
        model = cls(**values)
        try:
            model._check()
        except Invalid as exc:
            raise Problems([Problem(loc, exc.text, exc.at)]) from None
        except ValueError as exc:  # a helper's refusal the check did not word itself
            raise Problems([Problem(loc, _value_error(exc, data))]) from None
        return model

    def to_raw(self, *, nulls: bool = False) -> dict[str, Any]:
        """The file's mapping for this value (camelCase keys, JSON types); unset (None)
        keys left out unless `nulls`."""
        out: dict[str, Any] = {}
        for field in self.file_keys():
            value = _raw(getattr(self, field.name), nulls)
            if value is not None or nulls:
                out[field.alias] = value
        return out


def _read_field(spec: Key, value: Any, loc: Loc) -> Any:
    raw = value
    try:
        if spec.before is not None:
            value = spec.before(value)
        value = spec.kind(value, loc)
        return value if spec.after is None else spec.after(value)
    except ValueError as exc:  # a helper's refusal the hook did not word itself
        raise Invalid(_value_error(exc, raw)) from None


def _value_error(exc: ValueError, got: Any) -> str:
    return f"value error, {exc} (got {show(got)}); see docs/configuration.md"


def _raw(value: Any, nulls: bool) -> Any:
    if isinstance(value, Model):
        return value.to_raw(nulls=nulls)
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, tuple):
        return [_raw(v, nulls) for v in value]
    return value


def _not_mapping(value: Any) -> str:
    return f"must be a mapping of keys (got {show(value)}); write 'key: value' lines under it"


def _unknown_key(key: str, valid: Iterable[str]) -> str:
    valid = list(valid)
    by_lower = {v.lower().replace("_", ""): v for v in valid}
    guess = by_lower.get(key.lower().replace("_", ""))
    if guess is None:
        import difflib  # only a config with a typo pays for it

        close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
        guess = close[0] if close else None
    if guess is not None:
        return f"unknown key {key!r}; did you mean {guess!r}?"
    return f"unknown key {key!r}; valid keys here: {', '.join(valid)}"


def field_at(model: type[Model], parts: Iterable[str]) -> _Field | None:
    """The field at a dotted key path (`flags.plugin.deviceIDStrategy`), or None."""
    current: type[Model] | None = model
    field = None
    for part in parts:
        if current is None:
            return None
        field = current.field_for(part)
        if field is None:
            return None
        current = field.key.kind.model
    return field


def to_json(model: Model) -> str:
    """One compact JSON line of the file's mapping for `model`."""
    return json.dumps(model.to_raw(), separators=(",", ":"), ensure_ascii=False)


__all__ = [
    "AS_IS",
    "LAX_BOOL",
    "LAX_FLOAT",
    "LAX_INT",
    "STR",
    "STRICT_BOOL",
    "STRICT_INT",
    "Invalid",
    "Key",
    "Kind",
    "ListOf",
    "Model",
    "Nested",
    "Optional",
    "Problem",
    "Problems",
    "at_least",
    "camel",
    "field_at",
    "invalid",
    "key",
    "literal",
    "one_of",
    "required",
    "show",
    "to_json",
]
