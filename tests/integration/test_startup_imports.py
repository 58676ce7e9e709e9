"""What a fresh `kubegpu` process loads, and `serve` as a node runs it.

Each command loads what it needs and nothing else: `--version` and `--help` no command at
all, and no command another one. `serve` starts, registers and allocates with no
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

import pytest

from kubegpu.cli import COMMANDS
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


def test_events_still_answers_to_the_old_name_of_kube_errors() -> None:
    """`events.EventError`, the name of events' failures before `kubegpu.kube`, is
    `KubeError`, so code written against the old name keeps catching them."""
    from kubegpu import events
    from kubegpu.kube import KubeError

    assert events.EventError is KubeError
