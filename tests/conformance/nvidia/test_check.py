"""NVIDIA's README and chart config examples through `kubegpu check`, as NVIDIA's chart runs them.

NVIDIA's chart starts its plugin with `MPS_ROOT` set from `mps.root` (default
`/run/nvidia/mps`); the plugin itself has no default for `--mps-root` and refuses an MPS
config without one ("using MPS requires --mps-root to be specified", `validateFlags` in
`cmd/nvidia-device-plugin/main.go` of NVIDIA/k8s-device-plugin v0.20.0). `check` takes
the same `--mps-root`/`MPS_ROOT` as `serve`, so every example passes as the chart runs it,
and the MPS ones without a root are refused as NVIDIA's plugin refuses them, in one line
naming both ways to give it.

The examples are read, unmodified, from ``../shared/peer-data/nvidia/readme-configs``; each
file's `# override: KEY=VALUE` header says what the chart sets beside it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from kubegpu.cli import main
from tests.conformance.origin import PEER_DATA, needs_peer_data, peer_file

README_CONFIGS = PEER_DATA / "nvidia" / "readme-configs"
MPS_EXAMPLES = ["readme-l552-mps.yaml", "readme-l576-mps-rename.yaml"]
#: The env var the chart sets for each config key an example's header overrides.
CHART_ENV = {"flags.mpsRoot": "MPS_ROOT"}


def _examples() -> list[str]:
    return sorted(p.name for p in README_CONFIGS.glob("*.yaml")) if README_CONFIGS.is_dir() else []


def _chart_env(path: Path) -> dict[str, str]:
    """The env vars NVIDIA's chart sets beside this example (its `# override:` lines)."""
    found = re.findall(r"^# override: (\S+)=(\S+)$", path.read_text(), re.MULTILINE)
    return {CHART_ENV[key]: value for key, value in found}


def _effective(out: str) -> dict[str, object]:
    """The effective config `check` printed: the YAML from its `# effective config` line
    to the first blank line."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("# effective config"))
    end = lines.index("", start) if "" in lines[start:] else len(lines)
    value: dict[str, object] = yaml.safe_load("\n".join(lines[start:end]))
    return value


@pytest.fixture(autouse=True)
def _no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("SIMULATE", "MPS_ROOT", *CHART_ENV.values()):
        monkeypatch.delenv(name, raising=False)


@needs_peer_data
@pytest.mark.parametrize("name", _examples())
def test_every_example_passes_check_with_the_env_nvidias_chart_sets(
    name: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path = peer_file("nvidia", "readme-configs", name)
    for env, value in _chart_env(path).items():
        monkeypatch.setenv(env, value)
    status = main(["check", str(path), "--simulate", "h100-8"])
    captured = capsys.readouterr()
    assert status == 0, captured.err
    assert f"{path}: valid" in captured.out


@needs_peer_data
@pytest.mark.parametrize("name", MPS_EXAMPLES)
@pytest.mark.parametrize("how", ["flag", "env"])
def test_the_mps_examples_pass_with_an_mps_root_and_share_by_mps(
    name: str, how: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path = peer_file("nvidia", "readme-configs", name)
    args = ["check", str(path), "--simulate", "h100-8"]
    if how == "flag":
        args += ["--mps-root", "/run/nvidia/mps"]
    else:
        monkeypatch.setenv("MPS_ROOT", "/run/nvidia/mps")
    assert main(args) == 0
    out = capsys.readouterr().out
    flags = _effective(out)["flags"]
    assert isinstance(flags, dict) and flags["mpsRoot"] == "/run/nvidia/mps"
    rows = [line.split() for line in out.splitlines() if " mps " in f" {line} "]
    assert rows and all(row[-1] == "10" for row in rows), out  # replicas: 10 in both


@needs_peer_data
@pytest.mark.parametrize("name", MPS_EXAMPLES)
def test_the_mps_examples_without_a_root_are_refused_as_nvidia_refuses_them(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """NVIDIA's plugin refuses them without `--mps-root`; so does `check`, in one line
    naming the key and the option and env var that set it."""
    path = peer_file("nvidia", "readme-configs", name)
    assert main(["check", str(path), "--simulate", "h100-8"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    (line,) = captured.err.splitlines()
    assert "flags.mpsRoot" in line and "--mps-root/MPS_ROOT" in line


def test_check_takes_mps_root_as_serve_does() -> None:
    """One option, one meaning: the flag and env var of `serve` (and NVIDIA's plugin)."""
    from kubegpu.cli.check import CHECK_KEYS
    from kubegpu.cli.serve import SERVE_KEYS

    assert CHECK_KEYS["mps_root"] == SERVE_KEYS["mps_root"] == "flags.mpsRoot"
