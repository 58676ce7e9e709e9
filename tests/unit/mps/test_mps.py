"""MPS daemon supervision against a stand-in control binary (tests/fixtures/fake-mps-control)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from kubegpu.allocation import MountSpec
from kubegpu.config import Config, parse_config
from kubegpu.devices.model import Gpu, Inventory
from kubegpu.errors import ConfigError
from kubegpu.mps import MpsDaemon, MpsError, MpsReconciler, container_edits
from kubegpu.nvidia_paths import MPS_CONTAINER_PIPE_DIR as CONTAINER_PIPE_DIR
from kubegpu.state import NodeStore
from kubegpu.supervisor import Supervisor
from tests.unit.mps.conftest import FAKE, commands, pid_alive
from tests.waiting import WAIT

# The stand-in runs once per MPS command: start it on this interpreter, not a pyenv shim.
pytestmark = pytest.mark.usefixtures("python3_on_path")
RESOURCE = "nvidia.com/gpu.shared"


def gpu(index: int, memory_mib: int = 81559) -> Gpu:
    return Gpu(
        index=index,
        uuid=f"GPU-{index}",
        minor=index,
        product="NVIDIA H100 80GB HBM3",
        memory_mib=memory_mib,
        pci_bus_id=f"0000:0{index}:00.0",
        numa_node=0,
        compute_capability=(9, 0),
    )


GPUS = (gpu(0), gpu(1, memory_mib=40000))
INVENTORY = Inventory(gpus=GPUS)


def daemon(tmp_path: Path, env: dict[str, str] | None = None, **kw: Any) -> MpsDaemon:
    opts: dict[str, Any] = {
        "control_binary": FAKE,
        "env": env or {},
        "ready_timeout": 10.0,
        "probe_interval": 0.01,
        "health_interval": 0.05,
        "backoff": (0.01, 0.05),
        **kw,
    }
    return MpsDaemon(RESOURCE, tmp_path / "mps", GPUS, 4, **opts)


def after_probes(d: MpsDaemon) -> tuple[int, list[str]]:
    """(number of leading readiness probes, the commands after them)."""
    log = commands(d)
    n = next(i for i, c in enumerate(log) if c != "get_default_active_thread_percentage")
    return n, log[n:]


def daemon_pid(d: MpsDaemon) -> int:
    return int((d.pipe_dir / "daemon.pid").read_text())


@pytest.fixture
async def cleanup() -> AsyncIterator[list[MpsDaemon]]:
    started: list[MpsDaemon] = []
    yield started
    for d in started:
        await d.stop()


def ready_changes() -> tuple[asyncio.Queue[bool], Callable[[bool], None]]:
    queue: asyncio.Queue[bool] = asyncio.Queue()
    return queue, queue.put_nowait


async def test_start_sets_env_dirs_and_default_limits(
    tmp_path: Path, cleanup: list[MpsDaemon]
) -> None:
    d = daemon(tmp_path)
    cleanup.append(d)
    assert not d.ready
    await d.start()
    assert d.ready
    assert d.pipe_dir == tmp_path / "mps" / "nvidia.com_gpu.shared" / "pipe"
    assert d.log_dir == tmp_path / "mps" / "nvidia.com_gpu.shared" / "log"
    env = json.loads((d.pipe_dir / "daemon.env").read_text())
    assert env == {
        "CUDA_VISIBLE_DEVICES": "GPU-0,GPU-1",
        "CUDA_MPS_PIPE_DIRECTORY": str(d.pipe_dir),
        "CUDA_MPS_LOG_DIRECTORY": str(d.log_dir),
    }
    # probe first; limits only once the daemon answers: total/replicas, 100/replicas
    probes, rest = after_probes(d)
    assert probes >= 1
    assert rest == [
        "set_default_device_pinned_mem_limit GPU-0 20389M",
        "set_default_device_pinned_mem_limit GPU-1 10000M",
        "set_default_active_thread_percentage 25",
    ]
    assert await d.command("get_default_active_thread_percentage") == "25.0"


async def test_explicit_limits(tmp_path: Path, cleanup: list[MpsDaemon]) -> None:
    d = daemon(tmp_path, memory_limit_mib=5120, active_thread_percentage=60)
    cleanup.append(d)
    await d.start()
    assert after_probes(d)[1] == [
        "set_default_device_pinned_mem_limit GPU-0 5120M",
        "set_default_device_pinned_mem_limit GPU-1 5120M",
        "set_default_active_thread_percentage 60",
    ]


async def test_readiness_waits_for_the_daemon_to_answer(
    tmp_path: Path, cleanup: list[MpsDaemon]
) -> None:
    changes, on_change = ready_changes()
    d = daemon(tmp_path, env={"FAKE_MPS_READY_AFTER": "4"}, on_change=on_change)
    cleanup.append(d)
    await d.start()
    probes, rest = after_probes(d)
    assert probes >= 4  # three refused before the daemon said it was up
    assert len(rest) == 3 and all(c.startswith("set_") for c in rest)
    assert changes.get_nowait() is True and changes.empty()


async def test_never_ready_times_out_and_cleans_up(tmp_path: Path) -> None:
    d = daemon(tmp_path, env={"FAKE_MPS_READY_AFTER": "1000000"}, ready_timeout=0.3)
    with pytest.raises(MpsError, match=r"not answering after 0\.3s"):
        await d.start()
    assert not d.ready
    assert commands(d)[-1] == "quit"
    assert not (d.pipe_dir / "daemon.pid").exists()
    assert not any(c.startswith("set_") for c in commands(d))


async def test_daemon_start_failure_reports_its_stderr(tmp_path: Path) -> None:
    d = daemon(tmp_path, env={"FAKE_MPS_FAIL_START": "3"})
    with pytest.raises(MpsError, match=r"exited with 3: fake-mps-control: cannot start"):
        await d.start()
    assert not d.ready


@pytest.mark.parametrize("binary", ["/nonexistent/nvidia-cuda-mps-control", "no-such-mps-binary"])
async def test_bad_binary_is_a_clear_error(tmp_path: Path, binary: str) -> None:
    d = daemon(tmp_path, control_binary=binary)
    with pytest.raises(
        MpsError, match=r"not found or not executable.*ships with the NVIDIA driver"
    ):
        await d.start()


async def test_non_executable_binary(tmp_path: Path) -> None:
    script = tmp_path / "mps-control"
    script.write_text("#!/bin/sh\n")
    script.chmod(0o644)
    with pytest.raises(MpsError, match="not executable"):
        await daemon(tmp_path, control_binary=str(script)).start()


async def test_stop_sends_quit_and_the_daemon_exits(tmp_path: Path) -> None:
    changes, on_change = ready_changes()
    d = daemon(tmp_path, on_change=on_change)
    await d.start()
    pid = daemon_pid(d)
    await d.stop()
    assert commands(d)[-1] == "quit"
    assert not d.ready
    assert not pid_alive(pid)
    assert [changes.get_nowait(), changes.get_nowait()] == [True, False]
    await d.stop()  # idempotent


@pytest.mark.parametrize("fork", [False, True], ids=["foreground", "forking"])
async def test_supervise_restarts_a_killed_daemon(tmp_path: Path, fork: bool) -> None:
    changes, on_change = ready_changes()
    env = {"FAKE_MPS_FORK": "1"} if fork else {}
    d = daemon(tmp_path, env=env, on_change=on_change)
    await d.start()
    assert await asyncio.wait_for(changes.get(), WAIT) is True
    supervisor = asyncio.create_task(d.supervise())
    try:
        first = daemon_pid(d)
        os.kill(first, signal.SIGKILL)
        assert await asyncio.wait_for(changes.get(), WAIT) is False
        assert await asyncio.wait_for(changes.get(), WAIT) is True
        assert d.ready
        assert d.restarts == 1
        second = daemon_pid(d)
        assert second != first and pid_alive(second)
        # the restarted daemon is configured again
        assert commands(d)[-1] == "set_default_active_thread_percentage 25"
    finally:
        await d.stop()
        await asyncio.wait_for(supervisor, WAIT)
    assert not pid_alive(second)
    assert not (d.pipe_dir / "daemon.pid").exists()


async def test_stop_ends_supervision_without_restart(tmp_path: Path) -> None:
    d = daemon(tmp_path)
    await d.start()
    supervisor = asyncio.create_task(d.supervise())
    await d.stop()
    await asyncio.wait_for(supervisor, WAIT)
    assert d.restarts == 0
    assert not d.ready


def test_container_edits_with_another_shm_dir() -> None:
    edits = container_edits(RESOURCE, "/run/nvidia/mps", "/run/nvidia/mps/shm")
    assert dict(edits.envs) == {"CUDA_MPS_PIPE_DIRECTORY": CONTAINER_PIPE_DIR}
    assert edits.mounts == (
        MountSpec(CONTAINER_PIPE_DIR, "/run/nvidia/mps/nvidia.com_gpu.shared/pipe"),
        MountSpec("/dev/shm", "/run/nvidia/mps/shm"),
    )


def test_container_edits_follow_from_the_root_alone_and_match_the_daemons(
    tmp_path: Path,
) -> None:
    """Allocate computes the mounts from `flags.mpsRoot`; they are the ones the daemon
    started under that root serves (its pipe directory, the host's /dev/shm)."""
    edits = container_edits(RESOURCE, "/run/nvidia/mps")
    assert dict(edits.envs) == {"CUDA_MPS_PIPE_DIRECTORY": CONTAINER_PIPE_DIR}
    assert edits.mounts == (
        MountSpec(CONTAINER_PIPE_DIR, "/run/nvidia/mps/nvidia.com_gpu.shared/pipe"),
        MountSpec("/dev/shm", "/dev/shm"),
    )
    d = MpsDaemon(RESOURCE, tmp_path, GPUS, 2)
    assert container_edits(RESOURCE, tmp_path).mounts[0].host_path == str(d.pipe_dir)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"gpus": ()}, "has no GPUs"),
        ({"replicas": 0}, "replicas must be >= 1"),
        ({"active_thread_percentage": 101}, "activeThreadPercentage must be 1..100"),
        ({"memory_limit_mib": 0}, "memoryLimit must be positive"),
    ],
)
def test_invalid_settings(tmp_path: Path, kwargs: dict[str, Any], message: str) -> None:
    args: dict[str, Any] = {"gpus": GPUS, "replicas": 2, **kwargs}
    with pytest.raises(ConfigError, match=message):
        MpsDaemon(RESOURCE, tmp_path, args.pop("gpus"), args.pop("replicas"), **args)


def test_thread_percentage_never_zero(tmp_path: Path) -> None:
    assert MpsDaemon(RESOURCE, tmp_path, GPUS, 48).active_thread_percentage == 2
    assert MpsDaemon(RESOURCE, tmp_path, GPUS, 1).active_thread_percentage == 100


# -- MpsReconciler: the daemons follow the node's state ----------------------------------

SHARED = "nvidia.com/gpu"


def mps_config(root: Path, replicas: int) -> Config:
    resource = f"{{name: {SHARED}, replicas: {replicas}}}"
    return parse_config(
        f"version: v1\nflags: {{mpsRoot: {root}}}\nsharing:\n  mps:\n    resources:\n"
        f"    - {resource}\n"
    )


async def test_the_reconciler_keeps_one_daemon_per_mps_resource_of_the_state(
    tmp_path: Path,
) -> None:
    """Started with the state, restarted when its limits change, stopped when the resource
    is no longer MPS-shared; readiness goes to the store, which gates the devices."""
    store = NodeStore()
    reconciler = MpsReconciler(store, control_binary=FAKE)
    root = tmp_path / "mps"
    try:
        await reconciler.reconcile(store.update(inventory=INVENTORY, config=mps_config(root, 2)))
        first = reconciler.daemons[SHARED]
        assert first.ready and store.state.mps_ready == {SHARED: True}
        assert reconciler.waiting() == []
        assert store.state.specs[0].healthy_count == 4
        assert "set_default_active_thread_percentage 50" in commands(first)

        # A state that changes nothing MPS-related keeps the running daemon.
        await reconciler.reconcile(store.update(health={}, mps_ready={SHARED: True}))
        assert reconciler.daemons[SHARED] is first

        await reconciler.reconcile(store.update(config=mps_config(root, 4)))
        second = reconciler.daemons[SHARED]
        assert second is not first and second.ready and not first.ready
        assert commands(second)[-1] == "set_default_active_thread_percentage 25"
        assert store.state.specs[0].healthy_count == 8

        await reconciler.reconcile(store.update(config=Config()))
        assert reconciler.daemons == {} and store.state.mps_ready == {}
        assert commands(second).count("quit") == 2  # one per daemon stopped
    finally:
        await reconciler.stop()


async def test_a_daemon_that_cannot_start_leaves_its_resource_waiting(tmp_path: Path) -> None:
    """Logged, advertised unhealthy, still supervised: the node keeps serving the rest."""
    store = NodeStore()
    reconciler = MpsReconciler(store, control_binary=str(tmp_path / "no-such-binary"))
    state = store.update(inventory=INVENTORY, config=mps_config(tmp_path / "mps", 2))
    try:
        await reconciler.reconcile(state)
        assert reconciler.waiting() == [SHARED]
        assert store.state.specs[0].healthy_count == 0
    finally:
        await reconciler.stop()
    assert reconciler.daemons == {}


async def test_the_reconciler_follows_the_store(tmp_path: Path) -> None:
    store = NodeStore()
    reconciler = MpsReconciler(store, control_binary=FAKE)
    try:
        async with Supervisor("test") as tasks:
            tasks.start("mps", reconciler.follow(store.state.version), root=True)
            store.update(inventory=INVENTORY, config=mps_config(tmp_path / "mps", 2))
            async with asyncio.timeout(20):
                async for state in store.subscribe():
                    if state.mps_ready.get(SHARED):
                        break
    finally:
        # As the daemon does: the follower is cancelled first, then the daemons stopped.
        await reconciler.stop()
    assert store.state.mps_ready == {} and reconciler.daemons == {}
