"""The supervisor: named tasks, failures logged with the name, a root failure stops all."""

from __future__ import annotations

import ast
import asyncio
import logging
from pathlib import Path

import pytest

import kubegpu
from kubegpu import supervisor
from kubegpu.supervisor import Supervisor, spawn, until_stopped
from tests.waiting import WAIT

SRC = Path(kubegpu.__file__).parent
#: Only the supervisor creates tasks. The kubelet emulator (kubegpu.kubelet) stands in
#: for another program, the kubelet, and keeps its own task set.
ALLOWED = {SRC / "supervisor.py"}
EXEMPT_DIRS = {SRC / "kubelet"}
TASK_MAKERS = {"create_task", "ensure_future"}


def _bare_task_calls(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        if name in TASK_MAKERS:
            found.append(f"{path.relative_to(SRC.parent)}:{node.lineno}: {name}")
    return found


def test_no_task_is_created_outside_the_supervisor() -> None:
    offenders = [
        hit
        for path in sorted(SRC.rglob("*.py"))
        if path not in ALLOWED and not any(d in path.parents for d in EXEMPT_DIRS)
        for hit in _bare_task_calls(path)
    ]
    assert offenders == [], "start tasks with kubegpu.supervisor.spawn/Supervisor.start"


def test_the_scan_finds_a_bare_create_task() -> None:
    module = SRC / "supervisor.py"
    assert _bare_task_calls(module), "the supervisor itself creates tasks: the scan must see it"


async def test_a_failing_root_stops_the_daemon_with_its_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    stop = asyncio.Event()
    helper_cancelled = asyncio.Event()

    async def helper() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            helper_cancelled.set()

    async def broken() -> None:
        raise RuntimeError("watch broke")

    with caplog.at_level(logging.ERROR, "kubegpu.supervisor"):
        async with Supervisor() as tasks:
            tasks.start("helper", helper())
            tasks.start("watcher", broken(), root=True)
            with pytest.raises(RuntimeError, match="watch broke"):
                await asyncio.wait_for(tasks.wait(stop), WAIT)
    assert helper_cancelled.is_set()
    assert "task 'watcher' failed: watch broke" in caplog.text


async def test_a_failing_helper_is_logged_by_name_and_does_not_stop(
    caplog: pytest.LogCaptureFixture,
) -> None:
    stop = asyncio.Event()

    async def broken() -> None:
        raise ValueError("registrar bug")

    async with Supervisor() as tasks:
        task = tasks.start("register nvidia.com/gpu", broken())
        await asyncio.gather(task, return_exceptions=True)
        stop.set()
        await asyncio.wait_for(tasks.wait(stop), WAIT)  # returns: no root failed
    assert "task 'register nvidia.com/gpu' failed: registrar bug" in caplog.text


async def test_spawn_uses_the_running_supervisor_and_stop_cancels_everything() -> None:
    async with Supervisor() as tasks:
        assert supervisor.current() is tasks
        spawned = spawn("inner", asyncio.Event().wait())
        assert tasks.tasks == {"inner": False}
    assert spawned.cancelled()
    assert supervisor.current() is not tasks


async def test_until_stopped_abandons_work_when_stop_is_set() -> None:
    stop = asyncio.Event()
    reached = asyncio.Event()

    async def slow() -> None:
        reached.set()
        await asyncio.Event().wait()

    waiting = spawn("start-up", until_stopped("slow", slow(), stop))
    await asyncio.wait_for(reached.wait(), WAIT)
    stop.set()
    assert await asyncio.wait_for(waiting, WAIT) is False

    async def quick() -> None:
        raise LookupError("no config")

    with pytest.raises(LookupError):
        await until_stopped("quick", quick(), asyncio.Event())
