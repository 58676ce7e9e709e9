"""`serve --mode dra`: the daemon runs the DRA kubelet plugin over the shared core."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import stat
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc
import pytest

from kubegpu.api import dra_pb2, dra_stub
from kubegpu.api import pluginregistration_pb2 as reg_pb
from kubegpu.api import pluginregistration_pb2_grpc as reg_grpc
from kubegpu.cli.options import parse
from kubegpu.cli.serve import serve
from kubegpu.daemon import Daemon, DaemonSettings
from kubegpu.devices.simulated import SimulatedBackend
from kubegpu.dra.checkpoint import CHECKPOINT_FILE, LEGACY_FILE
from kubegpu.dra.claims import spec_file_name
from kubegpu.errors import DirectoryLockError, StartupError
from kubegpu.mode import Mode
from tests.fronts import dra_driver
from tests.integration.dra.test_driver import put_claim
from tests.integration.test_serve import Serve, start
from tests.rig.kube import FakeKube
from tests.waiting import WAIT, eventually

NODE = "node-a"
DRIVER = "gpu.nvidia.com"
#: What NVIDIA's DRA driver keeps in `<plugins>/gpu.nvidia.com/checkpoint.json`.
NVIDIA_CHECKPOINT = (
    b'{"version":"v2","checksum":2319426367,"v1":{"preparedClaims":{}},'
    b'"v2":{"checksum":1876543210,"preparedClaims":{}}}'
)


def settings(root: Path, plugins: Path | None = None) -> DaemonSettings:
    return DaemonSettings(
        mode=Mode.DRA,
        simulate="h100-8",
        registrar_dir=root / "registry",
        kubelet_plugins_dir=plugins or root / "plugins",
        plugin_dir=root / "dp",
        cdi_dir=root / "cdi",
        node_name=NODE,
    )


@pytest.fixture
async def daemon(socket_dir: Path) -> AsyncIterator[tuple[Daemon, FakeKube]]:
    kube = FakeKube()
    running = Daemon(settings(socket_dir), kube=kube)
    stop = asyncio.Event()
    task = asyncio.create_task(running.run(stop))
    started = asyncio.create_task(running.started.wait())
    await asyncio.wait([task, started], return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        started.cancel()
        task.result()
    try:
        yield running, kube
    finally:
        stop.set()
        await task


async def test_the_flags_reach_the_daemon_settings() -> None:
    values = parse(
        serve,
        ["--kubelet-registrar-directory-path", "/r", "--kubelet-plugins-directory-path", "/p"],
        {"KUBEGPU_MODE": "dra"},
    )
    assert values["mode"] == "dra"
    assert values["kubelet_registrar_directory_path"] == "/r"
    assert values["kubelet_plugins_directory_path"] == "/p"
    assert parse(serve, [], {})["mode"] == "plugin"


async def test_simulated_node_serves_dra_and_no_device_plugin(
    daemon: tuple[Daemon, FakeKube], socket_dir: Path
) -> None:
    running, kube = daemon
    assert running.ready() == (True, "ok")
    reg = socket_dir / "registry" / "gpu.nvidia.com-reg.sock"
    async with grpc.aio.insecure_channel(f"unix://{reg}") as channel:
        info = await reg_grpc.RegistrationStub(channel).GetInfo(reg_pb.InfoRequest())  # type: ignore[no-untyped-call]
    assert info.endpoint == str(socket_dir / "plugins" / "gpu.nvidia.com" / "dra.sock")
    assert not (socket_dir / "dp").exists() or not any((socket_dir / "dp").iterdir())
    claim = put_claim(kube, "c", "gpu-5")
    answer = await dra_driver(running).preparer.prepare([claim])
    devices, error = answer[claim.uid]
    assert error == "" and [d.device for d in devices] == ["gpu-5"]
    spec = json.loads((socket_dir / "cdi" / spec_file_name(claim.uid)).read_text())
    nodes = [n["path"] for n in spec["devices"][0]["containerEdits"]["deviceNodes"]]
    assert nodes == ["/dev/nvidia5"]


async def test_stopping_removes_the_sockets_and_keeps_the_checkpoint(socket_dir: Path) -> None:
    kube = FakeKube()
    running = Daemon(settings(socket_dir), kube=kube)
    stop = asyncio.Event()
    task = asyncio.create_task(running.run(stop))
    await running.started.wait()
    claim = put_claim(kube, "c", "gpu-0")
    await dra_driver(running).preparer.prepare([claim])
    stop.set()
    await task
    assert not (socket_dir / "registry" / "gpu.nvidia.com-reg.sock").exists()
    assert not (socket_dir / "plugins" / "gpu.nvidia.com" / "dra.sock").exists()
    assert (socket_dir / "plugins" / "gpu.nvidia.com" / CHECKPOINT_FILE).exists()
    assert (socket_dir / "cdi" / spec_file_name(claim.uid)).exists()


async def test_two_dra_daemons_cannot_share_the_plugins_directory(
    daemon: tuple[Daemon, FakeKube], socket_dir: Path
) -> None:
    second = Daemon(settings(socket_dir), kube=FakeKube())
    with pytest.raises(
        DirectoryLockError,
        match=r"DRA driver directory .*/gpu\.nvidia\.com is in use by another kubegpu serve; "
        r"stop it first, give this one another --kubelet-plugins-directory-path$",
    ):
        await second.run(asyncio.Event())
    # The first one still serves: the refused one stopped nothing of it.
    running, _ = daemon
    assert running.ready() == (True, "ok")


async def test_the_daemon_writes_nothing_in_the_plugins_directory_beside_its_own(
    daemon: tuple[Daemon, FakeKube], socket_dir: Path
) -> None:
    """The chart mounts `<plugins>/<driver>` alone (other drivers' sockets and state stay
    out of the pod): the lock and everything else live in the driver's directory."""
    assert sorted(p.name for p in (socket_dir / "plugins").iterdir()) == ["gpu.nvidia.com"]


async def test_a_dra_socket_path_over_the_unix_limit_is_refused(socket_dir: Path) -> None:
    deep = socket_dir / ("d" * 100)
    running = Daemon(settings(socket_dir, deep), kube=FakeKube())
    with pytest.raises(StartupError, match="longer than 107 bytes"):
        await running.run(asyncio.Event())


async def test_claims_are_answered_over_the_socket(
    daemon: tuple[Daemon, FakeKube], socket_dir: Path
) -> None:
    _, kube = daemon
    claim = put_claim(kube, "c", "gpu-7")
    sock = socket_dir / "plugins" / "gpu.nvidia.com" / "dra.sock"
    async with grpc.aio.insecure_channel(f"unix://{sock}") as channel:
        request = dra_pb2.NodePrepareResourcesRequest(claims=[claim])
        answer = await dra_stub(channel).NodePrepareResources(request)
    assert answer.claims[claim.uid].devices[0].device_name == "gpu-7"


async def test_a_newer_xid_on_an_unhealthy_gpu_is_the_taint_of_its_device(
    daemon: tuple[Daemon, FakeKube],
) -> None:
    """The slice's taint names the Xid that made the GPU unhealthy; another Xid on the GPU
    while it is unhealthy left the first in the taint until the periodic comparison."""
    running, kube = daemon
    backend = running.backend
    assert isinstance(backend, SimulatedBackend)

    def taint_of_gpu_0() -> str | None:
        for body in kube.resource_slices.values():
            for device in body["spec"].get("devices") or []:
                if device["name"] == "gpu-0":
                    taints = device.get("taints") or [{}]
                    return str(taints[0].get("value"))
        return None

    backend.inject_xid(0, 61)  # unhealthy until its probes pass
    await eventually(lambda: taint_of_gpu_0() == "61")
    backend.inject_xid(0, 79)  # fallen off the bus: unhealthy until a reset
    await eventually(lambda: taint_of_gpu_0() == "79")


async def test_dra_mode_needs_the_node_name() -> None:
    from kubegpu.cli.options import UsageError
    from kubegpu.cli.serve import check_serve

    values = parse(serve, ["--mode", "dra"], {})
    with pytest.raises(UsageError, match=r"--mode dra \(KUBEGPU_MODE\) needs --node-name"):
        check_serve(values, {})
    check_serve(parse(serve, ["--mode", "dra", "--node-name", "n1"], {}), {})


async def test_a_clean_stop_with_no_claim_prepared_leaves_nothing_for_nvidias_driver(
    socket_dir: Path,
) -> None:
    """After an uninstall NVIDIA's DRA driver must start on the node: its checkpoint is
    untouched, and nothing of ours is left in its directory, the registry or the CDI
    directory."""
    data = socket_dir / "plugins" / DRIVER
    data.mkdir(parents=True)
    nvidia = data / LEGACY_FILE
    nvidia.write_bytes(NVIDIA_CHECKPOINT)
    kube = FakeKube()
    running = Daemon(settings(socket_dir), kube=kube)
    stop = asyncio.Event()
    task = asyncio.create_task(running.run(stop))
    await running.started.wait()
    assert (data / CHECKPOINT_FILE).exists()
    claim = put_claim(kube, "c", "gpu-0")
    assert (await dra_driver(running).preparer.prepare([claim]))[claim.uid][1] == ""
    assert await dra_driver(running).preparer.unprepare([claim]) == {claim.uid: ""}
    stop.set()
    await task
    assert sorted(p.name for p in data.iterdir()) == [LEGACY_FILE]
    assert nvidia.read_bytes() == NVIDIA_CHECKPOINT
    assert list((socket_dir / "registry").iterdir()) == []
    assert list((socket_dir / "cdi").iterdir()) == []


async def test_a_kubegpu_checkpoint_at_nvidias_name_is_adopted_with_its_claims(
    socket_dir: Path,
) -> None:
    """An earlier kubegpu kept its checkpoint as `checkpoint.json`: the next start moves
    it to kubegpu's own name and answers its claims from it."""
    kube = FakeKube()
    first = Daemon(settings(socket_dir), kube=kube)
    stop = asyncio.Event()
    task = asyncio.create_task(first.run(stop))
    await first.started.wait()
    claim = put_claim(kube, "c", "gpu-3")
    await dra_driver(first).preparer.prepare([claim])
    stop.set()
    await task
    data = socket_dir / "plugins" / DRIVER
    (data / CHECKPOINT_FILE).rename(data / LEGACY_FILE)
    # No claim in this API: only the adopted checkpoint can answer it.
    second = Daemon(settings(socket_dir), kube=FakeKube())
    stop = asyncio.Event()
    task = asyncio.create_task(second.run(stop))
    try:
        await second.started.wait()
        devices, error = (await dra_driver(second).preparer.prepare([claim]))[claim.uid]
        assert error == "" and [d.device for d in devices] == ["gpu-3"]
        assert not os.path.lexists(data / LEGACY_FILE)
        assert claim.uid in json.loads((data / CHECKPOINT_FILE).read_text())["claims"]
    finally:
        stop.set()
        await task


# -- `serve --mode dra` as a process, with hostile files where the checkpoints go -----------


def dra_serve_cmd(root: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "kubegpu.cli",
        "serve",
        "--mode",
        "dra",
        "--simulate",
        "h100-8",
        "--node-name",
        NODE,
        "--kubelet-plugins-directory-path",
        str(root / "plugins"),
        "--kubelet-registrar-directory-path",
        str(root / "registry"),
        "--device-plugin-path",
        str(root / "dp"),
    ]


async def start_dra_serve(root: Path) -> Serve:
    # No API server: the slice publisher retries in the background, start-up does not wait.
    return await start(dra_serve_cmd(root), KUBECONFIG=str(root / "no-kubeconfig"))


async def ended(serve: Serve) -> tuple[int, str]:
    """Wait (up to WAIT) for `serve` to exit by itself; killed if it does not."""
    try:
        code = await asyncio.wait_for(serve.proc.wait(), WAIT)
    finally:
        if serve.proc.returncode is None:
            serve.proc.kill()
            await serve.proc.wait()
    await asyncio.wait_for(serve._reader, WAIT)
    return code, "".join(serve.lines)


async def stopped(serve: Serve) -> tuple[int, str]:
    """SIGTERM `serve` and wait (up to WAIT) for its exit; killed if it does not end."""
    if serve.proc.returncode is None:
        serve.proc.send_signal(signal.SIGTERM)
    return await ended(serve)


def fifo(path: Path) -> None:
    os.mkfifo(path)


def urandom_link(path: Path) -> None:
    path.symlink_to("/dev/urandom")


def directory(path: Path) -> None:
    path.mkdir()


def plant(root: Path, name: str, what: Callable[[Path], None]) -> Path:
    path = root / "plugins" / DRIVER / name
    path.parent.mkdir(parents=True, exist_ok=True)
    what(path)
    return path


@pytest.mark.parametrize(
    ("what", "kind"),
    [(fifo, "a FIFO"), (urandom_link, "a symbolic link"), (directory, "a directory")],
    ids=["fifo", "urandom-link", "directory"],
)
async def test_no_regular_file_at_the_checkpoint_path_ends_serve_with_one_line(
    socket_dir: Path, what: Callable[[Path], None], kind: str
) -> None:
    """Not read (a FIFO would hang the start where SIGTERM cannot end it, /dev/urandom
    fill memory) and not moved: kubegpu writes only a regular file there."""
    path = plant(socket_dir, CHECKPOINT_FILE, what)
    code, out = await ended(await start_dra_serve(socket_dir))
    assert code == 1, out
    [line] = [line for line in out.splitlines() if str(path) in line]
    assert line == (
        f"kubegpu: DRA checkpoint {path} is {kind}, not a regular file: kubegpu writes "
        f"nothing else there; remove it and start again (claim CDI specs on disk are kept "
        f"and adopted)"
    )
    assert "Traceback" not in out
    assert os.path.lexists(path)


@pytest.mark.parametrize("what", [fifo, urandom_link], ids=["fifo", "urandom-link"])
async def test_a_fifo_or_device_link_at_nvidias_checkpoint_name_is_left_alone(
    socket_dir: Path, what: Callable[[Path], None]
) -> None:
    """`checkpoint.json` is NVIDIA's DRA driver's name: whatever is there is not ours,
    and `serve` starts beside it without blocking on it; SIGTERM then ends it."""
    path = plant(socket_dir, LEGACY_FILE, what)
    before = os.lstat(path)
    serve = await start_dra_serve(socket_dir)
    try:
        await serve.wait_for_line(f"DRA driver {DRIVER}: serving")
    finally:
        code, out = await stopped(serve)
    assert code == 0, out
    after = os.lstat(path)
    assert (after.st_ino, stat.S_IFMT(after.st_mode)) == (
        before.st_ino,
        stat.S_IFMT(before.st_mode),
    )
    assert not os.path.lexists(path.parent / CHECKPOINT_FILE)  # a clean stop, no claim
