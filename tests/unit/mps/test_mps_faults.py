"""MPS supervision when the control binary misbehaves: hangs, ignores quit, fails to start.

Each stand-in here is a small shell script written per test (no interpreter start, so the
tests stay fast); tests/fixtures/fake-mps-control covers the well-behaved binary.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kubegpu.devices.model import Gpu
from kubegpu.mps import PROBE, MpsDaemon, MpsError
from tests.unit.mps.conftest import pid_alive
from tests.waiting import WAIT

RESOURCE = "nvidia.com/gpu"
GPUS = (
    Gpu(
        index=0,
        uuid="GPU-0",
        minor=0,
        product="NVIDIA A10G",
        memory_mib=23028,
        pci_bus_id="0000:00:1e.0",
        numa_node=0,
        compute_capability=(8, 6),
    ),
)

# `-d` starts the "daemon" (a `sleep` that records its pid); without arguments it is a
# control client that answers one command, only while the daemon is alive.
_SCRIPT = """#!/bin/sh
dir="$CUDA_MPS_PIPE_DIRECTORY"
if [ "$1" = "-d" ]; then
  n=$(( $(cat "$dir/starts" 2>/dev/null || echo 0) + 1 ))
  echo "$n" > "$dir/starts"
  case " {fail_starts} " in *" $n "*) echo "stand-in: start $n refused" >&2; exit 3;; esac
  echo "$$" > "$dir/daemon.pid"
  {on_term}
  exec sleep 600
fi
echo "$$" > "$dir/client.pid"
{hang}
read -r line
echo "$line" >> "$dir/commands.log"
if ! kill -0 "$(cat "$dir/daemon.pid" 2>/dev/null)" 2>/dev/null; then
  echo "Cannot find MPS control daemon process" >&2
  exit 1
fi
case "$line" in
  {probe}) echo '{answer}' ;;
  quit) kill "$(cat "$dir/daemon.pid")" ;;
esac
"""


def stand_in(
    tmp_path: Path,
    *,
    answer: str = "25.0",
    ignore_quit: bool = False,
    hang: bool = False,
    fail_starts: tuple[int, ...] = (),
) -> str:
    script = tmp_path / "mps-control"
    script.write_text(
        _SCRIPT.format(
            fail_starts=" ".join(map(str, fail_starts)),
            on_term="trap '' TERM" if ignore_quit else "",
            hang="exec sleep 600" if hang else "",
            probe=PROBE,
            answer=answer,
        )
    )
    script.chmod(0o755)
    return str(script)


def daemon(tmp_path: Path, binary: str, **kw: Any) -> MpsDaemon:
    opts: dict[str, Any] = {
        "control_binary": binary,
        "ready_timeout": 5.0,
        "command_timeout": 2.0,
        "probe_interval": 0.01,
        "health_interval": 0.05,
        "backoff": (0.01, 0.05),
        **kw,
    }
    return MpsDaemon(RESOURCE, tmp_path / "mps", GPUS, 2, **opts)


def recorded_pid(d: MpsDaemon, name: str) -> int:
    return int((d.pipe_dir / name).read_text())


@pytest.fixture
def leftovers() -> Iterator[list[int]]:
    """Pids to kill if a test fails before the code under test reaps them."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        if pid_alive(pid):
            os.kill(pid, signal.SIGKILL)


async def test_a_daemon_that_ignores_quit_is_killed(
    tmp_path: Path, leftovers: list[int], caplog: pytest.LogCaptureFixture
) -> None:
    d = daemon(tmp_path, stand_in(tmp_path, ignore_quit=True), command_timeout=0.3)
    await d.start()
    pid = recorded_pid(d, "daemon.pid")
    leftovers.append(pid)
    assert d.ready
    with caplog.at_level(logging.WARNING, "kubegpu.mps"):
        await d.stop()
    assert (d.pipe_dir / "commands.log").read_text().splitlines()[-1] == "quit"
    assert "ignored quit; killing it" in caplog.text
    assert not pid_alive(pid)
    assert not d.ready


async def test_a_hung_control_client_is_killed_with_a_clear_error(
    tmp_path: Path, leftovers: list[int]
) -> None:
    d = daemon(tmp_path, stand_in(tmp_path, hang=True), command_timeout=0.2)
    d.pipe_dir.mkdir(parents=True)
    with pytest.raises(MpsError, match=rf"did not answer '{PROBE}' within 0\.2s"):
        await d.command(PROBE)
    client = recorded_pid(d, "client.pid")
    leftovers.append(client)
    assert not pid_alive(client)


async def test_an_answer_that_is_not_a_number_is_not_ready(
    tmp_path: Path, leftovers: list[int]
) -> None:
    """The real client prints the percentage once the server is up; anything else (a
    banner, an error on stdout) means not yet."""
    d = daemon(tmp_path, stand_in(tmp_path, answer="server starting"), ready_timeout=0.2)
    with pytest.raises(MpsError, match=r"not answering after 0\.2s"):
        await d.start()
    leftovers.append(recorded_pid(d, "daemon.pid"))
    assert not d.ready
    assert not pid_alive(recorded_pid(d, "daemon.pid"))  # asked to quit, and it did


async def test_a_binary_that_cannot_be_executed_is_a_clear_error(tmp_path: Path) -> None:
    """Found and executable, yet exec fails (an interpreter or loader that is not there,
    as with a binary from another driver build): one MpsError for start and commands."""
    script = tmp_path / "mps-control"
    script.write_text("#!/nonexistent/interpreter\n")
    script.chmod(0o755)
    d = daemon(tmp_path, str(script))
    with pytest.raises(MpsError, match=r"cannot run .*mps-control -d"):
        await d.start()
    with pytest.raises(MpsError, match=r"cannot run .*mps-control"):
        await d.command(PROBE)
    assert not d.ready


async def test_supervision_retries_a_failed_restart_with_backoff(
    tmp_path: Path, leftovers: list[int], caplog: pytest.LogCaptureFixture
) -> None:
    """The daemon dies; the first restart is refused (exit 3), the next one works."""
    changes: asyncio.Queue[bool] = asyncio.Queue()
    d = daemon(tmp_path, stand_in(tmp_path, fail_starts=(2,)), on_change=changes.put_nowait)
    await d.start()
    assert await asyncio.wait_for(changes.get(), WAIT) is True
    first = recorded_pid(d, "daemon.pid")
    leftovers.append(first)
    supervisor = asyncio.create_task(d.supervise())
    try:
        with caplog.at_level(logging.WARNING, "kubegpu.mps"):
            os.kill(first, signal.SIGKILL)
            assert await asyncio.wait_for(changes.get(), WAIT) is False
            assert await asyncio.wait_for(changes.get(), WAIT) is True
        second = recorded_pid(d, "daemon.pid")
        leftovers.append(second)
        assert (d.pipe_dir / "starts").read_text().strip() == "3"
        assert d.restarts == 1 and second != first and pid_alive(second)
        assert "exited with 3: stand-in: start 2 refused" in caplog.text
    finally:
        await d.stop()
        await asyncio.wait_for(supervisor, WAIT)
    assert not pid_alive(second)
