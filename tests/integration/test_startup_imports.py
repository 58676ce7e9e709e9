"""What `kubegpu serve` imports: start-up time and RSS pay for every module loaded before
registering, so the clients of outside worlds (Kubernetes, and kubegpu's own adapter to
it), the parts only some runs need (the labeller, PyYAML without a config file) and the
parts only some requests need (placement) load when first used, not at import.

Each probe runs in a fresh interpreter: `sys.modules` of the test process is shared with
every other test and says nothing.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import pytest

from tests.waiting import WAIT, Kubelet

GPU = "nvidia.com/gpu"

#: Runs `kubegpu <args>` as the console script does and, at exit, writes which of the
#: watched modules were loaded. argv: report file, watched names (comma-separated), args.
PROBE = """
import atexit, runpy, sys
report, watched = sys.argv[1], sys.argv[2].split(",")
def write():
    with open(report, "w") as f:
        f.write(" ".join(m for m in watched if m in sys.modules))
atexit.register(write)
sys.argv = ["kubegpu", *sys.argv[3:]]
runpy.run_module("kubegpu.cli", run_name="__main__", alter_sys=True)
"""


def _env(**extra: str) -> dict[str, str]:
    drop = ("CONFIG_FILE", "MIG_STRATEGY", "NODE_NAME", "METRICS_PORT", "HEALTH_PORT")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(extra)
    return env


async def _loaded_by(code: str, *args: str, watched: tuple[str, ...], report: Path) -> set[str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", code, str(report), ",".join(watched), *args, env=_env()
    )
    assert await asyncio.wait_for(proc.wait(), WAIT) == 0
    return set(report.read_text().split())


async def test_importing_the_daemon_loads_no_kubernetes_labeller_yaml_or_prometheus(
    tmp_path: Path,
) -> None:
    report = tmp_path / "loaded"
    code = (
        "import sys; report, watched = sys.argv[1], sys.argv[2].split(','); "
        "import kubegpu.daemon; "
        "open(report, 'w').write(' '.join(m for m in watched if m in sys.modules))"
    )
    watched = (
        "kubegpu.daemon",
        "kubernetes",
        "kubegpu.kube",
        "kubegpu.labeller",
        "kubegpu.topology",
        "yaml",
        "prometheus_client",
        "difflib",
    )
    loaded = await _loaded_by(code, watched=watched, report=report)
    # The first name proves the probe ran; the others must not have come with it.
    assert loaded == {"kubegpu.daemon"}


@pytest.mark.parametrize(
    ("node_name", "allocate"), [(None, True), ("node-a", True), (None, False), ("node-a", False)]
)
async def test_serve_registers_and_allocates_without_the_kubernetes_client(
    socket_dir: Path, node_name: str | None, allocate: bool
) -> None:
    """`serve` up to registered, one Allocate and a clean stop load no Kubernetes client,
    nor kubegpu's adapter to it, also with NODE_NAME set (events on): both load with the
    first Event sent. Nor prometheus_client without a metrics port: it loads on the first
    scrape. Placement (`kubegpu.topology`) loads with the first GetPreferredAllocation,
    which the kubelet sends before Allocate, and not before. Nor difflib: the config
    loader needs it only to suggest a fix for an unknown key. Nor pydantic, which other
    installed packages may bring: the config schema is kubegpu's own (`config.schema`).
    Nor `importlib.resources`: the simulated presets are read by path."""
    kubelet = Kubelet(socket_dir / "dp", grace_period=0.5)
    await kubelet.start()
    report = socket_dir / "loaded"
    watched = (
        "kubegpu.daemon",
        "kubernetes",
        "kubegpu.kube",
        "kubegpu.topology",
        "prometheus_client",
        "difflib",
        "pydantic",
        "importlib.resources",
    )
    args = ["serve", "--simulate", "a10g-4", "--device-plugin-path", str(kubelet.plugin_dir)]
    env = _env(**({"NODE_NAME": node_name} if node_name else {}))
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        PROBE,
        str(report),
        ",".join(watched),
        *args,
        env=env,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        await kubelet.wait_for_resource(GPU, capacity=4, allocatable=4)
        if allocate:
            await kubelet.allocate(GPU, 1, pod="p")
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = await asyncio.wait_for(proc.communicate(), WAIT)
        await kubelet.stop()
    assert proc.returncode == 0, err.decode()
    placement = {"kubegpu.topology"} if allocate else set()
    assert set(report.read_text().split()) == {"kubegpu.daemon", *placement}


def test_events_still_answers_to_the_old_name_of_kube_errors() -> None:
    """`events.EventError` (before `kubegpu.kube`) resolves on use, to `KubeError`, now that
    importing events no longer imports the adapter; other missing names still fail."""
    from kubegpu import events
    from kubegpu.kube import KubeError

    assert events.EventError is KubeError
    with pytest.raises(AttributeError, match="no attribute 'NoSuchName'"):
        _ = events.NoSuchName
