"""The ResourceSlice publisher on FakeKube: it follows the node-state store (MIG layout,
config reload, health) into the API, with pool generations, 409 re-reads and retries."""

from __future__ import annotations

import asyncio
import copy
import logging
import threading
from collections.abc import AsyncIterator
from typing import Any

import pytest

from kubegpu.config import Config, parse_config
from kubegpu.devices import Health, HealthEvent, HealthEventKind
from kubegpu.devices.model import Inventory
from kubegpu.dra.publisher import (
    CONFLICT_RETRIES,
    FRESH_LIST_S,
    PACE_CAP_S,
    PACE_FIRST_S,
    SlicePublisher,
)
from kubegpu.dra.slices import AMD_DRIVER, NVIDIA_DRIVER, Fault
from kubegpu.health import HealthTracker
from kubegpu.kube import KubeError, SliceEvent
from kubegpu.kube.errors import status_error
from kubegpu.state import NodeState, NodeStore
from kubegpu.watch.backoff import Backoff
from tests.builders import gpu, inventory
from tests.rig.kube import FakeKube
from tests.waiting import WAIT, eventually

NODE = "node-1"
MIXED = parse_config("version: v1\nflags:\n  migStrategy: mixed\n")


def sliced(replicas: int) -> Config:
    return parse_config(
        "version: v1\nsharing:\n  timeSlicing:\n    resources:\n"
        f"    - name: nvidia.com/gpu\n      replicas: {replicas}\n"
    )


def stored(kube: FakeKube, driver: str = NVIDIA_DRIVER) -> list[dict[str, Any]]:
    return [
        s
        for s in kube.resource_slices.values()
        if s["spec"]["driver"] == driver and s["spec"]["nodeName"] == NODE
    ]


def devices(kube: FakeKube) -> dict[str, dict[str, Any]]:
    return {d["name"]: d for s in stored(kube) for d in s["spec"]["devices"]}


def generations(kube: FakeKube) -> set[int]:
    return {s["spec"]["pool"]["generation"] for s in stored(kube)}


def writes(kube: FakeKube) -> list[str]:
    return [c for c in kube.calls if not c.startswith("list ")]


@pytest.fixture
def kube() -> FakeKube:
    times = iter(f"2026-01-01T00:00:{s:02d}Z" for s in range(60))
    return FakeKube(clock=lambda: next(times))


def publisher(kube: FakeKube, store: NodeStore, **options: Any) -> SlicePublisher:
    # Writes paced a millisecond apart unless a test is about the pacing itself.
    options.setdefault("pace", Backoff(0.001, 0.002))
    return SlicePublisher(kube, store, NODE, drivers=(NVIDIA_DRIVER,), **options)


def lists(kube: FakeKube) -> int:
    return kube.request_counts()[("list", "resourceslices")]


def replaces(kube: FakeKube) -> int:
    return kube.request_counts()[("replace", "resourceslice")]


def taint(kube: FakeKube, device: str) -> str | None:
    """The device's taint in the API (its value, else its key), None when it has none."""
    taints = devices(kube).get(device, {}).get("taints")
    if not taints:
        return None
    return str(taints[0].get("value") or taints[0]["key"])


def store_of(inv: Inventory, config: Config | None = None) -> NodeStore:
    return NodeStore(NodeState(inventory=inv, config=config or Config(), version=1))


def test_first_sync_creates_the_pool_and_an_unchanged_one_writes_nothing(kube: FakeKube) -> None:
    store = store_of(inventory(gpu(0), gpu(1)))
    pub = publisher(kube, store)
    assert pub.sync(store.state) is True
    (obj,) = stored(kube)
    assert obj["metadata"]["name"].startswith(f"{NODE}-gpu.nvidia.com-")
    assert obj["spec"]["pool"] == {"name": NODE, "generation": 1, "resourceSliceCount": 1}
    assert list(devices(kube)) == ["gpu-0", "gpu-1"]
    before = list(kube.calls)
    assert pub.sync(store.state) is False
    assert kube.calls[len(before) :] == [f"list resourceslices/{NVIDIA_DRIVER}/{NODE}"]
    assert pub.published[NVIDIA_DRIVER] == stored(kube)


def test_two_syncs_at_once_never_publish_the_pool_twice() -> None:
    """A kubelet restart wipes the slices and re-registers the driver: the registration's
    sync and the watch's sync both find the pool empty. Run side by side they each created
    it (seen on a 1.36.2 cluster: two slices of one pool, claims unschedulable until the
    next resync); one sync must see what the other wrote."""
    first_listed = threading.Event()
    second_listed = threading.Event()

    class RacingKube(FakeKube):
        def list_resource_slices(self, driver: str, node: str) -> list[dict[str, Any]]:
            found = super().list_resource_slices(driver, node)
            if not first_listed.is_set():
                first_listed.set()
                # Hold the first sync's (empty) answer until the second sync has listed too,
                # or long enough that it evidently cannot while this one runs.
                second_listed.wait(timeout=2.0)
            else:
                second_listed.set()
            return found

    kube = RacingKube()
    store = store_of(inventory(gpu(0), gpu(1)))
    pub = publisher(kube, store)
    other = threading.Thread(target=lambda: (first_listed.wait(WAIT), pub.sync(store.state)))
    other.start()
    pub.sync(store.state)
    other.join(WAIT)
    assert not other.is_alive()
    assert len(stored(kube)) == 1


def test_a_mig_layout_change_replaces_the_slice_with_the_next_generation(kube: FakeKube) -> None:
    store = store_of(inventory(gpu(0), gpu(1)), MIXED)
    pub = publisher(kube, store)
    pub.sync(store.state)
    (name,) = kube.resource_slices
    store.update(inventory=inventory(gpu(0, migs=("3g.40gb", "3g.40gb")), gpu(1)))
    assert pub.sync(store.state) is True
    assert list(kube.resource_slices) == [name]  # replaced in place, not re-created
    assert generations(kube) == {2}
    assert list(devices(kube)) == ["gpu-0-mig-3g40gb-1-0", "gpu-0-mig-3g40gb-2-0", "gpu-1"]
    assert writes(kube)[-1] == f"replace resourceslice/{name}"


def test_a_config_reload_changing_replicas_changes_the_shares(kube: FakeKube) -> None:
    store = store_of(inventory(gpu(0)), sliced(4))
    pub = publisher(kube, store)
    pub.sync(store.state)
    assert devices(kube)["gpu-0"]["capacity"]["shares"]["value"] == "4"
    store.update(config=sliced(8))
    pub.sync(store.state)
    shared = devices(kube)["gpu-0"]
    assert shared["capacity"]["shares"]["value"] == "8"
    assert generations(kube) == {2}
    store.update(config=Config())  # sharing switched off: an exclusive device again
    pub.sync(store.state)
    assert "allowMultipleAllocations" not in devices(kube)["gpu-0"]
    assert generations(kube) == {3}


def test_health_taints_a_device_keeps_its_time_and_recovery_lifts_it(kube: FakeKube) -> None:
    store = store_of(inventory(gpu(0), gpu(1)))
    pub = publisher(kube, store)
    pub.sync(store.state)
    faults = {gpu(0).uuid: Fault(xid=79)}
    store.update(health={gpu(0).uuid: Health.UNHEALTHY}, faults=faults)
    pub.sync(store.state)
    (taint,) = devices(kube)["gpu-0"]["taints"]
    assert taint == {
        "key": "gpu.nvidia.com/xid",
        "value": "79",
        "effect": "NoSchedule",
        "timeAdded": "2026-01-01T00:00:00Z",  # stamped by the (fake) API server
    }
    # Another device goes bad: the first taint keeps its time, the new one gets its own.
    store.update(health={gpu(0).uuid: Health.UNHEALTHY, gpu(1).uuid: Health.UNHEALTHY})
    pub.sync(store.state)
    assert devices(kube)["gpu-0"]["taints"] == [taint]
    assert devices(kube)["gpu-1"]["taints"] == [
        {
            "key": "gpu.nvidia.com/gpu-lost",
            "effect": "NoSchedule",
            "timeAdded": "2026-01-01T00:00:01Z",
        }
    ]
    store.update(health={}, faults={})
    pub.sync(store.state)
    assert all("taints" not in d for d in devices(kube).values())
    assert generations(kube) == {4}


def test_a_conflict_reads_the_slices_again_and_writes_once(kube: FakeKube) -> None:
    store = store_of(inventory(gpu(0)))
    pub = publisher(kube, store)
    pub.sync(store.state)
    (name,) = kube.resource_slices
    kube.fail_next(
        "replace resourceslice/", status_error(f"update ResourceSlice {name}", 409, "Conflict")
    )
    store.update(health={gpu(0).uuid: Health.UNHEALTHY})
    assert pub.sync(store.state) is True
    listing = f"list resourceslices/{NVIDIA_DRIVER}/{NODE}"
    assert kube.calls[-4:] == [
        listing,
        f"replace resourceslice/{name}",  # refused with 409
        listing,
        f"replace resourceslice/{name}",
    ]
    assert "taints" in devices(kube)["gpu-0"]


def test_conflicts_that_persist_become_the_failure(kube: FakeKube) -> None:
    store = store_of(inventory(gpu(0)))
    pub = publisher(kube, store)
    conflict = status_error("create ResourceSlice x", 409, "Conflict")
    for _ in range(CONFLICT_RETRIES + 1):
        kube.fail_next("create resourceslice/", conflict)
    with pytest.raises(KubeError) as info:
        pub.sync(store.state)
    assert info.value is conflict
    assert kube.calls.count(f"list resourceslices/{NVIDIA_DRIVER}/{NODE}") == CONFLICT_RETRIES + 1


def test_stale_and_surplus_slices_are_deleted(kube: FakeKube) -> None:
    store = store_of(inventory(gpu(0)))
    pub = publisher(kube, store)

    def stray(name: str, node: str) -> dict[str, Any]:
        pool = {"name": node, "generation": 5, "resourceSliceCount": 2}
        spec = {"driver": NVIDIA_DRIVER, "nodeName": node, "pool": pool}
        return {"metadata": {"name": name}, "spec": spec | {"devices": [{"name": "gpu-7"}]}}

    kube.create_resource_slice(stray("left-over", NODE))
    kube.create_resource_slice(stray("left-over-2", NODE))
    kube.create_resource_slice(stray("other", "n2"))
    pub.sync(store.state)
    (mine,) = stored(kube)
    assert mine["metadata"]["name"] == "left-over"  # reused, its devices replaced
    assert mine["spec"]["pool"] == {"name": NODE, "generation": 6, "resourceSliceCount": 1}
    assert "left-over-2" not in kube.resource_slices  # surplus: deleted after the write
    assert writes(kube)[-2:] == [
        "replace resourceslice/left-over",
        "delete resourceslice/left-over-2",
    ]
    assert "other" in kube.resource_slices  # another node's pool is not ours to touch
    store.update(inventory=inventory())  # every GPU gone: no pool at all
    pub.sync(store.state)
    assert [s["metadata"]["name"] for s in kube.resource_slices.values()] == ["other"]
    assert writes(kube)[-1] == "delete resourceslice/left-over"


def test_a_slice_of_another_pool_on_this_node_is_deleted_not_rewritten(kube: FakeKube) -> None:
    """A slice of this driver and node under another pool name (the daemon once ran with
    another node name) cannot become ours: the API refuses to change a pool's name, and
    rewriting it failed every sync, so no change (a taint) was published. Deleted, as
    Kubernetes' own slice controller deletes the pools it does not publish."""
    store = store_of(inventory(gpu(0)))
    pub = publisher(kube, store)
    pool = {"name": "old-name", "generation": 3, "resourceSliceCount": 1}
    spec = {"driver": NVIDIA_DRIVER, "nodeName": NODE, "pool": pool, "devices": []}
    kube.create_resource_slice({"metadata": {"name": "renamed"}, "spec": spec})
    assert pub.sync(store.state)
    assert "renamed" not in kube.resource_slices
    (mine,) = stored(kube)
    assert mine["spec"]["pool"]["name"] == NODE
    assert writes(kube)[-1] == "delete resourceslice/renamed"
    assert not pub.sync(store.state)  # settled: nothing more to write


def test_every_driver_publishes_its_own_vendors_devices(kube: FakeKube) -> None:
    store = store_of(inventory(gpu(0)))
    pub = SlicePublisher(kube, store, NODE)
    pub.sync(store.state)
    assert len(stored(kube)) == 1 and stored(kube, AMD_DRIVER) == []
    assert f"list resourceslices/{AMD_DRIVER}/{NODE}" in kube.calls
    assert pub.clear() == 1
    assert kube.resource_slices == {}


def test_mig_slices_take_their_parents_xid(kube: FakeKube) -> None:
    parent = gpu(0, migs=("1g.10gb",))
    store = store_of(inventory(parent), MIXED)
    pub = publisher(kube, store)
    store.update(health={parent.uuid: Health.UNHEALTHY}, faults={parent.uuid: Fault(xid=48)})
    pub.sync(store.state)
    (device,) = devices(kube).values()
    assert device["taints"][0]["value"] == "48"


def test_pcie_roots_are_read_for_the_inventorys_buses(kube: FakeKube) -> None:
    store = store_of(inventory(gpu(0), gpu(1)))
    asked: list[list[str]] = []

    def roots(buses: Any) -> dict[str, str]:
        asked.append(list(buses))
        return {"0000:10:00.0": "pci0000:0f"}

    publisher(kube, store, pcie_roots=roots).sync(store.state)
    assert asked == [["0000:10:00.0", "0000:11:00.0"]]
    published = devices(kube)
    assert published["gpu-0"]["attributes"]["resource.kubernetes.io/pcieRoot"] == {
        "string": "pci0000:0f"
    }
    assert "resource.kubernetes.io/pcieRoot" not in published["gpu-1"]["attributes"]


def test_the_health_tracker_says_which_xid_made_a_device_unhealthy() -> None:
    tracker = HealthTracker(Config().flags.health, clock=lambda: 0.0)
    tracker.observe(HealthEvent(gpu(0).uuid, HealthEventKind.XID, xid=79))
    tracker.observe(HealthEvent(gpu(1).uuid, HealthEventKind.PROBE_FAILED, detail="lost"))
    assert tracker.faults() == {
        gpu(0).uuid: Fault(79, "Xid 79 (GPU has fallen off the bus)"),
        gpu(1).uuid: Fault(None, "probe failed: lost"),
    }


# -- the loop ---------------------------------------------------------------------------------


@pytest.fixture
async def running(kube: FakeKube) -> AsyncIterator[tuple[NodeStore, SlicePublisher]]:
    store = store_of(inventory(gpu(0), gpu(1)))
    pub = publisher(kube, store, backoff=Backoff(0.01, 0.02))
    task = asyncio.ensure_future(pub.run())
    try:
        yield store, pub
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def test_the_loop_follows_the_store(
    kube: FakeKube, running: tuple[NodeStore, SlicePublisher]
) -> None:
    store, _ = running
    await eventually(lambda: list(devices(kube)) == ["gpu-0", "gpu-1"])
    store.update(health={gpu(1).uuid: Health.UNHEALTHY})
    await eventually(lambda: "taints" in devices(kube).get("gpu-1", {}))
    store.update(inventory=inventory(gpu(0)))
    await eventually(lambda: list(devices(kube)) == ["gpu-0"])
    assert generations(kube) == {3}


async def test_the_loop_follows_a_newer_xid_of_a_device_already_unhealthy(
    kube: FakeKube, running: tuple[NodeStore, SlicePublisher]
) -> None:
    """Only why moved (the store's faults, not its health map): the taint follows."""
    store, _ = running
    store.update(health={gpu(1).uuid: Health.UNHEALTHY}, faults={gpu(1).uuid: Fault(xid=79)})
    await eventually(lambda: taint(kube, "gpu-1") == "79")
    store.update(faults={gpu(1).uuid: Fault(xid=48)})
    await eventually(lambda: taint(kube, "gpu-1") == "48")


async def test_the_loop_retries_an_api_failure(
    kube: FakeKube, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="kubegpu.dra.publisher")
    down = KubeError(
        "list ResourceSlices of gpu.nvidia.com on node-1: HTTP 503 Service Unavailable"
    )
    kube.fail_next("list resourceslices/", down)
    store = store_of(inventory(gpu(0)))
    pub = publisher(kube, store, backoff=Backoff(0.01, 0.02))
    task = asyncio.ensure_future(pub.run())
    try:
        # The write lands before the loop sees the sync succeed: wait for what the test
        # asserts, the pacing started over, not for the write alone.
        await eventually(lambda: bool(stored(kube)) and pub.backoff.delay == 0.01)
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert [r.getMessage() for r in caplog.records] == [
        f"node {NODE}: cannot publish ResourceSlices: {down}; retrying in 0.0s"
    ]
    assert pub.backoff.delay == 0.01  # a success starts the pacing over


async def test_slices_deleted_by_someone_else_are_published_again_at_once(
    kube: FakeKube, running: tuple[NodeStore, SlicePublisher], caplog: pytest.LogCaptureFixture
) -> None:
    """A starting kubelet deletes its node's slices; the watch brings them back with no
    change of the node's state and long before the periodic comparison."""
    caplog.set_level(logging.INFO, logger="kubegpu.dra.publisher")
    store, pub = running
    assert pub.resync_s >= 600  # the periodic comparison cannot be what brings them back
    await eventually(lambda: list(devices(kube)) == ["gpu-0", "gpu-1"])
    version = store.state.version
    (name,) = [s["metadata"]["name"] for s in stored(kube)]
    await asyncio.to_thread(kube.delete_resource_slice, name)
    await eventually(lambda: list(devices(kube)) == ["gpu-0", "gpu-1"])
    assert store.state.version == version
    assert f"ResourceSlice {name} of {NVIDIA_DRIVER} was deleted; publishing it again" in (
        caplog.text
    )


async def test_resync_compares_with_the_api_at_once(kube: FakeKube) -> None:
    """What the watch cannot report (here: slices dropped behind its back) comes back when
    the driver asks, as it does when the kubelet registers it (later than just after the
    watch listed: see the next test)."""
    now = [0.0]
    store = store_of(inventory(gpu(0), gpu(1)))
    pub = publisher(kube, store, clock=lambda: now[0])
    task = asyncio.ensure_future(pub.run())
    try:
        await eventually(lambda: list(devices(kube)) == ["gpu-0", "gpu-1"])
        now[0] += FRESH_LIST_S
        kube.resource_slices.clear()  # no event: not through the API
        pub.resync()
        await eventually(lambda: list(devices(kube)) == ["gpu-0", "gpu-1"])
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def test_a_start_lists_the_slices_once_with_the_registration_after_it(
    kube: FakeKube,
) -> None:
    """A DRA start listed the slices three times: the first comparison, again for the
    watch's own first list, and again when the kubelet registered the driver. The first
    comparison now follows the watch's list, and a registration right after it is covered
    by that list and the watch's events since; a change after that reads nothing."""
    store = store_of(inventory(gpu(0), gpu(1)))
    pub = publisher(kube, store, clock=lambda: 0.0)
    task = asyncio.ensure_future(pub.run())
    try:
        await eventually(lambda: list(devices(kube)) == ["gpu-0", "gpu-1"])
        pub.resync()  # the kubelet registers the driver
        store.update(health={gpu(0).uuid: Health.UNHEALTHY})
        await eventually(lambda: "taints" in devices(kube)["gpu-0"])
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert lists(kube) == 1


async def test_the_periodic_comparison_reads_the_api(kube: FakeKube) -> None:
    """Between changes the publisher compares with what it last wrote, without a request;
    the periodic comparison still reads the API, for what no watch reported."""
    store = store_of(inventory(gpu(0), gpu(1)))
    pub = publisher(kube, store, resync_s=0.05)
    task = asyncio.ensure_future(pub.run())
    try:
        await eventually(lambda: list(devices(kube)) == ["gpu-0", "gpu-1"])
        kube.resource_slices.clear()  # no event: not through the API
        await eventually(lambda: list(devices(kube)) == ["gpu-0", "gpu-1"])
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


class EchoFirstKube(FakeKube):
    """An API server whose watch is faster than its answers: a write is answered only
    once the watcher has taken the write's own event."""

    def __init__(self) -> None:
        super().__init__()
        self._taken: set[tuple[str | None, str | None]] = set()
        self._took = threading.Condition()

    async def watch_resource_slices(self, driver: str, node: str) -> AsyncIterator[SliceEvent]:
        async for event in super().watch_resource_slices(driver, node):
            yield event
            # The watcher asks for the next event once it has handled this one.
            meta = event.slice.get("metadata") or {}
            with self._took:
                self._taken.add((meta.get("name"), meta.get("resourceVersion")))
                self._took.notify_all()

    def _echoed(self, answer: dict[str, Any]) -> dict[str, Any]:
        key = (answer["metadata"]["name"], answer["metadata"]["resourceVersion"])
        with self._took:
            assert self._took.wait_for(lambda: key in self._taken, WAIT)
        return answer

    def create_resource_slice(self, body: dict[str, Any]) -> dict[str, Any]:
        return self._echoed(super().create_resource_slice(body))

    def replace_resource_slice(self, body: dict[str, Any]) -> dict[str, Any]:
        return self._echoed(super().replace_resource_slice(body))


async def test_its_own_writes_seen_before_their_answers_read_nothing() -> None:
    """The watch event of the publisher's own write, arriving before the write's answer,
    made it list the slices again (1,270 lists for 1,003 writes in a flap storm); and
    every change listed them before writing. Now a change costs its write alone."""
    kube = EchoFirstKube()
    store = store_of(inventory(gpu(0), gpu(1)))
    pub = publisher(kube, store)
    task = asyncio.ensure_future(pub.run())
    try:
        await eventually(lambda: list(devices(kube)) == ["gpu-0", "gpu-1"])
        listed = lists(kube)
        for health, check in (
            ({gpu(0).uuid: Health.UNHEALTHY}, lambda: taint(kube, "gpu-0") is not None),
            ({}, lambda: taint(kube, "gpu-0") is None),
            ({gpu(1).uuid: Health.UNHEALTHY}, lambda: taint(kube, "gpu-1") is not None),
        ):
            store.update(health=health)
            await eventually(check)
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert (lists(kube) - listed, replaces(kube)) == (0, 3)


class PacedTime:
    """The pace's clock and sleep: each sleep is recorded and lasts until `release()`."""

    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []
        self._gate = asyncio.Event()

    def clock(self) -> float:
        return self.now

    async def sleep(self, delay: float) -> None:
        self.slept.append(delay)
        self._gate = asyncio.Event()
        await self._gate.wait()
        self.now += delay

    def release(self) -> None:
        self._gate.set()


async def test_a_storm_of_changes_is_written_once_per_pace_showing_the_newest_state(
    kube: FakeKube,
) -> None:
    """1,000 health events on one GPU, each taken into the node's state before the next,
    were 1,003 slice writes. Now the first change after a quiet spell is written at once,
    and while changes keep coming one write per pace (doubling) carries the newest."""
    time = PacedTime()
    pace = Backoff(PACE_FIRST_S, PACE_CAP_S, sleep=time.sleep, clock=time.clock)
    store = store_of(inventory(gpu(0), gpu(1)))
    pub = publisher(kube, store, pace=pace, clock=time.clock)
    task = asyncio.ensure_future(pub.run())
    try:
        await eventually(lambda: time.slept == [PACE_FIRST_S])  # created; the next waits
        for i in range(1001):  # GPU 0 flaps, and ends unhealthy
            store.update(health={gpu(0).uuid: Health.UNHEALTHY} if i % 2 == 0 else {})
            await asyncio.sleep(0)  # the publisher sees each change
        assert replaces(kube) == 0  # nothing while the pace holds
        time.release()
        await eventually(lambda: time.slept == [PACE_FIRST_S, 2 * PACE_FIRST_S])
        assert replaces(kube) == 1
        assert taint(kube, "gpu-0") is not None  # the newest state
        # A quiet spell as long as the cap: the next change is written at once, and the
        # spacing starts over.
        time.release()
        await eventually(lambda: time.now == 3 * PACE_FIRST_S)
        time.now += PACE_CAP_S
        store.update(health={})
        await eventually(lambda: len(time.slept) == 3)
        assert time.slept[-1] == PACE_FIRST_S
        assert replaces(kube) == 2
        assert taint(kube, "gpu-0") is None
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def test_a_newer_xid_of_a_gpu_already_unhealthy_renames_its_taint(kube: FakeKube) -> None:
    """A second Xid on an unhealthy GPU changes no health, so the taint kept the first Xid
    until the periodic comparison; the store's faults say so, and it is written."""
    store = store_of(inventory(gpu(0), gpu(1)))
    pub = publisher(kube, store)
    task = asyncio.ensure_future(pub.run())
    try:
        store.update(health={gpu(0).uuid: Health.UNHEALTHY}, faults={gpu(0).uuid: Fault(xid=61)})
        await eventually(lambda: taint(kube, "gpu-0") == "61")
        store.update(faults={gpu(0).uuid: Fault(xid=79)})
        await eventually(lambda: taint(kube, "gpu-0") == "79")
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


def test_a_write_on_a_stale_version_lists_and_writes_again(kube: FakeKube) -> None:
    """Compared without a list, a write may carry a version someone else moved on: the
    409 reads the slices and the write goes again, once."""
    store = store_of(inventory(gpu(0)))
    pub = publisher(kube, store)
    pub.sync(store.state)
    (name,) = kube.resource_slices
    kube.replace_resource_slice(copy.deepcopy(kube.resource_slices[name]))  # another writer
    store.update(health={gpu(0).uuid: Health.UNHEALTHY})
    before = len(kube.calls)
    assert pub.sync(store.state, trusted=frozenset({NVIDIA_DRIVER})) is True
    assert kube.calls[before:] == [
        f"replace resourceslice/{name}",  # refused with 409
        f"list resourceslices/{NVIDIA_DRIVER}/{NODE}",
        f"replace resourceslice/{name}",
    ]
    assert "taints" in devices(kube)["gpu-0"]


async def test_the_loop_waits_as_long_as_the_server_asks_up_to_its_cap(
    kube: FakeKube, caplog: pytest.LogCaptureFixture
) -> None:
    """A 429 (or 503) with Retry-After: the next try waits that long, but never longer
    than the backoff's cap, whatever the header says."""
    caplog.set_level(logging.WARNING, logger="kubegpu.dra.publisher")
    throttled = status_error(
        "create ResourceSlice node-1-gpu.nvidia.com-*", 429, "Too Many Requests", retry_after=3600
    )
    kube.fail_next("create resourceslice/", throttled)
    store = store_of(inventory(gpu(0)))
    pub = publisher(kube, store, backoff=Backoff(0.01, 0.3))
    task = asyncio.ensure_future(pub.run())
    try:
        await eventually(lambda: bool(stored(kube)))
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert [r.getMessage() for r in caplog.records] == [
        f"node {NODE}: cannot publish ResourceSlices: {throttled}; retrying in 0.3s"
    ]


# -- what the API holds is data ---------------------------------------------------------------


def broken(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    """A slice of this node as a broken server or proxy might list it."""
    return {
        "metadata": {"name": name, "resourceVersion": "5"},
        "spec": {"driver": NVIDIA_DRIVER, "nodeName": NODE} | spec,
    }


BROKEN = [
    broken("no-pool", {"devices": [{"name": "gpu-7"}]}),
    broken("bad-generation", {"pool": {"name": NODE, "generation": "2"}}),
    broken("nameless-device", {"pool": {"name": NODE, "generation": 1}, "devices": [{}]}),
    broken(
        "odd-taint",
        {
            "pool": {"name": NODE, "generation": 1},
            "devices": [{"name": "gpu-0", "taints": [{"key": "k", "value": {}, "effect": "e"}]}],
        },
    ),
    broken("devices-not-a-list", {"pool": {"name": NODE, "generation": 1}, "devices": "x"}),
]


@pytest.mark.parametrize("bad", BROKEN, ids=[b["metadata"]["name"] for b in BROKEN])
def test_a_slice_that_cannot_be_read_is_left_alone_and_logged_once(
    kube: FakeKube, bad: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="kubegpu.dra.publisher")
    name = bad["metadata"]["name"]
    kube.resource_slices[name] = bad  # as listed; no server would store it
    store = store_of(inventory(gpu(0)))
    pub = publisher(kube, store)
    assert pub.sync(store.state) is True  # the pool is published around it
    assert pub.sync(store.state) is False
    assert kube.resource_slices[name] == bad  # neither rewritten nor deleted
    assert not any(name in call for call in writes(kube))
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith(f"node {NODE}: ResourceSlice {name} of {NVIDIA_DRIVER} cannot be read (")
    assert pub.clear() == 2  # an uninstall deletes what it can name, this one too


async def test_the_loop_outlives_an_unreadable_slice(kube: FakeKube) -> None:
    """One broken slice in a list answer ended the daemon (its root task failed); the
    loop now publishes and goes on following the store."""
    kube.resource_slices["no-pool"] = BROKEN[0]
    store = store_of(inventory(gpu(0), gpu(1)))
    pub = publisher(kube, store, backoff=Backoff(0.01, 0.02))

    def published() -> list[str]:
        return [d for d in devices(kube) if d != "gpu-7"]  # the broken slice's device

    task = asyncio.ensure_future(pub.run())
    try:
        await eventually(lambda: published() == ["gpu-0", "gpu-1"])
        store.update(inventory=inventory(gpu(0)))
        await eventually(lambda: published() == ["gpu-0"])
        assert not task.done()
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def test_the_watch_outlives_unreadable_events(caplog: pytest.LogCaptureFixture) -> None:
    """Events whose slice has no usable metadata poke a comparison like any other; the
    watch goes on, so a deletion after them is still published again at once."""
    caplog.set_level(logging.INFO, logger="kubegpu.dra.publisher")

    class OddKube(FakeKube):
        async def watch_resource_slices(self, driver: str, node: str) -> AsyncIterator[SliceEvent]:
            for odd in ({"metadata": "x"}, {}, {"metadata": {"name": 5}}, {"metadata": None}):
                yield SliceEvent("DELETED", odd)
                yield SliceEvent("MODIFIED", odd)
            async for event in super().watch_resource_slices(driver, node):
                yield event

    kube = OddKube()
    store = store_of(inventory(gpu(0)))
    pub = publisher(kube, store, backoff=Backoff(0.01, 0.02))
    task = asyncio.ensure_future(pub.run())
    try:
        await eventually(lambda: list(devices(kube)) == ["gpu-0"])
        await eventually(lambda: f"watch resourceslices/{NVIDIA_DRIVER}/{NODE}" in kube.calls)
        (name,) = [s["metadata"]["name"] for s in stored(kube)]
        await asyncio.to_thread(kube.delete_resource_slice, name)
        await eventually(lambda: list(devices(kube)) == ["gpu-0"])
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert "ResourceSlice (without a name) of gpu.nvidia.com was deleted" in caplog.text
    assert f"ResourceSlice {name} of {NVIDIA_DRIVER} was deleted" in caplog.text


def without_taints(body: dict[str, Any]) -> None:
    """An API server without the DRADeviceTaints feature gate: it drops device taints."""
    for device in body.get("spec", {}).get("devices") or []:
        device.pop("taints", None)


def test_a_write_the_server_changes_is_logged_once_and_not_repeated(
    kube: FakeKube, caplog: pytest.LogCaptureFixture
) -> None:
    """The server drops the taints of every write: what it stored stands for what was
    sent, so the same devices are not written again (each write bumped the pool's
    generation and its watch event started the next: 91 writes in 15 s)."""
    caplog.set_level(logging.WARNING, logger="kubegpu.dra.publisher")
    kube.slice_storage = without_taints
    faults = {gpu(0).uuid: Fault(xid=79)}
    store = store_of(inventory(gpu(0), gpu(1)))
    pub = publisher(kube, store)
    assert pub.sync(store.state) is True
    store.update(health={gpu(0).uuid: Health.UNHEALTHY}, faults=faults)
    assert pub.sync(store.state) is True
    assert generations(kube) == {2}
    assert "taints" not in devices(kube)["gpu-0"]  # dropped by the server
    assert [pub.sync(store.state) for _ in range(3)] == [False] * 3
    assert generations(kube) == {2}
    # A change of the devices is written (once), and the same difference is not
    # reported again.
    faults = {**faults, gpu(1).uuid: Fault(xid=48)}
    store.update(
        health={gpu(0).uuid: Health.UNHEALTHY, gpu(1).uuid: Health.UNHEALTHY}, faults=faults
    )
    assert [pub.sync(store.state) for _ in range(3)] == [True, False, False]
    assert generations(kube) == {3}
    assert kube.request_counts()[("replace", "resourceslice")] == 2
    (line,) = [r.getMessage() for r in caplog.records]
    assert line == (
        f"node {NODE}: the API server stored the {NVIDIA_DRIVER} pool differently from what "
        "was written (spec.devices[].taints dropped); its version stands, and the same "
        "devices are not written again; device taints need the DRADeviceTaints feature gate "
        "on the API server (docs/dra.md), and until then an unhealthy device stays "
        "allocatable"
    )


async def test_a_server_that_drops_fields_is_not_written_in_a_loop(kube: FakeKube) -> None:
    """The loop as it ran in a cluster: the watch reports each write (here before the
    write's answer is back) and pokes a comparison; it finds what the server keeps and
    writes nothing."""
    kube.slice_storage = without_taints
    faults = {gpu(0).uuid: Fault(xid=79)}
    store = store_of(inventory(gpu(0), gpu(1)))
    pub = publisher(kube, store, backoff=Backoff(0.01, 0.02))
    task = asyncio.ensure_future(pub.run())
    try:
        await eventually(lambda: generations(kube) == {1})
        store.update(health={gpu(0).uuid: Health.UNHEALTHY}, faults=faults)
        await eventually(lambda: generations(kube) == {2})
        pub.resync()
        # One sync at a time: this one runs after any the watch poked.
        assert await asyncio.to_thread(pub.sync, store.state) is False
        assert generations(kube) == {2}
        assert kube.request_counts()[("replace", "resourceslice")] == 1
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


def test_the_fake_counts_requests_by_verb_and_resource(kube: FakeKube) -> None:
    """What a sync costs the API server, per event (the budget is measured with this)."""
    store = store_of(inventory(gpu(0)))
    pub = publisher(kube, store)
    pub.sync(store.state)
    store.update(health={gpu(0).uuid: Health.UNHEALTHY})
    pub.sync(store.state)
    pub.sync(store.state)
    assert kube.request_counts() == {
        ("list", "resourceslices"): 3,
        ("create", "resourceslice"): 1,
        ("replace", "resourceslice"): 1,
    }
