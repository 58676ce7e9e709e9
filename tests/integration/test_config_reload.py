"""`kubegpu serve` keeps serving its last good config through every bad reload.

Each input here once ended or stalled the daemon (allocatable 0 on the node); now each is
rejected on one log line while the kubelet keeps seeing the same devices.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from kubegpu.kubelet import KubeletEmulator
from tests.integration.test_serve import (
    GPU,
    SHARED,
    run_to_end,
    serve_cmd,
    start_time_sliced,
)

ALIAS_BOMB = "".join(
    f"l{n}: &l{n} [{', '.join([f'*l{n - 1}'] * 9) if n else ', '.join(['lol'] * 9)}]\n"
    for n in range(9)
)

#: (what is written, a fragment of the one-line rejection it must produce)
BAD_RELOADS = [
    ("", "the file is empty"),
    ("   \n", "the file is empty"),
    (ALIAS_BOMB, "expands to more than"),
    ("version: {2001-01-01: 1}\n", "unsupported config version"),
    ("flags: &f {plugin: *f}\n", "refers to a node that contains it"),
    ("flags: " + "[" * 3000 + "]" * 3000 + "\n", "nested more than"),
    (SHARED.format(replicas="9" * 4301), "over the limit of"),
    (SHARED.format(replicas=10**9), "4 MiB message limit"),
    ('version: "\\ud800"\n', "not valid YAML"),
    ("version: v1\nversion: v1\n", "duplicate key"),
]


async def test_every_bad_reload_keeps_the_last_good_config(
    kubelet: KubeletEmulator, socket_dir: Path
) -> None:
    config = socket_dir / "config.yaml"
    serve = await start_time_sliced(kubelet, config)
    try:
        await kubelet.wait_for_resource(GPU, capacity=16, allocatable=16)
        for text, fragment in BAD_RELOADS:
            config.write_text(text)
            serve.proc.send_signal(signal.SIGHUP)
            await serve.wait_for_line(fragment)
            assert serve.proc.returncode is None
            assert (kubelet.capacity(GPU), kubelet.allocatable(GPU)) == (16, 16)
        config.write_text(SHARED.format(replicas=2))
        await kubelet.wait_for_resource(GPU, capacity=8, allocatable=8)
    finally:
        code, out = await serve.stop()
    assert code == 0, out
    assert "Traceback" not in out


async def test_a_device_list_too_big_for_the_kubelet_is_refused_at_start(
    socket_dir: Path,
) -> None:
    config = socket_dir / "config.yaml"
    config.write_text(SHARED.format(replicas=9000))
    code, out = await run_to_end(
        serve_cmd(socket_dir, "--simulate", "h100-8", "--config-file", str(config))
    )
    assert code == 1, out
    assert "sharing.timeSlicing.resources[0].replicas" in out and "4 MiB" in out
    assert "Traceback" not in out


async def test_a_fifo_as_the_config_file_stops_start_up_with_one_line(socket_dir: Path) -> None:
    config = socket_dir / "config.yaml"
    os.mkfifo(config)
    code, out = await run_to_end(
        serve_cmd(socket_dir, "--simulate", "t4-1", "--config-file", str(config))
    )
    assert code == 1, out
    assert "not a regular file (a FIFO)" in out and "Traceback" not in out


async def test_a_fifo_or_a_device_on_reload_keeps_serving_and_sigterm_still_stops(
    kubelet: KubeletEmulator, socket_dir: Path
) -> None:
    """A FIFO once wedged every later reload and SIGTERM; /dev/urandom held the reload for
    good. Each is refused on one line; the kubelet keeps its devices; SIGTERM ends serve."""
    config = socket_dir / "config.yaml"
    serve = await start_time_sliced(kubelet, config)
    try:
        await kubelet.wait_for_resource(GPU, capacity=16, allocatable=16)
        fifo = socket_dir / "fifo"
        os.mkfifo(fifo)
        fifo.replace(config)
        await serve.wait_for_line("not a regular file (a FIFO)")
        config.unlink()
        config.symlink_to("/dev/urandom")
        serve.proc.send_signal(signal.SIGHUP)
        await serve.wait_for_line("not a regular file (a character device)")
        assert serve.proc.returncode is None
        assert (kubelet.capacity(GPU), kubelet.allocatable(GPU)) == (16, 16)
    finally:
        code, out = await serve.stop()
    assert code == 0, out
    assert "Traceback" not in out


async def test_a_file_held_open_beside_the_config_does_not_stop_its_reloads(
    kubelet: KubeletEmulator, socket_dir: Path
) -> None:
    """The README's "edit the config file, send SIGHUP" once failed whenever any file in
    the config's directory was held open for writing (serve's own log, an editor's swap
    file): every reload "kept changing". Both the edit and the SIGHUP now land."""
    config = socket_dir / "config.yaml"
    serve = await start_time_sliced(kubelet, config)
    try:
        await kubelet.wait_for_resource(GPU, capacity=16, allocatable=16)
        with (socket_dir / "other.log").open("a") as log:
            log.write("a line\n")
            log.flush()
            config.write_text(SHARED.format(replicas=2))
            await kubelet.wait_for_resource(GPU, capacity=8, allocatable=8)
            log.write("another line\n")
            log.flush()
            serve.proc.send_signal(signal.SIGHUP)
            await serve.wait_for_line("SIGHUP: re-reading the config")
            config.write_text(SHARED.format(replicas=3))
            serve.proc.send_signal(signal.SIGHUP)
            await kubelet.wait_for_resource(GPU, capacity=12, allocatable=12)
        assert not any("kept changing" in line for line in serve.lines)
    finally:
        code, out = await serve.stop()
    assert code == 0, out
    assert "Traceback" not in out


IMEX_CHANNEL_0 = Path("/dev/nvidia-caps-imex-channels/channel0")
needs_no_imex_channel = pytest.mark.skipif(
    IMEX_CHANNEL_0.exists(), reason=f"this host has {IMEX_CHANNEL_0}: the case needs none"
)


@needs_no_imex_channel
async def test_required_imex_channels_missing_at_start_refuse_start_up_in_one_line(
    socket_dir: Path,
) -> None:
    """NVIDIA's plugin refuses to start ("requested IMEX channel channel0 does not exist");
    kubegpu once started, advertised every GPU and refused every Allocate."""
    dev_root = socket_dir / "dev-root"
    dev_root.mkdir()
    code, out = await run_to_end(
        serve_cmd(
            socket_dir,
            "--simulate",
            "a10g-4",
            "--imex-channel-ids",
            "0",
            "--imex-required",
            "--nvidia-dev-root",
            str(dev_root),
        )
    )
    assert code == 1, out
    (line,) = [line for line in out.splitlines() if "IMEX channel" in line]
    assert line.startswith("kubegpu: imex.required: IMEX channel 0 does not exist"), line
    assert str(dev_root / "dev/nvidia-caps-imex-channels/channel0") in line
    assert "advertising" not in out and "Traceback" not in out


@needs_no_imex_channel
async def test_a_reload_requiring_missing_imex_channels_keeps_the_last_good_config(
    kubelet: KubeletEmulator, socket_dir: Path
) -> None:
    config = socket_dir / "config.yaml"
    serve = await start_time_sliced(kubelet, config)
    try:
        await kubelet.wait_for_resource(GPU, capacity=16, allocatable=16)
        required = "imex:\n  channelIDs: [0]\n  required: true\n"
        config.write_text(SHARED.format(replicas=2) + required)
        await serve.wait_for_line("IMEX channel 0 does not exist")
        assert (kubelet.capacity(GPU), kubelet.allocatable(GPU)) == (16, 16)
        (line,) = [line for line in serve.lines if "IMEX channel 0" in line]
        assert "rejected, the last good one keeps serving: imex.required" in line
        allocation = await kubelet.allocate(GPU, 1, pod="p")
        assert len(allocation.device_ids) == 1, "the last good config still allocates"
        config.write_text(SHARED.format(replicas=2))
        await kubelet.wait_for_resource(GPU, capacity=8, allocatable=8)
    finally:
        code, out = await serve.stop()
    assert code == 0, out
    assert "Traceback" not in out
