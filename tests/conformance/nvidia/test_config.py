"""NVIDIA's own config cases, run against kubegpu's config loader.

The cases are the data of NVIDIA/k8s-device-plugin v0.20.0 `api/config/v1/*_test.go`
(and validation facts of the Go sources next to them), kept under
`tests/conformance/data/nvidia/config/` with their origin. Each Go test decodes a JSON
fragment (flags, a device selector, a sharing entry, ...); here the fragment is put at its
key in a config file and loaded the way a ConfigMap is, so the case checks what an
operator's file means to kubegpu: accepted with the meaning NVIDIA gives it, or refused
with one line naming the key.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from kubegpu.config import Config, config_to_json, config_to_raw, load_config, parse_config
from kubegpu.config.loader import build_config
from kubegpu.config.names import (
    device_entry_kind,
    parse_go_duration,
    pattern_matches,
    qualify_resource_name,
)
from kubegpu.errors import ConfigError
from tests.conformance.origin import DATA, NVIDIA_DP

CONFIG_DATA = DATA / "nvidia" / "config"
SOURCE = "cm.yaml"
V1 = "api/config/v1"


def _cases(file: str, group: str) -> list[dict[str, Any]]:
    data = yaml.safe_load((CONFIG_DATA / file).read_text(encoding="utf-8"))
    cases: list[dict[str, Any]] = data[group]
    return cases


def _params(file: str, group: str) -> list[Any]:
    return [pytest.param(case, id=case["id"]) for case in _cases(file, group)]


def _cite(case_id: str) -> str:
    """The peer file a case id names (`replicas_test.go:...` -> its path at the pin)."""
    file = case_id.split(":", 1)[0]
    path = f"cmd/nvidia-device-plugin/{file}" if file == "main.go" else f"{V1}/{file}"
    return NVIDIA_DP.cite(path)


def _fragment(text: str) -> Any:
    """A Go test's JSON fragment as the value it decodes to (empty input is null)."""
    return yaml.safe_load(text)


def _load(raw: dict[str, Any]) -> Config:
    return build_config(raw, {}, source=SOURCE)


def _refused(key: str, load: Any, *args: Any) -> str:
    """Assert `load(*args)` refuses the config with one line naming `key`; the line."""
    with pytest.raises(ConfigError) as info:
        load(*args)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"{SOURCE}: {key}") or message.startswith(f"flag/env: {key}"), message
    return message


def _lookup(config: Config, dotted: str) -> Any:
    """A value of the effective config by its file key path (`flags.gfd.sleepInterval`)."""
    if dotted.split(".")[0].split("[")[0] not in ("version", "flags", "resources", "imex"):
        dotted = f"sharing.{dotted}"
    node: Any = config_to_raw(config, nulls=True)
    for part in dotted.split("."):
        name, *indices = re.split(r"\[(\d+)\]", part)
        node = node.get(name) if isinstance(node, dict) else None
        for index in (i for i in indices if i):
            node = node[int(index)]
    return node


def _assert_expected(config: Config, expect: dict[str, Any]) -> None:
    for key, want in expect.items():
        got = _lookup(config, key)
        if key.endswith(".name") and isinstance(got, str):
            got = qualify_resource_name(got)
        assert got == want, f"{key}: {got!r} != {want!r}"


# -- flags_test.go, duration.go ---------------------------------------------------------


@pytest.mark.parametrize("case", _params("flags.yaml", "unmarshal"))
def test_flags_unmarshal(case: dict[str, Any]) -> None:
    """`flags:` fragments of flags_test.go TestUnmarshalFlags and duration.go."""
    raw = {"flags": _fragment(case["input"])}
    if not case["accept"]:
        _refused(case["key"], _load, raw)
        return
    flags = _load(raw).flags
    for key, want in case["expect"].items():
        probes: dict[str, Callable[[], Any]] = {
            "sleep_interval_ns": lambda: parse_go_duration(flags.gfd.sleep_interval),
            "sleep_interval": lambda: flags.gfd.sleep_interval,
            "device_list_strategy": lambda: [s.value for s in flags.plugin.device_list_strategy],
            "mig_strategy": lambda: flags.mig_strategy.value,
            "fail_on_init_error": lambda: flags.fail_on_init_error,
            "use_node_feature_api": lambda: flags.gfd.use_node_feature_api,
        }
        got = probes[key]()
        assert got == want, f"{_cite(case['id'])}: {key}"


@pytest.mark.parametrize("case", _params("flags.yaml", "marshal"))
def test_flags_marshal_sleep_interval(case: dict[str, Any]) -> None:
    """flags_test.go TestMarshalFlags: a parsed sleepInterval is written back as NVIDIA
    writes it, and the written config reads back to the same value."""
    config = _load({"flags": {"gfd": {"sleepInterval": case["input"]}}})
    written = json.loads(config_to_json(config))
    assert written["flags"]["gfd"]["sleepInterval"] == case["output"]
    assert parse_config(config_to_json(config)) == config


def test_sleep_interval_feeds_the_labeller_as_nvidia_means_it() -> None:
    """duration.go: 0 means relabel without pause, not "invalid"; the labeller agrees."""
    from kubegpu.labeller import parse_duration

    zero = _load({"flags": {"gfd": {"sleepInterval": 0}}}).flags.gfd.sleep_interval
    five = _load({"flags": {"gfd": {"sleepInterval": 5}}}).flags.gfd.sleep_interval
    assert parse_duration(zero) == 0
    assert parse_duration(five) == pytest.approx(5e-9)


# -- replicas_test.go, replicas.go -------------------------------------------------------

_KINDS = {"gpuIndex": {"index"}, "migIndex": {"mig-index"}, "uuid": {"uuid", "mig-uuid"}}


@pytest.mark.parametrize("case", _params("replicas.yaml", "device_refs"))
def test_device_ref_kind(case: dict[str, Any]) -> None:
    """replicas_test.go TestReplicatedDeviceRef: index, MIG index or UUID."""
    assert device_entry_kind(case["input"]) in _KINDS[case["kind"]]


def _sharing_entry(devices: Any) -> dict[str, Any]:
    return {
        "sharing": {
            "timeSlicing": {"resources": [{"name": "gpu", "replicas": 2, "devices": devices}]}
        }
    }


@pytest.mark.parametrize("case", _params("replicas.yaml", "devices"))
def test_replicated_devices(case: dict[str, Any]) -> None:
    """replicas_test.go TestUnmarshalReplicatedDevices: a resource's `devices`."""
    raw = _sharing_entry(_fragment(case["input"]))
    if not case["accept"]:
        _refused("sharing.timeSlicing.resources[0]", _load, raw)
        return
    sharing = _load(raw).sharing.time_slicing
    assert sharing is not None
    devices = sharing.resources[0].devices
    # Go keeps list entries as strings (an index 0 becomes "0"); kubegpu keeps the YAML
    # type, which names the same device.
    got = [str(d) for d in devices] if isinstance(devices, tuple) else devices
    assert got == case["expect"], _cite(case["id"])


@pytest.mark.parametrize("case", _params("replicas.yaml", "marshal_devices"))
def test_replicated_devices_marshal(case: dict[str, Any]) -> None:
    """replicas_test.go TestMarshalReplicatedDevices: written back as given."""
    config = _load(_sharing_entry(case["input"]))
    written = json.loads(config_to_json(config))
    assert written["sharing"]["timeSlicing"]["resources"][0]["devices"] == case["output"]


@pytest.mark.parametrize("case", _params("replicas.yaml", "resource"))
def test_replicated_resource(case: dict[str, Any]) -> None:
    """replicas_test.go TestUnmarshalReplicatedResource: one sharing entry."""
    raw = {"sharing": {"timeSlicing": {"resources": [_fragment(case["input"])]}}}
    if not case["accept"]:
        _refused("sharing.timeSlicing.resources[0]", _load, raw)
        return
    sharing = _load(raw).sharing.time_slicing
    assert sharing is not None
    entry = sharing.resources[0]
    got = {
        "name": qualify_resource_name(entry.name),
        "replicas": entry.replicas,
        "devices": entry.devices,
        "rename": None if entry.rename is None else qualify_resource_name(entry.rename),
    }
    assert got == case["expect"], _cite(case["id"])


@pytest.mark.parametrize("case", _params("replicas.yaml", "resources"))
def test_replicated_resources(case: dict[str, Any]) -> None:
    """replicas_test.go TestUnmarshalReplicatedResources: `sharing.timeSlicing`; expect is
    each resource's name and the name it is advertised under."""
    raw = {"sharing": {"timeSlicing": _fragment(case["input"])}}
    if not case["accept"]:
        _refused("sharing.timeSlicing", _load, raw)
        return
    sharing = _load(raw).sharing.time_slicing
    assert sharing is not None
    got = []
    for entry in sharing.resources:
        name = qualify_resource_name(entry.name)
        if entry.rename is not None:
            advertised = qualify_resource_name(entry.rename)
        else:
            advertised = f"{name}.shared" if sharing.rename_by_default else name
        got.append([name, advertised])
    assert got == case["expect"], _cite(case["id"])


# -- imex_test.go, imex.go -----------------------------------------------------------------


@pytest.mark.parametrize("case", _params("imex.yaml", "cases"))
def test_imex(case: dict[str, Any]) -> None:
    """imex_test.go TestImexUnmarshal with imex.go AssertChannelIDsValid."""
    raw = {"imex": _fragment(case["input"])}
    if not case["accept"]:
        _refused("imex.channelIDs", _load, raw)
        return
    imex = _load(raw).imex
    assert list(imex.channel_ids) == case["expect"], _cite(case["id"])
    assert imex.required is case.get("required", False)


# -- resources_test.go ---------------------------------------------------------------------


@pytest.mark.parametrize("case", _params("resources.yaml", "patterns"))
def test_resource_pattern_matches(case: dict[str, Any]) -> None:
    """resources_test.go TestResourcePatternMatches (the matcher resources.py renames with)."""
    assert pattern_matches(case["pattern"], case["input"]) is case["expected"]


# -- config.go, sharing.go, resources.go, cmd/nvidia-device-plugin/main.go -----------------


@pytest.mark.parametrize("case", _params("validation.yaml", "cases"))
def test_config_file(case: dict[str, Any]) -> None:
    """Whole config files: what NVIDIA's loader and validateFlags accept, and their meaning."""
    if not case["accept"]:
        _refused(case["key"], parse_config, case["config"], SOURCE)
        return
    _assert_expected(parse_config(case["config"], SOURCE), case["expect"])


@pytest.mark.parametrize("case", _params("validation.yaml", "overrides"))
def test_flag_and_env_overrides(case: dict[str, Any], tmp_path: Path) -> None:
    """flags.go updateFromCLIFlag: a flag or env value wins over the file, in NVIDIA's
    spellings (comma lists, strconv.ParseBool booleans, durations)."""
    path = tmp_path / SOURCE
    path.write_text(case["config"], encoding="utf-8")
    if not case["accept"]:
        _refused(case["key"], load_config, path, case["set"])
        return
    _assert_expected(load_config(path, case["set"]), case["expect"])


_DELIBERATE = {case["id"]: case for case in _cases("validation.yaml", "deliberate")}


def _deliberate(case_id: str) -> dict[str, Any]:
    return _DELIBERATE[case_id]


@pytest.mark.deliberate("unknown-keys-rejected")
def test_unknown_key_is_refused() -> None:
    case = _deliberate("config.go:yaml.Unmarshal ignores unknown keys")
    message = _refused(case["key"], parse_config, case["config"], SOURCE)
    assert "passDeviceSpecs" in message  # the did-you-mean


@pytest.mark.deliberate("config-keys-case-sensitive")
def test_key_in_other_case_is_refused() -> None:
    case = _deliberate("config.go:encoding/json matches keys case-insensitively")
    message = _refused(case["key"], parse_config, case["config"], SOURCE)
    assert "migStrategy" in message


@pytest.mark.deliberate("resource-names-any-domain")
def test_resource_in_another_domain_is_accepted() -> None:
    case = _deliberate("resources.go:NewResourceName forces the nvidia.com domain")
    sharing = parse_config(case["config"], SOURCE).sharing.time_slicing
    assert sharing is not None
    assert qualify_resource_name(sharing.resources[0].name) == "amd.com/gpu"


@pytest.mark.deliberate("empty-device-list-strategy-rejected")
def test_empty_device_list_strategy_is_refused() -> None:
    case = _deliberate("strategy.go:NewDeviceListStrategies empty list")
    _refused(case["key"], parse_config, case["config"], SOURCE)


@pytest.mark.deliberate("timeslicing-and-mps-together")
def test_same_resource_under_both_strategies_is_refused() -> None:
    case = _deliberate("sharing.go:ReplicatedResources MPS hides timeSlicing")
    message = _refused(case["key"], parse_config, case["config"], SOURCE)
    assert "both timeSlicing and mps" in message


@pytest.mark.parametrize(
    ("flags", "dev_root"),
    [
        ({"nvidiaDriverRoot": "/run/nvidia/driver"}, "/run/nvidia/driver"),
        ({"nvidiaDriverRoot": "/run/nvidia/driver", "nvidiaDevRoot": ""}, "/run/nvidia/driver"),
        ({"nvidiaDriverRoot": "/run/nvidia/driver", "nvidiaDevRoot": "/"}, "/"),
    ],
)
def test_dev_root_defaults_to_driver_root(flags: dict[str, str], dev_root: str) -> None:
    """config.go NewConfig: an unset or empty nvidiaDevRoot is the driver root."""
    assert _load({"flags": flags}).flags.dev_root == dev_root, _cite("config.go:NewConfig")


def test_every_data_file_names_its_origin() -> None:
    for path in sorted(CONFIG_DATA.glob("*.yaml")):
        head = path.read_text(encoding="utf-8").splitlines()[:3]
        assert any(NVIDIA_DP.commit in line for line in head), path.name
    assert NVIDIA_DP.commit in (CONFIG_DATA / "README.md").read_text(encoding="utf-8")
