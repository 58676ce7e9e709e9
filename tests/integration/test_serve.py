"""`kubegpu serve` as a process: signals, init errors, bad input, live config reload."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kubegpu.kubelet import KubeletEmulator
from tests.waiting import WAIT

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


async def run_to_end(cmd: list[str], timeout: float = WAIT, **env: str) -> tuple[int, str]:
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

    async def wait_for_line(self, text: str, timeout: float = WAIT) -> None:
        async with asyncio.timeout(timeout), self._new:
            await self._new.wait_for(lambda: any(text in line for line in self.lines))

    async def stop(self, sig: int = signal.SIGTERM) -> tuple[int, str]:
        self.proc.send_signal(sig)
        code = await asyncio.wait_for(self.proc.wait(), WAIT)
        await asyncio.wait_for(self._reader, WAIT)
        return code, "".join(self.lines)


async def start(cmd: list[str], **env: str) -> Serve:
    proc = await asyncio.create_subprocess_exec(
        *cmd, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env=clean_env(**env)
    )
    return Serve(proc)


async def start_time_sliced(kubelet: KubeletEmulator, config: Path) -> Serve:
    """`serve` on a10g-4 with `config` written as 4 time-sliced replicas per GPU (16 in all)."""
    config.write_text(SHARED.format(replicas=4))
    return await start(
        serve_cmd(kubelet.plugin_dir, "--simulate", "a10g-4", "--config-file", str(config))
    )


async def test_sigterm_stops_cleanly_and_removes_socket(kubelet: KubeletEmulator) -> None:
    serve = await start(serve_cmd(kubelet.plugin_dir, "--simulate", "a10g-4"))
    try:
        await kubelet.wait_for_resource(GPU, capacity=4, allocatable=4)
        sock = kubelet.plugin_dir / "kubegpu-nvidia.com-gpu.sock"
        assert sock.exists()
    finally:
        code, out = await serve.stop()
    assert code == 0, out
    assert not sock.exists()
    assert "stopped cleanly" in out

    # Served devices turn unhealthy as the plugin stops and stay counted for the kubelet's
    # grace period: in its history, however long the process took to exit after that.
    def marked_unhealthy() -> bool:
        history = kubelet.history(GPU)
        return (4, 0) in history[history.index((4, 4)) :]

    await kubelet.wait_for(marked_unhealthy)


def ignores_hup(pid: int) -> bool:
    """Whether the process's SIGHUP disposition is SIG_IGN (bit 0 of SigIgn)."""
    status = Path(f"/proc/{pid}/status").read_text()
    mask = next(line.split()[1] for line in status.splitlines() if line.startswith("SigIgn:"))
    return bool(int(mask, 16) & (1 << (signal.SIGHUP - 1)))


async def hup_storm_until_registered(serve: Serve, kubelet: KubeletEmulator) -> int:
    """Send SIGHUPs from the moment `serve` ignores them until the kubelet holds its list;
    how many were sent. Fails if the process dies on the way."""
    registered = asyncio.ensure_future(kubelet.wait_for_resource(GPU, capacity=4))
    died = asyncio.ensure_future(serve.proc.wait())
    sent = 0
    try:
        async with asyncio.timeout(WAIT):
            while not ignores_hup(serve.proc.pid):
                assert serve.proc.returncode is None
                await asyncio.sleep(0)  # a yield to the loop, not a timed wait
        while not registered.done() and not died.done():
            serve.proc.send_signal(signal.SIGHUP)
            sent += 1
            # Paces the storm; returns at once when either condition holds.
            await asyncio.wait({registered, died}, timeout=0.005)
        assert not died.done(), "".join(serve.lines)
        await registered
    finally:
        registered.cancel()
        died.cancel()
    return sent


#: Records, in a fresh interpreter with SIGHUP at its default, each module loaded (the
#: `import` audit event) and whether SIGHUP was ignored when it started loading, while the
#: entry point in argv[2] runs ("script": the installed console script, "module": `python
#: -m kubegpu.cli`); writes them as JSON to argv[1]. Its own modules load before the audit
#: hook is added, so only what the entry point loads is recorded.
IMPORTS_UNTIL_HUP_IS_IGNORED = """
import _signal, json, sys
_signal.signal(_signal.SIGHUP, _signal.SIG_DFL)
seen = []
sys.addaudithook(
    lambda event, args: event == "import"
    and seen.append((args[0], _signal.getsignal(_signal.SIGHUP) == _signal.SIG_IGN))
)
out, entry, script = sys.argv[1:4]
sys.argv = [script, "--version"]
try:
    import runpy
    if entry == "script":
        runpy.run_path(script, run_name="__main__")
    else:
        runpy.run_module("kubegpu.cli", run_name="__main__", alter_sys=True)
except SystemExit:
    pass
with open(out, "w") as f:
    json.dump(seen, f)
"""


@pytest.mark.parametrize("entry", ["script", "module"])
def test_nothing_loads_between_kubegpus_first_line_and_ignoring_sighup(
    tmp_path: Path, entry: str
) -> None:
    """Property: `kubegpu serve` ignores SIGHUP from its first instruction on. Before the
    package's first line only the interpreter's own start runs (it is not kubegpu's to
    shorten); from that line no module loads, not even `signal`, until HUP is ignored."""
    script = Path(sys.executable).with_name("kubegpu")
    if entry == "script" and not script.is_file():
        pytest.skip(f"no console script beside {sys.executable} (install the package)")
    out = tmp_path / "imports.json"
    subprocess.run(
        [sys.executable, "-c", IMPORTS_UNTIL_HUP_IS_IGNORED, str(out), entry, str(script)],
        check=True,
        capture_output=True,
        timeout=WAIT,
    )
    seen = [(name, ignored) for name, ignored in json.loads(out.read_text())]
    first = next(i for i, (name, _) in enumerate(seen) if name.split(".")[0] == "kubegpu")
    assert not seen[first][1], "the test interpreter must start with HUP at its default"
    exposed = [name for name, ignored in seen[first:] if not ignored]
    assert sorted(exposed) == ["kubegpu", "kubegpu.cli"], exposed
    assert all(ignored for _, ignored in seen[first + 2 :])


async def wait_for_hup_reload(serve: Serve, kubelet: KubeletEmulator, config: Path) -> None:
    """A config change no file watch sees (written through a hard link in another
    directory) reaches the kubelet only through a SIGHUP's re-read: a later HUP reloads."""
    elsewhere = config.parent.parent / f"{config.parent.name}-link"
    elsewhere.mkdir()
    link = elsewhere / config.name
    os.link(config, link)
    link.write_text(SHARED.format(replicas=2))
    serve.proc.send_signal(signal.SIGHUP)
    await kubelet.wait_for_resource(GPU, capacity=8, allocatable=8)


def config_dir(tmp_path: Path) -> Path:
    """An all-defaults config file in a directory of its own."""
    directory = tmp_path / "etc"
    directory.mkdir()
    config = directory / "config.yaml"
    config.write_text("version: v1\n")
    return config


async def test_sighup_storm_from_the_first_python_line_never_kills_start_up(
    kubelet: KubeletEmulator, tmp_path: Path
) -> None:
    """HUPs from the moment the process ignores them (its package's first line, see the
    test above; before that only the interpreter's own start runs) until it has
    registered: it starts as if none came, and a later HUP still re-reads the config."""
    config = config_dir(tmp_path)
    # Spawned with SIGHUP at its default, not this process's (importing kubegpu.cli here
    # ignores it, and an ignored disposition is inherited across exec).
    previous = signal.signal(signal.SIGHUP, signal.SIG_DFL)
    try:
        serve = await start(
            serve_cmd(kubelet.plugin_dir, "--simulate", "a10g-4", "--config-file", str(config))
        )
    finally:
        signal.signal(signal.SIGHUP, previous)
    try:
        sent = await hup_storm_until_registered(serve, kubelet)
        assert serve.proc.returncode is None
        await wait_for_hup_reload(serve, kubelet, config)
    finally:
        code, out = await serve.stop()
    assert sent >= 1
    assert code == 0, out
    assert "stopped cleanly" in out and "Traceback" not in out


async def test_started_with_hup_and_term_blocked_a_hup_from_exec_on_never_kills_it(
    kubelet: KubeletEmulator, tmp_path: Path
) -> None:
    """A start command may hand the process SIGHUP and SIGTERM blocked (the mask survives
    exec). HUPs from the instant after exec wait, pending, and are discarded once ignored;
    serve lets both signals in once it handles them, so a later HUP re-reads the config
    and SIGTERM stops it (blocked, neither would ever arrive)."""
    config = config_dir(tmp_path)
    previous = signal.signal(signal.SIGHUP, signal.SIG_DFL)
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGHUP, signal.SIGTERM})
    try:
        serve = await start(
            serve_cmd(kubelet.plugin_dir, "--simulate", "a10g-4", "--config-file", str(config))
        )
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        signal.signal(signal.SIGHUP, previous)
    try:
        registered = asyncio.ensure_future(kubelet.wait_for_resource(GPU, capacity=4))
        died = asyncio.ensure_future(serve.proc.wait())
        sent = 0
        try:
            while not registered.done() and not died.done():
                serve.proc.send_signal(signal.SIGHUP)
                sent += 1
                await asyncio.wait({registered, died}, timeout=0.005)  # paces the storm
            assert not died.done(), "".join(serve.lines)
            await registered
        finally:
            registered.cancel()
            died.cancel()
        await wait_for_hup_reload(serve, kubelet, config)
    finally:
        try:
            code, out = await serve.stop()
        except TimeoutError:
            serve.proc.kill()  # SIGTERM still blocked: do not leave it running
            raise
    assert sent >= 1
    assert code == 0, out


async def test_started_as_the_image_starts_it_a_hup_from_exec_on_never_kills_it(
    kubelet: KubeletEmulator, tmp_path: Path
) -> None:
    """Before kubegpu's first line runs the interpreter starts (tens of ms on a busy node),
    and a HUP then killed the process; the image and the chart start it through
    `env --ignore-signal=HUP`, which ignores HUP in its first instructions, before Python
    loads: HUPs from then on are harmless, and once serving a HUP still re-reads the config."""
    config = tmp_path / "config.yaml"
    config.write_text("version: v1\n")
    previous = signal.signal(signal.SIGHUP, signal.SIG_DFL)
    try:
        serve = await start(
            [
                "env",
                "--ignore-signal=HUP",
                *serve_cmd(
                    kubelet.plugin_dir, "--simulate", "a10g-4", "--config-file", str(config)
                ),
            ]
        )
    finally:
        signal.signal(signal.SIGHUP, previous)
    try:
        assert await hup_storm_until_registered(serve, kubelet) >= 1
        serve.proc.send_signal(signal.SIGHUP)
        await serve.wait_for_line("SIGHUP: re-reading the config")
        assert serve.proc.returncode is None
    finally:
        code, out = await serve.stop()
    assert code == 0, out


async def test_env_vars_configure_like_nvidia(kubelet: KubeletEmulator) -> None:
    serve = await start(
        serve_cmd(kubelet.plugin_dir, "--simulate", "a100-40gb-mig"), MIG_STRATEGY="mixed"
    )
    try:
        await kubelet.wait_for_resource("nvidia.com/mig-1g.5gb", capacity=7)
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
    serve = await start_time_sliced(kubelet, config)
    try:
        await kubelet.wait_for_resource(GPU, capacity=16, allocatable=16)
        held = await kubelet.allocate(GPU, 1, pod="running")
        config.write_text(SHARED.format(replicas=8))
        await kubelet.wait_for_resource(GPU, capacity=32)
        config.write_text(SHARED.format(replicas=1))
        serve.proc.send_signal(signal.SIGHUP)  # re-read now rather than at the next poll
        await serve.wait_for_line("rejected, the last good one keeps serving")
        assert kubelet.capacity(GPU) == 32
        config.write_text(SHARED.format(replicas=2))
        await kubelet.wait_for_resource(GPU, capacity=8)
        (still,) = kubelet.allocations("running")
        assert still.device_ids == held.device_ids
    finally:
        code, out = await serve.stop()
    assert code == 0, out


def json_records(out: str) -> list[dict[str, object]]:
    """Each line of `out` as the JSON object it must be (`--log-format json`)."""
    records: list[dict[str, object]] = []
    for line in out.splitlines():
        entry = json.loads(line)
        assert isinstance(entry, dict) and {"ts", "level", "logger", "msg"} <= set(entry), line
        records.append(entry)
    return records


async def test_json_logs_are_one_object_a_line_from_start_to_stop(
    kubelet: KubeletEmulator, socket_dir: Path
) -> None:
    config = socket_dir / "config.yaml"
    config.write_text(SHARED.format(replicas=4))
    serve = await start(
        serve_cmd(kubelet.plugin_dir, "--simulate", "a10g-4", "--config-file", str(config)),
        LOG_FORMAT="json",
    )
    try:
        await kubelet.wait_for_resource(GPU, capacity=16, allocatable=16)
        config.write_text(SHARED.format(replicas=8))
        await kubelet.wait_for_resource(GPU, capacity=32)
        await serve.wait_for_line('"config reloaded')
    finally:
        code, out = await serve.stop()
    assert code == 0, out
    records = json_records(out)
    assert any(r["msg"] == "stopped cleanly" for r in records)
    assert any(str(r["msg"]).startswith("advertising nvidia.com/gpu") for r in records)
    # The config line: short for a person, the whole config as a field for a query.
    first, reload = (
        next(r for r in records if str(r["msg"]).startswith(event))
        for event in ("effective config", "config reloaded")
    )
    for entry, replicas in ((first, 4), (reload, 8)):
        assert entry["level"] == "info" and len(str(entry["msg"])) < 200, entry
        assert f"nvidia.com/gpu x{replicas}" in str(entry["msg"])
        assert entry["origin"] == f"file {config}"
        whole: Any = entry["config"]
        assert whole["sharing"]["timeSlicing"]["resources"][0]["replicas"] == replicas
        assert whole["flags"]["migStrategy"] == "none"
    assert first["config_digest"] != reload["config_digest"]


async def test_with_json_logs_the_error_that_ends_start_up_is_a_json_record(
    socket_dir: Path,
) -> None:
    bad = socket_dir / "config.yaml"
    bad.write_text("version: v1\nflags:\n  migStrategi: mixed\n")
    code, out = await run_to_end(
        serve_cmd(socket_dir, "--simulate", "t4-1", "--config-file", str(bad), "--log-format=json")
    )
    assert code == 1
    last = json_records(out)[-1]
    assert last["level"] == "error" and "migStrategi" in str(last["msg"]), last


# -- start-up order, signals, the plugin-directory lock, readiness ----------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def probe(port: int, path: str) -> tuple[int, str]:
    """One GET; (status, body), or (0, error) when nothing answers yet."""
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError as exc:
        return 0, str(exc)
    try:
        writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        data = await asyncio.wait_for(reader.read(), WAIT)
    finally:
        writer.close()
    head, _, body = data.decode().partition("\r\n\r\n")
    return int(head.split()[1]), body.strip()


async def until_probe(port: int, path: str, status: int, timeout: float = WAIT) -> str:
    """Wait until `path` answers `status`; its body."""
    async with asyncio.timeout(timeout):
        while True:
            code, body = await probe(port, path)
            if code == status:
                return body
            await asyncio.sleep(0.05)  # nothing signals "port open"; re-probe


async def ends_after(serve: Serve, sig: int = signal.SIGTERM) -> tuple[int, str]:
    serve.proc.send_signal(sig)
    code = await asyncio.wait_for(serve.proc.wait(), WAIT)
    await asyncio.wait_for(serve._reader, WAIT)
    return code, "".join(serve.lines)


def error_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("kubegpu")]


def unanswering_api_server() -> tuple[socket.socket, dict[str, str]]:
    """A listening socket that never answers, posing as the API server; the env to use it."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    env = {
        "NODE_NAME": "node-1",
        "KUBERNETES_SERVICE_HOST": "127.0.0.1",
        "KUBERNETES_SERVICE_PORT": str(listener.getsockname()[1]),
        "KUBECONFIG": "/nonexistent/kubeconfig",
    }
    return listener, env


def named_configs(root: Path) -> Path:
    configs = root / "configs"
    configs.mkdir()
    (configs / "default").write_text(SHARED.format(replicas=2))
    return configs


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
async def test_healthz_answers_and_sigterm_ends_while_waiting_for_the_api_server(
    socket_dir: Path, sig: int
) -> None:
    listener, env = unanswering_api_server()
    port = free_port()
    try:
        serve = await start(
            serve_cmd(
                socket_dir / "dp",
                "--simulate",
                "a10g-4",
                "--config-dir",
                str(named_configs(socket_dir)),
                "--default-config",
                "default",
                "--health-port",
                str(port),
                "--health-address",
                "127.0.0.1",
            ),
            **env,
        )
        assert await until_probe(port, "/healthz", 200) == "ok"
        assert await until_probe(port, "/readyz", 503) == "starting"
        if sig == signal.SIGHUP:  # re-read the config: must neither kill nor unblock wrongly
            serve.proc.send_signal(signal.SIGHUP)
            assert await until_probe(port, "/healthz", 200) == "ok"
            assert serve.proc.returncode is None
        code, out = await ends_after(serve)
    finally:
        listener.close()
    assert code == 0, out
    assert "stopped during start-up" in out and "Traceback" not in out


async def test_sigterm_ends_during_registration_retries_with_no_kubelet(socket_dir: Path) -> None:
    port = free_port()
    serve = await start(
        serve_cmd(
            socket_dir,
            "--simulate",
            "t4-1",
            "--health-port",
            str(port),
            "--health-address",
            "127.0.0.1",
        )
    )
    await serve.wait_for_line("retrying until the kubelet accepts it")
    assert "no kubelet" in await until_probe(port, "/readyz", 503)
    code, out = await ends_after(serve)
    assert code == 0, out
    assert not list(socket_dir.glob("kubegpu-*.sock"))


async def test_sigterm_ends_while_serving(kubelet: KubeletEmulator) -> None:
    serve = await start(serve_cmd(kubelet.plugin_dir, "--simulate", "h100-8"))
    await kubelet.wait_for_resource(GPU, capacity=8, allocatable=8)
    code, out = await ends_after(serve)
    assert code == 0, out


async def test_readyz_is_false_while_the_kubelet_has_no_list_from_us(
    kubelet: KubeletEmulator,
) -> None:
    port = free_port()
    serve = await start(
        serve_cmd(
            kubelet.plugin_dir,
            "--simulate",
            "a10g-4",
            "--health-port",
            str(port),
            "--health-address",
            "127.0.0.1",
        )
    )
    try:
        await kubelet.wait_for_resource(GPU, capacity=4)
        assert await until_probe(port, "/readyz", 200) == "ok"
        await kubelet.stop()  # the kubelet is gone, its socket file may linger
        assert "no kubelet" in await until_probe(port, "/readyz", 503)
        await kubelet.start()  # a new kubelet: not ready until it has our list again
        await kubelet.wait_for_resource(GPU, capacity=4)
        assert await until_probe(port, "/readyz", 200) == "ok"
    finally:
        code, out = await ends_after(serve)
    assert code == 0, out


async def test_a_second_serve_on_the_same_plugin_dir_refuses_even_after_a_kubelet_wipe(
    kubelet: KubeletEmulator,
) -> None:
    first = await start(serve_cmd(kubelet.plugin_dir, "--simulate", "a10g-4"))
    try:
        await kubelet.wait_for_resource(GPU, capacity=4)
        for _ in range(2):
            code, out = await run_to_end(serve_cmd(kubelet.plugin_dir, "--simulate", "t4-1"))
            assert code == 1, out
            (line,) = error_lines(out)
            assert "in use by another kubegpu serve" in line and str(kubelet.plugin_dir) in line
            assert "Traceback" not in out
            # The kubelet empties the directory on restart; the lock must survive that.
            await kubelet.restart()
            await kubelet.wait_for_resource(GPU, capacity=4, allocatable=4)
    finally:
        code, out = await ends_after(first)
    assert code == 0, out
    # Released when the holder ends: a new serve now starts.
    again = await start(serve_cmd(kubelet.plugin_dir, "--simulate", "t4-1"))
    await kubelet.wait_for_resource(GPU, capacity=1)
    code, out = await ends_after(again)
    assert code == 0, out


@pytest.mark.parametrize("which", ["health", "metrics"])
async def test_port_in_use_is_one_line_exit_1(socket_dir: Path, which: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        code, out = await run_to_end(
            serve_cmd(
                socket_dir,
                "--simulate",
                "t4-1",
                f"--{which}-port",
                port,
                f"--{which}-address",
                "127.0.0.1",
            )
        )
    assert code == 1, out
    (line,) = error_lines(out)
    assert f"--{which}-address/--{which}-port" in line and "in use" in line
    assert "Traceback" not in out


@pytest.mark.parametrize("which", ["health", "metrics"])
async def test_unresolvable_address_is_one_line_exit_1(socket_dir: Path, which: str) -> None:
    code, out = await run_to_end(
        serve_cmd(
            socket_dir,
            "--simulate",
            "t4-1",
            f"--{which}-port",
            str(free_port()),
            f"--{which}-address",
            "no-such-host.invalid",
        )
    )
    assert code == 1, out
    (line,) = error_lines(out)
    assert "no-such-host.invalid" in line and f"--{which}-address" in line
    assert "Traceback" not in out


async def test_binary_simulate_file_is_one_line_exit_1(socket_dir: Path) -> None:
    node = socket_dir / "node.bin"
    node.write_bytes(bytes(range(256)) * 4)
    code, out = await run_to_end(serve_cmd(socket_dir, "--simulate", str(node)))
    assert code == 1, out
    (line,) = error_lines(out)
    assert str(node) in line and "Traceback" not in out


async def test_reload_adding_a_resource_while_the_plugin_dir_is_missing_keeps_serving(
    kubelet: KubeletEmulator, socket_dir: Path
) -> None:
    config = socket_dir / "config.yaml"
    config.write_text("version: v1\nflags:\n  migStrategy: none\n")
    serve = await start(
        serve_cmd(kubelet.plugin_dir, "--simulate", "a100-40gb-mig", "--config-file", str(config))
    )
    try:
        await kubelet.wait_for_resource(GPU, capacity=2)
        await kubelet.stop()
        shutil.rmtree(kubelet.plugin_dir)
        config.write_text("version: v1\nflags:\n  migStrategy: mixed\n")
        await serve.wait_for_line(f"device-plugin directory {kubelet.plugin_dir} is missing")
        assert serve.proc.returncode is None
        await kubelet.start()  # the kubelet comes back and recreates the directory
        await kubelet.wait_for_resource("nvidia.com/mig-1g.5gb", capacity=7)
        await kubelet.wait_for_resource("nvidia.com/mig-3g.20gb", capacity=1)
    finally:
        code, out = await ends_after(serve)
    assert code == 0, out
    assert "Failed to bind" not in out


async def test_plugin_dir_too_long_for_our_sockets_is_one_line_exit_1(socket_dir: Path) -> None:
    # kubelet.sock fits under the 107-byte limit, kubegpu-nvidia.com-gpu.sock does not.
    pad = 90 - len(str(socket_dir)) - 1
    plugin_dir = socket_dir / ("p" * pad)
    code, out = await run_to_end(serve_cmd(plugin_dir, "--simulate", "t4-1"))
    assert code == 1, out
    (line,) = error_lines(out)
    assert "107 bytes" in line and "--device-plugin-path" in line
    assert "Traceback" not in out
