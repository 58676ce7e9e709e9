"""`make bench` (benchmarks/run.py): a section that cannot measure is reported, the others
still run, and the exit status says so."""

from __future__ import annotations

import asyncio
import json

import pytest

from benchmarks import run


async def _measures(plan: run.Plan) -> run.Figures:
    return {"idle_cpu_pct": 0.0, "idle_window_s": 10.0}


async def _breaks(plan: run.Plan) -> run.Figures:
    raise RuntimeError("the kubelet emulator did not hold 8 healthy nvidia.com/gpu")


async def _hangs(plan: run.Plan) -> run.Figures:
    await asyncio.Event().wait()
    return {}


async def test_a_failing_or_hung_section_is_reported_and_the_others_still_run(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    sections = (
        ("broken", "a section that raises", _breaks),
        ("hung", "a section that never ends", _hangs),
        ("fine", "a section that measures", _measures),
    )
    monkeypatch.setattr(run, "SECTIONS", sections)
    monkeypatch.setattr(run, "SECTION_DEADLINE_S", 0.5)
    assert await run._sections(run.QUICK, []) == 1
    out = capsys.readouterr().out
    assert "FAILED section broken: RuntimeError: the kubelet emulator did not hold" in out
    assert "FAILED section hung: still running after 0.5 s" in out
    figures = json.loads(out.strip().splitlines()[-1])
    assert figures["idle_cpu_pct"] == 0.0  # the section after the failures ran
    assert set(figures["failed_sections"]) == {"broken", "hung"}


async def test_only_runs_the_sections_named(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(run, "SECTIONS", (("broken", "", _breaks), ("fine", "", _measures)))
    assert await run._sections(run.FULL, ["fine"]) == 0
    assert "FAILED" not in capsys.readouterr().out
