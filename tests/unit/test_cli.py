"""The kubegpu command: one-line errors for bad input, flag/env precedence, `info`."""

from __future__ import annotations

import pytest

from kubegpu.cli import SERVE_FLAGS, build_parser, main, overrides_from, resolve_flags


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
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
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
    args = build_parser().parse_args(["serve", "--mig-strategy", "mixed", "--pass-device-specs"])
    env = {"MIG_STRATEGY": "single", "DEVICE_LIST_STRATEGY": "envvar,cdi-cri"}
    values = resolve_flags(args, SERVE_FLAGS, env)
    overrides = overrides_from(values, SERVE_FLAGS)
    assert overrides["flags.migStrategy"] == "mixed"
    assert overrides["flags.plugin.passDeviceSpecs"] is True
    assert overrides["flags.plugin.deviceListStrategy"] == ["envvar", "cdi-cri"]
    assert "flags.failOnInitError" not in overrides  # unset: the file decides


def test_info_lists_gpus_and_mig_slices(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info", "--simulate", "a100-40gb-mig"]) == 0
    out = capsys.readouterr().out
    assert "GPUs: 2" in out and "NVIDIA A100-SXM4-40GB" in out
    assert out.count("MIG 1g.5gb") == 7 and "MIG 3g.20gb (1:0)" in out
