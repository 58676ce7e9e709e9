"""The node-state store: versions, derived specs, subscriptions, last-good on bad input."""

from __future__ import annotations

import asyncio

import pytest

from kubegpu.config import Config, parse_config
from kubegpu.devices import Health
from kubegpu.errors import ConfigError
from kubegpu.state import NodeStore
from tests.builders import gpu, inventory
from tests.waiting import WAIT

INV = inventory(gpu(0), gpu(1))
U0, U1 = (g.uuid for g in INV.gpus)
MPS = parse_config(
    "version: v1\nflags: {mpsRoot: /run/mps}\n"
    "sharing:\n  mps:\n    resources:\n    - {name: nvidia.com/gpu, replicas: 2}\n"
)


def test_update_makes_a_new_version_and_no_op_updates_make_none() -> None:
    store = NodeStore()
    first = store.update(inventory=INV)
    assert first.version == 1 and store.state is first
    assert store.update(inventory=INV) is first, "an equal value is no change"
    second = store.update(health={U1: Health.UNHEALTHY})
    assert second.version == 2 and second.inventory is INV
    assert first.health == {}, "snapshots are immutable"


def test_specs_are_derived_once_per_version_with_health() -> None:
    state = NodeStore().update(inventory=INV, health={U1: Health.UNHEALTHY})
    (spec,) = state.specs
    assert state.specs is state.specs, "built once per version"
    assert spec.healthy_count == 1 and spec.by_id[U1].health is Health.UNHEALTHY
    assert state.owners[U0] == "nvidia.com/gpu"


def test_mps_devices_are_unhealthy_until_their_daemon_is_ready() -> None:
    store = NodeStore()
    state = store.update(inventory=INV, config=MPS)
    (planned,) = state.planned
    assert planned.healthy_count == 4, "planned ignores MPS readiness"
    assert state.specs[0].healthy_count == 0, "no daemon yet: shown, not allocatable"
    state = store.update(mps_ready={"nvidia.com/gpu": False})
    assert state.specs[0].healthy_count == 0
    state = store.update(mps_ready={"nvidia.com/gpu": True})
    assert state.specs[0].healthy_count == 4


def test_update_refuses_a_config_that_cannot_serve_and_the_store_keeps_the_last() -> None:
    store = NodeStore()
    good = store.update(inventory=inventory(gpu(0, migs=["1g.10gb", "2g.20gb"])))
    single = parse_config("version: v1\nflags: {migStrategy: single}")
    with pytest.raises(ConfigError, match="one MIG profile"):
        store.update(config=single)
    assert store.state is good and store.state.config == Config()


async def test_subscribe_gives_the_current_state_then_the_newest_coalescing() -> None:
    store = NodeStore()
    store.update(inventory=INV)
    seen: list[int] = []
    stream = store.subscribe()
    seen.append((await anext(stream)).version)
    store.update(health={U0: Health.UNHEALTHY})
    store.update(health={})  # two changes before the subscriber runs: it sees the last
    latest = await asyncio.wait_for(anext(stream), WAIT)
    seen.append(latest.version)
    assert seen == [1, 3] and latest.health == {}


async def test_changes_yields_every_update_in_order() -> None:
    store = NodeStore()
    changes = store.changes()  # registered now: nothing after this is missed
    store.update(inventory=INV)
    store.update(health={U0: Health.UNHEALTHY})
    store.update(health={})
    pairs = [await asyncio.wait_for(anext(changes), WAIT) for _ in range(3)]
    assert [(b.version, a.version) for b, a in pairs] == [(0, 1), (1, 2), (2, 3)]
    assert [dict(a.health) for _, a in pairs] == [{}, {U0: Health.UNHEALTHY}, {}]
