"""The v1 schema's validation rules, each asserting the exact one-line message."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kubegpu.config import (
    Config,
    DeviceIDStrategy,
    DeviceListStrategy,
    Flags,
    MigStrategy,
    apply_overrides,
    build_config,
    config_to_json,
    load_config,
    parse_config,
    parse_quantity,
    qualify_resource_name,
)
from kubegpu.config.loader import parse_raw
from kubegpu.config.names import format_go_duration, parse_go_duration
from kubegpu.errors import ConfigError
from kubegpu.labeller import parse_duration

MPS_ROOT = "flags: {mpsRoot: /run/nvidia/mps}\n"


def error(text: str, source: str = "cm.yaml") -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(text, source)
    message = str(info.value)
    assert "\n" not in message
    return message


def ts(entry: str, extra: str = "") -> str:
    """A timeSlicing config with one resource entry (flow-style YAML)."""
    return f"sharing: {{timeSlicing: {{{extra}resources: [{entry}]}}}}\n"


def mps(entry: str) -> str:
    return MPS_ROOT + f"sharing: {{mps: {{resources: [{entry}]}}}}\n"


# -- accepted configs ------------------------------------------------------------------------

NVIDIA_EXAMPLE = """\
version: v1
flags:
  migStrategy: "none"
  failOnInitError: true
  nvidiaDriverRoot: "/"
  plugin:
    passDeviceSpecs: false
    deviceListStrategy: envvar
    deviceIDStrategy: uuid
    nvidiaCTKPath: /usr/bin/nvidia-ctk
  gfd:
    useNodeFeatureAPI: false
sharing:
  timeSlicing:
    renameByDefault: true
    resources:
    - name: nvidia.com/gpu
      replicas: 10
      rename: gpu.ten
      devices:
      - "0"
      - 1
      - "0:1"
      - GPU-8f0f6cd6-2f3c-4e5a-9f43-000000000000
      - MIG-0a1b2c3d-0000-4000-8000-000000000001
imex:
  channelIDs: [0]
"""


def test_nvidia_example_is_accepted_with_nvidia_spellings() -> None:
    config = parse_config(NVIDIA_EXAMPLE)
    assert config.flags.plugin.device_id_strategy is DeviceIDStrategy.UUID
    assert config.flags.plugin.device_list_strategy == (DeviceListStrategy.ENVVAR,)
    entry = config.sharing.time_slicing.resources[0]  # type: ignore[union-attr]
    assert (entry.name, entry.replicas, entry.rename) == ("nvidia.com/gpu", 10, "gpu.ten")
    assert entry.devices[:2] == ("0", 1)  # type: ignore[index]
    assert config.imex.channel_ids == (0,)


def test_empty_file_is_defaults() -> None:
    assert parse_config("") == Config()
    assert parse_config("version: v1") == Config()


def test_python_code_may_build_models_by_field_name() -> None:
    config = Config(flags=Flags(mig_strategy=MigStrategy.MIXED))
    assert config.flags.mig_strategy is MigStrategy.MIXED
    assert config == parse_config("flags: {migStrategy: mixed}")
    with pytest.raises(AttributeError):
        config.flags.mig_strategy = MigStrategy.NONE  # type: ignore[misc]


# -- version and unknown keys ----------------------------------------------------------------


def test_unknown_version_lists_supported() -> None:
    assert error("version: v2\nflags: {newKey: 1}") == (
        "cm.yaml: version: unsupported config version (got 'v2'); this kubegpu reads version v1"
    )


def test_unknown_key_suggests_nearest() -> None:
    assert error("flags: {migStrategi: mixed}") == (
        "cm.yaml: flags.migStrategi: unknown key 'migStrategi'; did you mean 'migStrategy'?"
    )


def test_unknown_key_deep_in_a_list_keeps_the_index() -> None:
    assert error(ts("{name: gpu, replica: 4}")) == (
        "cm.yaml: sharing.timeSlicing.resources[0].replica: unknown key 'replica'; "
        "did you mean 'replicas'?"
    )


def test_snake_case_key_suggests_nvidia_spelling() -> None:
    assert error("flags: {plugin: {device_id_strategy: index}}") == (
        "cm.yaml: flags.plugin.device_id_strategy: unknown key 'device_id_strategy'; "
        "did you mean 'deviceIDStrategy'?"
    )


def test_unknown_key_without_near_match_lists_valid_keys() -> None:
    assert error("zzz: 1") == (
        "cm.yaml: zzz: unknown key 'zzz'; valid keys here: version, flags, resources, sharing, imex"
    )


def test_yaml_syntax_and_top_level_shape() -> None:
    assert error("flags: [").startswith("cm.yaml: not valid YAML (")
    assert error("- a") == (
        "cm.yaml: the top level must be a mapping (got [\"a\"]); start the file with 'version: v1'"
    )


def test_wrong_type_for_a_section() -> None:
    assert error("flags: [1]") == (
        "cm.yaml: flags: must be a mapping of keys (got [1]); write 'key: value' lines under it"
    )


def test_of_several_errors_the_line_names_the_first() -> None:
    # The validator stops at the first error, so the line claims no count of the rest.
    assert error("flags: {a: 1, b: 2}") == (
        "cm.yaml: flags.a: unknown key 'a'; valid keys here: migStrategy, failOnInitError, "
        "nvidiaDriverRoot, nvidiaDevRoot, mpsRoot, gdsEnabled, mofedEnabled, gdrcopyEnabled, "
        "deviceDiscoveryStrategy, plugin, gfd, health"
    )


# -- sharing ---------------------------------------------------------------------------------


def test_replicas_below_two() -> None:
    assert error(ts("{name: gpu, replicas: 1}")) == (
        "cm.yaml: sharing.timeSlicing.resources[0].replicas: must be at least 2 (got 1); "
        "sharing needs 2 or more replicas per GPU; remove the entry to not share"
    )


def test_replicas_not_a_number() -> None:
    assert error(ts("{name: gpu, replicas: many}")) == (
        "cm.yaml: sharing.timeSlicing.resources[0].replicas: must be a whole number "
        "(got 'many'); write e.g. 4"
    )


def test_missing_required_key() -> None:
    assert error(ts("{name: gpu}")) == (
        "cm.yaml: sharing.timeSlicing.resources[0].replicas: required key is missing; "
        "add 'replicas'"
    )


def test_strategy_without_resources() -> None:
    assert error("sharing: {timeSlicing: {renameByDefault: true}}") == (
        "cm.yaml: sharing.timeSlicing.resources: lists no resources to share (got []); "
        "add an entry like {name: nvidia.com/gpu, replicas: 4}, or remove the strategy"
    )


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("a/b/c", "has more than one '/'"),
        # NVIDIA's rule for its own domain: 63 characters including `nvidia.com/`.
        ("x" * 64, "is 75 characters with its domain; at most 63 are allowed"),
        (
            "nvidia.com/-gpu",
            "name part '-gpu' must be lowercase letters, digits, '-' and '.', "
            "starting and ending with a letter or digit",
        ),
        (
            "example.com/-gpu",
            "name part '-gpu' must be letters, digits, '-', '_' or '.', "
            "starting and ending with a letter or digit",
        ),
        ("NVIDIA.com/gpu", "domain 'NVIDIA.com' is not a lowercase DNS subdomain"),
        ("kubernetes.io/gpu", "the kubernetes.io domain is reserved for Kubernetes' own resources"),
        ("/gpu", "has an empty domain before '/'"),
    ],
)
def test_invalid_resource_names(name: str, reason: str) -> None:
    assert error(ts(f"{{name: '{name}', replicas: 2}}")) == (
        f"cm.yaml: sharing.timeSlicing.resources[0].name: not a valid extended resource name: "
        f"{reason} (got '{name}'); use '<domain>/<name>' like 'nvidia.com/gpu.shared', "
        f"or a bare name like 'gpu'"
    )


def test_rename_and_resource_pattern_names_are_checked_too() -> None:
    assert error(ts("{name: gpu, replicas: 2, rename: 'a b'}")).startswith(
        "cm.yaml: sharing.timeSlicing.resources[0].rename: not a valid extended resource name"
    )
    assert error("resources: {gpus: [{pattern: '*', name: 'x/y/z'}]}").startswith(
        "cm.yaml: resources.gpus[0].name: not a valid extended resource name: has more than one"
    )


def test_bare_names_get_nvidia_prefix() -> None:
    assert qualify_resource_name("gpu") == "nvidia.com/gpu"
    assert qualify_resource_name("example.com/gpu.shared") == "example.com/gpu.shared"


def test_duplicate_names_within_a_strategy_after_qualifying() -> None:
    text = ts("{name: gpu, replicas: 2}, {name: nvidia.com/gpu, replicas: 4}")
    assert error(text) == (
        "cm.yaml: sharing.timeSlicing.resources[1].name: is listed twice in this strategy "
        "(got 'nvidia.com/gpu'); give each resource one entry (use 'devices' to pick GPUs)"
    )


def test_rename_with_rename_by_default_is_fine() -> None:
    config = parse_config(
        ts("{name: gpu, replicas: 2, rename: gpu.two}", "renameByDefault: true, ")
    )
    assert config.sharing.time_slicing.resources[0].rename == "gpu.two"  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("devices", "expected"),
    [
        ("all", "all"),
        ("3", 3),
        (
            "[0, '1', '1:0', GPU-8f0f6cd6-2f3c-4e5a-9f43-000000000000,"
            " MIG-GPU-8f0f6cd6-2f3c-4e5a-9f43-000000000000/1/0]",
            (
                0,
                "1",
                "1:0",
                "GPU-8f0f6cd6-2f3c-4e5a-9f43-000000000000",
                "MIG-GPU-8f0f6cd6-2f3c-4e5a-9f43-000000000000/1/0",
            ),
        ),
    ],
)
def test_valid_device_selectors(devices: str, expected: Any) -> None:
    config = parse_config(ts(f"{{name: gpu, replicas: 2, devices: {devices}}}"))
    assert config.sharing.time_slicing.resources[0].devices == expected  # type: ignore[union-attr]


HINT = (
    "use 'all', a count of GPUs, or a list of GPU indices (0), MIG indices (0:1) or UUIDs (GPU-…)"
)


@pytest.mark.parametrize(
    ("devices", "suffix"),
    [
        ("[0, gpu0]", "devices[1]: entry is not a GPU index, MIG index (i:j) or UUID (got 'gpu0')"),
        ("[-1]", "devices[0]: entry is a negative GPU index (got -1)"),
        ("[true]", "devices[0]: entry is not a GPU index, MIG index (i:j) or UUID (got true)"),
        ("[]", "devices: lists no devices (got [])"),
        ("0", "devices: must be a positive count of GPUs (got 0)"),
        ("some", "devices: is not a device selector (got 'some')"),
    ],
)
def test_invalid_device_selectors(devices: str, suffix: str) -> None:
    message = error(ts(f"{{name: gpu, replicas: 2, devices: {devices}}}"))
    assert message == f"cm.yaml: sharing.timeSlicing.resources[0].{suffix}; {HINT}"


def test_device_listed_twice() -> None:
    assert error(ts("{name: gpu, replicas: 2, devices: [0, 0]}")) == (
        "cm.yaml: sharing.timeSlicing.resources[0].devices[1]: lists a device twice (got 0); "
        "list each device once"
    )


# -- MPS -------------------------------------------------------------------------------------


def test_mps_with_mixed_mig_strategy() -> None:
    text = "flags: {migStrategy: mixed, mpsRoot: /run/nvidia/mps}\n"
    text += "sharing: {mps: {resources: [{name: gpu, replicas: 2}]}}"
    assert error(text) == (
        "cm.yaml: flags.migStrategy: MPS sharing (sharing.mps) cannot be used with MIG strategy "
        "'mixed' (got 'mixed'); use migStrategy 'none' or 'single', or remove sharing.mps"
    )


def test_mps_without_mps_root() -> None:
    assert error("sharing: {mps: {resources: [{name: gpu, replicas: 2}]}}") == (
        "cm.yaml: flags.mpsRoot: is required when sharing.mps is configured (got null); "
        "set flags.mpsRoot or --mps-root/MPS_ROOT (e.g. /run/nvidia/mps)"
    )


def test_mps_root_from_a_flag_satisfies_the_file() -> None:
    raw = "sharing: {mps: {resources: [{name: gpu, replicas: 2}]}}"
    overrides = {"flags.mpsRoot": "/run/nvidia/mps"}
    config = build_config(parse_raw(raw), overrides, source="cm.yaml")
    assert config.flags.mps_root == "/run/nvidia/mps"
    assert apply_overrides(parse_raw(raw), overrides)["flags"] == overrides_as_tree(overrides)


def overrides_as_tree(overrides: dict[str, str]) -> dict[str, str]:
    return {key.split(".", 1)[1]: value for key, value in overrides.items()}


def test_mps_replicas_over_48() -> None:
    assert error(mps("{name: gpu, replicas: 49}")) == (
        "cm.yaml: sharing.mps.resources[0].replicas: exceeds the MPS limit of 48 clients per GPU "
        "(got 49); use at most 48 replicas"
    )


def test_mps_on_mig_devices() -> None:
    assert error(mps("{name: gpu, replicas: 4, devices: [0, '0:1']}")) == (
        "cm.yaml: sharing.mps.resources[0].devices[1]: names a MIG device; MPS sharing of MIG "
        "devices is not supported (got '0:1'); list whole GPUs only, or share MIG devices with "
        "timeSlicing"
    )


def test_same_resource_in_both_strategies() -> None:
    text = MPS_ROOT + (
        "sharing:\n  timeSlicing: {resources: [{name: gpu, replicas: 2}]}\n"
        "  mps: {resources: [{name: nvidia.com/gpu, replicas: 2}]}\n"
    )
    assert error(text) == (
        "cm.yaml: sharing.mps.resources[0].name: is shared by both timeSlicing and mps "
        "(got 'nvidia.com/gpu'); share each resource with one strategy only"
    )


@pytest.mark.parametrize(
    ("text", "bytes_"), [("10Gi", 10 * 2**30), ("512Mi", 2**29), ("1e3", 1000)]
)
def test_memory_limit_quantities(text: str, bytes_: int) -> None:
    config = parse_config(mps(f"{{name: gpu, replicas: 2, memoryLimit: {text}}}"))
    limit = config.sharing.mps.resources[0].memory_limit  # type: ignore[union-attr]
    assert limit is not None and parse_quantity(limit) == bytes_
    assert parse_quantity(1073741824) == 2**30


def test_memory_limit_not_a_quantity() -> None:
    assert error(mps("{name: gpu, replicas: 2, memoryLimit: 10GB}")) == (
        "cm.yaml: sharing.mps.resources[0].memoryLimit: memory limit is not a Kubernetes "
        "quantity (got '10GB'); write bytes or a quantity like '10Gi' or '512Mi'"
    )


@pytest.mark.parametrize("value", [0, 101])
def test_active_thread_percentage_range(value: int) -> None:
    assert error(mps(f"{{name: gpu, replicas: 2, activeThreadPercentage: {value}}}")) == (
        f"cm.yaml: sharing.mps.resources[0].activeThreadPercentage: must be between 1 and 100 "
        f"(got {value}); give a percentage of SMs"
    )


def test_mps_only_keys_refused_for_time_slicing() -> None:
    assert error(ts("{name: gpu, replicas: 2, memoryLimit: 1Gi}")) == (
        "cm.yaml: sharing.timeSlicing.resources[0].memoryLimit: applies to MPS only "
        "(got '1Gi'); move the entry under sharing.mps or remove the key"
    )


# -- flags -----------------------------------------------------------------------------------


def test_unknown_device_list_strategy() -> None:
    assert error("flags: {plugin: {deviceListStrategy: [envvar, bogus]}}") == (
        "cm.yaml: flags.plugin.deviceListStrategy[1]: unknown device list strategy "
        "(got 'bogus'); use one or more of: envvar, volume-mounts, cdi-annotations, cdi-cri"
    )


def test_device_list_strategy_string_is_one_element() -> None:
    config = parse_config("flags: {plugin: {deviceListStrategy: cdi-cri}}")
    assert config.flags.plugin.device_list_strategy == (DeviceListStrategy.CDI_CRI,)
    assert error("flags: {plugin: {deviceListStrategy: 'envvar,cdi-cri'}}").endswith(
        "(write several as a YAML list, not a comma string)"
    )


def test_device_list_strategy_twice_or_empty() -> None:
    # NVIDIA enables a strategy listed twice once (a set), so the duplicate is accepted.
    config = parse_config("flags: {plugin: {deviceListStrategy: [envvar, envvar]}}")
    assert config.flags.plugin.device_list_strategy == (DeviceListStrategy.ENVVAR,)
    assert error("flags: {plugin: {deviceListStrategy: []}}").startswith(
        "cm.yaml: flags.plugin.deviceListStrategy: needs at least one strategy (got [])"
    )


def test_device_list_strategy_env_comma_list() -> None:
    config = load_config(None, {"flags.plugin.deviceListStrategy": "envvar,cdi-cri"})
    assert config.flags.plugin.device_list_strategy == (
        DeviceListStrategy.ENVVAR,
        DeviceListStrategy.CDI_CRI,
    )


def test_device_id_and_mig_strategy_values() -> None:
    assert error("flags: {plugin: {deviceIDStrategy: serial}}") == (
        "cm.yaml: flags.plugin.deviceIDStrategy: unknown value (got 'serial'); "
        "use one of: uuid, index"
    )
    assert error("flags: {migStrategy: all}") == (
        "cm.yaml: flags.migStrategy: unknown value (got 'all'); use one of: none, single, mixed"
    )


def test_health_xids_non_negative_ints() -> None:
    assert error("flags: {health: {ignoredXids: [13, -1]}}") == (
        "cm.yaml: flags.health.ignoredXids[1]: must be >= 0 (got -1); use a value >= 0"
    )
    assert error("flags: {health: {criticalXids: [x]}}") == (
        "cm.yaml: flags.health.criticalXids[0]: must be a whole number (got 'x'); write e.g. 4"
    )


def test_bool_flag_type() -> None:
    assert error("flags: {failOnInitError: maybe}") == (
        "cm.yaml: flags.failOnInitError: must be true or false (got 'maybe'); write true or false"
    )


# -- overrides and files ---------------------------------------------------------------------


def test_overrides_win_over_the_file_and_env_strings_are_coerced(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("flags: {migStrategy: single, failOnInitError: true}\n")
    config = load_config(
        path,
        {
            "flags.migStrategy": "mixed",
            "flags.failOnInitError": "false",
            "flags.health.ignoredXids": "13, 31",
        },
    )
    assert config.flags.mig_strategy is MigStrategy.MIXED
    assert config.flags.fail_on_init_error is False
    assert config.flags.health.ignored_xids == (13, 31)


def test_error_in_an_override_blames_the_flag(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("flags: {migStrategy: single}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, {"flags.migStrategy": "bogus"})
    assert str(info.value) == (
        "flag/env: flags.migStrategy: unknown value (got 'bogus'); use one of: none, single, mixed"
    )


def test_unreadable_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "missing.yaml", {})
    assert str(info.value) == (
        f"{tmp_path / 'missing.yaml'}: cannot read the config file (No such file or directory); "
        "check the path and mount"
    )


@pytest.mark.parametrize(
    ("make", "kind"),
    [
        (os.mkfifo, "a FIFO"),
        (os.mkdir, "a directory"),
        (lambda path: Path(path).symlink_to("/dev/urandom"), "a character device"),
        (lambda path: Path(path).symlink_to("/dev/null"), "a character device"),
    ],
    ids=["fifo", "directory", "urandom", "null"],
)
def test_a_config_that_is_not_a_regular_file_is_refused_at_once(
    tmp_path: Path, make: Any, kind: str
) -> None:
    """A FIFO once blocked the reader for good (and with it SIGTERM); /dev/urandom never
    ends. Both are refused in one line before a byte is read."""
    path = tmp_path / "config.yaml"
    make(str(path))
    with pytest.raises(ConfigError) as info:
        load_config(path, {})
    assert str(info.value) == (
        f"{path}: the config file is not a regular file ({kind}); point --config-file at a file"
    )


@pytest.mark.parametrize(
    ("text", "overrides"),
    [
        ("version: v1\nflags: mps\n", {"flags.migStrategy": "none"}),
        ("version: v1\nflags: [1, 2]\n", {"flags.plugin.deviceListStrategy": "envvar"}),
        ("version: v1\nflags:\n  plugin: 7\n", {"flags.plugin.passDeviceSpecs": True}),
        ("version: v1\nflags:\n  health: on\n", {"flags.health.disabled": True}),
    ],
)
def test_a_flag_never_replaces_a_wrongly_typed_section_of_the_file(
    tmp_path: Path, text: str, overrides: dict[str, Any]
) -> None:
    """`serve` with a flag or env var once accepted what `kubegpu check` refuses (the flag's
    section replaced the file's): both now refuse the file, in the same words."""
    path = tmp_path / "config.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as alone:
        load_config(path, {})
    with pytest.raises(ConfigError) as overridden:
        load_config(path, overrides)
    assert str(overridden.value) == str(alone.value)
    assert str(alone.value).startswith(f"{path}: flags")


def test_config_to_json_is_one_compact_line_with_file_keys() -> None:
    text = config_to_json(parse_config(NVIDIA_EXAMPLE))
    assert "\n" not in text and ", " not in text
    data = json.loads(text)
    assert data["flags"]["plugin"]["deviceIDStrategy"] == "uuid"
    assert data["sharing"]["timeSlicing"]["resources"][0]["replicas"] == 10
    assert parse_config(text) == parse_config(NVIDIA_EXAMPLE)


@pytest.mark.parametrize(
    ("value", "ns"),
    [
        ("1h2m3.5s", 3723500000000),
        ("1.s", 10**9),
        ("+5s", 5 * 10**9),
        ("-1s", -(10**9)),
        ("3\u00b5s", 3000),
        ("3\u03bcs", 3000),
        ("2562047h47m16.854775807s", 2**63 - 1),
        (7.9, 7),
    ],
)
def test_go_durations(value: str | float, ns: int) -> None:
    assert parse_go_duration(value) == ns


@pytest.mark.parametrize("value", ["", ".", "s", "1", "1.5.5s", "5S", "1h 2m", "2562048h", True])
def test_bad_go_durations(value: object) -> None:
    with pytest.raises(ValueError):
        parse_go_duration(value)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("ns", "text"),
    [(0, "0s"), (-5, "0s"), (5, "5ns"), (90 * 10**9, "1m30s"), (1500 * 10**6, "1s500ms")],
)
def test_durations_are_written_for_the_labeller(ns: int, text: str) -> None:
    assert format_go_duration(ns) == text
    assert parse_duration(text) == max(ns, 0) / 1e9


def test_negative_sleep_interval_relabels_without_pause() -> None:
    assert parse_config("flags: {gfd: {sleepInterval: -1s}}").flags.gfd.sleep_interval == "0s"


# Not None: an empty section (`flags:`) reads as an absent one.
_NOT_A_MAPPING = st.one_of(
    st.booleans(),
    st.integers(),
    st.text(alphabet="abc mps-0[]{}:", max_size=8),
    st.lists(st.integers(), max_size=3),
)
_OVERRIDES = {
    "flags.migStrategy": "none",
    "flags.failOnInitError": False,
    "flags.plugin.deviceListStrategy": "envvar",
    "flags.plugin.passDeviceSpecs": True,
    "flags.health.disabled": True,
    "flags.gfd.oneshot": True,
}


@settings(max_examples=150, deadline=None)
@given(
    section=st.sampled_from(["flags", "flags.plugin", "flags.health", "flags.gfd"]),
    value=_NOT_A_MAPPING,
    overrides=st.dictionaries(st.sampled_from(sorted(_OVERRIDES)), st.just(None), min_size=1),
)
def test_no_flag_makes_a_wrongly_typed_section_acceptable(
    section: str, value: Any, overrides: dict[str, None]
) -> None:
    """The fuzzed form of the case above: any non-mapping value of a flags section, with any
    set of flags or env vars, is refused in the same words as without them."""
    keys = section.split(".")
    tree: dict[str, Any] = {"version": "v1"}
    here = tree
    for key in keys[:-1]:
        here = here.setdefault(key, {})
    here[keys[-1]] = value
    text = json.dumps(tree)  # JSON is YAML: the value arrives with the type it has here
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.yaml"
        path.write_text(text)
        with pytest.raises(ConfigError) as alone:
            load_config(path, {})
        with pytest.raises(ConfigError) as overridden:
            load_config(path, {key: _OVERRIDES[key] for key in overrides})
    assert str(overridden.value) == str(alone.value)
    assert str(alone.value).startswith(f"{path}: {section}")
