"""NVIDIA's device-plugin flags and env vars, as `kubegpu serve` reads them.

Data: tests/conformance/data/nvidia/cli/device-plugin-flags.yaml, the flag list of
NVIDIA/k8s-device-plugin@v0.20.0:cmd/nvidia-device-plugin/main.go with the config key
each flag sets (api/config/v1/flags.go, config.go) and its default. A DaemonSet written
for NVIDIA's plugin sets these by name or by env var; each must reach the same config
key with the same value, and leave NVIDIA's default when unset.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from kubegpu.cli import main
from kubegpu.cli.labels import LABELS_KEYS, labels, labels_main
from kubegpu.cli.options import EnvOption, UsageError, env_options, parse
from kubegpu.cli.serve import SERVE_KEYS, check_serve, plugin_dir, serve, serve_notices
from kubegpu.config import config_to_raw, flag_overrides, load_config
from tests.conformance.origin import DATA, NVIDIA_DP

ORIGIN = NVIDIA_DP.cite("cmd/nvidia-device-plugin/main.go")
DATA_FILE = yaml.safe_load(
    (DATA / "nvidia" / "cli" / "device-plugin-flags.yaml").read_text(encoding="utf-8")
)
FLAGS: list[dict[str, Any]] = DATA_FILE["flags"]
BOOLS: dict[str, list[str]] = DATA_FILE["bools"]
WITH_KEY = [f for f in FLAGS if f["config"]]
WITHOUT_KEY = [f for f in FLAGS if not f["config"]]


def _names(flag: dict[str, Any]) -> list[str]:
    return [flag["name"], *flag.get("aliases", [])]


def _by_name(
    flags: list[dict[str, Any]], what: str = "name"
) -> list[Any]:  # one param per flag, named after NVIDIA's flag and origin
    return [pytest.param(f, id=f"{f[what]} [{ORIGIN}]") for f in flags]


def _each_name(flags: list[dict[str, Any]]) -> list[Any]:
    return [pytest.param(f, n, id=f"--{n} [{ORIGIN}]") for f in flags for n in _names(f)]


def _each_env(flags: list[dict[str, Any]]) -> list[Any]:
    return [pytest.param(f, e, id=f"{e} [{ORIGIN}]") for f in flags for e in f["env"]]


def _serve_values(argv: list[str], env: dict[str, str]) -> dict[str, Any]:
    values = parse(serve, argv, env)
    check_serve(values, env)
    return values


def _config_value(values: dict[str, Any], key: str) -> Any:
    """The effective config's value at NVIDIA's key, with flags/env on top of no file."""
    node: Any = config_to_raw(load_config(None, flag_overrides(values, SERVE_KEYS)), nulls=True)
    for part in key.split("."):
        node = node[part]
    return node


def _serve_flag(name: str) -> EnvOption:
    matches = [o for o in env_options(serve) if f"--{name}" in o.opts]
    assert len(matches) == 1, f"--{name} is not exactly one kubegpu serve flag"
    return matches[0]


def _convert(option: EnvOption, text: str) -> Any:
    """The option's value for `text`, as its type reads it."""
    return option.type.convert(text, option, None)


@pytest.mark.parametrize("nvidia", _by_name(FLAGS))
def test_every_nvidia_flag_is_one_serve_flag_with_all_its_names_and_env_vars(
    nvidia: dict[str, Any],
) -> None:
    flag = _serve_flag(nvidia["name"])
    assert {f"--{n}" for n in _names(nvidia)} <= set(flag.opts)
    # NVIDIA's precedence: the first of its env vars that is set wins.
    assert list(flag.envs) == nvidia["env"]


@pytest.mark.parametrize(("nvidia", "name"), _each_name(WITH_KEY))
def test_each_flag_name_sets_nvidias_config_key(nvidia: dict[str, Any], name: str) -> None:
    values = _serve_values([f"--{name}={nvidia['sample']}"], {})
    assert _config_value(values, nvidia["config"]) == nvidia["expect"]


@pytest.mark.parametrize(("nvidia", "env"), _each_env(WITH_KEY))
def test_each_env_var_sets_nvidias_config_key(nvidia: dict[str, Any], env: str) -> None:
    values = _serve_values([], {env: str(nvidia["sample"])})
    assert _config_value(values, nvidia["config"]) == nvidia["expect"]


@pytest.mark.parametrize("nvidia", _by_name(WITH_KEY))
def test_unset_flags_leave_nvidias_default(nvidia: dict[str, Any]) -> None:
    values = _serve_values([], {})
    assert _config_value(values, nvidia["config"]) == nvidia["default"]


@pytest.mark.parametrize(("nvidia", "name"), _each_name(WITHOUT_KEY))
def test_flags_without_a_config_key_are_accepted(nvidia: dict[str, Any], name: str) -> None:
    flag = _serve_flag(nvidia["name"])
    values = _serve_values([f"--{name}={nvidia['sample']}"], {})
    expected = _convert(flag, str(nvidia["sample"]))
    assert values[flag.name or ""] == expected and expected


@pytest.mark.parametrize(("nvidia", "env"), _each_env(WITHOUT_KEY))
def test_env_vars_without_a_config_key_are_accepted(nvidia: dict[str, Any], env: str) -> None:
    flag = _serve_flag(nvidia["name"])
    values = _serve_values([], {env: str(nvidia["sample"])})
    assert values[flag.name or ""] == _convert(flag, str(nvidia["sample"]))


def test_kubelet_socket_default_is_nvidias() -> None:
    nvidia = next(f for f in FLAGS if f["name"] == "kubelet-socket")
    values = _serve_values([], {})
    assert str(plugin_dir(values) / "kubelet.sock") == nvidia["default"]


def test_kubelet_socket_elsewhere_moves_the_plugin_directory() -> None:
    values = _serve_values(
        [], {"KUBELET_SOCKET": "/var/lib/k0s/kubelet/device-plugins/kubelet.sock"}
    )
    assert plugin_dir(values) == Path("/var/lib/k0s/kubelet/device-plugins")


def test_kubelet_socket_outside_the_given_plugin_directory_is_refused() -> None:
    values = _serve_values(["--device-plugin-path=/a/device-plugins"], {})
    values["kubelet_socket"] = "/b/device-plugins/kubelet.sock"
    with pytest.raises(UsageError, match=r"KUBELET_SOCKET.*DEVICE_PLUGIN_PATH"):
        plugin_dir(values)


@pytest.mark.parametrize(
    "nvidia", _by_name([f for f in FLAGS if f["type"] == "stringslice" and not f["config"]])
)
def test_unset_slice_flags_are_empty(nvidia: dict[str, Any]) -> None:
    assert not _serve_values([], {})[_serve_flag(nvidia["name"]).name or ""]
    assert nvidia["default"] == []


def test_config_file_flag_reads_the_file(tmp_path: Path) -> None:
    file = tmp_path / "config.yaml"
    file.write_text("version: v1\nflags:\n  migStrategy: single\n")
    values = _serve_values([], {"CONFIG_FILE": str(file)})
    assert (
        load_config(values["config_file"], flag_overrides(values, SERVE_KEYS)).flags.mig_strategy
        == "single"
    )


# -- NVIDIA's env precedence and flag syntax -------------------------------------------

MULTI_ENV = [f for f in FLAGS if len(f["env"]) > 1]


@pytest.mark.parametrize("nvidia", _by_name(MULTI_ENV))
def test_first_of_nvidias_env_vars_wins(nvidia: dict[str, Any]) -> None:
    first, second = nvidia["env"][:2]
    values = _serve_values([], {first: "/first", second: "/second"})
    assert _config_value(values, nvidia["config"]) == "/first"
    values = _serve_values([], {second: "/second"})
    assert _config_value(values, nvidia["config"]) == "/second"


@pytest.mark.parametrize("nvidia", _by_name(WITH_KEY))
def test_flag_beats_env_var(nvidia: dict[str, Any]) -> None:
    default = nvidia["default"]
    values = _serve_values([f"--{nvidia['name']}={nvidia['sample']}"], {nvidia["env"][0]: "x"})
    assert _config_value(values, nvidia["config"]) == nvidia["expect"] != default


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (
            ["--device-list-strategy=envvar", "--device-list-strategy=cdi-cri"],
            ["envvar", "cdi-cri"],
        ),
        (
            ["--device-list-strategy", "volume-mounts,cdi-annotations"],
            ["volume-mounts", "cdi-annotations"],
        ),
    ],
    ids=[f"repeated [{ORIGIN}]", f"comma list [{ORIGIN}]"],
)
def test_slice_flags_add_up_when_repeated(argv: list[str], expected: list[str]) -> None:
    """urfave/cli's StringSliceFlag appends each occurrence and splits on commas."""
    values = _serve_values(argv, {"DEVICE_LIST_STRATEGY": "envvar"})
    assert _config_value(values, "flags.plugin.deviceListStrategy") == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [("0", [0]), (" 0 ", [0]), ("0x0", [0]), ("00", [0])],
    ids=lambda v: repr(v),
)
def test_imex_channel_ids_read_as_go_integers(text: str, expected: list[int]) -> None:
    """IntSliceFlag: each comma part trimmed and read by strconv.ParseInt(s, 0, 64)."""
    values = _serve_values([], {"IMEX_CHANNEL_IDS": text})
    assert _config_value(values, "imex.channelIDs") == expected


def _exit_line(
    argv: list[str],
    env: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> tuple[int, str]:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    try:
        code = main(["serve", *argv])
    except SystemExit as exit_:
        assert isinstance(exit_.code, int)
        code = exit_.code
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return code, err


@pytest.mark.parametrize(
    ("argv", "env", "named"),
    [
        (["--imex-channel-ids=1"], {}, "--imex-channel-ids"),
        (["--imex-channel-ids=0,1"], {}, "--imex-channel-ids"),
        ([], {"IMEX_CHANNEL_IDS": "zero"}, "IMEX_CHANNEL_IDS"),
        (["--shared-devices-allocation-policy=spread"], {}, "--shared-devices-allocation-policy"),
        ([], {"SHARED_DEVICES_ALLOCATION_POLICY": "Packed"}, "SHARED_DEVICES_ALLOCATION_POLICY"),
        ([], {"DEVICE_DISCOVERY_STRATEGY": "vfio"}, "DEVICE_DISCOVERY_STRATEGY"),
        (["--mig"], {}, "--mig"),  # Go's flags take no abbreviations
    ],
    ids=lambda v: str(v),
)
def test_what_nvidia_refuses_is_refused_in_one_line(
    argv: list[str],
    env: dict[str, str],
    named: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, err = _exit_line(argv, env, monkeypatch, capsys)
    assert code == 2 and named in err


# -- booleans: Go's strconv.ParseBool ---------------------------------------------------

BOOL_FLAGS = [f for f in FLAGS if f["type"] == "bool"]


@pytest.mark.parametrize("nvidia", _by_name(BOOL_FLAGS))
@pytest.mark.parametrize(
    ("text", "expected"),
    [(t, True) for t in BOOLS["accepted_true"]] + [(t, False) for t in BOOLS["accepted_false"]],
)
def test_bools_take_gos_spellings(nvidia: dict[str, Any], text: str, expected: bool) -> None:
    for values in (
        _serve_values([f"--{nvidia['name']}={text}"], {}),
        _serve_values([], {nvidia["env"][0]: text}),
    ):
        assert _config_value(values, nvidia["config"]) is expected


@pytest.mark.parametrize("nvidia", _by_name(BOOL_FLAGS))
def test_a_bare_bool_flag_is_true_and_an_empty_bool_env_var_false(nvidia: dict[str, Any]) -> None:
    """urfave/cli v2 (flag_bool.go): an env var set to "" means false, not "unset"."""
    assert _config_value(_serve_values([f"--{nvidia['name']}"], {}), nvidia["config"]) is True
    assert _config_value(_serve_values([], {nvidia["env"][0]: ""}), nvidia["config"]) is False


@pytest.mark.parametrize("text", BOOLS["refused"])
@pytest.mark.parametrize("nvidia", _by_name(BOOL_FLAGS))
def test_other_bool_spellings_are_refused_naming_the_flag_and_the_spellings(
    nvidia: dict[str, Any],
    text: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, err = _exit_line([f"--{nvidia['name']}={text}"], {}, monkeypatch, capsys)
    assert code == 2 and f"--{nvidia['name']}" in err and "True" in err and "F" in err
    code, err = _exit_line([], {nvidia["env"][0]: text}, monkeypatch, capsys)
    assert code == 2 and nvidia["env"][0] in err and "false" in err


# -- deliberate differences -------------------------------------------------------------


@pytest.mark.deliberate("kubelet-socket-in-plugin-dir")
@pytest.mark.parametrize(
    "value", ["", "/var/lib/kubelet/device-plugins/kubelet-2.sock", "kubelet.sock"]
)
def test_kubelet_socket_must_be_kubelet_sock_in_a_directory(
    value: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """NVIDIA takes any path, and "" to register with no kubelet; kubegpu always registers,
    on `kubelet.sock` in the device-plugin directory (where the kubelet looks for plugins)."""
    code, err = _exit_line([f"--kubelet-socket={value}"], {}, monkeypatch, capsys)
    assert code == 2 and "--kubelet-socket" in err


@pytest.mark.deliberate("cdi-feature-flags-not-applied")
def test_cdi_feature_flags_are_accepted_and_reported_unused() -> None:
    values = _serve_values([], {"CDI_FEATURE_FLAGS": "disable-nvsandboxutils"})
    notices = serve_notices(values)
    assert len(notices) == 1 and "disable-nvsandboxutils" in notices[0]
    assert serve_notices(_serve_values([], {})) == []


@pytest.mark.deliberate("empty-env-is-unset")
@pytest.mark.parametrize(
    "nvidia", _by_name([f for f in WITH_KEY if f["type"] in ("string", "stringslice")])
)
def test_an_empty_env_var_leaves_the_default(nvidia: dict[str, Any]) -> None:
    """NVIDIA takes `""` as the value (refused for the strategies, an empty path or
    prefix otherwise); kubegpu reads it as unset, as templated manifests render unset."""
    values = _serve_values([], {nvidia["env"][0]: ""})
    assert _config_value(values, nvidia["config"]) == nvidia["default"]


# -- GPU Feature Discovery's flags, as `kubegpu labels` reads them ---------------------

GFD_ORIGIN = NVIDIA_DP.cite("cmd/gpu-feature-discovery/main.go")
GFD_DATA = yaml.safe_load((DATA / "nvidia" / "cli" / "gfd-flags.yaml").read_text(encoding="utf-8"))
GFD_FLAGS: list[dict[str, Any]] = GFD_DATA["flags"]
#: Where `kubegpu labels` keeps what GFD keeps elsewhere: NVIDIA's `flags.useNodeFeatureAPI`
#: is read into `flags.gfd` (config/v1.py); the discovery strategy and the driver's mount
#: are labeller options (GFD's `main.go` does not use the latter either).
LABELS_AT: dict[str, tuple[str, str]] = {
    "use-node-feature-api": ("config", "flags.gfd.useNodeFeatureAPI"),
    "device-discovery-strategy": ("option", "device_discovery_strategy"),
    "driver-root-ctr-path": ("option", "container_driver_root"),
}


def _gfd(flags: list[dict[str, Any]], each: str = "") -> list[Any]:
    if each == "name":
        return [pytest.param(f, n, id=f"--{n} [{GFD_ORIGIN}]") for f in flags for n in _names(f)]
    if each == "env":
        return [pytest.param(f, e, id=f"{e} [{GFD_ORIGIN}]") for f in flags for e in f["env"]]
    return [pytest.param(f, id=f"{f['name']} [{GFD_ORIGIN}]") for f in flags]


def _labels_value(nvidia: dict[str, Any], argv: list[str], env: dict[str, str]) -> Any:
    """What `kubegpu labels` makes of GFD's flag: the effective config's value, or the
    labeller option's."""
    from kubegpu.config import load_config
    from kubegpu.labeller import parse_duration

    opts = parse(labels, argv, env)
    where, key = LABELS_AT.get(nvidia["name"], ("config", nvidia["config"] or ""))
    if where == "option" or not nvidia["config"]:
        return opts.get(key or nvidia["name"].replace("-", "_"))
    overrides = flag_overrides(opts, LABELS_KEYS)
    node: Any = config_to_raw(load_config(None, overrides), nulls=True)
    for part in key.split("."):
        node = node[part]
    return parse_duration(node) if nvidia["type"] == "duration" else node


def _labels_flag(name: str) -> EnvOption:
    names = {f"--{name}"} if len(name) > 1 else {f"-{name}"}
    matches = [o for o in env_options(labels) if names & set(o.opts)]
    assert len(matches) == 1, f"{names} is not exactly one kubegpu labels flag"
    return matches[0]


@pytest.mark.parametrize("nvidia", _gfd(GFD_FLAGS))
def test_every_gfd_flag_is_one_labels_flag_with_its_names_and_env_vars(
    nvidia: dict[str, Any],
) -> None:
    option = _labels_flag(nvidia["name"])
    for name in _names(nvidia):
        assert option is _labels_flag(name)
    assert list(option.envs) == nvidia["env"]


@pytest.mark.parametrize(("nvidia", "name"), _gfd(GFD_FLAGS, "name"))
def test_each_gfd_flag_name_reaches_the_same_setting(nvidia: dict[str, Any], name: str) -> None:
    dash = "-" if len(name) == 1 else "--"
    value = _labels_value(nvidia, [f"{dash}{name}", str(nvidia["sample"])], {})
    assert value == (nvidia["sample"] if nvidia["expect"] is None else nvidia["expect"])


@pytest.mark.parametrize(("nvidia", "env"), _gfd(GFD_FLAGS, "env"))
def test_each_gfd_env_var_reaches_the_same_setting(nvidia: dict[str, Any], env: str) -> None:
    value = _labels_value(nvidia, [], {env: str(nvidia["sample"])})
    assert value == (nvidia["sample"] if nvidia["expect"] is None else nvidia["expect"])


@pytest.mark.parametrize("nvidia", _gfd([f for f in GFD_FLAGS if len(f["env"]) > 1]))
def test_first_of_gfds_env_vars_wins(nvidia: dict[str, Any]) -> None:
    first, second = nvidia["env"][:2]
    sample, other = str(nvidia["sample"]), str(nvidia["default"]).lower()
    assert _labels_value(nvidia, [], {first: sample, second: other}) == (
        nvidia["sample"] if nvidia["expect"] is None else nvidia["expect"]
    )


DEFAULTS_CHECKED = [f for f in GFD_FLAGS if f["config"] and f["name"] not in LABELS_AT]


@pytest.mark.parametrize("nvidia", _gfd(DEFAULTS_CHECKED))
def test_unset_gfd_flags_leave_gfds_default(nvidia: dict[str, Any]) -> None:
    assert _labels_value(nvidia, [], {}) == nvidia["default"]


@pytest.mark.deliberate("labels-features-file-default")
def test_use_node_feature_api_defaults_to_false_unlike_gfd() -> None:
    """GFD v0.20.0 defaults --use-node-feature-api to true; kubegpu labels writes NFD's
    features.d file unless asked, so it runs (and `-o -` prints) without an API server."""
    nvidia = next(f for f in GFD_FLAGS if f["name"] == "use-node-feature-api")
    assert nvidia["default"] is True
    assert _labels_value(nvidia, [], {}) is False
    assert _labels_value(nvidia, ["--use-node-feature-api"], {}) is True


@pytest.mark.parametrize(
    ("text", "seconds"),
    list(GFD_DATA["sleep_intervals"]["accepted"].items()),
    ids=[f"{t!r} [{GFD_ORIGIN}]" for t in GFD_DATA["sleep_intervals"]["accepted"]],
)
def test_gfd_sleep_intervals_are_read_as_go_durations(text: str, seconds: float) -> None:
    """A negative interval sleeps not at all in Go's timer: it reads as 0 here."""
    nvidia = next(f for f in GFD_FLAGS if f["name"] == "sleep-interval")
    assert _labels_value(nvidia, [f"--sleep-interval={text}"], {}) == max(seconds, 0)


@pytest.mark.parametrize(
    "text",
    GFD_DATA["sleep_intervals"]["refused"],
    ids=[f"{t!r} [{GFD_ORIGIN}]" for t in GFD_DATA["sleep_intervals"]["refused"]],
)
def test_what_gfd_refuses_as_a_sleep_interval_is_refused(
    text: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert labels_main([f"--sleep-interval={text}"], environ={}) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--sleep-interval" in err


@pytest.mark.parametrize(
    ("argv", "env", "named"),
    [
        (["--mig-strategy=Mixed"], {}, "--mig-strategy"),
        ([], {"GFD_MIG_STRATEGY": "half"}, "GFD_MIG_STRATEGY"),
        (["--device-discovery-strategy=cuda"], {}, "--device-discovery-strategy"),
        ([], {"USE_NODE_FEATURE_API": "yes"}, "USE_NODE_FEATURE_API"),
        (["--oneshot=on"], {}, "--oneshot"),
    ],
    ids=lambda v: str(v),
)
def test_what_gfd_refuses_is_refused_by_labels(
    argv: list[str], env: dict[str, str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert labels_main(argv, environ=env) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and named in err


@pytest.mark.parametrize("nvidia", _gfd([f for f in GFD_FLAGS if f["type"] == "bool"]))
def test_an_empty_gfd_bool_env_var_is_false(nvidia: dict[str, Any]) -> None:
    assert _labels_value(nvidia, [], {nvidia["env"][0]: ""}) is False
