"""The kubelet emulator's plugin watcher with DRA drivers over real unix sockets.

Each test follows a behaviour of pkg/kubelet/pluginmanager and cm/dra/plugin (see
tests.rig.dra.watcher and .plugins): registration, refusal, deregistration when the
registration socket goes, re-registration after a kubelet restart.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import pytest

from tests.integration.kubelet.dra_fakes import DRIVER, FakeDriver
from tests.rig.dra import V1_SERVICE, V1BETA1_SERVICE, DRAKubelet
from tests.rig.kube import FakeKube
from tests.waiting import WAIT

MakeDriver = Callable[..., Awaitable[FakeDriver]]


@pytest.fixture
async def make_driver(node: DRAKubelet, kube: FakeKube) -> AsyncIterator[MakeDriver]:
    made: list[FakeDriver] = []

    async def make(**kwargs: Any) -> FakeDriver:
        kwargs.setdefault("kube", kube)
        driver = FakeDriver(node.registry_dir, node.plugins_dir, **kwargs)
        made.append(driver)
        return await driver.start()

    try:
        yield make
    finally:
        for driver in made:
            await driver.stop()


async def test_a_driver_registers_and_is_told_so(node: DRAKubelet, make_driver: MakeDriver) -> None:
    driver = await make_driver()
    await node.wait_for_driver(DRIVER, timeout=WAIT)
    await node.wait_for(lambda: driver.statuses == [(True, "")], WAIT)
    # The driver hears the outcome before the kubelet's side records the attempt.
    await node.wait_for(lambda: len(node.attempts) == 1, WAIT)
    plugin = node.plugin(DRIVER)
    assert plugin is not None
    assert plugin.endpoint == str(driver.dra_path)
    assert plugin.service == V1_SERVICE
    [attempt] = node.attempts
    assert attempt.ok and attempt.type == "DRAPlugin" and attempt.name == DRIVER


async def test_the_service_is_the_first_the_plugin_lists_that_the_kubelet_knows(
    node: DRAKubelet, make_driver: MakeDriver
) -> None:
    await make_driver(versions=("v1beta1.DRAPlugin", "v1.DRAPlugin"), serve="v1beta1")
    await node.wait_for_driver(DRIVER, timeout=WAIT)
    plugin = node.plugin(DRIVER)
    assert plugin is not None and plugin.service == V1BETA1_SERVICE


async def test_an_unknown_plugin_type_is_refused_and_told_why(
    node: DRAKubelet, make_driver: MakeDriver
) -> None:
    driver = await make_driver(type="CSIPlugin")
    await node.wait_for(lambda: bool(driver.statuses), WAIT)
    registered, error = driver.statuses[0]
    assert not registered
    assert error == (
        f"RegisterPlugin error -- no handler registered for plugin type: CSIPlugin at socket "
        f"{driver.reg_path}"
    )
    assert node.drivers == []


async def test_no_supported_version_is_refused_and_retried_with_backoff(
    node: DRAKubelet, make_driver: MakeDriver
) -> None:
    driver = await make_driver(versions=("v2.DRAPlugin",))
    await node.wait_for(lambda: len(driver.statuses) >= 2, WAIT)
    registered, error = driver.statuses[0]
    assert not registered
    assert error == (
        "RegisterPlugin error -- plugin validation failed with err: invalid supported gRPC "
        f"versions of DRA driver plugin {DRIVER} at endpoint {driver.dra_path}: none of "
        'services supported by the plugin (["v2.DRAPlugin"]) are supported by the kubelet '
        '(["v1.DRAPlugin" "v1beta1.DRAPlugin"])'
    )
    assert node.drivers == []
    failed = [a for a in node.attempts if a.socket == str(driver.reg_path)]
    assert all(
        a.error == "RegisterPlugin error -- pluginHandler.ValidatePluginFunc failed" for a in failed
    )
    # Retried while the socket exists, each attempt later than the one before.
    assert [a.time for a in failed] == sorted(a.time for a in failed)


async def test_an_empty_version_list_is_refused(node: DRAKubelet, make_driver: MakeDriver) -> None:
    driver = await make_driver(versions=())
    await node.wait_for(lambda: bool(driver.statuses), WAIT)
    assert driver.statuses[0][1].endswith(
        "empty list of supported gRPC services (aka supported versions)"
    )


async def test_removing_the_registration_socket_deregisters_the_driver(
    node: DRAKubelet, make_driver: MakeDriver
) -> None:
    driver = await make_driver()
    await node.wait_for_driver(DRIVER, timeout=WAIT)
    driver.reg_path.unlink()
    await node.wait_for_driver(DRIVER, registered=False, timeout=WAIT)
    assert node.watcher.deregistrations == [(str(driver.reg_path), DRIVER, str(driver.dra_path))]


async def test_sockets_already_there_register_when_the_kubelet_restarts(
    node: DRAKubelet, make_driver: MakeDriver
) -> None:
    driver = await make_driver()
    await node.wait_for(lambda: len(node.attempts) == 1, WAIT)
    await node.restart()
    await node.wait_for(lambda: len(node.attempts) == 2, WAIT)
    assert driver.statuses == [(True, ""), (True, "")]
    assert node.drivers == [DRIVER]
    assert [a.ok for a in node.attempts] == [True, True]


async def test_a_socket_created_again_is_registered_again(
    node: DRAKubelet, make_driver: MakeDriver
) -> None:
    driver = await make_driver()
    await node.wait_for(lambda: len(driver.statuses) == 1, WAIT)
    await driver.stop()
    await node.wait_for_driver(DRIVER, registered=False, timeout=WAIT)
    await driver.start()
    await node.wait_for(lambda: len(driver.statuses) == 2, WAIT)
    assert driver.statuses == [(True, ""), (True, "")]
    assert node.drivers == [DRIVER]


async def test_files_and_hidden_sockets_are_not_plugins(
    node: DRAKubelet, make_driver: MakeDriver
) -> None:
    (node.registry_dir / "notes.sock").write_text("not a socket")
    hidden = await make_driver(reg_socket=".hidden-reg.sock", name="hidden.example.com")
    visible = await make_driver()
    await node.wait_for(lambda: len(node.attempts) == 1, WAIT)
    assert hidden.statuses == []
    assert [a.socket for a in node.attempts] == [str(visible.reg_path)]


async def test_a_socket_without_registration_service_fails_get_info_and_is_retried(
    node: DRAKubelet,
) -> None:
    path = node.registry_dir / "mute.sock"
    server = grpc.aio.server()
    server.add_insecure_port(f"unix://{path}")
    await server.start()
    try:
        await node.wait_for(lambda: len(node.attempts) >= 2, WAIT)
    finally:
        await server.stop(0)
    prefix = (
        f"RegisterPlugin error -- failed to get plugin info using RPC GetInfo at socket {path}, "
        "err: rpc error: code = Unimplemented"
    )
    assert all(a.error is not None and a.error.startswith(prefix) for a in node.attempts)
    assert node.drivers == []
