"""The DRA kubelet plugin over real unix sockets, called by grpc clients as the kubelet
calls it: registration, prepare/unprepare under both service names, errors, restarts."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx2
import pytest
from asyncinotify import Event as InotifyEvent
from asyncinotify import Inotify, Mask, Watch

from kubegpu.api import dra_pb2, dra_stub
from kubegpu.api import pluginregistration_pb2 as reg_pb
from kubegpu.api import pluginregistration_pb2_grpc as reg_grpc
from kubegpu.config import Config
from kubegpu.config.loader import parse_config
from kubegpu.dra.checkpoint import CHECKPOINT_FILE, Checkpoint, ClaimState
from kubegpu.dra.claims import spec_file_name
from kubegpu.dra.driver import DraDriver
from kubegpu.dra.service import (
    MAX_CLAIMS_READ,
    MAX_REQUEST_BYTES,
    READS_PER_PREPARE,
    SERVICES,
    ClaimPreparer,
    ClaimSource,
)
from kubegpu.dra.state import DeviceState
from kubegpu.kube import KubeClient, KubeError
from kubegpu.state import NodeStore
from tests.builders import gpu, inventory
from tests.rig.kube import FakeKube
from tests.waiting import WAIT, eventually

DRIVER = "gpu.nvidia.com"
NODE = "node-a"
#: UIDs of claims the API does not hold (deleted, or replaced by a claim of the same name).
UNKNOWN_UID = "3d9d1a52-5cf0-4a2b-9a4e-2f1d8b1e0c01"
OLD_UID = "3d9d1a52-5cf0-4a2b-9a4e-2f1d8b1e0c02"
GONE_UID = "3d9d1a52-5cf0-4a2b-9a4e-2f1d8b1e0c03"


@dataclass
class Plugin:
    driver: DraDriver
    kube: FakeKube
    store: NodeStore
    root: Path
    cdi_dir: Path
    channel: grpc.aio.Channel

    def call(self, method: str, service: str = SERVICES[0]) -> Any:
        response: Any = {
            "NodePrepareResources": dra_pb2.NodePrepareResourcesResponse,
            "NodeUnprepareResources": dra_pb2.NodeUnprepareResourcesResponse,
        }[method]
        return self.channel.unary_unary(
            f"/{service}/{method}",
            request_serializer=lambda message: message.SerializeToString(),
            response_deserializer=response.FromString,
        )

    async def prepare(self, *claims: dra_pb2.Claim, service: str = SERVICES[0]) -> Any:
        request = dra_pb2.NodePrepareResourcesRequest(claims=claims)
        return await self.call("NodePrepareResources", service)(request)

    async def unprepare(self, *claims: dra_pb2.Claim) -> Any:
        request = dra_pb2.NodeUnprepareResourcesRequest(claims=claims)
        return await self.call("NodeUnprepareResources")(request)

    def put_claim(self, name: str, *devices: str) -> dra_pb2.Claim:
        return put_claim(self.kube, name, *devices)

    def specs(self) -> list[str]:
        return sorted(p.name for p in self.cdi_dir.iterdir()) if self.cdi_dir.is_dir() else []


def put_claim(kube: FakeKube, name: str, *devices: str) -> dra_pb2.Claim:
    """An allocated claim of `devices` in the API, as the kubelet names it."""
    stored = kube.put_resource_claim(
        {
            "metadata": {"namespace": "ns", "name": name},
            "spec": {},
            "status": {
                "allocation": {
                    "devices": {
                        "results": [
                            {"request": "gpu", "driver": DRIVER, "pool": NODE, "device": d}
                            for d in devices
                        ]
                    }
                }
            },
        }
    )
    return dra_pb2.Claim(namespace="ns", name=name, uid=stored["metadata"]["uid"])


def make_driver(root: Path, store: NodeStore, kube: ClaimSource) -> DraDriver:
    preparer = ClaimPreparer(
        DeviceState(store, data_dir=root / "plugins" / DRIVER, cdi_dir=root / "cdi", pool=NODE),
        kube,
    )
    return DraDriver(
        preparer, driver=DRIVER, registrar_dir=root / "registry", plugins_dir=root / "plugins"
    )


async def running(driver: DraDriver) -> asyncio.Task[None]:
    await driver.start()
    return asyncio.create_task(driver.run())


async def stop(driver: DraDriver, task: asyncio.Task[None]) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await driver.stop()


@pytest.fixture
async def plugin(socket_dir: Path) -> AsyncIterator[Plugin]:
    store = NodeStore()
    store.update(inventory=inventory(gpu(0), gpu(1)), config=Config())
    kube = FakeKube()
    driver = make_driver(socket_dir, store, kube)
    task = await running(driver)
    channel = grpc.aio.insecure_channel(f"unix://{driver.service.path}")
    try:
        yield Plugin(driver, kube, store, socket_dir, socket_dir / "cdi", channel)
    finally:
        await channel.close(None)
        await stop(driver, task)


async def registration_info(path: Path) -> reg_pb.PluginInfo:
    async with grpc.aio.insecure_channel(f"unix://{path}") as channel:
        stub = reg_grpc.RegistrationStub(channel)  # type: ignore[no-untyped-call]
        info: reg_pb.PluginInfo = await stub.GetInfo(reg_pb.InfoRequest())
        return info


async def test_get_info_names_the_driver_its_socket_and_versions(plugin: Plugin) -> None:
    path = plugin.root / "registry" / f"{DRIVER}-reg.sock"
    info = await registration_info(path)
    assert info.type == "DRAPlugin"
    assert info.name == DRIVER
    assert info.endpoint == str(plugin.root / "plugins" / DRIVER / "dra.sock")
    assert list(info.supported_versions) == ["v1.DRAPlugin", "v1beta1.DRAPlugin"]


async def test_a_refused_registration_is_one_log_line(
    plugin: Plugin, caplog: pytest.LogCaptureFixture
) -> None:
    path = plugin.driver.registrar.path
    async with grpc.aio.insecure_channel(f"unix://{path}") as channel:
        stub = reg_grpc.RegistrationStub(channel)  # type: ignore[no-untyped-call]
        await stub.NotifyRegistrationStatus(
            reg_pb.RegistrationStatus(plugin_registered=False, error="no\nsuch version")
        )
    refused = [r.getMessage() for r in caplog.records if "refused to register" in r.getMessage()]
    assert len(refused) == 1 and "\n" not in refused[0]
    assert plugin.driver.ready() == (
        False,
        "the kubelet refused the DRA driver: no\nsuch version",
    )


@pytest.mark.parametrize("service", SERVICES)
async def test_prepare_writes_a_cdi_spec_and_answers_its_ids(plugin: Plugin, service: str) -> None:
    claim = plugin.put_claim("one", "gpu-1")
    answer = (await plugin.prepare(claim, service=service)).claims[claim.uid]
    assert answer.error == ""
    [device] = answer.devices
    assert (device.pool_name, device.device_name, list(device.request_names)) == (
        NODE,
        "gpu-1",
        ["gpu"],
    )
    assert list(device.cdi_device_ids) == [f"k8s.gpu.nvidia.com/claim={claim.uid}-gpu-1"]
    spec = json.loads((plugin.cdi_dir / spec_file_name(claim.uid)).read_text())
    assert spec["devices"][0]["containerEdits"]["deviceNodes"] == [{"path": "/dev/nvidia1"}]


async def test_prepare_is_idempotent_and_needs_no_api_the_second_time(plugin: Plugin) -> None:
    claim = plugin.put_claim("one", "gpu-0")
    first = await plugin.prepare(claim)
    plugin.kube.fail_with = KubeError("the API server is down")
    second = await plugin.prepare(claim)
    assert second == first


async def test_unprepare_removes_the_spec_and_an_unknown_claim_is_fine(plugin: Plugin) -> None:
    claim = plugin.put_claim("one", "gpu-0")
    await plugin.prepare(claim)
    spec = plugin.cdi_dir / spec_file_name(claim.uid)
    assert spec.exists()
    answer = await plugin.unprepare(claim)
    assert answer.claims[claim.uid].error == ""
    assert not spec.exists()
    assert claim.uid not in plugin.driver.preparer.state.checkpoint.claims
    again = await plugin.unprepare(claim, dra_pb2.Claim(namespace="ns", name="x", uid=UNKNOWN_UID))
    assert {u: c.error for u, c in again.claims.items()} == {claim.uid: "", UNKNOWN_UID: ""}


async def test_per_claim_errors_leave_the_other_claims_prepared(plugin: Plugin) -> None:
    good = plugin.put_claim("good", "gpu-0")
    stale = plugin.put_claim("stale", "gpu-1")
    replaced = dra_pb2.Claim(namespace="ns", name="stale", uid=OLD_UID)
    missing = dra_pb2.Claim(namespace="ns", name="gone", uid=GONE_UID)
    wrong = plugin.put_claim("wrong", "gpu-9")
    answer = await plugin.prepare(good, replaced, missing, wrong)
    errors = {uid: c.error for uid, c in answer.claims.items()}
    assert errors[good.uid] == ""
    assert "another claim of that name" in errors[OLD_UID]
    assert stale.uid in errors[OLD_UID]
    assert "cannot read it from the API" in errors[GONE_UID]
    assert "'gpu-9' does not exist" in errors[wrong.uid]
    assert sorted(p.name for p in plugin.cdi_dir.iterdir()) == [spec_file_name(good.uid)]


async def test_bad_requests_get_a_status_and_the_server_keeps_serving(plugin: Plugin) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as bad_uid:
        await plugin.prepare(dra_pb2.Claim(namespace="ns", name="x", uid="../../etc/passwd"))
    assert bad_uid.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "is not a Kubernetes object UID" in (bad_uid.value.details() or "")
    raw = plugin.channel.unary_unary(
        f"/{SERVICES[0]}/NodePrepareResources",
        request_serializer=lambda b: b,
        response_deserializer=dra_pb2.NodePrepareResourcesResponse.FromString,
    )
    with pytest.raises(grpc.aio.AioRpcError) as garbage:
        await raw(b"\x0a\x05\x1a\x03\xff\xfe\xfd")
    assert garbage.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.aio.AioRpcError) as huge:
        await raw(b"\x0a\x00" * (MAX_REQUEST_BYTES // 2 + 1))
    assert huge.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    claim = plugin.put_claim("after", "gpu-0")
    assert (await plugin.prepare(claim)).claims[claim.uid].error == ""


async def test_a_spec_that_cannot_be_written_fails_only_that_claim(plugin: Plugin) -> None:
    plugin.cdi_dir.write_text("a file where the CDI directory should be")
    claim = plugin.put_claim("one", "gpu-0")
    answer = (await plugin.prepare(claim)).claims[claim.uid]
    assert "cannot write its CDI spec" in answer.error
    assert claim.uid not in plugin.driver.preparer.state.checkpoint.claims


@pytest.mark.parametrize("which", ["service", "registrar"])
async def test_a_deleted_socket_is_served_again(plugin: Plugin, which: str) -> None:
    server = getattr(plugin.driver, which)
    served = server.served
    server.path.unlink()
    await eventually(lambda: server.served > served and server.serving)
    claim = plugin.put_claim("after", "gpu-0")
    async with grpc.aio.insecure_channel(f"unix://{plugin.driver.service.path}") as channel:
        plugin.channel = channel
        assert (await plugin.prepare(claim)).claims[claim.uid].error == ""
    info = await registration_info(plugin.driver.registrar.path)
    assert info.name == DRIVER


@pytest.mark.parametrize("which", ["service", "registrar"])
async def test_a_socket_replaced_by_another_is_served_again(plugin: Plugin, which: str) -> None:
    """The servers are known by the inode they bound (`rpc.UnixServer`): a socket someone
    else put at the name is not ours, and the kubelet would dial it."""
    server = getattr(plugin.driver, which)
    served = server.served
    with socket.socket(socket.AF_UNIX) as stranger:
        staged = server.path.with_name(".stranger")
        stranger.bind(str(staged))
        staged.replace(server.path)
        theirs = server.path.stat().st_ino
        await eventually(lambda: server.served > served and server.path.stat().st_ino != theirs)
    assert plugin.driver.ready() == (True, "ok")
    info = await registration_info(plugin.driver.registrar.path)
    assert info.name == DRIVER


class CountingInotify(Inotify):
    """inotify, counting the watches armed and the events read."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = 0
        self.read = 0

    def add_watch(self, path: Any, mask: Mask) -> Watch:
        self.armed += 1
        return super().add_watch(path, mask)

    def sync_get(self) -> InotifyEvent | None:
        event = super().sync_get()
        self.read += event is not None
        return event


async def test_checkpoint_writes_beside_the_socket_do_not_wake_the_socket_watch(
    socket_dir: Path,
) -> None:
    """The socket watch covers the driver's directory, where the checkpoint is replaced on
    every prepare and unprepare: each replacement re-armed the watch and woke its loop
    (1,402 times for 300 claims). Only the sockets' own names count now; a deleted socket
    is still served again."""
    store = NodeStore()
    store.update(inventory=inventory(gpu(0), gpu(1)), config=Config())
    kube = FakeKube()
    counting = CountingInotify()
    preparer = ClaimPreparer(
        DeviceState(
            store, data_dir=socket_dir / "plugins" / DRIVER, cdi_dir=socket_dir / "cdi", pool=NODE
        ),
        kube,
    )
    driver = DraDriver(
        preparer,
        driver=DRIVER,
        registrar_dir=socket_dir / "registry",
        plugins_dir=socket_dir / "plugins",
        inotify=lambda: counting,
    )

    async def read_beyond(events: int) -> None:
        await eventually(lambda: counting.read > events)

    task = await running(driver)
    try:
        await eventually(lambda: counting.armed > 0)
        armed = counting.armed
        for i in range(5):
            claim = put_claim(kube, f"c{i}", "gpu-0")
            read = counting.read
            await preparer.prepare([claim])
            await read_beyond(read)  # the watch has read the checkpoint's events
            read = counting.read
            await preparer.unprepare([claim])
            await read_beyond(read)
        assert counting.armed == armed
        served = driver.service.served
        driver.service.path.unlink()
        await eventually(lambda: driver.service.served > served and driver.service.serving)
    finally:
        await stop(driver, task)
        counting.close()


async def test_stop_removes_both_sockets_and_keeps_prepared_claims(socket_dir: Path) -> None:
    store = NodeStore()
    store.update(inventory=inventory(gpu(0)), config=Config())
    kube = FakeKube()
    driver = make_driver(socket_dir, store, kube)
    task = await running(driver)
    claim = put_claim(kube, "c", "gpu-0")
    await driver.preparer.prepare([claim])
    await stop(driver, task)
    assert not driver.service.path.exists() and not driver.registrar.path.exists()
    # A new process answers the same claim from the checkpoint, its spec still there.
    again = make_driver(socket_dir, store, FakeKube())
    task = await running(again)
    try:
        answer = await again.preparer.prepare([claim])
        assert answer[claim.uid][1] == ""
        assert answer[claim.uid][0][0].device == "gpu-0"
    finally:
        await stop(again, task)


async def test_a_restart_mid_prepare_leaves_nothing_behind(socket_dir: Path) -> None:
    """The process died after writing a claim's spec (or while writing another's), before
    recording them: the next start removes both, and the kubelet's retry prepares the
    claim afresh."""
    store = NodeStore()
    store.update(inventory=inventory(gpu(0)), config=Config())
    kube = FakeKube()
    claim = put_claim(kube, "c", "gpu-0")
    data = socket_dir / "plugins" / DRIVER
    Checkpoint(data).save()  # as the first start left it: no claim prepared yet
    cdi_dir = socket_dir / "cdi"
    cdi_dir.mkdir()
    (cdi_dir / spec_file_name(claim.uid)).write_text("{}")
    (cdi_dir / f".{spec_file_name('u-other')}.x1y2").write_text("{")
    driver = make_driver(socket_dir, store, kube)
    task = await running(driver)
    try:
        assert list(cdi_dir.iterdir()) == []
        assert driver.preparer.state.checkpoint.claims == {}
        answer = await driver.preparer.prepare([claim])
        assert answer[claim.uid][1] == ""
        assert [p.name for p in cdi_dir.iterdir()] == [spec_file_name(claim.uid)]
        assert json.loads((data / CHECKPOINT_FILE).read_text())["claims"].keys() == {claim.uid}
    finally:
        await stop(driver, task)


async def test_a_checkpoint_that_cannot_be_written_fails_the_claims_and_keeps_no_spec(
    plugin: Plugin,
) -> None:
    claim = plugin.put_claim("one", "gpu-0")
    # A directory where the checkpoint file goes: renaming the new file over it fails.
    blocker = plugin.driver.preparer.state.data_dir / CHECKPOINT_FILE
    blocker.unlink(missing_ok=True)
    blocker.mkdir()
    answer = (await plugin.prepare(claim)).claims[claim.uid]
    assert "cannot write the checkpoint" in answer.error
    assert plugin.specs() == []  # an unrecorded spec would be removed under the pod later
    blocker.rmdir()
    answer = (await plugin.prepare(claim)).claims[claim.uid]
    assert answer.error == "" and plugin.specs() == [spec_file_name(claim.uid)]
    blocker.unlink()
    blocker.mkdir()
    refused = (await plugin.unprepare(claim)).claims[claim.uid]
    assert "cannot write the checkpoint" in refused.error
    assert plugin.specs() == [spec_file_name(claim.uid)]  # kept for the kubelet's retry
    assert claim.uid in plugin.driver.preparer.state.checkpoint.claims
    blocker.rmdir()
    assert (await plugin.unprepare(claim)).claims[claim.uid].error == ""
    assert plugin.specs() == []


async def test_concurrent_prepares_of_one_claim_write_once(plugin: Plugin) -> None:
    claim = plugin.put_claim("one", "gpu-0")
    writes: Callable[[], int] = lambda: plugin.driver.preparer.state.checkpoint.writes  # noqa: E731
    before = writes()
    answers = await asyncio.gather(*(plugin.prepare(claim) for _ in range(5)))
    assert all(a == answers[0] for a in answers)
    assert writes() - before == 1  # the claim prepared once


async def test_time_sliced_gpu_is_prepared_for_several_claims(socket_dir: Path) -> None:
    config = parse_config(
        "version: v1\nsharing:\n  timeSlicing:\n    resources:\n"
        "    - name: nvidia.com/gpu\n      replicas: 4\n"
    )
    store = NodeStore()
    store.update(inventory=inventory(gpu(0)), config=config)
    kube = FakeKube()
    driver = make_driver(socket_dir, store, kube)
    task = await running(driver)
    try:
        claims = [put_claim(kube, f"c{i}", "gpu-0") for i in range(4)]
        answers = await driver.preparer.prepare(claims)
        assert all(error == "" for _, error in answers.values())
        assert len(list((socket_dir / "cdi").iterdir())) == 4
    finally:
        await stop(driver, task)


async def test_after_a_corrupt_checkpoint_the_kubelets_calls_still_clean_up(
    socket_dir: Path,
) -> None:
    """Specs found on disk are kept (running pods' containers may restart from them); the
    kubelet's prepare rebuilds the claim's spec and its unprepare removes it."""
    store = NodeStore()
    store.update(inventory=inventory(gpu(0)), config=Config())
    kube = FakeKube()
    claim = put_claim(kube, "c", "gpu-0")
    data = socket_dir / "plugins" / DRIVER
    data.mkdir(parents=True)
    (data / CHECKPOINT_FILE).write_text("garbage")
    cdi_dir = socket_dir / "cdi"
    cdi_dir.mkdir()
    spec = cdi_dir / spec_file_name(claim.uid)
    spec.write_text("{}")
    driver = make_driver(socket_dir, store, kube)
    task = await running(driver)
    try:
        assert spec.exists()
        assert driver.preparer.state.checkpoint.claims[claim.uid].state is ClaimState.ADOPTED
        answer = await driver.preparer.prepare([claim])
        assert answer[claim.uid][1] == ""
        assert json.loads(spec.read_text())["devices"][0]["name"] == f"{claim.uid}-gpu-0"
        assert await driver.preparer.unprepare([claim]) == {claim.uid: ""}
        assert not spec.exists()
    finally:
        await stop(driver, task)


async def test_a_restart_writes_a_prepared_claims_missing_spec_again(socket_dir: Path) -> None:
    """The kubelet never prepares a claim again that it holds as prepared, but a container
    of the pod that restarts needs the spec: it comes back from the checkpoint alone."""
    store = NodeStore()
    store.update(inventory=inventory(gpu(0), gpu(1)), config=Config())
    kube = FakeKube()
    driver = make_driver(socket_dir, store, kube)
    task = await running(driver)
    claim = put_claim(kube, "c", "gpu-0", "gpu-1")
    answer = await driver.preparer.prepare([claim])
    await stop(driver, task)
    spec = socket_dir / "cdi" / spec_file_name(claim.uid)
    written = spec.read_text()
    spec.unlink()
    # No claim in the API any more: the checkpoint is all there is.
    again = make_driver(socket_dir, store, FakeKube())
    task = await running(again)
    try:
        assert spec.read_text() == written
        assert again.preparer.state.checkpoint.claims[claim.uid].devices == answer[claim.uid][0]
    finally:
        await stop(again, task)


async def test_a_lost_checkpoint_keeps_the_prepared_claims_specs(socket_dir: Path) -> None:
    """The plugins directory emptied under running pods: their claims' specs stay, and the
    kubelet's unprepare still removes them."""
    store = NodeStore()
    store.update(inventory=inventory(gpu(0)), config=Config())
    kube = FakeKube()
    driver = make_driver(socket_dir, store, kube)
    task = await running(driver)
    claim = put_claim(kube, "c", "gpu-0")
    await driver.preparer.prepare([claim])
    await stop(driver, task)
    (socket_dir / "plugins" / DRIVER / CHECKPOINT_FILE).unlink()
    spec = socket_dir / "cdi" / spec_file_name(claim.uid)
    again = make_driver(socket_dir, store, kube)
    task = await running(again)
    try:
        assert spec.exists()
        assert again.preparer.state.checkpoint.claims[claim.uid].state is ClaimState.ADOPTED
        assert await again.preparer.unprepare([claim]) == {claim.uid: ""}
        assert not spec.exists()
    finally:
        await stop(again, task)


# -- names from outside are data ------------------------------------------------------------


async def refused(call: Any) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    return info.value


async def test_a_line_break_in_a_name_forges_no_log_line_and_releases_nothing(
    plugin: Plugin, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="kubegpu")
    claim = plugin.put_claim("one", "gpu-0")
    await plugin.prepare(claim)
    forged = "ns\n2026-01-01 00:00:00 INFO kubegpu.dra: all GPUs healthy"
    error = await refused(
        plugin.unprepare(dra_pb2.Claim(namespace=forged, name="x", uid=claim.uid))
    )
    assert "namespace 'ns\\n2026" in (error.details() or "")
    assert plugin.specs() == [spec_file_name(claim.uid)]
    assert claim.uid in plugin.driver.preparer.state.checkpoint.claims
    assert all("\n" not in r.getMessage() for r in caplog.records)


async def test_a_huge_name_is_refused_before_it_reaches_the_api_or_a_log_line(
    plugin: Plugin, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="kubegpu")
    claim = plugin.put_claim("c" * 100_000, "gpu-0")  # the fake stores any name
    await refused(plugin.prepare(claim))
    assert plugin.specs() == [] and plugin.kube.calls == []
    assert max(len(r.getMessage()) for r in caplog.records) < 2000


@pytest.mark.parametrize(
    ("namespace", "name"),
    [
        ("../../api/v1/namespaces/kube-system/secrets", "x"),
        ("ns", "../../../../../api/v1/namespaces/kube-system/secrets"),
    ],
)
async def test_a_path_in_a_name_sends_no_api_request(
    socket_dir: Path, namespace: str, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The plugin reads claims with its ServiceAccount's token: a `../` must not take that
    request to another path of the API."""
    kubeconfig = socket_dir / "kubeconfig"
    kubeconfig.write_text(
        json.dumps(
            {
                "clusters": [{"name": "c", "cluster": {"server": "https://kube.test"}}],
                "users": [{"name": "u", "user": {"token": "t"}}],
                "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "x",
            }
        )
    )
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    sent: list[str] = []

    def answer(request: httpx2.Request) -> httpx2.Response:
        sent.append(request.url.path)
        return httpx2.Response(404, json={"kind": "Status", "status": "Failure", "code": 404})

    store = NodeStore()
    store.update(inventory=inventory(gpu(0)), config=Config())
    driver = make_driver(socket_dir, store, KubeClient(transport=httpx2.MockTransport(answer)))
    task = await running(driver)
    try:
        async with grpc.aio.insecure_channel(f"unix://{driver.service.path}") as channel:
            call = dra_stub(channel).NodePrepareResources
            claim = dra_pb2.Claim(namespace=namespace, name=name, uid=UNKNOWN_UID)
            await refused(call(dra_pb2.NodePrepareResourcesRequest(claims=[claim])))
            assert sent == []
            # A well-named claim is read at its own path.
            claim = dra_pb2.Claim(namespace="ns", name="c", uid=UNKNOWN_UID)
            answer_ = await call(dra_pb2.NodePrepareResourcesRequest(claims=[claim]))
            assert "cannot read it from the API" in answer_.claims[UNKNOWN_UID].error
            assert sent == ["/apis/resource.k8s.io/v1/namespaces/ns/resourceclaims/c"]
    finally:
        await stop(driver, task)


async def test_a_uid_named_unlike_its_record_is_neither_released_nor_answered(
    plugin: Plugin,
) -> None:
    claim = plugin.put_claim("one", "gpu-0")
    await plugin.prepare(claim)
    spec = spec_file_name(claim.uid)
    for namespace, name in [("ns", "other"), ("other", "one")]:
        impostor = dra_pb2.Claim(namespace=namespace, name=name, uid=claim.uid)
        error = (await plugin.unprepare(impostor)).claims[claim.uid].error
        assert "this UID was prepared as claim ns/one" in error
        assert plugin.specs() == [spec]
        answer = (await plugin.prepare(impostor)).claims[claim.uid]
        assert "this UID was prepared as claim ns/one" in answer.error
        assert list(answer.devices) == []
    assert claim.uid in plugin.driver.preparer.state.checkpoint.claims
    assert (await plugin.unprepare(claim)).claims[claim.uid].error == ""
    assert plugin.specs() == []


# -- no request waits on an unrelated one -----------------------------------------------------


def put_unused_claim(kube: FakeKube, name: str) -> dra_pb2.Claim:
    """An allocated claim with no device of this driver: prepared without a CDI spec."""
    result = {"request": "nic", "driver": "nic.example.com", "pool": NODE, "device": "nic-0"}
    stored = kube.put_resource_claim(
        {
            "metadata": {"namespace": "ns", "name": name},
            "spec": {},
            "status": {"allocation": {"devices": {"results": [result]}}},
        }
    )
    return dra_pb2.Claim(namespace="ns", name=name, uid=stored["metadata"]["uid"])


class HeldReads:
    """The claims of `kube`, each read of a claim named `held-*` kept waiting (in the
    reading thread, as a slow API server would) until `release` is set."""

    def __init__(self, kube: FakeKube) -> None:
        self.kube = kube
        self.release = threading.Event()
        self.started = 0
        self.most = 0
        self._now = 0
        self._lock = threading.Lock()

    def get_resource_claim(self, namespace: str, name: str) -> dict[str, Any]:
        if name.startswith("held-"):
            with self._lock:
                self.started += 1
                self._now += 1
                self.most = max(self.most, self._now)
            try:
                self.release.wait(WAIT)
            finally:
                with self._lock:
                    self._now -= 1
        return self.kube.get_resource_claim(namespace, name)


@pytest.fixture
async def held(socket_dir: Path) -> AsyncIterator[tuple[Plugin, HeldReads]]:
    store = NodeStore()
    store.update(inventory=inventory(gpu(0), gpu(1)), config=Config())
    kube = FakeKube()
    reads = HeldReads(kube)
    driver = make_driver(socket_dir, store, reads)
    task = await running(driver)
    channel = grpc.aio.insecure_channel(f"unix://{driver.service.path}")
    try:
        yield Plugin(driver, kube, store, socket_dir, socket_dir / "cdi", channel), reads
    finally:
        reads.release.set()
        await channel.close(None)
        await stop(driver, task)


async def test_an_unprepare_does_not_wait_for_prepares_held_on_api_reads(
    held: tuple[Plugin, HeldReads],
) -> None:
    """More prepares than any default thread pool has threads, each held on its claim's
    read: an unprepare needs no read, and is answered while they all still wait."""
    plugin, reads = held
    done = plugin.put_claim("done", "gpu-0")
    assert (await plugin.prepare(done)).claims[done.uid].error == ""
    waiting = [put_unused_claim(plugin.kube, f"held-{i}") for i in range(40)]
    prepares = [asyncio.create_task(plugin.driver.preparer.prepare([c])) for c in waiting]
    await eventually(lambda: reads.started > 0)
    answer = await asyncio.wait_for(plugin.unprepare(done), WAIT)
    assert answer.claims[done.uid].error == ""
    assert plugin.specs() == []
    assert not any(p.done() for p in prepares)
    reads.release.set()
    for answers in await asyncio.gather(*prepares):
        assert [error for _, error in answers.values()] == [""]


async def test_a_one_claim_prepare_does_not_wait_for_a_large_one(
    held: tuple[Plugin, HeldReads],
) -> None:
    plugin, reads = held
    large = [put_unused_claim(plugin.kube, f"held-{i}") for i in range(MAX_CLAIMS_READ)]
    everything = asyncio.create_task(plugin.driver.preparer.prepare(large))
    await eventually(lambda: reads.started > 0)
    small = plugin.put_claim("small", "gpu-0")
    answer = await asyncio.wait_for(plugin.prepare(small), WAIT)
    assert answer.claims[small.uid].error == ""
    assert not everything.done()
    reads.release.set()
    answers = await everything
    assert all(error == "" for _, error in answers.values()) and len(answers) == len(large)
    # The large request never held more than its share of the reading threads.
    assert reads.most <= READS_PER_PREPARE


async def test_a_request_reads_a_bounded_number_of_claims_and_the_next_call_the_rest(
    plugin: Plugin,
) -> None:
    claims = [put_unused_claim(plugin.kube, f"c{i}") for i in range(MAX_CLAIMS_READ + 3)]

    def reads() -> int:
        return sum(c.startswith("get resourceclaim/") for c in plugin.kube.calls)

    first = await plugin.driver.preparer.prepare(claims)
    assert reads() == MAX_CLAIMS_READ
    errors = {uid: error for uid, (_, error) in first.items() if error}
    assert set(errors) == {c.uid for c in claims[MAX_CLAIMS_READ:]}
    assert all("not prepared in this call" in e for e in errors.values())
    # The kubelet sends the same claims again: those prepared come from the checkpoint.
    second = await plugin.driver.preparer.prepare(claims)
    assert reads() == MAX_CLAIMS_READ + 3
    assert all(error == "" for _, error in second.values()) and len(second) == len(claims)


async def test_a_request_logs_one_line_whatever_its_number_of_claims(
    plugin: Plugin, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kubegpu")
    claims = [put_unused_claim(plugin.kube, f"c{i}") for i in range(20)]
    claims.append(dra_pb2.Claim(namespace="ns", name="gone", uid=GONE_UID))
    await plugin.prepare(*claims)
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("kubegpu")]
    assert len(lines) == 2, lines
    assert lines[0].startswith("NodePrepareResources: prepared 20 claim(s): ns/c0 (")
    assert lines[0].endswith("; and 15 more")
    assert lines[1].startswith("NodePrepareResources: 1 of 21 claim(s) not prepared")
    caplog.clear()
    await plugin.unprepare(*claims)
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("kubegpu")]
    assert len(lines) == 1 and lines[0].startswith("NodeUnprepareResources: unprepared 20 claim(s)")
