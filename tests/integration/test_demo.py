"""`kubegpu demo` runs its whole story on every shipped preset, whatever the node's size."""

from __future__ import annotations

import pytest

from kubegpu.cli import main
from kubegpu.devices.simulated import PRESETS


@pytest.mark.parametrize("preset", PRESETS)
def test_demo_runs_to_completion_on_every_preset(
    preset: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["demo", "--simulate", preset]) == 0
    out = capsys.readouterr().out
    assert f"simulated node '{preset}'" in out
    assert "re-registered" in out and "keeps its GPUs across the restart" in out
    assert "its socket is gone" in out
    assert "demo finished" in out


def test_demo_on_an_unknown_preset_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--simulate", "a100-40gb"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "a100-40gb" in err and "preset" in err
