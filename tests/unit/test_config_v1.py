"""`kubegpu.config.schema`: the validator the v1 schema is written in.

The expected conversions of the lax kinds (kubegpu's own health keys) are the ones the
schema had when it was built on pydantic 2 (recorded from pydantic's validators on
2026-11-23, before the switch), so a file that loaded before loads the same now. The
whole loader was also compared with the pydantic-based one on ~14,000 generated and
mutated configs, value for value and error line for error line (docs/performance.md,
"A config schema without pydantic").
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest

from kubegpu.config import Config, Flags, HealthFlags, MigStrategy, build_config, parse_config
from kubegpu.config.schema import (
    LAX_BOOL,
    LAX_FLOAT,
    LAX_INT,
    STR,
    STRICT_BOOL,
    STRICT_INT,
    Invalid,
    Kind,
    Problem,
    Problems,
    field_at,
    literal,
)
from kubegpu.errors import ConfigError


def _read(kind: Kind, value: Any) -> Any:
    return kind(value, ("key",))


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (True, 1),
        (False, 0),
        (2, 2),
        (-1, -1),
        (1.0, 1),
        ("1", 1),
        (" 1 ", 1),
        ("1_0", 10),
        ("1.0", 1),
        ("+5", 5),
        (b"1", 1),
        (10**30, 10**30),
    ],
)
def test_lax_int_reads_what_pydantic_read(value: Any, expected: int) -> None:
    assert _read(LAX_INT, value) == expected


@pytest.mark.parametrize(
    "value", [1.5, "0x10", "true", "1e3", "inf", "a", "٣", None, [1], {}, 1e300, float(2**63)]
)
def test_lax_int_refuses_what_pydantic_refused(value: Any) -> None:
    with pytest.raises(Invalid, match="must be a whole number"):
        _read(LAX_INT, value)


@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_lax_int_refuses_non_finite_numbers(value: float) -> None:
    with pytest.raises(Invalid, match="finite number"):
        _read(LAX_INT, value)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (True, 1.0),
        (2, 2.0),
        ("1.5", 1.5),
        (" 1 ", 1.0),
        ("1e3", 1000.0),
        ("-inf", -math.inf),
        ("Infinity", math.inf),
        (b"1", 1.0),
        (10**30, 1e30),
    ],
)
def test_lax_float_reads_what_pydantic_read(value: Any, expected: float) -> None:
    assert _read(LAX_FLOAT, value) == expected


@pytest.mark.parametrize("value", ["0x10", "true", "a", "٣", None, [1], 10**400])
def test_lax_float_refuses_what_pydantic_refused(value: Any) -> None:
    with pytest.raises(Invalid, match="must be a number"):
        _read(LAX_FLOAT, value)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (True, True),
        (0, False),
        (1.0, True),
        ("1", True),
        ("yes", True),
        ("off", False),
        ("f", False),
        ("T", True),
        (b"true", True),
    ],
)
def test_lax_bool_reads_what_pydantic_read(value: Any, expected: bool) -> None:
    assert _read(LAX_BOOL, value) is expected


@pytest.mark.parametrize("value", [2, -1, 1.5, " 1 ", "1.0", "+5", None, [True]])
def test_lax_bool_refuses_what_pydantic_refused(value: Any) -> None:
    with pytest.raises(Invalid, match="must be true or false"):
        _read(LAX_BOOL, value)


@pytest.mark.parametrize(
    ("kind", "value"),
    [
        (STRICT_BOOL, "true"),
        (STRICT_BOOL, 1),
        (STRICT_INT, True),
        (STRICT_INT, 2.0),
        (STRICT_INT, "2"),
        (STR, 1),
        (STR, b"\xff"),
        (STR, None),
    ],
)
def test_nvidias_keys_are_strict_as_gos_json_decoding_is(kind: Kind, value: Any) -> None:
    with pytest.raises(Invalid, match="must be"):
        _read(kind, value)


def test_a_literal_names_its_choices() -> None:
    with pytest.raises(Invalid) as info:
        _read(literal("auto", "nvml", "tegra"), "cuda")
    assert info.value.text == (
        "input should be 'auto', 'nvml' or 'tegra' (got 'cuda'); see docs/configuration.md"
    )


def test_every_failing_field_is_reported_with_its_path() -> None:
    with pytest.raises(Problems) as info:
        Config.read({"flags": {"migStrategy": "x", "plugin": {"passDeviceSpecs": 1}, "bad": 1}})
    paths = [p.path for p in info.value.problems]
    assert paths == ["flags.migStrategy", "flags.plugin.passDeviceSpecs", "flags.bad"]
    assert [p.unknown for p in info.value.problems] == [False, False, True]


def test_rules_across_fields_run_only_once_the_fields_are_valid() -> None:
    # The MPS rule (mpsRoot required) would fire too; a bad field is what to fix first.
    raw = {"sharing": {"mps": {"resources": [{"name": "gpu", "replicas": "x"}]}}}
    with pytest.raises(Problems) as info:
        Config.read(raw)
    assert [p.path for p in info.value.problems] == ["sharing.mps.resources[0].replicas"]


def test_a_problem_path_joins_keys_indices_and_the_sub_path() -> None:
    assert Problem(("a", 0, "b"), "x", at="c[1]").path == "a[0].b.c[1]"
    assert Problem(("a",), "x", at="[2]").path == "a[2]"
    assert Problem((), "x", at="flags.mpsRoot").path == "flags.mpsRoot"


def test_to_raw_gives_the_files_keys_and_leaves_unset_keys_out_unless_asked() -> None:
    raw = Config(flags=Flags(mig_strategy=MigStrategy.MIXED)).to_raw()
    assert raw["flags"]["migStrategy"] == "mixed"
    assert raw["flags"]["plugin"]["deviceIDStrategy"] == "uuid"
    assert "mpsRoot" not in raw["flags"]
    assert Config().to_raw(nulls=True)["flags"]["mpsRoot"] is None
    assert parse_config(str(raw).replace("'", '"')) == Config(
        flags=Flags(mig_strategy=MigStrategy.MIXED)
    )


def test_field_at_follows_nested_and_optional_models() -> None:
    found = field_at(Config, ["sharing", "mps", "resources"])
    assert found is not None and found.name == "resources"
    assert field_at(Config, ["flags", "plugin", "deviceIDStrategy"]) is not None
    assert field_at(Config, ["flags", "nope"]) is None
    assert field_at(Config, ["version", "deeper"]) is None


def test_a_helper_value_error_becomes_a_one_line_config_error() -> None:
    # Files cannot hold bytes (yamlsafe refuses !!binary), but a raw mapping can: b"" reads
    # as the name "", which the name helper refuses with a plain ValueError.
    raw = {"sharing": {"mps": {"resources": [{"name": b"", "replicas": 2}]}}}
    with pytest.raises(ConfigError) as info:
        build_config(raw, {"flags.mpsRoot": "/run/mps"}, source="cm.yaml")
    line = str(info.value)
    assert line.startswith("cm.yaml: sharing.mps: value error, has an empty name after '/'")
    assert "\n" not in line


def test_models_are_hashable_frozen_values() -> None:
    assert hash(HealthFlags()) == hash(HealthFlags())
    with pytest.raises(dataclasses.FrozenInstanceError):
        HealthFlags().disabled = True  # type: ignore[misc]
