"""A zero-gap upgrade: a second `serve --handover` takes over from the one serving.

As a DaemonSet rolled with `maxSurge: 1, maxUnavailable: 0` does it: the new process starts
beside the old one, registers its own sockets, the old one hands over, and the old one gets
SIGTERM once the new one is ready. Throughout, a client calls Allocate as the kubelet does
(each new call on the newest endpoint the kubelet registered); no call may fail and the
old process exits 0.

Under each kubelet the emulator models:

- 1.37+: the node's allocatable never leaves 4 and each process registers once.
- 1.36: the old process's stream ending makes the kubelet disconnect the successor (its
  stale `runClient`), so the devices read unhealthy until the successor registers again,
  which it does at once: the history holds exactly one unhealthy step, (4, 0), between
  (4, 4) and (4, 4), and the successor registers twice. How long that step lasts is
  measured by `make bench` (benchmarks/handover.py), never asserted here.
"""

from __future__ import annotations

import signal
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kubegpu.kubelet import KubeletEmulator
from tests.integration.hammer import Hammer
from tests.integration.test_serve import GPU, error_lines, run_to_end, serve_cmd, start
from tests.waiting import Kubelet, eventually

OLD = "kubegpu-nvidia.com-gpu.sock"
NEW = "kubegpu-nvidia.com-gpu+1.sock"


@pytest.fixture(params=["1.36", "1.37"])
async def each_kubelet(socket_dir: Path, request: pytest.FixtureRequest) -> AsyncIterator[Kubelet]:
    """The emulator as each kubelet it models (a short grace period, for `serve` tests)."""
    emulator = Kubelet(socket_dir / "dp", grace_period=0.5, version=request.param)
    await emulator.start()
    try:
        yield emulator
    finally:
        await emulator.stop()


async def test_a_successor_takes_over_registration_without_a_gap(
    each_kubelet: KubeletEmulator,
) -> None:
    kubelet = each_kubelet
    plugin_dir = kubelet.plugin_dir
    old = await start(serve_cmd(plugin_dir, "--simulate", "a10g-4"))
    new = None
    hammer = None
    history: list[tuple[int, int]] = []
    try:
        await kubelet.wait_for_resource(GPU, capacity=4, allocatable=4)

        def newest() -> str:
            # The kubelet allocates through the newest registration (in registration order).
            registered = list(kubelet.endpoints(GPU))
            return registered[-1] if registered else OLD

        hammer = Hammer(lambda: plugin_dir / newest(), sorted(kubelet.devices(GPU)))
        await eventually(lambda: hammer is not None and hammer.ok >= 100)

        new = await start(serve_cmd(plugin_dir, "--simulate", "a10g-4", "--handover"))
        await new.wait_for_line("took over registration")
        await old.wait_for_line("handed registration over")
        assert kubelet.endpoints(GPU) == {OLD: True, NEW: True}
        before = hammer.ok
        await eventually(lambda: hammer is not None and hammer.ok >= before + 100)

        # Two processes serve the directory: a third one has no socket slot to serve on.
        code, out = await run_to_end(serve_cmd(plugin_dir, "--simulate", "a10g-4", "--handover"))
        assert code == 1, out
        (line,) = error_lines(out)
        assert str(plugin_dir) in line and "2 processes" in line

        # The new pod is ready: the DaemonSet stops the old one.
        code, out = await old.stop()
        assert code == 0, out
        assert "stopped cleanly" in out
        await kubelet.wait_for(lambda: kubelet.endpoints(GPU) == {NEW: True})
        await kubelet.wait_for_resource(GPU, capacity=4, allocatable=4)
        assert not (plugin_dir / OLD).exists()
        before = hammer.ok
        await eventually(lambda: hammer is not None and hammer.ok >= before + 100)
        history = kubelet.history(GPU)
    finally:
        if hammer is not None:
            hammer.done = True
            await hammer.join()
        if new is not None:
            await new.stop()
        if old.proc.returncode is None:
            await old.stop()
    assert hammer is not None
    assert hammer.failures() == []
    assert {o.socket for o in hammer.outcomes} == {OLD, NEW}
    if kubelet.endpoint_store:
        # Capacity and allocatable never moved: 4/4 from the first list to the last.
        assert history == [(4, 4)]
        # The old process registered once and never again after handing over.
        assert [r.endpoint for r in kubelet.registrations] == [OLD, NEW]
    else:
        # The kubelet's stale disconnect made everything unhealthy once; the successor's
        # one registration more made it healthy again.
        assert history == [(4, 4), (4, 0), (4, 4)]
        assert [r.endpoint for r in kubelet.registrations] == [OLD, NEW, NEW]


async def test_the_old_process_registers_again_when_its_successor_dies_first(
    each_kubelet: KubeletEmulator,
) -> None:
    """The successor is killed right after it took over, before the old process got its
    SIGTERM: the old process owns the directory again and registers again, so the node's
    GPUs come back (under 1.36 the kubelet marked them unhealthy when the successor's
    stream ended), and the successor, restarted, takes over from it once more."""
    kubelet = each_kubelet
    plugin_dir = kubelet.plugin_dir
    cmd = serve_cmd(plugin_dir, "--simulate", "a10g-4")
    old = await start(cmd)
    new = again = None

    def registered() -> list[str]:
        return [r.endpoint for r in kubelet.registrations if r.ok]

    def describe() -> str:
        return f"registrations {registered()}, endpoints {kubelet.endpoints(GPU)}"

    try:
        await kubelet.wait_for_resource(GPU, capacity=4, allocatable=4)
        new = await start([*cmd, "--handover"])
        await new.wait_for_line("took over registration")
        code, _ = await new.stop(signal.SIGKILL)
        assert code == -signal.SIGKILL
        await kubelet.wait_for(lambda: registered() == [OLD, NEW, OLD], describe=describe)
        await kubelet.wait_for(lambda: kubelet.endpoints(GPU) == {OLD: True})
        await kubelet.wait_for_resource(GPU, capacity=4, allocatable=4)
        assert len((await kubelet.allocate(GPU, 2)).device_ids) == 2

        # The DaemonSet restarts the new pod: a handover as the first one.
        again = await start([*cmd, "--handover"])
        await again.wait_for_line("took over registration")
        await kubelet.wait_for(lambda: registered()[:4] == [OLD, NEW, OLD, NEW], describe=describe)
        code, out = await old.stop()
        assert code == 0, out
        assert out.count("handed registration over") == 2
        await kubelet.wait_for(lambda: kubelet.endpoints(GPU) == {NEW: True})
        await kubelet.wait_for_resource(GPU, capacity=4, allocatable=4)
    finally:
        for serve in (again, new, old):
            if serve is not None and serve.proc.returncode is None:
                await serve.stop()


async def test_without_handover_a_second_serve_is_still_refused_and_a_successor_is_not(
    kubelet: KubeletEmulator,
) -> None:
    """The handover changes nothing for a lone `serve`: it owns the directory, serves
    slot 0 and, with a successor gone, owns it again on the next start."""
    first = await start(serve_cmd(kubelet.plugin_dir, "--simulate", "t4-1"))
    try:
        await kubelet.wait_for_resource(GPU, capacity=1)
        code, out = await run_to_end(serve_cmd(kubelet.plugin_dir, "--simulate", "t4-1"))
        assert code == 1, out
        (line,) = error_lines(out)
        assert "in use by another kubegpu serve" in line and "--handover" in line
    finally:
        code, out = await first.stop()
    assert code == 0, out
