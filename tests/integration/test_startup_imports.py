"""What a fresh `kubegpu` process loads, and `serve` as a node runs it.

Each command loads what it needs and nothing else: `--version` and `--help` no command at
all, and no command another one; `serve` its own mode's front and nothing of the other's
(`daemon.FRONTS`). `serve` starts, registers and allocates with no
Kubernetes API in reach (the API is only needed for Node events and the named-config
label, and neither may hold up serving), then stops cleanly on SIGTERM.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kubegpu.cli import COMMANDS
from tests.rig.dra import DRAKubelet
from tests.rig.kube import FakeKube
from tests.waiting import WAIT, Kubelet

GPU = "nvidia.com/gpu"

#: What only a command that runs may load: gRPC and protobuf, the config schema's
#: validator, YAML, the Kubernetes client, NVML, and the modules built on them.
HEAVY = (
    "grpc",
    "google.protobuf",
    "msgspec",
    "yaml",
    "lightkube",
    "httpx2",
    "pynvml",
    "kubegpu.api",
    "kubegpu.config",
    "kubegpu.devices",
    "kubegpu.cli.options",
)
_GRPC = ("grpc", "google.protobuf", "kubegpu.api")
_KUBE = ("lightkube", "httpx2", "kubegpu.kube", "kubegpu.config.source")
#: What a command has no use for, and so does not load: gRPC where it serves no kubelet,
#: the Kubernetes client where it reads no API, and for the schema no GPU or event loop.
NOT_NEEDED = {
    "labels": _GRPC,
    "cdi": _GRPC + _KUBE,
    "info": _GRPC + _KUBE,
    "check": _GRPC + _KUBE,
    "config": (*_GRPC, *_KUBE, "pynvml", "kubegpu.devices", "asyncio"),
}
#: Each command's module.
MODULES = {name: f"kubegpu.cli.{name}" for name in COMMANDS}


def _loaded_after(code: str) -> set[str]:
    """The modules a fresh interpreter holds after running `code`."""
    probe = f"{code}\nimport sys\nprint(' '.join(sys.modules))"
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    ).stdout
    return set(out.splitlines()[-1].split())


def _within(modules: set[str], packages: tuple[str, ...]) -> list[str]:
    return sorted(m for m in modules if any(m == p or m.startswith(p + ".") for p in packages))


@pytest.mark.parametrize("argv", [["--version"], ["--help"], []])
def test_version_and_help_load_no_command(argv: list[str]) -> None:
    """`kubegpu --version`, `--help` and a bare `kubegpu` (its usage) load click and the
    top-level command only: no command module, nothing a command needs."""
    loaded = _loaded_after(
        "import contextlib, io\nfrom kubegpu.cli import main\nquiet = io.StringIO()\n"
        "with contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):\n"
        f"    main({argv!r})"
    )
    assert _within(loaded, HEAVY + tuple(MODULES.values())) == []


def test_help_lists_every_command_with_its_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The listing is written without importing the commands, from the text each command
    gives as its own short help."""
    from kubegpu.cli import kubegpu, main

    monkeypatch.setenv("COLUMNS", "200")  # one line per command, however narrow the tty
    assert main(["--help"]) == 0
    listing = capsys.readouterr().out.partition("Commands:")[2].splitlines()
    rows = [line.split(None, 1) for line in listing if line.strip()]
    assert [name for name, _ in rows] == list(COMMANDS)
    ctx = kubegpu.make_context("kubegpu", ["--help"], resilient_parsing=True)
    for name, line in rows:
        command = kubegpu.get_command(ctx, name)
        assert command is not None
        assert line == COMMANDS[name].summary == command.get_short_help_str(limit=1000)


@pytest.mark.parametrize("name", list(MODULES))
def test_a_command_loads_no_other_command(name: str) -> None:
    loaded = _loaded_after(f"import {MODULES[name]}")
    others = tuple(module for other, module in MODULES.items() if other != name)
    assert _within(loaded, others) == []


@pytest.mark.parametrize("name", list(NOT_NEEDED))
def test_a_command_loads_nothing_it_has_no_use_for(name: str) -> None:
    loaded = _loaded_after(f"import {MODULES[name]}")
    assert _within(loaded, NOT_NEEDED[name]) == []


@pytest.mark.parametrize("name", list(MODULES))
def test_no_command_loads_pydantic(name: str) -> None:
    """The config schema is msgspec's (already loaded for the Kubernetes client), not a
    validator that builds its models: no command loads pydantic, even where installed."""
    loaded = _loaded_after(f"import {MODULES[name]}\nimport kubegpu.config")
    assert _within(loaded, ("pydantic", "pydantic_core")) == []


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


#: `serve` through the console script's own entry (`kubegpu.cli.main`), then every module the
#: process loaded while it ran, printed once SIGTERM has ended it: all it loaded to register
#: and serve, read from outside, with nothing added to the product to tell it.
SERVE_THEN_MODULES = (
    "import sys\n"
    "from kubegpu.cli import main\n"
    "code = main(sys.argv[1:])\n"
    "print(' '.join(sorted(sys.modules)), flush=True)\n"
    "sys.exit(code)\n"
)
#: What a `serve` of each mode has no use for: the other mode's front and all below it.
OTHER_MODE = {"plugin": ("kubegpu.dra",), "dra": ("kubegpu.plugin",)}


async def _modules_of_serve(args: list[str], registered: asyncio.Future[None]) -> set[str]:
    """Run `kubegpu <args>` until `registered` is done, then SIGTERM it: what it loaded."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        SERVE_THEN_MODULES,
        *args,
        env=_env(KUBECONFIG="/nonexistent/kubeconfig"),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        exited = asyncio.ensure_future(proc.wait())
        either: set[asyncio.Future[Any]] = {registered, exited}
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        exited.cancel()
        registered.result()  # the error, if serve exited first or the wait timed out
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
        out, err = await asyncio.wait_for(proc.communicate(), WAIT)
    assert proc.returncode == 0, err.decode()
    return set(out.decode().splitlines()[-1].split())


async def test_a_device_plugin_serve_loads_nothing_of_dra(socket_dir: Path) -> None:
    kubelet = Kubelet(socket_dir / "dp", grace_period=0.5)
    await kubelet.start()
    try:
        args = ["serve", "--simulate", "h100-8", "--device-plugin-path", str(kubelet.plugin_dir)]
        registered = asyncio.ensure_future(
            kubelet.wait_for_resource(GPU, capacity=8, allocatable=8)
        )
        loaded = await _modules_of_serve(args, registered)
    finally:
        await kubelet.stop()
    assert "kubegpu.plugin.front" in loaded
    assert _within(loaded, OTHER_MODE["plugin"]) == []


async def test_a_dra_serve_loads_nothing_of_the_device_plugin(socket_dir: Path) -> None:
    """Registered with the kubelet's plugin watcher (GetInfo, NotifyRegistrationStatus)."""
    dra = DRAKubelet(socket_dir / "kubelet", FakeKube(), retry_initial=0.05)
    await dra.start()
    try:
        args = [
            "serve",
            "--mode",
            "dra",
            "--simulate",
            "h100-8",
            "--node-name",
            "n1",
            "--kubelet-registrar-directory-path",
            str(dra.registry_dir),
            "--kubelet-plugins-directory-path",
            str(dra.plugins_dir),
            "--device-plugin-path",
            str(socket_dir / "dp"),
        ]
        registered = asyncio.ensure_future(dra.wait_for_driver("gpu.nvidia.com", timeout=WAIT))
        loaded = await _modules_of_serve(args, registered)
    finally:
        await dra.stop()
    assert "kubegpu.dra.front" in loaded
    assert _within(loaded, OTHER_MODE["dra"]) == []


def test_events_still_answers_to_the_old_name_of_kube_errors() -> None:
    """`events.EventError`, the name of events' failures before `kubegpu.kube`, is
    `KubeError`, so code written against the old name keeps catching them."""
    from kubegpu import events
    from kubegpu.kube import KubeError

    assert events.EventError is KubeError
