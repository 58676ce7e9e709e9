"""`kubegpu check CONFIG`: offline validation as `serve` loads it, and what it would advertise."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from kubegpu.cli import main
from kubegpu.config import load_config, parse_config


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return path


def effective(out: str) -> str:
    """The YAML `check` printed: from its `# effective config` line to the first blank one."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("# effective config"))
    end = lines.index("", start) if "" in lines[start:] else len(lines)
    return "\n".join(lines[start:end]) + "\n"


def table(out: str) -> dict[str, list[str]]:
    """RESOURCE -> [DEVICES, HEALTHY, SHARING, REPLICAS] from the printed table."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("RESOURCE"))
    return {line.split()[0]: line.split()[1:] for line in lines[start + 1 :]}


@pytest.fixture(autouse=True)
def _no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SIMULATE", raising=False)


def test_time_slicing_on_a_simulated_node(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = write(
        tmp_path,
        "version: v1\nsharing:\n  timeSlicing:\n    resources:\n"
        "    - name: nvidia.com/gpu\n      replicas: 4\n",
    )
    assert main(["check", str(config), "--simulate", "h100-8"]) == 0
    out = capsys.readouterr().out
    assert f"{config}: valid" in out
    assert table(out) == {"nvidia.com/gpu": ["32", "32", "time-slicing", "4"]}


def test_the_effective_config_is_readable_yaml_that_loads_back_as_the_same_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = write(
        tmp_path,
        "version: v1\nflags:\n  migStrategy: mixed\nsharing:\n  timeSlicing:\n    resources:\n"
        "    - name: nvidia.com/gpu\n      replicas: 4\n      rename: gpu-shared\n",
    )
    assert main(["check", str(config), "--simulate", "h100-8"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == f"{config}: valid"
    text = effective(out)
    # Block style, one key a line: no JSON-like flow mapping of the whole config.
    assert len(text.splitlines()) > 30 and all(len(line) < 100 for line in text.splitlines())
    assert "{" not in text.replace("{}", "")
    raw: dict[str, Any] = yaml.safe_load(text)
    # The schema's order and the file's camelCase keys; nothing of the file lost.
    assert list(raw) == ["version", "flags", "resources", "sharing", "imex"]
    assert list(raw["flags"])[:2] == ["migStrategy", "failOnInitError"]
    assert raw["sharing"]["timeSlicing"]["resources"][0]["rename"] == "gpu-shared"
    assert raw["flags"]["health"]["ignoredXids"] == [13, 31, 43, 45, 68, 109]
    # It is a config file: pasted into a ConfigMap, it is the same config.
    assert parse_config(text) == load_config(config, {})
    assert table(out) == {"nvidia.com/gpu-shared": ["32", "32", "time-slicing", "4"]}


def test_mixed_mig_lists_each_profile(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = write(tmp_path, "version: v1\nflags:\n  migStrategy: mixed\n")
    assert main(["check", str(config), "--simulate", "a100-40gb-mig"]) == 0
    rows = table(capsys.readouterr().out)
    assert any(name.startswith("nvidia.com/mig-") for name in rows), rows
    assert all(cols[2] == "none" for cols in rows.values())


def test_a_typo_exits_1_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = write(tmp_path, "version: v1\nflags:\n  migStrategi: mixed\n")
    assert main(["check", str(config), "--simulate", "h100-8"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    (line,) = captured.err.splitlines()
    assert "flags.migStrategi" in line and "migStrategy" in line


@pytest.mark.parametrize(
    "text",
    ["version: v1\nversion: v1\n", "a: &a [*a]\n", "flags: " + "[" * 500 + "]" * 500 + "\n"],
    ids=["duplicate-key", "self-alias", "deep"],
)
def test_unparseable_files_exit_1_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str
) -> None:
    assert main(["check", str(write(tmp_path, text)), "--simulate", "t4-1"]) == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"kubegpu: {tmp_path}")


def test_a_device_list_too_big_for_the_kubelet_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = write(
        tmp_path,
        "version: v1\nsharing:\n  timeSlicing:\n    resources:\n"
        "    - name: nvidia.com/gpu\n      replicas: 1000000000\n",
    )
    assert main(["check", str(config), "--simulate", "h100-8"]) == 1
    captured = capsys.readouterr()
    assert "valid" not in captured.out
    (line,) = captured.err.splitlines()
    assert "sharing.timeSlicing.resources[0].replicas" in line and "4 MiB" in line


def test_without_a_gpu_it_validates_and_says_how_to_see_devices(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = write(tmp_path, "version: v1\n")
    empty_root = tmp_path / "no-driver"
    empty_root.mkdir()
    args = ["check", str(config), "--backend", "nvml", "--nvidia-driver-root", str(empty_root)]
    assert main(args) == 0
    captured = capsys.readouterr()
    assert f"{config}: valid" in captured.out
    assert "--simulate" in captured.err


def test_a_missing_file_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", str(tmp_path / "absent.yaml"), "--simulate", "t4-1"]) == 1
    assert "cannot read the config file" in capsys.readouterr().err


MPS = (
    "version: v1\nsharing:\n  mps:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 4\n"
)


@pytest.mark.parametrize("how", ["--mps-root", "MPS_ROOT"])
def test_an_mps_config_takes_its_root_from_the_flag_or_env_var_as_serve_does(
    tmp_path: Path, how: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    config = write(tmp_path, MPS)
    args = ["check", str(config), "--simulate", "h100-8"]
    if how == "MPS_ROOT":
        monkeypatch.setenv("MPS_ROOT", "/run/nvidia/mps")
    else:
        args += ["--mps-root", "/run/nvidia/mps"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert yaml.safe_load(effective(out))["flags"]["mpsRoot"] == "/run/nvidia/mps"
    assert table(out) == {"nvidia.com/gpu": ["32", "32", "mps", "4"]}


def test_an_mps_config_without_a_root_names_the_flag_check_takes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("MPS_ROOT", raising=False)
    assert main(["check", str(write(tmp_path, MPS)), "--simulate", "h100-8"]) == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert "flags.mpsRoot" in line and "--mps-root/MPS_ROOT" in line
