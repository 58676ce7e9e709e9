"""The kubegpu command: one-line errors for bad input, flag/env precedence, `info`."""

from __future__ import annotations

from pathlib import Path

import pytest

from kubegpu.cli import main
from kubegpu.cli.options import parse
from kubegpu.cli.serve import SERVE_KEYS, serve
from kubegpu.config import flag_overrides


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["serve", "--mig-strategy=sideways"], "--mig-strategy"),
        (["serve", "--fail-on-init-error=maybe"], "--fail-on-init-error"),
        (["serve", "--metrics-port=eighty"], "--metrics-port"),
        (["serve", "--no-such-flag"], "--no-such-flag"),
    ],
)
def test_bad_flags_exit_2_with_one_line_naming_the_flag(
    argv: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and named in err


def test_bad_env_value_names_the_variable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("DEVICE_ID_STRATEGY", "serial")
    assert main(["serve", "--simulate", "t4-1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "DEVICE_ID_STRATEGY" in err and "serial" in err


def test_flag_beats_env_and_unset_values_do_not_override_the_file() -> None:
    env = {"MIG_STRATEGY": "single", "DEVICE_LIST_STRATEGY": "envvar,cdi-cri"}
    values = parse(serve, ["--mig-strategy", "mixed", "--pass-device-specs"], env)
    overrides = flag_overrides(values, SERVE_KEYS)
    assert overrides["flags.migStrategy"] == "mixed"
    assert overrides["flags.plugin.passDeviceSpecs"] is True
    assert overrides["flags.plugin.deviceListStrategy"] == ["envvar", "cdi-cri"]
    assert "flags.failOnInitError" not in overrides  # unset: the file decides


def test_info_lists_gpus_and_mig_slices(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info", "--simulate", "a100-40gb-mig"]) == 0
    out = capsys.readouterr().out
    assert "GPUs: 2" in out and "NVIDIA A100-SXM4-40GB" in out
    assert out.count("MIG 1g.5gb") == 7 and "MIG 3g.20gb (1:0)" in out


# -- every serve mistake: one line naming it, exit 2, nothing started ------------------

LONG_DIR = "/" + "d" * 100  # + "/kubelet.sock" passes the 107-byte sun_path limit


def run_main(argv: list[str]) -> int:
    """`main`'s exit status, whether it returns it or a command exits with it."""
    try:
        return main(argv)
    except SystemExit as exit_:
        assert isinstance(exit_.code, int)
        return exit_.code


@pytest.mark.parametrize(
    ("argv", "env", "named"),
    [
        (["--metrics-port=70000"], {}, "--metrics-port"),
        (["--health-port=-1"], {}, "--health-port"),
        ([], {"HEALTH_PORT": "65536"}, "HEALTH_PORT"),
        (["--health-address=a..b"], {}, "--health-address"),
        (["--metrics-address=-x.example"], {}, "--metrics-address"),
        ([], {"HEALTH_ADDRESS": "10.0.0.256:80"}, "HEALTH_ADDRESS"),
        ([], {"METRICS_ADDRESS": "bad host"}, "METRICS_ADDRESS"),
        (["--device-plugin-path=device-plugins"], {}, "--device-plugin-path"),
        (["--device-plugin-path="], {}, "--device-plugin-path"),
        ([f"--device-plugin-path={LONG_DIR}"], {}, "107"),
        (["--simulate="], {}, "--simulate"),
        (["--node-label=gpu config"], {}, "--node-label"),
        (["--node-label=nvidia.com/"], {}, "--node-label"),
        (["--node-label=Bad_Prefix/x"], {}, "--node-label"),
        ([], {"NODE_LABEL": "-leading-dash"}, "NODE_LABEL"),
        (["--mps-root=run/mps"], {}, "--mps-root"),
        ([], {"MPS_ROOT": "mps"}, "MPS_ROOT"),
        (["--simulate=t4-1", "--backend=nvml"], {}, "--backend"),
        (["--simulate=t4-1"], {"BACKEND": "amd"}, "BACKEND"),
        (["--config-file=/c.yaml", "--config-dir=/configs"], {}, "--config-dir"),
        ([], {"CONFIG_FILE": "/c.yaml", "CONFIG_FILE_SRCDIR": "/configs"}, "CONFIG_FILE_SRCDIR"),
        (["--simulate=t4-1"], {"DP_DISABLE_HEALTHCHECKS": "xid48"}, "DP_DISABLE_HEALTHCHECKS"),
        (["--simulate=t4-1"], {"DP_ENABLE_HEALTHCHECKS": "48,sometimes"}, "DP_ENABLE_HEALTHCHECKS"),
    ],
)
def test_serve_mistakes_exit_2_with_one_line_and_no_traceback(
    argv: list[str],
    env: dict[str, str],
    named: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert run_main(["serve", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert named in err and "Traceback" not in err


@pytest.mark.parametrize(
    "argv",
    [
        ["--metrics-port=0", "--health-port=65535"],
        ["--health-address=::", "--metrics-address=[::1]"],
        ["--health-address=node-1.example.", "--metrics-address=10.0.0.7"],
        ["--node-label=nvidia.com/device-plugin.config"],
        ["--node-label=config"],
        ["--mps-root=/run/nvidia/mps"],
        ["--simulate=t4-1", "--backend=simulated"],
        ["--device-plugin-path=/var/lib/kubelet/device-plugins/"],
    ],
)
def test_good_values_pass_the_same_checks(argv: list[str]) -> None:
    from kubegpu.cli.serve import check_serve

    values = parse(serve, argv, {})
    check_serve(values, {"DP_DISABLE_HEALTHCHECKS": "all", "DP_ENABLE_HEALTHCHECKS": "48, 79"})


def test_binary_simulate_file_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    binary = tmp_path / "node.yaml"
    binary.write_bytes(bytes(range(256)))
    assert run_main(["info", "--simulate", str(binary)]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(binary) in err and "UTF-8" in err


def test_malformed_simulate_yaml_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "node.yaml"
    bad.write_text("gpus: [\n  - a: b: c\n")
    assert run_main(["info", "--simulate", str(bad)]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(bad) in err


def test_sighup_is_ignored_while_serve_starts_and_restored_after(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SIGHUP's default kills; serve ignores it until its loop handler re-reads config."""
    import signal

    from kubegpu import cli
    from kubegpu.cli import serve as serve_module

    seen: list[object] = []

    def fake_serve(values: object, env: object) -> int:
        seen.append(signal.getsignal(signal.SIGHUP))
        return 0

    def before(signum: int, frame: object) -> None:
        """The embedding program's own handler, which `main` must hand back."""

    monkeypatch.setattr(serve_module, "run_serve", fake_serve)
    previous = signal.signal(signal.SIGHUP, before)
    try:
        assert cli.main(["serve"]) == 0
        assert seen == [signal.SIG_IGN]
        assert signal.getsignal(signal.SIGHUP) == before
    finally:
        signal.signal(signal.SIGHUP, previous)


def test_sighup_is_ignored_before_the_cli_loads_click_or_logging() -> None:
    """A HUP while the interpreter imports the CLI (tens of ms) must not kill `serve`."""
    import subprocess
    import sys

    probe = """
import importlib.abc, signal, sys
seen = {}
class Spy(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name in ("click", "logging") and name not in seen:
            seen[name] = signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
        return None
sys.meta_path.insert(0, Spy())
for name in ("click", "logging"):
    sys.modules.pop(name, None)
import kubegpu.cli
print(sorted(seen.items()))
"""
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[('click', True), ('logging', True)]"


def test_cli_paths_are_the_apis() -> None:
    from kubegpu import api, cli

    assert cli.DEVICE_PLUGIN_PATH == api.DEVICE_PLUGIN_PATH
    assert cli.KUBELET_SOCKET == api.KUBELET_SOCKET


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["info", "--simulate", ""], "--simulate"),
        (["info", "--simulate", "t4-1", "--backend", "amd"], "--backend"),
    ],
)
def test_info_mistakes_exit_2_with_one_line(
    argv: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and named in err


# -- Go's value syntax, as NVIDIA's urfave/cli flags read it ----------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0", 0),
        ("7", 7),
        ("-3", -3),
        ("+3", 3),
        ("010", 8),
        ("0x1f", 31),
        ("0o17", 15),
        ("0b101", 5),
        ("1_000", 1000),
    ],
)
def test_go_integers(text: str, expected: int) -> None:
    from kubegpu.gosyntax import parse_go_int

    assert parse_go_int(text) == expected


@pytest.mark.parametrize("text", ["", "-", "--1", "0x", "08", "1.0", " 1", "one", "+-1"])
def test_not_go_integers(text: str) -> None:
    from kubegpu.gosyntax import parse_go_int

    with pytest.raises(ValueError, match="invalid integer"):
        parse_go_int(text)


def test_yes_is_not_a_go_bool(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_main(["serve", "--gds-enabled=yes"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "--gds-enabled" in err and "'yes'" in err and "True" in err and "FALSE" in err


def test_kubelet_socket_moves_the_plugin_dir_and_is_checked_like_it() -> None:
    from kubegpu.cli.options import UsageError
    from kubegpu.cli.serve import plugin_dir

    values = parse(serve, ["--kubelet-socket=/k/device-plugins/kubelet.sock"], {})
    assert plugin_dir(values) == Path("/k/device-plugins")
    values["kubelet_socket"] = "/" + "d" * 100 + "/kubelet.sock"
    with pytest.raises(UsageError, match="107"):
        plugin_dir(values)
