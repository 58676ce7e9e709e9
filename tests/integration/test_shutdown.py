"""SIGTERM while the kubelet calls Allocate: every call that reached the plugin is answered.

A call "reached the plugin" here when it started before the test sent SIGTERM: the client
loops stop starting calls at that moment, as a kubelet does once the plugin has withdrawn
(its ListAndWatch ended, so it admits no pod onto the resource). Each of those calls must
end OK, not CANCELLED (taken by gRPC, never handed to the servicer) nor UNAVAILABLE (the
socket closed under it); the process then exits 0.
"""

from __future__ import annotations

import asyncio
import signal

from kubegpu.kubelet import KubeletEmulator
from tests.integration.hammer import Hammer
from tests.integration.test_serve import GPU, serve_cmd, start
from tests.waiting import WAIT, eventually


async def one_round(kubelet: KubeletEmulator) -> tuple[int, str, Hammer]:
    """Start `serve`, hammer Allocate, SIGTERM it mid-stream; exit code, output, calls."""
    serve = await start(serve_cmd(kubelet.plugin_dir, "--simulate", "a10g-4"))
    socket = kubelet.plugin_dir / "kubegpu-nvidia.com-gpu.sock"
    hammer: Hammer | None = None
    try:
        await kubelet.wait_for_resource(GPU, capacity=4, allocatable=4)
        hammer = Hammer(lambda: socket, sorted(kubelet.devices(GPU)), clients=8)
        # Enough calls answered that every client is mid-stream when the signal comes.
        await eventually(lambda: hammer is not None and hammer.ok >= 200)
    finally:
        if hammer is not None:
            hammer.signalled = True  # set and sent in one step: no call starts between
        serve.proc.send_signal(signal.SIGTERM)
        code = await asyncio.wait_for(serve.proc.wait(), WAIT)
        await asyncio.wait_for(serve._reader, WAIT)
        if hammer is not None:
            await hammer.join()
    return code, "".join(serve.lines), hammer


async def test_sigterm_answers_every_allocate_that_reached_the_plugin(
    kubelet: KubeletEmulator,
) -> None:
    # Several rounds: which calls gRPC holds unhanded at the signal is a matter of timing.
    for _ in range(5):
        code, out, hammer = await one_round(kubelet)
        assert code == 0, out
        assert hammer.failures() == [], out
        assert all(o.before_signal for o in hammer.outcomes)
        await kubelet.wait_for(lambda: kubelet.allocatable(GPU) == 0)
