"""A bounded YAML reader: any byte string becomes plain data or one `ConfigError` line.

`yaml.safe_load` is not safe for a daemon that reloads files an operator edits live: an
alias bomb expands to gigabytes, 3,000 nested brackets overflow the recursive composer, a
4,301-digit integer trips CPython's int limit (`ValueError`), a self-referencing alias
builds a cycle, and timestamps or mappings used as keys later break JSON logging.

So we take only the *event stream* from PyYAML (libyaml's C parser when present: it is a
state machine, never recursive) and build the objects ourselves with a stack, checking
every limit as we go. The limits are far above any real device-plugin config (NVIDIA's
examples are under 2 KiB) and small enough that the worst input is parsed and validated
in well under 100 ms with bounded memory.

The result is what sigs.k8s.io/yaml (which NVIDIA's plugin uses) would see: scalar keys
become strings, timestamps stay strings, only the core tags are understood.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Final

import yaml
from yaml.resolver import Resolver

from kubegpu.errors import ConfigError

#: The largest config file read, in bytes: a ConfigMap holds at most 1 MiB in all.
MAX_BYTES: Final = 1024 * 1024
#: The deepest nesting of mappings and lists (a real config nests 5 deep).
MAX_DEPTH: Final = 32
#: Scalars, mappings and lists in the document, each alias counted at its full expanded size.
MAX_NODES: Final = 2_000
#: The longest single scalar (key or value), in characters.
MAX_SCALAR_CHARS: Final = 4096
#: The most digits an integer may have (an int64 has 19).
MAX_INT_DIGITS: Final = 32

_Parser: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_RESOLVER: Any = Resolver()
_TAG: Final = "tag:yaml.org,2002:"
_DIGITS = re.compile(r"[0-9a-fA-F]")


@dataclass
class _Frame:
    """A mapping or list under construction."""

    kind: str  # "map" | "seq"
    path: str
    anchor: str | None
    value: Any
    size: int = 1
    key: Any = None
    has_key: bool = False
    merges: list[dict[str, Any]] | None = None


def load_bytes(data: bytes, source: str = "<config>") -> Any:
    """The single YAML (or JSON) document in `data`; `None` when it is empty.

    Raises `ConfigError` (one line naming the key path and what to do) for anything else.
    """
    if len(data) > MAX_BYTES:
        raise ConfigError(
            f"{source}: the file is {len(data)} bytes, over the limit of {MAX_BYTES}; "
            "a device-plugin config is a few KiB: remove what does not belong"
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{source}: not UTF-8 text (byte {exc.start}: {exc.reason}); save it as UTF-8"
        ) from exc
    return load_text(text, source)


def load_text(text: str, source: str = "<config>") -> Any:
    """As `load_bytes`, for text already decoded."""
    if len(text) > MAX_BYTES:
        raise ConfigError(
            f"{source}: the file is {len(text)} characters, over the limit of {MAX_BYTES}; "
            "a device-plugin config is a few KiB: remove what does not belong"
        )
    _check_text(text, source, "")
    try:
        return _Builder(source).build(yaml.parse(text.removeprefix("\ufeff"), Loader=_Parser))
    except yaml.YAMLError as exc:
        reason = _yaml_reason(exc)
        raise ConfigError(f"{source}: not valid YAML ({reason}); fix the syntax") from exc
    except RecursionError as exc:  # not expected (the parser is iterative), but never fatal
        raise ConfigError(
            f"{source}: nested too deeply; keep nesting under {MAX_DEPTH} levels"
        ) from exc


class _Builder:
    def __init__(self, source: str) -> None:
        self.source = source
        self.anchors: dict[str, tuple[Any, int]] = {}
        self.nodes = 0
        self.stack: list[_Frame] = []
        self.documents = 0
        self.result: Any = None

    def fail(self, path: str, what: str) -> ConfigError:
        where = f"{_short(path)}: " if path else ""
        return ConfigError(f"{self.source}: {where}{what}")

    def build(self, events: Iterator[yaml.Event]) -> Any:
        for event in events:
            if isinstance(event, yaml.DocumentStartEvent):
                # Like sigs.k8s.io/yaml, the first document is the config; later ones are
                # still parsed (and bounded) but ignored.
                self.documents += 1
            elif isinstance(event, yaml.MappingStartEvent | yaml.SequenceStartEvent):
                self.open(event)
            elif isinstance(event, yaml.MappingEndEvent | yaml.SequenceEndEvent):
                frame = self.stack.pop()
                value = frame.value
                if frame.merges:
                    for merged in frame.merges:  # explicit keys win over merged ones
                        for k, v in merged.items():
                            value.setdefault(k, v)
                self.done(value, frame.size, frame.anchor)
            elif isinstance(event, yaml.ScalarEvent):
                self.scalar(event)
            elif isinstance(event, yaml.AliasEvent):
                self.alias(event)
        return self.result

    def path(self) -> str:
        return self.stack[-1].path if self.stack else ""

    def child_path(self) -> str:
        """The key path of the value about to be added."""
        if not self.stack:
            return ""
        top = self.stack[-1]
        if top.kind == "seq":
            return f"{top.path}[{len(top.value)}]"
        if not top.has_key:
            return top.path
        key = str(top.key)
        return f"{top.path}.{key}" if top.path else key

    def count(self, n: int, path: str) -> None:
        self.nodes += n
        if self.nodes > MAX_NODES:
            raise self.fail(
                path,
                f"the document expands to more than {MAX_NODES} values (anchors and aliases "
                "count each time they are used); write the values out or remove the aliases",
            )

    def open(self, event: yaml.CollectionStartEvent) -> None:
        path = self.child_path()
        if len(self.stack) >= MAX_DEPTH:
            raise self.fail(path, f"nested more than {MAX_DEPTH} levels deep; flatten it")
        is_map = isinstance(event, yaml.MappingStartEvent)
        want = "map" if is_map else "seq"
        tag = event.tag
        if tag not in (None, "!", f"{_TAG}{want}"):
            raise self.fail(path, f"unsupported YAML tag {tag!r}; remove the tag")
        self.count(1, path)
        self.stack.append(
            _Frame("map" if is_map else "seq", path, event.anchor, {} if is_map else [])
        )

    def scalar(self, event: yaml.ScalarEvent) -> None:
        top = self.stack[-1] if self.stack else None
        is_key = top is not None and top.kind == "map" and not top.has_key
        path = self.child_path()
        if is_key:
            path = f"{path}.{event.value}" if path else event.value
        if len(event.value) > MAX_SCALAR_CHARS:
            raise self.fail(
                path,
                f"a value of {len(event.value)} characters, over the limit of "
                f"{MAX_SCALAR_CHARS}; shorten it",
            )
        _check_text(event.value, self.source, path)
        self.count(1, path)
        tag = event.tag
        if tag in (None, "!"):
            tag = _RESOLVER.resolve(yaml.ScalarNode, event.value, event.implicit)
        value = self.construct(tag, event.value, path, is_key)
        self.done(value, 1, event.anchor)

    def construct(self, tag: str, text: str, path: str, is_key: bool) -> Any:
        kind = tag.removeprefix(_TAG) if tag.startswith(_TAG) else tag
        if is_key:
            if kind == "merge":
                return _MERGE
            # Keys are strings, as in JSON and sigs.k8s.io/yaml: `1: x` is the key "1".
            if kind not in ("str", "int", "float", "bool", "null", "timestamp"):
                raise self.fail(path, f"unsupported YAML tag {tag!r} on a key; remove the tag")
            return text
        if kind == "str" or kind == "timestamp":
            return text  # a date stays the text written, as sigs.k8s.io/yaml gives it
        if kind == "null":
            return None
        if kind == "bool":
            return text.lower() in ("yes", "true", "on")
        if kind == "int":
            return self.integer(text, path)
        if kind == "float":
            try:
                return _float(text)
            except ValueError as exc:
                raise self.fail(path, f"not a number (got {text[:40]!r}); write e.g. 1.5") from exc
        if kind == "merge":
            return text  # `<<` as a value is just text
        raise self.fail(path, f"unsupported YAML tag {tag!r}; remove the tag")

    def integer(self, text: str, path: str) -> int:
        if len(_DIGITS.findall(text)) > MAX_INT_DIGITS:
            raise self.fail(
                path, f"a number of more than {MAX_INT_DIGITS} digits; use a realistic value"
            )
        # PyYAML's own rules (0x, 0o, 0b, sexagesimal, underscores) on a bounded string.
        value: int = yaml.constructor.SafeConstructor.construct_yaml_int(
            _NO_CONSTRUCTOR, yaml.ScalarNode(f"{_TAG}int", text)
        )
        return value

    def alias(self, event: yaml.AliasEvent) -> None:
        path = self.child_path()
        anchor = event.anchor
        if anchor not in self.anchors:
            if any(f.anchor == anchor for f in self.stack):
                raise self.fail(
                    path, f"alias *{anchor} refers to a node that contains it; remove the alias"
                )
            raise self.fail(path, f"alias *{anchor} has no anchor &{anchor} before it; define it")
        value, size = self.anchors[anchor]
        self.count(size, path)
        self.done(value, size, None)

    def done(self, value: Any, size: int, anchor: str | None) -> None:
        """Attach a finished value to its parent (or make it the document)."""
        if anchor is not None:
            self.anchors[anchor] = (value, size)
        if not self.stack:
            if self.documents <= 1:
                self.result = value
            return
        top = self.stack[-1]
        top.size += size
        if top.kind == "seq":
            top.value.append(value)
            return
        if not top.has_key:
            if not isinstance(value, str):
                what = "a mapping or list" if isinstance(value, dict | list) else "an alias"
                raise self.fail(top.path, f"{what} used as a key; keys must be plain names")
            top.key, top.has_key = value, True
            return
        key, top.key, top.has_key = top.key, None, False
        if key is _MERGE:
            merged = value if isinstance(value, list) else [value]
            if not all(isinstance(m, dict) for m in merged):
                raise self.fail(top.path, "'<<' merges only mappings; alias a mapping there")
            top.merges = [*(top.merges or []), *merged]
            return
        if key in top.value:
            where = f"{top.path}.{key}" if top.path else key
            raise self.fail(where, "duplicate key; keep only one of them")
        top.value[key] = value


class _MergeKey(str):
    __slots__ = ()


_MERGE: Final = _MergeKey("<<")
_NO_CONSTRUCTOR: Any = yaml.constructor.SafeConstructor.__new__(yaml.constructor.SafeConstructor)


def _float(text: str) -> float:
    """PyYAML's float rules; `1e999999999` is inf at once (float() never loops on it)."""
    clean = text.replace("_", "").lower()
    sign = -1.0 if clean.startswith("-") else 1.0
    clean = clean.lstrip("+-")
    if clean == ".inf":
        return sign * math.inf
    if clean == ".nan":
        return math.nan
    if ":" in clean:  # sexagesimal, e.g. 1:30.5
        total = 0.0
        for part in clean.split(":"):
            total = total * 60 + float(part)
        return sign * total
    return sign * float(clean)


def _check_text(text: str, source: str, path: str) -> None:
    """Reject lone surrogates (`"\\ud800"` escapes), which no UTF-8 consumer can carry."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        where = f"{_short(path)}: " if path else ""
        raise ConfigError(
            f"{source}: {where}invalid character U+{ord(text[exc.start]):04X} "
            "(a lone UTF-16 surrogate); remove it or write the real character"
        ) from exc


def _short(path: str) -> str:
    """A key path fit for a log line: at most 80 characters, surrogates escaped."""
    path = path.encode("utf-8", "backslashreplace").decode("utf-8").replace("\n", " ")
    return path if len(path) <= 80 else f"{path[:79]}…"


def _yaml_reason(exc: yaml.YAMLError) -> str:
    mark = getattr(exc, "problem_mark", None)
    problem = str(getattr(exc, "problem", None) or "syntax error").replace("\n", " ")
    if mark is not None:
        return f"{problem} at line {mark.line + 1}, column {mark.column + 1}"
    return problem[:200]
