"""`kubegpu.config.v1` on msgspec, and the loader's one place that words its errors.

The lax forms of kubegpu's own health keys are the ones they have always read (recorded
from the validators the schema first ran on); NVIDIA's keys are strict, as Go's JSON
decoding is. Each case goes through the loader, as a file's value would.
"""

from __future__ import annotations

import math
from typing import Any

import msgspec
import pytest

from kubegpu.config import (
    Config,
    Flags,
    HealthFlags,
    MigStrategy,
    build_config,
    config_to_raw,
    parse_config,
    v1,
)
from kubegpu.config.loader import _leaf_annotation, _sub_path, describe_error
from kubegpu.config.v1 import ReplicatedResource
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


def test_an_unknown_key_is_named_before_other_errors() -> None:
    # A typo also makes the key it meant look missing, so the unknown key is shown first,
    # wherever it is; the validator stops there, so the line counts no further errors.
    raw = {"flags": {"migStrategy": "x", "plugin": {"passDeviceSpecs": 1}, "bad": 1}}
    assert _refusal(raw) == (
        "cm.yaml: flags.bad: unknown key 'bad'; valid keys here: migStrategy, failOnInitError, "
        "nvidiaDriverRoot, nvidiaDevRoot, mpsRoot, gdsEnabled, mofedEnabled, gdrcopyEnabled, "
        "deviceDiscoveryStrategy, plugin, gfd, health"
    )
    assert _refusal({"flags": {"migStrategy": "x", "plugin": {"passDeviceSpecs": 1}}}) == (
        "cm.yaml: flags.migStrategy: unknown value (got 'x'); use one of: none, single, mixed"
    )


def test_rules_across_fields_run_only_once_the_fields_are_valid() -> None:
    # The MPS rule (mpsRoot required) would fire too; a bad field is what to fix first.
    line = _refusal({"sharing": {"mps": {"resources": [{"name": "gpu", "replicas": "x"}]}}})
    assert line.startswith("cm.yaml: sharing.mps.resources[0].replicas: must be a whole number")


def test_an_error_path_joins_keys_indices_and_the_sub_path() -> None:
    assert _sub_path("a[0].b", "c[1]") == "a[0].b.c[1]"
    assert _sub_path("a", "[2]") == "a[2]"
    assert _sub_path("", "flags.mpsRoot") == "flags.mpsRoot"
    assert _sub_path("devices", "") == "devices"


def test_msgspecs_error_text_gives_the_path_and_the_value_is_found_in_the_input() -> None:
    raw = {"sharing": {"mps": {"resources": [{"name": "gpu", "replicas": "x"}]}}}
    error = msgspec.ValidationError(
        "Expected `int`, got `str` - at `$.sharing.mps.resources[0].replicas`"
    )
    assert describe_error(error, raw) == (
        "sharing.mps.resources[0].replicas",
        "must be a whole number (got 'x'); write e.g. 4",
    )


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


def test_a_helper_value_error_becomes_a_one_line_config_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A rule's helper that raises a plain ValueError (here the name rules, switched off so
    # that the empty name reaches the check across a strategy's entries) is still one line.
    monkeypatch.setattr(v1, "_check_resource_name", lambda value: None)
    raw = {"sharing": {"mps": {"resources": [{"name": "", "replicas": 2}]}}}
    with pytest.raises(ConfigError) as info:
        build_config(raw, {"flags.mpsRoot": "/run/mps"}, source="cm.yaml")
    line = str(info.value)
    assert line.startswith("cm.yaml: sharing.mps: value error, has an empty name after '/'")
    assert "\n" not in line


def test_models_are_hashable_frozen_values() -> None:
    assert hash(HealthFlags()) == hash(HealthFlags())
    with pytest.raises(AttributeError):
        HealthFlags().disabled = True  # type: ignore[misc]
    assert msgspec.structs.replace(HealthFlags(), disabled=True).disabled is True


@pytest.mark.parametrize(
    "build",
    [
        lambda: v1.PluginFlags(device_list_strategy=()),
        lambda: v1.GfdFlags(sleep_interval="5x"),
        lambda: ReplicatedResource(name="a/b/c", replicas=2),
        lambda: ReplicatedResource(name="gpu", replicas=1),
        lambda: ReplicatedResource(name="gpu", replicas=2, devices=()),
        lambda: v1.Imex(channel_ids=(1,)),
        lambda: Config(version="v2"),
        lambda: Config(
            sharing=v1.Sharing(
                mps=v1.SharingStrategy(resources=(ReplicatedResource(name="gpu", replicas=2),))
            )
        ),
    ],
)
def test_a_model_built_in_code_obeys_the_rules_a_files_model_does(build: Any) -> None:
    with pytest.raises(ValueError):
        build()
