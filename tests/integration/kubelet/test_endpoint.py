"""One connected plugin as the emulator sees it, over real unix sockets.

ListAndWatch updates and health, stream end and grace period, rolling updates with two
endpoints under each kubelet modelled (1.36: one client per resource; 1.37+: an endpoint
per socket), and watching the emulator (kubelet/endpoint.py, the manager's observation).
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from kubegpu.api import HEALTHY, UNHEALTHY
from kubegpu.kubelet import (
    AdmissionError,
    KubeletEmulator,
)
from tests.integration.kubelet.fakes import GPU, MakePlugin, dev, gpus
from tests.waiting import eventually

# ------------------------------------------------------------------------ ListAndWatch


async def test_one_device_health_flips(kubelet: KubeletEmulator, make_plugin: MakePlugin) -> None:
    plugin = make_plugin([dev("gpu-0")])
    await plugin.serve_and_register()
    await kubelet.wait_for_resource(GPU, capacity=1, allocatable=1)
    await plugin.set_health("gpu-0", UNHEALTHY)
    await kubelet.wait_for_resource(GPU, capacity=1, allocatable=0)
    assert not kubelet.devices(GPU)["gpu-0"].healthy
    await plugin.set_health("gpu-0", HEALTHY)
    await kubelet.wait_for_resource(GPU, capacity=1, allocatable=1)
    assert kubelet.history(GPU) == [(1, 1), (1, 0), (1, 1)]


async def test_four_devices_health_flips(kubelet: KubeletEmulator, make_plugin: MakePlugin) -> None:
    plugin = make_plugin(gpus(4))
    await plugin.serve_and_register()
    await kubelet.wait_for_resource(GPU, capacity=4, allocatable=4)
    # The node e2e sequence: 4/4 → 3/4 → 4/4 → 2/4 → 3/4 → 4/4.
    for unhealthy, expected in [
        ({"gpu-0"}, 3),
        (set(), 4),
        ({"gpu-1", "gpu-2"}, 2),
        ({"gpu-2"}, 3),
        (set(), 4),
    ]:
        await plugin.set_devices(
            [dev(f"gpu-{i}", UNHEALTHY if f"gpu-{i}" in unhealthy else HEALTHY) for i in range(4)]
        )
        await kubelet.wait_for_resource(GPU, capacity=4, allocatable=expected)
    assert kubelet.history(GPU) == [(4, 4), (4, 3), (4, 4), (4, 2), (4, 3), (4, 4)]


async def test_update_replaces_whole_device_set(
    kubelet: KubeletEmulator, make_plugin: MakePlugin
) -> None:
    plugin = make_plugin(gpus(4))
    await plugin.serve_and_register()
    await kubelet.wait_for_resource(GPU, capacity=4)
    await plugin.set_devices([dev("gpu-9", UNHEALTHY)])
    await kubelet.wait_for_resource(GPU, capacity=1, allocatable=0)
    assert list(kubelet.devices(GPU)) == ["gpu-9"]


async def test_stream_end_marks_unhealthy_no_retry_then_gone(
    kubelet: KubeletEmulator,
    make_plugin: MakePlugin,
) -> None:
    plugin = make_plugin(gpus(4))
    await plugin.serve_and_register()
    await kubelet.wait_for_resource(GPU, capacity=4, allocatable=4)
    await plugin.end_streams()
    await kubelet.wait_for_resource(GPU, capacity=4, allocatable=0)
    assert GPU in kubelet.resources
    # After the grace period (0.2 s here) the resource disappears; no retry meanwhile.
    await kubelet.wait_for(lambda: GPU not in kubelet.resources)
    assert plugin.calls["ListAndWatch"] == 1
    assert len(kubelet.calls("ListAndWatch")) == 1
    assert kubelet.history(GPU) == [(4, 4), (4, 0), (0, 0)]


async def test_plugin_death_marks_unhealthy(
    kubelet: KubeletEmulator, make_plugin: MakePlugin
) -> None:
    plugin = make_plugin(gpus(2))
    await plugin.serve_and_register()
    await kubelet.wait_for_resource(GPU, capacity=2, allocatable=2)
    await plugin.stop()
    await kubelet.wait_for_resource(GPU, capacity=2, allocatable=0)
    assert kubelet.endpoints(GPU) == {"fake.sock": False}


async def test_plugin_restart_restores_capacity_keeps_assignments(
    kubelet: KubeletEmulator,
    make_plugin: MakePlugin,
) -> None:
    plugin = make_plugin(gpus(2))
    await plugin.serve_and_register()
    await kubelet.wait_for_resource(GPU, capacity=2, allocatable=2)
    first = await kubelet.allocate(GPU, 1, pod="p1")
    await plugin.stop()
    await kubelet.wait_for_resource(GPU, capacity=2, allocatable=0)
    await plugin.serve_and_register()
    await kubelet.wait_for_resource(GPU, capacity=2, allocatable=2)
    again = await kubelet.allocate(GPU, 1, pod="p1")
    assert again.cached and again.device_ids == first.device_ids
    other = await kubelet.allocate(GPU, 1, pod="p2")
    assert set(other.device_ids).isdisjoint(first.device_ids)


async def test_device_id_longer_than_63_is_rejected(
    kubelet: KubeletEmulator, make_plugin: MakePlugin
) -> None:
    plugin = make_plugin(gpus(1))
    await plugin.serve_and_register()
    await kubelet.wait_for_resource(GPU, capacity=1)
    await plugin.set_devices([dev("x" * 64), dev("gpu-1")])
    await kubelet.wait_for(lambda: bool(kubelet.rejected_updates))
    assert "63" in kubelet.rejected_updates[0]
    assert list(kubelet.devices(GPU)) == ["gpu-0"]


# ------------------------------------------------------------------------ rolling update


async def test_two_endpoints_keep_capacity(
    newest_kubelet: KubeletEmulator, make_plugin: MakePlugin
) -> None:
    kubelet = newest_kubelet
    old = make_plugin(gpus(2), socket="old.sock")
    await old.serve_and_register()
    await kubelet.wait_for_resource(GPU, capacity=2, allocatable=2)
    new = make_plugin(gpus(2), socket="new.sock")
    await new.serve_and_register()
    # Wait until the new instance's own report is the one in force.
    await kubelet.wait_for(
        lambda: (
            kubelet.endpoints(GPU) == {"old.sock": True, "new.sock": True}
            and all(d.endpoint == "new.sock" for d in kubelet.devices(GPU).values())
        )
    )
    await old.stop()
    # The old endpoint goes at once (no grace period: a sibling serves the resource) and
    # the devices stay as they were: capacity never dipped.
    await kubelet.wait_for(lambda: kubelet.endpoints(GPU) == {"new.sock": True})
    assert (kubelet.capacity(GPU), kubelet.allocatable(GPU)) == (2, 2)
    allocation = await kubelet.allocate(GPU, 1)
    assert allocation.envs["PLUGIN"] == "new.sock"
    assert kubelet.history(GPU) == [(2, 2)]


async def test_the_newest_endpoint_allocates_the_last_update_wins(
    each_kubelet: KubeletEmulator, make_plugin: MakePlugin
) -> None:
    """The kubelet keeps one device set per resource and one primary endpoint: whichever
    endpoint sent the last ListAndWatch update defines the devices, even the older one, and
    the newest registration answers Allocate, even for devices only the older advertised.
    Both kubelets agree on this; they differ in what an ending stream does."""
    kubelet = each_kubelet
    old = make_plugin([dev("a-0")], socket="old.sock")
    new = make_plugin([dev("b-0")], socket="new.sock")
    await old.serve_and_register()
    await kubelet.wait_for_resource(GPU, capacity=1)
    await new.serve_and_register()
    await kubelet.wait_for(lambda: list(kubelet.devices(GPU)) == ["b-0"])
    assert kubelet.capacity(GPU) == 1  # not the union of both reports
    await old.set_devices([dev("a-0"), dev("a-1")])
    await kubelet.wait_for_resource(GPU, capacity=2, allocatable=2)
    assert set(kubelet.devices(GPU)) == {"a-0", "a-1"}
    allocation = await kubelet.allocate(GPU, 1, pod="p1")
    assert allocation.device_ids[0].startswith("a-")
    assert allocation.envs["PLUGIN"] == "new.sock"
    assert (old.calls["Allocate"], new.calls["Allocate"]) == (0, 1)


async def test_the_primary_ending_promotes_the_sibling(
    newest_kubelet: KubeletEmulator, make_plugin: MakePlugin
) -> None:
    kubelet = newest_kubelet
    old = make_plugin(gpus(2), socket="old.sock")
    new = make_plugin(gpus(2), socket="new.sock")
    await old.serve_and_register()
    await new.serve_and_register()
    await kubelet.wait_for(lambda: len(kubelet.endpoints(GPU)) == 2)
    await new.stop()
    await kubelet.wait_for(lambda: kubelet.endpoints(GPU) == {"old.sock": True})
    assert kubelet.allocatable(GPU) == 2
    allocation = await kubelet.allocate(GPU, 1)
    assert allocation.envs["PLUGIN"] == "old.sock"
    # The last endpoint ending is a plugin gone: everything unhealthy, then the grace period.
    await old.stop()
    await kubelet.wait_for_resource(GPU, capacity=2, allocatable=0)
    await kubelet.wait_for(lambda: GPU not in kubelet.resources)


async def test_before_1_37_an_older_plugin_ending_disconnects_its_successor(
    kubelet: KubeletEmulator, make_plugin: MakePlugin, caplog: pytest.LogCaptureFixture
) -> None:
    """A 1.36 kubelet's `runClient` disconnects whichever client is registered when a
    stream ends: the old plugin stopping closes the successor's connection and makes every
    device unhealthy, though the successor runs on; only its registering again helps."""
    assert kubelet.version == (1, 36)  # the default
    old = make_plugin(gpus(2), socket="old.sock")
    new = make_plugin(gpus(2), socket="new.sock")
    await old.serve_and_register()
    await kubelet.wait_for_resource(GPU, capacity=2, allocatable=2)
    await new.serve_and_register()
    await kubelet.wait_for(
        lambda: (
            kubelet.endpoints(GPU) == {"old.sock": True, "new.sock": True}
            and all(d.endpoint == "new.sock" for d in kubelet.devices(GPU).values())
        )
    )
    # The successor's own stream ends too: the kubelet closed its connection.
    successor_ended = (
        '"ListAndWatch ended unexpectedly for device plugin" err="rpc error: code = Canceled '
        f'desc = grpc: the client connection is closing" resource="{GPU}"'
    )

    def said() -> list[str]:
        return [r.getMessage() for r in caplog.records]

    with caplog.at_level(logging.INFO, logger="kubegpu.kubelet"):
        await old.stop()
        await kubelet.wait_for(lambda: successor_ended in said())
    assert kubelet.endpoints(GPU) == {"new.sock": False}
    assert kubelet.history(GPU) == [(2, 2), (2, 0)]
    with pytest.raises(AdmissionError):
        await kubelet.allocate(GPU, 1)
    assert f'"Deregistered client" name="{GPU}"' in said()
    assert f'"Mark all resources Unhealthy for resource" resourceName="{GPU}"' in said()
    assert f'"Endpoint became unhealthy" resourceName="{GPU}"' in said()
    await new.register()
    await kubelet.wait_for(lambda: kubelet.endpoints(GPU) == {"new.sock": True})
    await kubelet.wait_for_resource(GPU, capacity=2, allocatable=2)
    assert kubelet.history(GPU) == [(2, 2), (2, 0), (2, 2)]
    assert new.calls["ListAndWatch"] == 2
    allocation = await kubelet.allocate(GPU, 1)
    assert allocation.envs["PLUGIN"] == "new.sock"


async def test_before_1_37_a_disconnected_successor_is_dropped_after_the_grace_period(
    kubelet: KubeletEmulator, make_plugin: MakePlugin
) -> None:
    old = make_plugin(gpus(2), socket="old.sock")
    new = make_plugin(gpus(2), socket="new.sock")
    await old.serve_and_register()
    await new.serve_and_register()
    await kubelet.wait_for(lambda: len(kubelet.endpoints(GPU)) == 2)
    await old.stop()
    # Nothing in the kubelet registers the successor again: its devices stay unhealthy
    # until the grace period removes the resource, while its process still serves.
    await kubelet.wait_for(lambda: GPU not in kubelet.resources)
    assert kubelet.history(GPU)[-2:] == [(2, 0), (0, 0)]
    assert (new.plugin_dir / new.socket).exists()


async def test_before_1_37_a_stream_left_open_by_a_re_registration_disconnects_it(
    kubelet: KubeletEmulator, make_plugin: MakePlugin
) -> None:
    """A plugin that registers again on its socket without ending its first stream: the
    1.36 kubelet replaces the client but the old loop runs on, and its end disconnects the
    new registration (the same `runClient`)."""
    plugin = make_plugin(gpus(2))
    await plugin.serve_and_register()
    await kubelet.wait_for_resource(GPU, capacity=2, allocatable=2)
    await plugin.register()
    await kubelet.wait_for(lambda: plugin.calls["ListAndWatch"] == 2)
    assert kubelet.endpoints(GPU) == {"fake.sock": True}
    await plugin.end_stream(1)  # the first stream only: the second stays open
    await kubelet.wait_for_resource(GPU, capacity=2, allocatable=0)
    assert kubelet.endpoints(GPU) == {"fake.sock": False}
    assert kubelet.history(GPU) == [(2, 2), (2, 0)]


async def test_from_1_37_an_older_plugin_ending_leaves_the_successor_alone(
    newest_kubelet: KubeletEmulator, make_plugin: MakePlugin
) -> None:
    kubelet = newest_kubelet
    old = make_plugin(gpus(2), socket="old.sock")
    new = make_plugin(gpus(2), socket="new.sock")
    await old.serve_and_register()
    await new.serve_and_register()
    await kubelet.wait_for(lambda: len(kubelet.endpoints(GPU)) == 2)
    # The successor's stream is open before the old plugin goes (on a loaded machine the
    # endpoint can be recorded before its ListAndWatch reaches the plugin).
    await eventually(lambda: new.calls["ListAndWatch"] == 1)
    await old.stop()
    await kubelet.wait_for(lambda: kubelet.endpoints(GPU) == {"new.sock": True})
    assert new.calls["ListAndWatch"] == 1
    assert kubelet.allocatable(GPU) == 2


async def test_disconnect_ends_the_current_plugins_stream(
    each_kubelet: KubeletEmulator, make_plugin: MakePlugin
) -> None:
    """`disconnect` is the kubelet dropping a plugin while both run (1.36: DeRegisterPlugin):
    the devices are unhealthy until the plugin registers again."""
    kubelet = each_kubelet
    plugin = make_plugin(gpus(2))
    await plugin.serve_and_register()
    await kubelet.wait_for_resource(GPU, capacity=2, allocatable=2)
    await kubelet.disconnect(GPU)
    await kubelet.wait_for(
        lambda: kubelet.endpoints(GPU) == {"fake.sock": False} and kubelet.allocatable(GPU) == 0
    )
    assert plugin.calls["ListAndWatch"] == 1
    await plugin.register()
    await kubelet.wait_for_resource(GPU, capacity=2, allocatable=2)
    assert kubelet.history(GPU) == [(2, 2), (2, 0), (2, 2)]


def test_a_version_that_is_not_major_minor_is_refused(socket_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"'latest' is not MAJOR.MINOR; give e.g. '1.36'"):
        KubeletEmulator(socket_dir, version="latest")
    assert KubeletEmulator(socket_dir, version="v1.37.0").endpoint_store


# ------------------------------------------------------------------------ observation


async def test_wait_timeout_names_expected_and_actual(kubelet: KubeletEmulator) -> None:
    with pytest.raises(TimeoutError) as info:
        await kubelet.wait_for_resource(GPU, capacity=4, allocatable=4, timeout=0.05)
    assert "expected example.com/gpu capacity=4 allocatable=4" in str(info.value)
    assert "actual capacity=0 allocatable=0" in str(info.value)


async def test_on_change_subscribers(kubelet: KubeletEmulator, make_plugin: MakePlugin) -> None:
    seen: list[str] = []
    unsubscribe = kubelet.on_change(seen.append)
    plugin = make_plugin(gpus(1))
    await plugin.serve_and_register()
    await kubelet.wait_for_resource(GPU, capacity=1)
    assert GPU in seen
    unsubscribe()
    seen.clear()
    await plugin.set_health("gpu-0", UNHEALTHY)
    await kubelet.wait_for_resource(GPU, allocatable=0)
    assert seen == []
