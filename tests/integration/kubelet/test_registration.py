"""The emulator's Registration server on kubelet.sock, against small in-test plugins.

Validation, dialling inside Register, options from the plugin, re-registration
(kubelet/registration.py, `endpoint.dial`).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from kubegpu.api import VERSION, pb
from kubegpu.kubelet import (
    KubeletEmulator,
    endpoint,
)
from tests.integration.kubelet.fakes import GPU, MakePlugin, gpus
from tests.waiting import WAIT, Kubelet

# ------------------------------------------------------------------------ registration


async def test_registration_reports_capacity(
    kubelet: KubeletEmulator, make_plugin: MakePlugin
) -> None:
    plugin = make_plugin(gpus(2))
    await plugin.serve_and_register()
    await kubelet.wait_for_resource(GPU, capacity=2, allocatable=2)
    [record] = kubelet.registrations
    assert record.ok and record.resource == GPU and record.endpoint == "fake.sock"
    assert plugin.calls["GetDevicePluginOptions"] == 1
    assert plugin.calls["ListAndWatch"] == 1
    assert kubelet.history(GPU) == [(2, 2)]
    assert set(kubelet.devices(GPU)) == {"gpu-0", "gpu-1"}
    assert kubelet.resources == [GPU]


@pytest.mark.parametrize(
    ("version", "resource", "endpoint", "message"),
    [
        (
            "v1alpha1",
            GPU,
            "fake.sock",
            'requested API version "v1alpha1" is not supported by kubelet',
        ),
        (VERSION, "gpu", "fake.sock", 'the ResourceName "gpu" is invalid'),
        (VERSION, "kubernetes.io/gpu", "fake.sock", "is invalid"),
        (VERSION, "gpu.kubernetes.io/gpu", "fake.sock", "is invalid"),
        (VERSION, "requests.example.com/gpu", "fake.sock", "is invalid"),
        (VERSION, "example.com/" + "g" * 64, "fake.sock", "is invalid"),
        (VERSION, "example.com/gpu!", "fake.sock", "is invalid"),
        (VERSION, "example.com/-gpu", "fake.sock", "is invalid"),
        (VERSION, "Example.com/gpu", "fake.sock", "is invalid"),
        (VERSION, GPU, "sub/fake.sock", "invalid endpoint"),
        (VERSION, GPU, "", "invalid endpoint"),
    ],
    ids=[
        "version",
        "no-slash",
        "k8s-namespace",
        "k8s-subdomain",
        "requests-prefix",
        "name-too-long",
        "bad-char",
        "bad-start",
        "uppercase-prefix",
        "endpoint-slash",
        "endpoint-empty",
    ],
)
async def test_registration_validation(
    kubelet: KubeletEmulator,
    make_plugin: MakePlugin,
    version: str,
    resource: str,
    endpoint: str,
    message: str,
) -> None:
    plugin = make_plugin(gpus(1))
    await plugin.start()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await plugin.register(version=version, resource=resource, endpoint=endpoint)
    assert info.value.code() == grpc.StatusCode.UNKNOWN
    assert message in (info.value.details() or "")
    assert plugin.calls["GetDevicePluginOptions"] == 0
    assert plugin.calls["ListAndWatch"] == 0
    [record] = kubelet.registrations
    assert not record.ok and message in (record.error or "")
    assert kubelet.resources == []


async def test_longest_valid_name_is_accepted(
    kubelet: KubeletEmulator, make_plugin: MakePlugin
) -> None:
    name = "example.com/" + "g" * 63
    plugin = make_plugin(gpus(1), resource=name)
    await plugin.serve_and_register()
    await kubelet.wait_for_resource(name, capacity=1)


async def test_options_failure_fails_register(
    kubelet: KubeletEmulator, make_plugin: MakePlugin
) -> None:
    plugin = make_plugin(gpus(1))
    plugin.fail["GetDevicePluginOptions"] = grpc.StatusCode.INTERNAL
    await plugin.start()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await plugin.register()
    assert (info.value.details() or "").startswith(
        "failed to get device plugin options: rpc error: code = Internal desc = "
    )
    assert plugin.calls["ListAndWatch"] == 0
    assert kubelet.calls("ListAndWatch") == []
    assert kubelet.resources == [] and kubelet.capacity(GPU) == 0
    assert not kubelet.registrations[0].ok


async def test_register_before_serving_fails_to_dial(
    socket_dir: Path, make_plugin: MakePlugin
) -> None:
    async with Kubelet(socket_dir, dial_timeout=0.3) as kubelet:
        plugin = make_plugin(gpus(1))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await plugin.register()
        assert "failed to dial device plugin" in (info.value.details() or "")
        assert kubelet.resources == []


async def test_options_come_from_the_plugin_not_the_request(
    kubelet: KubeletEmulator,
    make_plugin: MakePlugin,
) -> None:
    plugin = make_plugin(gpus(2), preferred_available=False)
    await plugin.start()
    await plugin.register(
        options=pb.DevicePluginOptions(
            get_preferred_allocation_available=True, pre_start_required=True
        )
    )
    await kubelet.wait_for_resource(GPU, capacity=2)
    options = kubelet.options(GPU)
    assert options is not None and not options.get_preferred_allocation_available
    await kubelet.allocate(GPU, 1)
    assert plugin.calls["GetPreferredAllocation"] == 0
    assert plugin.calls["PreStartContainer"] == 0


async def test_reregistration_replaces_the_endpoint(
    kubelet: KubeletEmulator, make_plugin: MakePlugin
) -> None:
    plugin = make_plugin(gpus(2))
    await plugin.serve_and_register()
    await kubelet.wait_for_resource(GPU, capacity=2, allocatable=2)
    await plugin.register()
    await kubelet.wait_for(lambda: len(kubelet.calls("ListAndWatch")) == 2)
    await plugin.set_devices(gpus(3))
    await kubelet.wait_for_resource(GPU, capacity=3, allocatable=3)
    assert kubelet.endpoints(GPU) == {"fake.sock": True}
    assert kubelet.history(GPU) == [(2, 2), (3, 3)]


async def test_the_dial_shares_no_connection_with_other_channels_of_the_process(
    socket_dir: Path, make_plugin: MakePlugin, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kubelet's dial gets a connection of its own, as a grpc-go client connection
    does: a channel of the same process that failed to reach the socket (a client that
    called while the plugin's socket was gone) must not hold the dial in its reconnect
    backoff. Both sides get an hour of backoff, so sharing would fail the dial outright."""
    backoff = (
        ("grpc.initial_reconnect_backoff_ms", 3_600_000),
        ("grpc.min_reconnect_backoff_ms", 3_600_000),
    )
    monkeypatch.setattr(endpoint, "DIAL_OPTIONS", (*endpoint.DIAL_OPTIONS, *backoff))
    plugin = make_plugin(gpus(1))
    async with grpc.aio.insecure_channel(
        f"unix://{socket_dir / plugin.socket}", options=backoff
    ) as failed:
        state = failed.get_state(try_to_connect=True)
        async with asyncio.timeout(WAIT):
            while state is not grpc.ChannelConnectivity.TRANSIENT_FAILURE:
                await failed.wait_for_state_change(state)
                state = failed.get_state()
        async with Kubelet(socket_dir, dial_timeout=WAIT) as kubelet:
            await plugin.serve_and_register()
            await kubelet.wait_for_resource(GPU, capacity=1, allocatable=1)
            assert [r.ok for r in kubelet.registrations] == [True]
