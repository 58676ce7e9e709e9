"""`make bench`'s sections measure what they say on today's tree, on a loaded machine.

No figure is judged here (speed is `make bench`'s business): these check that a section
can run at all, with the smallest counts, and that its waits do not give up while a slow
machine is still getting there.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import pytest

from benchmarks import api_budget, dra, harness, startup, watch
from benchmarks.clock import LoopClock
from benchmarks.run import STORM_WRITES, table
from kubegpu.dra.publisher import RESYNC_S
from kubegpu.dra.stale import INTERVAL_S as STALE_CHECK_S
from kubegpu.kubelet import KubeletEmulator
from kubegpu.mode import Mode


async def test_the_socket_deletion_benchmark_runs_beside_the_handover_directory() -> None:
    # `serve` keeps a `kubegpu-handover` lock directory beside its socket: the benchmark
    # must delete the socket the plugin registered, whatever else the directory holds.
    figures = await watch.bench_socket_deleted(1)
    assert figures["socket_deleted_n"] == 1
    assert figures["socket_deleted_busy_n"] == 1


async def test_an_hour_on_the_loops_clock_holds_every_turn_of_a_task_whose_work_is_slow() -> None:
    """A periodic task whose work takes real time in a thread (a slice resync on a loaded
    machine) gets as many turns in an hour of the loop's clock as its period allows: the
    clock does not move on while that work runs."""
    turns = 0

    async def every_ten_minutes() -> None:
        nonlocal turns
        while True:
            await asyncio.sleep(600)
            turns += 1
            # Work that takes real time, many settle periods long, as a sync under load.
            await asyncio.to_thread(time.sleep, 0.05)

    with LoopClock() as clock:
        task = asyncio.ensure_future(every_ten_minutes())
        await asyncio.sleep(0)  # the task arms its first timer at the hour's start
        try:
            await clock.advance(3600, step=10, settle=0.005)
        finally:
            task.cancel()
    assert turns == 6


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


async def test_the_dra_start_benchmark_times_fresh_processes_to_the_kubelets_registration() -> None:
    """`serve --mode dra` as a node runs it, registered by the DRA kubelet's plugin
    watcher; its figures reach the table beside the device plugin's targets."""
    nodes = await startup.bench_fresh_dra(["a10g-4"], trials=1)
    figures = nodes["a10g-4"]
    assert (figures["gpus"], figures["processes"]) == (4, 1)
    assert figures["start_to_registered_s"]["median"] > 0
    assert figures["rss_mib"]["median"] > 0
    assert figures["rss_settled_mib"]["median"] > 0
    rows = table({"dra_nodes": nodes}).splitlines()
    settled = f"RSS {startup.SETTLED_S:g} s after registration"
    assert any(row.strip().startswith(settled) for row in rows)
    assert [row.split("(")[0].strip() for row in rows if row.startswith("DRA: ")] == [
        "DRA: start → registered",
        "DRA: RSS after registration",
    ]


async def test_the_dra_benchmark_calls_the_node_over_its_socket_from_another_process() -> None:
    figures = (await dra.bench_dra(claims=2, warmup=1))["dra"]
    assert figures["claims"] == 2
    assert figures["load_failures"] == 0
    # One API read per prepared claim, in the node's process: the client is elsewhere.
    assert figures["api_requests"]["get resourceclaim"] == 5


@pytest.mark.parametrize("mode", api_budget.MODES)
async def test_the_api_budget_counts_what_a_health_flap_sends(mode: Mode) -> None:
    counts = await api_budget.measure(mode, "health_flap", api_budget.health_flap)
    # GPUUnhealthy, then GPUHealthy; in DRA mode the slices are written again each time.
    assert counts["create event"] == 2
    assert counts.get("replace resourceslice", 0) == (2 if mode == "dra" else 0)


async def test_a_flap_storm_costs_the_api_a_few_slice_writes_and_no_list() -> None:
    """Each health change taken in was its own list and replace: 1,000 flap events made
    1,003 slice writes and 1,270 lists. Writes are paced now, and carry no list."""
    counts = await api_budget.measure(Mode.DRA, "flap_storm", api_budget.flap_storm(100))
    assert counts.get("replace resourceslice", 0) <= STORM_WRITES
    assert "list resourceslices" not in counts


async def test_the_api_budget_moves_the_loops_clock_through_a_steady_hour() -> None:
    counts = await api_budget.measure(Mode.DRA, "steady_hour", api_budget.steady_hour)
    # The publisher compares its slices with the API every RESYNC_S, the check for stale
    # device-plugin resources reads the Node every INTERVAL_S, and nothing else is due.
    assert counts == {
        "list resourceslices": int(3600 // RESYNC_S),
        "get node": int(3600 // STALE_CHECK_S),
    }


async def test_the_sized_benchmark_prepares_claims_that_each_start_an_mps_daemon() -> None:
    # bench_sized raises when a prepare or unprepare answers an error, so a sized claim
    # that could not get its daemon and limits fails here.
    figures = (await dra.bench_sized(claims=2, warmup=1))["dra_sized"]
    assert figures["claims"] == 2
    assert set(figures) >= {"prepare_cold_ms", "prepare_running_ms", "unprepare_ms"}
