"""A zero-gap upgrade: a second `serve --handover` takes over from the one serving.

As a DaemonSet rolled with `maxSurge: 1, maxUnavailable: 0` does it: the new process starts
beside the old one, registers its own sockets, the old one hands over, and the old one gets
SIGTERM once the new one is ready. Throughout, a client calls Allocate as the kubelet does
(each new call on the newest endpoint the kubelet holds); no call may fail, the node's
allocatable never leaves 4, and the old process exits 0.
"""

from __future__ import annotations

from kubegpu.kubelet import KubeletEmulator
from tests.integration.hammer import Hammer
from tests.integration.test_serve import GPU, error_lines, run_to_end, serve_cmd, start
from tests.waiting import eventually

OLD = "kubegpu-nvidia.com-gpu.sock"
NEW = "kubegpu-nvidia.com-gpu+1.sock"


async def test_a_successor_takes_over_registration_without_a_gap(
    kubelet: KubeletEmulator,
) -> None:
    plugin_dir = kubelet.plugin_dir
    old = await start(serve_cmd(plugin_dir, "--simulate", "a10g-4"))
    new = None
    hammer = None
    history: list[tuple[int, int]] = []
    try:
        await kubelet.wait_for_resource(GPU, capacity=4, allocatable=4)

        def newest() -> str:
            # The kubelet allocates through the newest live registration.
            live = [name for name, alive in kubelet.endpoints(GPU).items() if alive]
            return live[-1] if live else OLD

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
    # Capacity and allocatable never moved: 4/4 from the first list to the last.
    assert history == [(4, 4)]
    # The old process registered once and never again after handing over.
    assert [r.endpoint for r in kubelet.registrations] == [OLD, NEW]


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
