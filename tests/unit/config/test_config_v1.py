"""`kubegpu.config.v1` on pydantic, and the loader's one place that words pydantic's errors.

The lax forms of kubegpu's own health keys are the ones they have always read (recorded
from pydantic's validators when the schema first ran on it); NVIDIA's keys are strict, as
Go's JSON decoding is. Each case goes through the loader, as a file's value would.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pydantic
import pytest

from kubegpu.config import (
    Config,
    Flags,
    HealthFlags,
    MigStrategy,
    build_config,
    config_to_raw,
    parse_config,
)
from kubegpu.config.loader import _error_path, _leaf_annotation, format_validation_error
from kubegpu.config.v1 import CONFIG_ADAPTER, ReplicatedResource
from kubegpu.errors import ConfigError


def _health(**keys: Any) -> HealthFlags:
    return build_config({"flags": {"health": keys}}, {}, source="cm.yaml").flags.health


def _refusal(raw: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as info:
        build_config(raw, {}, source="cm.yaml")
    return str(info.value)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (True, 1),
        (False, 0),
        (2, 2),
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
def test_lax_int_keys_read_what_they_always_read(value: Any, expected: int) -> None:
    assert _health(criticalXids=[value]).critical_xids == (expected,)


@pytest.mark.parametrize(
    "value", [1.5, "0x10", "true", "1e3", "inf", "a", "٣", [1], {}, 1e300, float(2**63)]
)
def test_lax_int_keys_refuse_what_they_always_refused(value: Any) -> None:
    assert "criticalXids[0]: must be a whole number" in _refusal(
        {"flags": {"health": {"criticalXids": [value]}}}
    )


@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_lax_int_keys_refuse_non_finite_numbers(value: float) -> None:
    line = _refusal({"flags": {"health": {"criticalXids": [value]}}})
    assert "criticalXids[0]: input should be a finite number" in line
    assert line.endswith("; write e.g. 4")


def test_a_negative_xid_is_refused_with_its_bound() -> None:
    line = _refusal({"flags": {"health": {"ignoredXids": [-1]}}})
    assert line == "cm.yaml: flags.health.ignoredXids[0]: must be >= 0 (got -1); use a value >= 0"


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (True, 1.0),
        (2, 2.0),
        ("1.5", 1.5),
        (" 1 ", 1.0),
        ("1e3", 1000.0),
        ("Infinity", math.inf),
        (b"1", 1.0),
        (10**30, 1e30),
    ],
)
def test_lax_float_keys_read_what_they_always_read(value: Any, expected: float) -> None:
    assert _health(recoverySeconds=value).recovery_seconds == expected


@pytest.mark.parametrize("value", ["0x10", "true", "a", "٣", [1], 10**400])
def test_lax_float_keys_refuse_what_they_always_refused(value: Any) -> None:
    assert "recoverySeconds: must be a number" in _refusal(
        {"flags": {"health": {"recoverySeconds": value}}}
    )


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
def test_lax_bool_keys_read_what_they_always_read(value: Any, expected: bool) -> None:
    assert _health(disabled=value).disabled is expected


@pytest.mark.parametrize("value", [2, -1, 1.5, " 1 ", "1.0", "+5", [True]])
def test_lax_bool_keys_refuse_what_they_always_refused(value: Any) -> None:
    assert "disabled: must be true or false" in _refusal({"flags": {"health": {"disabled": value}}})


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        ({"flags": {"plugin": {"passDeviceSpecs": "true"}}}, "must be true or false"),
        ({"flags": {"plugin": {"passDeviceSpecs": 1}}}, "must be true or false"),
        ({"imex": {"channelIDs": [True]}}, "must be a whole number"),
        ({"imex": {"channelIDs": [0.0]}}, "must be a whole number"),
        ({"imex": {"channelIDs": ["0"]}}, "must be a whole number"),
        ({"flags": {"nvidiaDriverRoot": 1}}, "must be a string"),
        ({"flags": {"nvidiaDriverRoot": b"\xff"}}, "must be a string"),
        ({"resources": {"gpus": [{"pattern": "*", "name": None}]}}, "must be a string"),
    ],
)
def test_nvidias_keys_are_strict_as_gos_json_decoding_is(
    raw: dict[str, Any], fragment: str
) -> None:
    assert fragment in _refusal(raw)


def test_a_literal_names_its_choices() -> None:
    assert _refusal({"flags": {"deviceDiscoveryStrategy": "cuda"}}) == (
        "cm.yaml: flags.deviceDiscoveryStrategy: input should be 'auto', 'nvml' or 'tegra' "
        "(got 'cuda'); see docs/configuration.md"
    )


def _errors(raw: dict[str, Any]) -> pydantic.ValidationError:
    with pytest.raises(pydantic.ValidationError) as info:
        CONFIG_ADAPTER.validate_python(raw, by_name=False)
    return info.value


def test_every_failing_field_is_reported_with_its_path() -> None:
    exc = _errors({"flags": {"migStrategy": "x", "plugin": {"passDeviceSpecs": 1}, "bad": 1}})
    assert [_error_path(e) for e in exc.errors()] == [
        "flags.migStrategy",
        "flags.plugin.passDeviceSpecs",
        "flags.bad",
    ]
    # The unknown key is shown first: a typo also makes the key it meant look missing.
    assert format_validation_error(exc).startswith("flags.bad: unknown key 'bad'")
    assert format_validation_error(exc).endswith("[2 more error(s) after this one]")


def test_rules_across_fields_run_only_once_the_fields_are_valid() -> None:
    # The MPS rule (mpsRoot required) would fire too; a bad field is what to fix first.
    exc = _errors({"sharing": {"mps": {"resources": [{"name": "gpu", "replicas": "x"}]}}})
    assert [_error_path(e) for e in exc.errors()] == ["sharing.mps.resources[0].replicas"]


def test_an_error_path_joins_keys_indices_and_the_sub_path() -> None:
    def path(loc: tuple[Any, ...], at: str) -> str:
        return _error_path({"loc": loc, "ctx": {"at": at}})

    assert path(("a", 0, "b"), "c[1]") == "a[0].b.c[1]"
    assert path(("a",), "[2]") == "a[2]"
    assert path((), "flags.mpsRoot") == "flags.mpsRoot"
    assert path(("devices", "function-before[_devices()]", "tuple[str, ...]"), "") == "devices"


def test_config_to_raw_gives_the_files_keys_and_leaves_unset_keys_out_unless_asked() -> None:
    raw = config_to_raw(Config(flags=Flags(mig_strategy=MigStrategy.MIXED)))
    assert raw["flags"]["migStrategy"] == "mixed"
    assert raw["flags"]["plugin"]["deviceIDStrategy"] == "uuid"
    assert "mpsRoot" not in raw["flags"]
    assert config_to_raw(Config(), nulls=True)["flags"]["mpsRoot"] is None
    assert parse_config(str(raw).replace("'", '"')) == Config(
        flags=Flags(mig_strategy=MigStrategy.MIXED)
    )


def test_override_keys_find_their_field_through_nested_and_optional_models() -> None:
    assert _leaf_annotation(["sharing", "mps", "resources"]) == tuple[ReplicatedResource, ...]
    assert _leaf_annotation(["flags", "plugin", "deviceIDStrategy"]) is not None
    assert _leaf_annotation(["flags", "nope"]) is None
    assert _leaf_annotation(["version", "deeper"]) is None


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
    assert dataclasses.replace(HealthFlags(), disabled=True).disabled is True
