"""`kubegpu serve` as a process: signals, init errors, bad input, live config reload."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kubegpu.kubelet import KubeletEmulator

GPU = "nvidia.com/gpu"
SHARED = """version: v1
sharing:
  timeSlicing:
    resources:
    - name: nvidia.com/gpu
      replicas: {replicas}
"""


def serve_cmd(plugin_dir: Path, *args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "kubegpu.cli",
        "serve",
        "--device-plugin-path",
        str(plugin_dir),
        *args,
    ]


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("CONFIG_FILE", "MIG_STRATEGY")}
    env.update(extra)
    return env


async def run_to_end(cmd: list[str], timeout: float = 20, **env: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        *cmd, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env=clean_env(**env)
    )
    out, _ = await asyncio.wait_for(proc.communicate(), timeout)
    assert proc.returncode is not None
    return proc.returncode, out.decode()


class Serve:
    """A running `kubegpu serve` whose output is collected as it comes."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.lines: list[str] = []
        self._new = asyncio.Condition()
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        async for raw in self.proc.stdout:
            async with self._new:
                self.lines.append(raw.decode())
                self._new.notify_all()

    async def wait_for_line(self, text: str, timeout: float = 15) -> None:
        async with asyncio.timeout(timeout), self._new:
            await self._new.wait_for(lambda: any(text in line for line in self.lines))

    async def stop(self, sig: int = signal.SIGTERM) -> tuple[int, str]:
        self.proc.send_signal(sig)
        code = await asyncio.wait_for(self.proc.wait(), 15)
        await asyncio.wait_for(self._reader, 5)
        return code, "".join(self.lines)


async def start(cmd: list[str], **env: str) -> Serve:
    proc = await asyncio.create_subprocess_exec(
        *cmd, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env=clean_env(**env)
    )
    return Serve(proc)


@pytest.fixture
async def kubelet(socket_dir: Path) -> AsyncIterator[KubeletEmulator]:
    emulator = KubeletEmulator(socket_dir / "dp", grace_period=0.5)
    await emulator.start()
    try:
        yield emulator
    finally:
        await emulator.stop()


async def test_sigterm_stops_cleanly_and_removes_socket(kubelet: KubeletEmulator) -> None:
    serve = await start(serve_cmd(kubelet.plugin_dir, "--simulate", "a10g-4"))
    try:
        await kubelet.wait_for_resource(GPU, capacity=4, allocatable=4, timeout=20)
        sock = kubelet.plugin_dir / "kubegpu-nvidia.com-gpu.sock"
        assert sock.exists()
    finally:
        code, out = await serve.stop()
    assert code == 0, out
    assert not sock.exists()
    assert "stopped cleanly" in out
    await kubelet.wait_for_resource(GPU, capacity=4, allocatable=0)


async def test_env_vars_configure_like_nvidia(kubelet: KubeletEmulator) -> None:
    serve = await start(
        serve_cmd(kubelet.plugin_dir, "--simulate", "a100-40gb-mig"), MIG_STRATEGY="mixed"
    )
    try:
        await kubelet.wait_for_resource("nvidia.com/mig-1g.5gb", capacity=7, timeout=20)
    finally:
        code, out = await serve.stop(signal.SIGINT)
    assert code == 0, out


async def test_no_nvml_exits_1_with_a_clear_message(socket_dir: Path) -> None:
    # An empty driver root: no NVML library there, even on a GPU machine.
    empty = socket_dir / "no-driver"
    empty.mkdir()
    code, out = await run_to_end(
        serve_cmd(socket_dir, "--backend", "nvml", "--nvidia-driver-root", str(empty))
    )
    assert code == 1
    assert "NVML" in out and "driver" in out
    assert "Traceback" not in out


async def test_no_nvml_with_fail_on_init_error_false_stays_up(kubelet: KubeletEmulator) -> None:
    empty = kubelet.plugin_dir.parent / "no-driver"
    empty.mkdir()
    serve = await start(
        serve_cmd(
            kubelet.plugin_dir,
            "--backend",
            "nvml",
            "--nvidia-driver-root",
            str(empty),
            "--fail-on-init-error=false",
        )
    )
    await serve.wait_for_line("advertising nothing")
    code, out = await serve.stop()
    assert code == 0, out
    assert "advertising nothing" in out
    assert kubelet.resources == []


async def test_unwritable_plugin_dir_is_a_clear_error(tmp_path: Path) -> None:
    target = tmp_path / "file"
    target.write_text("not a directory")
    code, out = await run_to_end(serve_cmd(target / "dp", "--simulate", "t4-1"))
    assert code == 1
    assert "device-plugin directory" in out and "--device-plugin-path" in out
    assert "Traceback" not in out


async def test_invalid_config_at_start_exits_1_naming_the_key(socket_dir: Path) -> None:
    bad = socket_dir / "config.yaml"
    bad.write_text("version: v1\nflags:\n  migStrategi: mixed\n")
    code, out = await run_to_end(
        serve_cmd(socket_dir, "--simulate", "t4-1", "--config-file", str(bad))
    )
    assert code == 1
    assert "migStrategi" in out and "migStrategy" in out
    assert "Traceback" not in out


async def test_config_reload_changes_replicas_and_keeps_last_good(
    kubelet: KubeletEmulator, socket_dir: Path
) -> None:
    config = socket_dir / "config.yaml"
    config.write_text(SHARED.format(replicas=4))
    serve = await start(
        serve_cmd(kubelet.plugin_dir, "--simulate", "a10g-4", "--config-file", str(config))
    )
    try:
        await kubelet.wait_for_resource(GPU, capacity=16, allocatable=16, timeout=20)
        held = await kubelet.allocate(GPU, 1, pod="running")
        config.write_text(SHARED.format(replicas=8))
        await kubelet.wait_for_resource(GPU, capacity=32, timeout=10)
        config.write_text(SHARED.format(replicas=1))
        serve.proc.send_signal(signal.SIGHUP)  # re-read now rather than at the next poll
        await serve.wait_for_line("rejected, the last good one keeps serving")
        assert kubelet.capacity(GPU) == 32
        config.write_text(SHARED.format(replicas=2))
        await kubelet.wait_for_resource(GPU, capacity=8, timeout=10)
        (still,) = kubelet.allocations("running")
        assert still.device_ids == held.device_ids
    finally:
        code, out = await serve.stop()
    assert code == 0, out
