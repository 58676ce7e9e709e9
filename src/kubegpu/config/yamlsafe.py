"""A bounded YAML reader: any byte string becomes plain data or one `ConfigError` line.

`yaml.safe_load` is not safe for a daemon that reloads files an operator edits live: an
alias bomb expands to gigabytes, 3,000 nested brackets overflow the recursive composer, a
4,301-digit integer trips CPython's int limit (`ValueError`), a self-referencing alias
builds a cycle, and timestamps or mappings used as keys later break JSON logging.

So PyYAML's own composer is subclassed (`_Checks`) to check every limit where each node
is composed, naming the key path in the refusal. Under it runs libyaml's scanner and parser
(`CSafeLoader`'s, when PyYAML has libyaml: fast, never recursive, and tabs between tokens
read as go-yaml reads them); libyaml's own composer is not used. Newer libyaml
releases refuse 1,000-deep nesting while scanning ahead, before the composer sees it, so on any
libyaml error the pure-Python loader reads the text again under the same composer: the
limit it hits is what is reported, else libyaml's error. The refusals therefore do not
depend on the PyYAML or libyaml release. The limits are far above any real device-plugin
config (NVIDIA's examples are under 2 KiB).

The result is what sigs.k8s.io/yaml (which NVIDIA's plugin uses) would see: keys are
strings, timestamps stay strings, only the core tags are understood, and of several
documents the first is the config.
"""

from __future__ import annotations

import contextlib
import re
from typing import TYPE_CHECKING, Any, Final

import yaml
from yaml.composer import Composer
from yaml.constructor import SafeConstructor
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

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

_TAG: Final = "tag:yaml.org,2002:"
#: Scalar tags read as the text written (a date stays a string, as in sigs.k8s.io/yaml).
_AS_TEXT: Final = {f"{_TAG}{kind}" for kind in ("str", "timestamp", "merge", "value")}
_SCALAR_TAGS: Final = _AS_TEXT | {f"{_TAG}{kind}" for kind in ("int", "float", "bool", "null")}
_DIGITS = re.compile(r"[0-9a-fA-F]")


def load_bytes(data: bytes, source: str = "<config>") -> Any:
    """The first YAML (or JSON) document in `data`; `None` when it is empty.

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
    text = text.removeprefix("\ufeff")
    try:
        return _load(_FastLoader(text, source))
    except yaml.YAMLError as exc:
        if _FastLoader is not _PureLoader:
            # libyaml may stop first on input that breaks one of our limits (newer ones
            # refuse 1,000-deep nesting while scanning ahead): the pure loader,
            # which checks as it goes, says which limit; otherwise the error is libyaml's.
            with contextlib.suppress(yaml.YAMLError):
                _load(_PureLoader(text, source))
        raise _not_yaml(exc, source) from exc


def _load(loader: Any) -> Any:
    try:
        if not loader.check_node():
            return None
        node = loader.get_node()
        while loader.check_node():  # later documents are read (and bounded), then ignored
            loader.get_node()
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _not_yaml(exc: yaml.YAMLError, source: str) -> ConfigError:
    if isinstance(exc, yaml.MarkedYAMLError):
        mark = exc.problem_mark or exc.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = " ".join(str(exc.problem or exc.context or "syntax error").split())
        return ConfigError(f"{source}: not valid YAML ({problem}{where}); fix the syntax")
    return ConfigError(f"{source}: not valid YAML ({_short(str(exc))}); fix the syntax")


class _Checks(Composer, SafeConstructor):
    """PyYAML's composer, checking every limit, tag and key as it composes each node."""

    def __init__(self, source: str) -> None:
        Composer.__init__(self)
        self.source = source
        #: Key paths of the mappings and lists being composed, outermost first.
        self.paths: list[str] = []
        self.count = 0
        #: Each anchor's size with its aliases expanded, so an alias costs what it expands to.
        self.sizes: dict[Any, int] = {}
        self.open_anchors: set[Any] = set()

    def fail(self, path: str, what: str) -> ConfigError:
        where = f"{_short(path)}: " if path else ""
        return ConfigError(f"{self.source}: {where}{what}")

    def add(self, n: int, path: str) -> None:
        self.count += n
        if self.count > MAX_NODES:
            raise self.fail(
                path,
                f"the document expands to more than {MAX_NODES} values (anchors and aliases "
                "count each time they are used); write the values out or remove the aliases",
            )

    if TYPE_CHECKING:  # provided by the parser that the concrete loader mixes in

        def peek_event(self) -> Any: ...

    def path_of(self, parent: Node | None, index: Any, event: Any) -> str:
        """The key path of the node about to be composed under `parent` from `event`."""
        if parent is None:
            return ""
        base = self.paths[-1]
        if isinstance(parent, SequenceNode):
            return f"{base}[{index}]"
        if index is None:  # a key: its path is the one it names
            name = event.value if isinstance(event, yaml.ScalarEvent) else ""
        else:
            name = index.value if isinstance(index, ScalarNode) else ""
        return f"{base}.{name}" if base and name else base or name

    def compose_node(self, parent: Node | None, index: Any) -> Node | None:
        event = self.peek_event()
        path = self.path_of(parent, index, event)
        anchor = event.anchor
        if isinstance(event, yaml.AliasEvent):
            if anchor in self.open_anchors:
                raise self.fail(
                    path, f"alias *{anchor} refers to a node that contains it; remove the alias"
                )
            if anchor not in self.anchors:
                raise self.fail(
                    path, f"alias *{anchor} has no anchor &{anchor} before it; define it"
                )
            self.add(self.sizes[anchor], path)
            node = super().compose_node(parent, index)
        else:
            if anchor is not None:  # YAML lets a later anchor of the same name replace it
                self.anchors.pop(anchor, None)
                self.open_anchors.add(anchor)
            collection = isinstance(event, yaml.CollectionStartEvent)
            if collection:
                if len(self.paths) >= MAX_DEPTH:
                    raise self.fail(path, f"nested more than {MAX_DEPTH} levels deep; flatten it")
                self.paths.append(path)
            elif isinstance(event, yaml.ScalarEvent):
                self.check_scalar_text(event.value, path)
            start = self.count
            self.add(1, path)
            node = super().compose_node(parent, index)
            if collection:
                self.paths.pop()
            if anchor is not None:
                self.open_anchors.discard(anchor)
                self.sizes[anchor] = self.count - start
            self.check_composed(
                node, path, is_key=isinstance(parent, MappingNode) and index is None
            )
        if isinstance(parent, MappingNode) and index is None and not isinstance(node, ScalarNode):
            what = "an alias" if isinstance(event, yaml.AliasEvent) else "a mapping or list"
            raise self.fail(self.paths[-1], f"{what} used as a key; keys must be plain names")
        return node

    def check_scalar_text(self, text: str, path: str) -> None:
        if len(text) > MAX_SCALAR_CHARS:
            raise self.fail(
                path,
                f"a value of {len(text)} characters, over the limit of "
                f"{MAX_SCALAR_CHARS}; shorten it",
            )
        _check_text(text, self.source, path)

    def check_composed(self, node: Node | None, path: str, *, is_key: bool) -> None:
        """Only the core tags; numbers that parse and fit; mapping keys given once."""
        if isinstance(node, ScalarNode):
            if node.tag not in _SCALAR_TAGS:
                raise self.fail(path, f"unsupported YAML tag {node.tag!r}; remove the tag")
            if is_key:
                return  # a key is its text, whatever it looks like
            if node.tag == f"{_TAG}int":
                if len(_DIGITS.findall(node.value)) > MAX_INT_DIGITS:
                    raise self.fail(
                        path,
                        f"a number of more than {MAX_INT_DIGITS} digits; use a realistic value",
                    )
                self.parses(node, self.construct_yaml_int, path, "a whole number", "4")
            elif node.tag == f"{_TAG}float":
                self.parses(node, self.construct_yaml_float, path, "a number", "1.5")
        elif isinstance(node, SequenceNode | MappingNode):
            kind = "map" if isinstance(node, MappingNode) else "seq"
            if node.tag != f"{_TAG}{kind}":
                raise self.fail(path, f"unsupported YAML tag {node.tag!r}; remove the tag")
        if isinstance(node, MappingNode):
            seen: set[str] = set()
            for key, value in node.value:
                where = f"{path}.{key.value}" if path else key.value
                if key.value in seen:
                    raise self.fail(where, "duplicate key; keep only one of them")
                seen.add(key.value)
                merged = value.value if isinstance(value, SequenceNode) else [value]
                if key.tag == f"{_TAG}merge" and not all(
                    isinstance(m, MappingNode) for m in merged
                ):
                    raise self.fail(path, "'<<' merges only mappings; alias a mapping there")

    def parses(self, node: ScalarNode, construct: Any, path: str, what: str, example: str) -> None:
        """An explicitly tagged number (`!!int abc`) that does not parse is refused here."""
        try:
            construct(node)
        except (ValueError, IndexError):  # PyYAML indexes an empty `!!int` or `!!float`
            raise self.fail(
                path, f"not {what} (got {node.value[:40]!r}); write e.g. {example}"
            ) from None

    def construct_mapping(self, node: MappingNode, deep: bool = False) -> dict[Any, Any]:
        """Keys are the text written, as in JSON and sigs.k8s.io/yaml: `1: x` is the key "1"."""
        self.flatten_mapping(node)
        return {key.value: self.construct_object(value, deep=deep) for key, value in node.value}

    def construct_yaml_bool(self, node: ScalarNode) -> bool:
        """YAML 1.1's words; `!!bool` on any other word is false rather than an error."""
        return str(node.value).lower() in ("yes", "true", "on")


class _PureLoader(_Checks, yaml.SafeLoader):
    def __init__(self, text: str, source: str) -> None:
        yaml.SafeLoader.__init__(self, text)
        _Checks.__init__(self, source)


_CSafeLoader: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class _CLoader(_Checks, _CSafeLoader):  # type: ignore[misc]
    """libyaml's scanner and parser (C: fast, and tabs read as libyaml reads them) under
    the checking composer, which comes first in the MRO, before libyaml's own."""

    def __init__(self, text: str, source: str) -> None:
        _CSafeLoader.__init__(self, text)
        _Checks.__init__(self, source)


_FastLoader: Any = _CLoader if hasattr(yaml, "CSafeLoader") else _PureLoader


def _construct_text(loader: Any, node: Node) -> str:
    return str(node.value)


def _construct_bool(loader: Any, node: ScalarNode) -> bool:
    return bool(loader.construct_yaml_bool(node))


for _loader in (_PureLoader, _CLoader):
    for _tag in _AS_TEXT:
        _loader.add_constructor(_tag, _construct_text)
    _loader.add_constructor(f"{_TAG}bool", _construct_bool)


def _check_text(text: str, source: str, path: str) -> None:
    """Reject lone surrogates (`"\\ud800"` escapes), which no UTF-8 consumer can carry."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        where = f"{_short(path)}: " if path else ""
        raise ConfigError(
            f"{source}: {where}not valid YAML (invalid character U+{ord(text[exc.start]):04X}, "
            "a lone UTF-16 surrogate); remove it or write the real character"
        ) from exc


def _short(path: str) -> str:
    """A key path fit for a log line: at most 80 characters, surrogates escaped."""
    path = " ".join(path.encode("utf-8", "backslashreplace").decode("utf-8").splitlines())
    return path if len(path) <= 80 else f"{path[:79]}…"
