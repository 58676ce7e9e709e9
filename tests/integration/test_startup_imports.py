"""`kubegpu serve` as a node runs it: a fresh process that starts, registers and allocates
with no Kubernetes API in reach (the API is only needed for Node events and the
named-config label, and neither may hold up serving), then stops cleanly on SIGTERM.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path

import pytest

from tests.waiting import WAIT, Kubelet

GPU = "nvidia.com/gpu"


def _unreachable_cluster(directory: Path) -> Path:
    """A kubeconfig whose API server does not listen (nothing answers on port 1)."""
    path = directory / "kubeconfig"
    path.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:1"}}],
                "users": [{"name": "u", "user": {"token": "t"}}],
                "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "x",
            }
        )
    )
    return path


def _env(**extra: str) -> dict[str, str]:
    drop = (
        "CONFIG_FILE",
        "MIG_STRATEGY",
        "NODE_NAME",
        "METRICS_PORT",
        "HEALTH_PORT",
        "KUBERNETES_SERVICE_HOST",
        "KUBERNETES_SERVICE_PORT",
    )
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(extra)
    return env


@pytest.mark.parametrize(
    ("node_name", "allocate"), [(None, True), ("node-a", True), (None, False), ("node-a", False)]
)
async def test_serve_registers_and_allocates_without_a_reachable_kubernetes_api(
    socket_dir: Path, node_name: str | None, allocate: bool
) -> None:
    """Also with NODE_NAME set, which turns Node events on: the API is first reached when
    an event is sent, never on the way to registering or answering the kubelet."""
    kubelet = Kubelet(socket_dir / "dp", grace_period=0.5)
    await kubelet.start()
    args = ["serve", "--simulate", "a10g-4", "--device-plugin-path", str(kubelet.plugin_dir)]
    env = _env(
        KUBECONFIG=str(_unreachable_cluster(socket_dir)),
        **({"NODE_NAME": node_name} if node_name else {}),
    )
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "kubegpu.cli",
        *args,
        env=env,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        await kubelet.wait_for_resource(GPU, capacity=4, allocatable=4)
        if allocate:
            allocation = await kubelet.allocate(GPU, 1, pod="p")
            assert len(allocation.device_ids) == 1
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = await asyncio.wait_for(proc.communicate(), WAIT)
        await kubelet.stop()
    assert proc.returncode == 0, err.decode()
    assert "Traceback" not in err.decode()


def test_events_still_answers_to_the_old_name_of_kube_errors() -> None:
    """`events.EventError`, the name of events' failures before `kubegpu.kube`, is
    `KubeError`, so code written against the old name keeps catching them."""
    from kubegpu import events
    from kubegpu.kube import KubeError

    assert events.EventError is KubeError
