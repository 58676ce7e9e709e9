"""`make bench`'s sections measure what they say on today's tree, on a loaded machine.

No figure is judged here (speed is `make bench`'s business): these check that a section
can run at all, with the smallest counts, and that its waits do not give up while a slow
machine is still getting there.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from benchmarks import harness, watch
from benchmarks.clock import LoopClock
from kubegpu.kubelet import KubeletEmulator


async def test_the_socket_deletion_benchmark_runs_beside_the_handover_directory() -> None:
    # `serve` keeps a `kubegpu-handover` lock directory beside its socket: the benchmark
    # must delete the socket the plugin registered, whatever else the directory holds.
    figures = await watch.bench_socket_deleted(1)
    assert figures["socket_deleted_n"] == 1
    assert figures["socket_deleted_busy_n"] == 1


async def test_waiting_for_registration_outlasts_a_slow_start(socket_dir: Path) -> None:
    """A first `serve` that compiles its bytecode on a loaded machine has taken more than
    30 s to register: the benchmark keeps waiting (the loop's clock is moved on, no real
    wait), and still gives up, saying so, at its deadline."""
    kubelet = KubeletEmulator(socket_dir / "dp")
    await kubelet.start()
    try:
        # A process that stays up and never registers: a `serve` still starting.
        args = [sys.executable, "-c", "import sys; sys.stdin.read()"]
        async with harness.child(args, socket_dir / "log", stdin_pipe=True) as slow:
            with LoopClock() as clock:
                waiting = asyncio.ensure_future(harness.wait_registered(kubelet, None, slow))
                await clock.advance(60, step=5)
                assert not waiting.done()
                await clock.advance(harness.DEADLINE_S, step=30)
                with pytest.raises(RuntimeError, match=r"did not hold .* within 300 s"):
                    await waiting
    finally:
        await kubelet.stop()
