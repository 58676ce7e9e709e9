"""The shared option machinery: `--help` shows env names and defaults, `--driver-root` means
one root everywhere, one bool syntax, one flag > env > file merge."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import click
import pytest

import kubegpu.check
import kubegpu.devices
from kubegpu.cli import main
from kubegpu.cli.cdi import generate
from kubegpu.cli.check import check
from kubegpu.cli.info import info
from kubegpu.cli.labels import LABELS_KEYS, labels, labels_main
from kubegpu.cli.options import EnvOption, env_options, given, parse
from kubegpu.cli.serve import SERVE_KEYS, serve
from kubegpu.config import effective_config, flag_overrides
from kubegpu.devices.simulated import SimulatedBackend

COMMANDS = {
    "serve": serve,
    "labels": labels,
    "cdi generate": generate,
    "info": info,
    "check": check,
}


def _help(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main([*argv, "--help"]) == 0
    return " ".join(capsys.readouterr().out.split())  # click wraps long lines


@pytest.mark.parametrize("name", list(COMMANDS))
def test_help_shows_every_env_var_and_the_defaults(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    text = _help(name.split(), capsys)
    for option in env_options(COMMANDS[name]):
        for env in option.envs:
            assert env in text, f"{name} --help does not name {env}"
    assert "default: (/)" in text  # --nvidia-driver-root, shown though the file may set it


def test_help_of_serve_names_nvidias_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    text = _help(["serve"], capsys)
    assert "env var: MIG_STRATEGY; default: (none)" in text
    assert "env var: DEVICE_PLUGIN_PATH; default: /var/lib/kubelet/device-plugins/" in text
    assert "env var: NVIDIA_CDI_HOOK_PATH, NVIDIA_CTK_PATH" in text


def test_help_of_labels_names_gfds_env_vars_in_gfds_order(
    capsys: pytest.CaptureFixture[str],
) -> None:
    text = _help(["labels"], capsys)
    assert "env var: GFD_MIG_STRATEGY, MIG_STRATEGY" in text
    assert "-o, --output-file, --output" in text or "--output-file, --output, -o" in text


def test_top_level_help_version_and_usage(capsys: pytest.CaptureFixture[str]) -> None:
    from kubegpu import __version__

    text = _help([], capsys)
    for name in ("serve", "labels", "cdi", "info", "demo", "check"):
        assert name in text
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"kubegpu {__version__}"
    assert main([]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: kubegpu")


def test_an_unknown_command_is_one_line_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sevre"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "sevre" in err


def test_python_dash_m_runs_the_cli() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kubegpu.cli", "--version"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.startswith("kubegpu ")


# -- one --driver-root --------------------------------------------------------------------


def _driver_root_options(command: click.Command) -> tuple[EnvOption, EnvOption]:
    host = [o for o in env_options(command) if "--driver-root" in o.opts]
    mounted = [o for o in env_options(command) if "--container-driver-root" in o.opts]
    assert len(host) == 1 and len(mounted) == 1
    return host[0], mounted[0]


@pytest.mark.parametrize("name", list(COMMANDS))
def test_driver_root_is_nvidias_host_root_in_every_command(name: str) -> None:
    """`--driver-root` is NVIDIA's alias of `--nvidia-driver-root`: the host's driver root;
    `--container-driver-root` (`--driver-root-ctr-path`) is where it is mounted here."""
    host, mounted = _driver_root_options(COMMANDS[name])
    assert set(host.opts) == {"--nvidia-driver-root", "--driver-root"}
    assert host.envs == ("NVIDIA_DRIVER_ROOT",) and host.name == "driver_root"
    assert host.config_key == "flags.nvidiaDriverRoot"
    assert set(mounted.opts) == {"--container-driver-root", "--driver-root-ctr-path"}
    assert mounted.envs == ("DRIVER_ROOT_CTR_PATH", "CONTAINER_DRIVER_ROOT")
    assert mounted.config_key == "flags.plugin.containerDriverRoot"


@pytest.fixture
def opened(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """The backends the commands open, each a simulated T4."""
    calls: list[dict[str, Any]] = []

    def open_backend(kind: str = "auto", **kwargs: Any) -> SimulatedBackend:
        calls.append({"kind": kind, **kwargs})
        return SimulatedBackend.load("t4-1")

    monkeypatch.setattr(kubegpu.devices, "open_backend", open_backend)
    monkeypatch.setattr(kubegpu.check, "open_backend", open_backend)  # bound at its import
    return calls


def _run(name: str, extra: list[str], tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("version: v1\n")
    argv = {
        "info": ["info"],
        "check": ["check", str(config)],
        "cdi generate": ["cdi", "generate", "-o", str(tmp_path / "spec.json")],
    }
    if name == "labels":
        out = str(tmp_path / "gfd")
        rc = labels_main(
            ["--oneshot", "-o", out, "--sysfs-root", str(tmp_path), *extra], environ={}
        )
    else:
        rc = main([*argv[name], *extra])
    assert rc == 0


@pytest.mark.parametrize("name", ["info", "check", "cdi generate", "labels"])
def test_every_command_reads_the_driver_where_the_host_root_is_mounted(
    name: str, tmp_path: Path, opened: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    for var in ("NVIDIA_DRIVER_ROOT", "DRIVER_ROOT_CTR_PATH", "CONTAINER_DRIVER_ROOT"):
        monkeypatch.delenv(var, raising=False)
    host = tmp_path / "host-driver"  # not mounted at /driver-root here: read as it is
    host.mkdir()
    mounted = tmp_path / "mounted"
    mounted.mkdir()
    _run(name, ["--driver-root", str(host)], tmp_path)
    _run(
        name, ["--nvidia-driver-root", str(host), "--container-driver-root", str(mounted)], tmp_path
    )
    _run(name, [], tmp_path)
    assert [call["driver_root"] for call in opened] == [str(host), str(mounted), "/"]


def test_cdi_writes_the_host_root_into_host_paths(tmp_path: Path) -> None:
    mounted = tmp_path / "mounted"
    (mounted / "usr/bin").mkdir(parents=True)
    (mounted / "usr/bin/nvidia-smi").write_text("")
    out = tmp_path / "spec.json"
    argv = ["cdi", "generate", "--simulate", "t4-1", "-o", str(out)]
    assert (
        main(
            [*argv, "--driver-root", "/run/nvidia/driver", "--container-driver-root", str(mounted)]
        )
        == 0
    )
    text = out.read_text()
    assert '"hostPath": "/run/nvidia/driver/usr/bin/nvidia-smi"' in text
    assert str(mounted) not in text


# -- one bool syntax, one merge -----------------------------------------------------------


@pytest.mark.parametrize("text", ["yes", "on", "Y"])
def test_serve_and_labels_refuse_the_same_bools(
    text: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", f"--gds-enabled={text}"]) == 2
    serve_err = capsys.readouterr().err
    assert labels_main([f"--oneshot={text}"], environ={}) == 2
    labels_err = capsys.readouterr().err
    reason = serve_err.split("--gds-enabled: ", 1)[1]
    assert reason == labels_err.split("--oneshot: ", 1)[1]


def test_an_empty_env_var_is_unset_except_for_a_bool() -> None:
    assert given(serve, [], {"MIG_STRATEGY": "", "GDS_ENABLED": ""}) == {"gds_enabled"}
    assert parse(serve, [], {"GDS_ENABLED": ""})["gds_enabled"] is False


def test_flag_env_and_file_merge_the_same_way_for_serve_and_labels(tmp_path: Path) -> None:
    file = tmp_path / "config.yaml"
    file.write_text("version: v1\nflags:\n  migStrategy: mixed\n  failOnInitError: false\n")
    env = {"MIG_STRATEGY": "single"}
    for command, keys in ((serve, SERVE_KEYS), (labels, LABELS_KEYS)):
        config = effective_config(file, parse(command, [], env), keys)
        assert config.flags.mig_strategy == "single"  # env beats the file
        assert config.flags.fail_on_init_error is False  # unset: the file decides
        values = parse(command, ["--mig-strategy=none"], env)
        assert flag_overrides(values, keys)["flags.migStrategy"] == "none"  # flag beats env
    assert effective_config(file, {}, {}).flags.mig_strategy == "mixed"


def test_config_keys_are_keys_of_the_schema() -> None:
    from kubegpu.config import Config, config_to_raw

    for keys in (SERVE_KEYS, LABELS_KEYS):
        for key in keys.values():
            node: Any = config_to_raw(Config(), nulls=True)
            for part in key.split("."):
                assert isinstance(node, dict) and part in node, key
                node = node[part]


def _by_name(command: click.Command) -> dict[str, EnvOption]:
    return {o.name: o for o in env_options(command) if o.name}


#: Options `serve` and `labels` share with one meaning: one declaration, so the same
#: `--help` words, env names (but GFD's own `GFD_` twins first) and config key.
SAME_IN_SERVE_AND_LABELS = [
    "config_dir",
    "default_config",
    "fallback_strategies",
    "node_label",
    "mig_strategy",
    "config_file",
    "driver_root",
]


@pytest.mark.parametrize("name", SAME_IN_SERVE_AND_LABELS)
def test_an_option_shared_by_serve_and_labels_reads_the_same(name: str) -> None:
    mine, gfds = _by_name(serve)[name], _by_name(labels)[name]
    assert mine.help == gfds.help
    assert mine.opts == gfds.opts
    assert mine.config_key == gfds.config_key
    assert mine.show_default == gfds.show_default and mine.default == gfds.default
    # GFD reads GFD_<NAME> before the plugin's name; the plugin's names come in the same order.
    assert [e for e in gfds.envs if not e.startswith("GFD_")] == list(mine.envs)


@pytest.mark.parametrize("name", ["dev_root", "device_id_strategy", "nvidia_ctk_path"])
def test_an_option_shared_by_serve_and_cdi_reads_the_same_env_vars(name: str) -> None:
    mine, cdis = _by_name(serve)[name], _by_name(generate)[name]
    assert mine.envs == cdis.envs and mine.opts == cdis.opts
    # cdi generate reads no config file: its defaults are its own, shown without
    # the parentheses that mean "the config file's value, else this".
    assert mine.config_key is not None and cdis.config_key is None


def test_defaults_without_a_config_key_are_not_shown_as_the_files(
    capsys: pytest.CaptureFixture[str],
) -> None:
    serve_help, labels_help = _help(["serve"], capsys), _help(["labels"], capsys)
    for text in (serve_help, labels_help):
        # (click may wrap the line after the hyphen)
        assert "env var: NODE_LABEL; default: nvidia.com/device-" in text
        assert "default: (nvidia.com/device-" not in text
    assert "env var: WITH_LABELS; default: (false)" in serve_help
    assert "default: False" not in serve_help
    assert "env var: DEVICE_ID_STRATEGY; default: uuid" in _help(["cdi", "generate"], capsys)


def test_device_discovery_strategy_says_which_meaning_it_has(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert "NVIDIA's device discovery strategy: auto, nvml, tegra (kubegpu's is --backend)" in (
        _help(["serve"], capsys)
    )
    assert "NVIDIA's device discovery strategy: auto, nvml, tegra, vfio" in _help(
        ["labels"], capsys
    )
    assert "kubegpu's backend (as --backend elsewhere): auto, nvml, simulated" in _help(
        ["cdi", "generate"], capsys
    )
    assert (
        parse(labels, ["--device-discovery-strategy", "vfio"], {})["device_discovery_strategy"]
        == "vfio"
    )
    with pytest.raises(click.UsageError, match="invalid choice 'vfio'"):
        parse(serve, ["--device-discovery-strategy", "vfio"], {})


def test_cdi_generate_errors_are_one_line_from_main(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("SIMULATE", raising=False)
    target = tmp_path / "taken"
    target.mkdir()  # a directory where the spec file should go
    assert main(["cdi", "generate", "--simulate", "t4-1", "-o", str(target)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"kubegpu: cannot write {target}: ") and err.count("\n") == 1
    assert "Traceback" not in err
