"""Config loading is total and bounded: any bytes give a Config or one ConfigError line.

The corpus holds inputs that once crashed or stalled the daemon; the property
tests throw arbitrary bytes and YAML-ish trees at the loader.
"""

from __future__ import annotations

import difflib
import json
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kubegpu.config import Config, MigStrategy, loader, parse_config, yamlsafe
from kubegpu.errors import ConfigError

SHARED = "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n"


def alias_bomb(levels: int = 9, width: int = 9) -> bytes:
    """The classic "billion laughs": each level aliases the previous one `width` times."""
    lines = [f"l0: &l0 [{', '.join(['lol'] * width)}]"]
    for n in range(1, levels):
        lines.append(f"l{n}: &l{n} [{', '.join([f'*l{n - 1}'] * width)}]")
    return ("\n".join(lines) + "\n").encode()


def assert_total(data: bytes | str) -> Config | ConfigError:
    """The loader's contract: a Config, or a ConfigError whose message is one clean line."""
    try:
        return parse_config(data, "cm.yaml")
    except ConfigError as exc:
        text = str(exc)
        assert text.startswith("cm.yaml"), text
        assert "\n" not in text and "\r" not in text, text
        text.encode("utf-8")  # printable to a UTF-8 log: no lone surrogates
        assert len(text) < 1000, text
        return exc


# -- the corpus ------------------------------------------------------------------------------

CORPUS: list[tuple[str, bytes, str]] = [
    # (id, input, a fragment the one-line error must contain: the key path or the limit)
    (
        "strategy-nested-list",
        b"version: v1\nflags:\n  plugin:\n    deviceListStrategy: [[envvar]]\n",
        "flags.plugin.deviceListStrategy[0]",
    ),
    (
        "strategy-mapping-item",
        b"version: v1\nflags:\n  plugin:\n    deviceListStrategy:\n    - envvar: true\n",
        "flags.plugin.deviceListStrategy[0]",
    ),
    ("version-date-key", b"version: {2001-01-01: 1}\n", "version"),
    ("self-alias", b"flags: &f {plugin: *f}\n", "alias *f"),
    ("int-4301-digits", (SHARED + "      replicas: " + "9" * 4301 + "\n").encode(), "replicas"),
    ("int-40-digits", (SHARED + "      replicas: " + "9" * 40 + "\n").encode(), "digits"),
    ("lone-surrogate", b'version: "\\ud800"\n', "cm.yaml"),
    ("nesting-3000", b"flags: " + b"[" * 3000 + b"]" * 3000 + b"\n", "nested more than"),
    ("nesting-maps-3000", b"flags: " + b"{a: " * 3000 + b"1" + b"}" * 3000 + b"\n", "nested"),
    ("alias-bomb", alias_bomb(), "expands to more than"),
    (
        "memory-limit-exponent",
        (
            b"version: v1\nsharing:\n  mps:\n    resources:\n    - name: nvidia.com/gpu\n"
            b'      replicas: 2\n      memoryLimit: "1e999999999"\n'
        ),
        "sharing.mps.resources[0].memoryLimit",
    ),
    ("one-mebibyte-plus", b"version: v1\n#" + b"x" * yamlsafe.MAX_BYTES, "over the limit"),
    (
        "duplicate-key",
        b"version: v1\nflags:\n  migStrategy: none\n  migStrategy: mixed\n",
        "flags.migStrategy: duplicate key",
    ),
    ("not-utf8", b"version: v1\nflags:\n  migStrategy: \xff\xfe\n", "not UTF-8"),
    ("python-tag", b"version: !!python/object/apply:os.system [true]\n", "unsupported YAML tag"),
    ("set-tag", b"flags: !!set {a, b}\n", "unsupported YAML tag"),
    ("mapping-as-key", b"? [a, b]\n: 1\n", "used as a key"),
    ("undefined-alias", b"version: *nope\n", "no anchor"),
    ("top-level-list", b"- version: v1\n", "top level must be a mapping"),
    ("nul-byte", b"version: v1\x00\n", "cm.yaml"),
    ("long-scalar", b"version: " + b"v" * (yamlsafe.MAX_SCALAR_CHARS + 1) + b"\n", "characters"),
]


@pytest.mark.parametrize(("data", "fragment"), [c[1:] for c in CORPUS], ids=[c[0] for c in CORPUS])
def test_issue_corpus_gives_one_line_error(data: bytes, fragment: str) -> None:
    result = assert_total(data)
    assert isinstance(result, ConfigError), result
    assert fragment in str(result), str(result)


@pytest.mark.parametrize(("data", "fragment"), [c[1:] for c in CORPUS], ids=[c[0] for c in CORPUS])
def test_the_pure_python_loader_refuses_the_corpus_in_the_same_words(
    data: bytes, fragment: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Where PyYAML has no libyaml, or libyaml stops first (its own nesting limit), the pure
    # loader decides: the line is kubegpu's either way, whatever PyYAML's release says.
    monkeypatch.setattr(yamlsafe, "_FastLoader", yamlsafe._PureLoader)
    result = assert_total(data)
    assert isinstance(result, ConfigError), result
    assert fragment in str(result), str(result)


@pytest.mark.skipif(not hasattr(yaml, "CSafeLoader"), reason="PyYAML without libyaml")
def test_tabs_between_tokens_are_read_as_libyaml_and_go_yaml_read_them() -> None:
    # PyYAML's pure scanner refuses a tab wherever it separates tokens; NVIDIA's reader
    # (go-yaml) and libyaml take it, so a ConfigMap with a stray tab keeps loading.
    config = parse_config("version: v1\t\nflags:\n  migStrategy:\tmixed\t# a comment\n")
    assert config.flags.mig_strategy is MigStrategy.MIXED


def test_replicas_of_a_billion_parse_without_expanding() -> None:
    # The schema accepts the number; the device list check refuses it (see test_resources).
    config = parse_config((SHARED + "      replicas: 1000000000\n").encode())
    assert config.sharing.time_slicing is not None
    assert config.sharing.time_slicing.resources[0].replicas == 10**9


# -- what stays accepted ---------------------------------------------------------------------


def test_anchors_and_merge_keys_within_budget_work() -> None:
    text = (
        "version: v1\n"
        "x-common: &common {name: nvidia.com/gpu, replicas: 4}\n"
        "sharing:\n  timeSlicing:\n    resources:\n    - <<: *common\n      replicas: 2\n"
    )
    # x-common is an unknown top-level key (rejected as a typo), so merge into a real one.
    with pytest.raises(ConfigError, match="x-common"):
        parse_config(text)
    text = (
        "version: v1\nsharing:\n  timeSlicing:\n    resources:\n"
        "    - &gpu {name: nvidia.com/gpu, replicas: 4}\n"
        "    - <<: *gpu\n      name: nvidia.com/mig-1g.10gb\n"
    )
    config = parse_config(text)
    assert config.sharing.time_slicing is not None
    entry = config.sharing.time_slicing.resources[1]
    assert (entry.name, entry.replicas) == ("nvidia.com/mig-1g.10gb", 4)


def test_json_is_yaml() -> None:
    raw = {"version": "v1", "flags": {"migStrategy": "mixed"}}
    assert parse_config(json.dumps(raw)) == parse_config("version: v1\nflags: {migStrategy: mixed}")


def test_yaml_1_1_scalars_are_read_as_pyyaml_reads_them() -> None:
    text = "version: v1\nflags:\n  failOnInitError: no\n  gdsEnabled: on\n"
    config = parse_config(text)
    assert config.flags.fail_on_init_error is False
    assert config.flags.gds_enabled is True
    # A hex integer stays an integer, as PyYAML reads it.
    config = parse_config(SHARED + "      replicas: 0x10\n")
    assert config.sharing.time_slicing is not None
    assert config.sharing.time_slicing.resources[0].replicas == 16


def test_only_the_first_document_counts() -> None:
    config = parse_config("version: v1\nflags: {migStrategy: mixed}\n---\nflags: {x: 1}\n")
    assert str(config.flags.mig_strategy) == "mixed"


def test_bom_and_empty_document_are_fine() -> None:
    assert parse_config("\ufeffversion: v1\n") == Config()
    assert parse_config(b"") == Config()
    assert parse_config("# only a comment\n") == Config()


def test_limits_are_on_the_edge_not_before_it() -> None:
    depth_ok = "flags: " + "[" * (yamlsafe.MAX_DEPTH - 1) + "]" * (yamlsafe.MAX_DEPTH - 1)
    deeper = "flags: " + "[" * yamlsafe.MAX_DEPTH + "]" * yamlsafe.MAX_DEPTH
    assert "nested" not in str(assert_total(depth_ok))
    assert "nested more than" in str(assert_total(deeper))
    digits_ok = SHARED + "      replicas: " + "1" * yamlsafe.MAX_INT_DIGITS + "\n"
    assert "digits" not in str(assert_total(digits_ok))


def test_unexpected_library_errors_still_become_config_errors(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The last line of defence: a bug deeper down must not end the daemon on reload.
    def boom(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("surprise\nsecond line")

    monkeypatch.setattr(loader, "read_file_keys", boom)
    with pytest.raises(ConfigError) as info:
        parse_config("version: v1\n", "cm.yaml")
    assert str(info.value).startswith("cm.yaml: cannot read this config (RuntimeError: surprise")
    assert "\n" not in str(info.value)


# -- properties --------------------------------------------------------------------------------

PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPERTY
@given(st.binary(max_size=600))
def test_any_bytes(data: bytes) -> None:
    assert_total(data)


YAML_CHARS = st.sampled_from([*"abv1:-[]{},&*!|>'\"#\n \t?%@`\\0.", "\ud800", "é"])


@PROPERTY
@given(st.lists(YAML_CHARS, max_size=300).map("".join))
def test_any_yaml_punctuation(text: str) -> None:
    assert_total(text.encode("utf-8", "surrogatepass"))
    assert_total(text)


SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**60), max_value=10**60),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.sampled_from(["envvar", "nvidia.com/gpu", "mixed", "v1", "1e999999999", "10Gi", "all"]),
)
KEYS = st.one_of(
    st.sampled_from(
        [
            "version",
            "flags",
            "sharing",
            "timeSlicing",
            "mps",
            "resources",
            "name",
            "replicas",
            "devices",
            "plugin",
            "deviceListStrategy",
            "migStrategy",
            "memoryLimit",
            "rename",
        ]
    ),
    st.text(max_size=10),
)
TREES = st.recursive(
    SCALARS,
    lambda children: st.one_of(
        st.lists(children, max_size=4), st.dictionaries(KEYS, children, max_size=4)
    ),
    max_leaves=25,
)


def wrapped(tree: Any, depth: int, kind: str) -> str:
    """The tree as flow YAML (JSON with surrogates kept as escapes), nested `depth` deep."""
    body = json.dumps(tree, ensure_ascii=True, allow_nan=True)
    body = body.replace("NaN", ".nan").replace("-Infinity", "-.inf").replace("Infinity", ".inf")
    opener, closer = ("[", "]") if kind == "seq" else ("{k: ", "}")
    return opener * depth + body + closer * depth


@PROPERTY
@given(
    st.dictionaries(KEYS, TREES, max_size=5),
    st.integers(min_value=0, max_value=60),
    st.sampled_from(["seq", "map"]),
    st.sampled_from(["", "flags", "sharing", "version"]),
)
def test_yamlish_trees(tree: dict[str, Any], depth: int, kind: str, under: str) -> None:
    doc = wrapped(tree, depth, kind)
    text = f"{under}: {doc}\n" if under else doc
    assert_total(text)
    assert_total("version: v1\n" + text if under and under != "version" else text)


@PROPERTY
@given(
    st.integers(min_value=1, max_value=12),
    st.integers(min_value=1, max_value=12),
    st.sampled_from(["flags", "sharing", "x"]),
)
def test_alias_bombs_of_any_shape(levels: int, width: int, under: str) -> None:
    bomb = alias_bomb(levels, width).decode()
    text = bomb + f"{under}: *l{levels - 1}\n"
    result = assert_total(text)
    expanded = sum(width**n for n in range(1, levels + 1))
    if expanded > yamlsafe.MAX_NODES:
        assert "expands to more than" in str(result)


@PROPERTY
@given(
    st.integers(min_value=1, max_value=6000),
    st.sampled_from(["", "-", "+", "0x", "0o", "0b", "1_"]),
    st.sampled_from(["replicas", "x"]),
)
def test_integers_of_any_size(digits: int, prefix: str, key: str) -> None:
    # Built as text: CPython itself refuses to print an int of more than 4,300 digits.
    assert_total(SHARED + f"      {key}: {prefix}{'1' * digits}\n")


def test_many_unknown_keys_cost_one_suggestion(monkeypatch: pytest.MonkeyPatch) -> None:
    """900 unknown keys once took one "did you mean" search each (most of half a second to
    refuse); only the key the one-line error names gets a suggestion."""
    calls: list[str] = []
    real = difflib.get_close_matches

    def counted(word: str, *args: Any, **kwargs: Any) -> list[str]:
        calls.append(word)
        return real(word, *args, **kwargs)

    monkeypatch.setattr(difflib, "get_close_matches", counted)
    text = "version: v1\nflags:\n" + "".join(f"  unknownKey{i}: {i}\n" for i in range(900))
    with pytest.raises(ConfigError, match=r"flags\.unknownKey0: unknown key"):
        parse_config(text)
    assert len(calls) <= 1
