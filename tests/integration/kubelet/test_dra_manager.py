"""The kubelet emulator's DRA manager with a small DRA driver over real unix sockets.

Each test follows a behaviour of pkg/kubelet/cm/dra/manager.go (see
tests.rig.dra.manager): one NodePrepareResources per driver, per-claim errors failing
the pod's sync with the kubelet's wording, CDI IDs per container, unprepare only when the
last pod goes, the checkpoint surviving a restart and the claim prepared again.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from tests.integration.kubelet.dra_fakes import DRIVER, FakeDriver, allocated_claim, pod
from tests.rig.dra import FAILED_PREPARE, STATE_FILE, DRAKubelet, PrepareError
from tests.rig.kube import FakeKube
from tests.waiting import WAIT

OTHER = "nic.example.com"


@pytest.fixture
async def drivers(node: DRAKubelet, kube: FakeKube) -> AsyncIterator[dict[str, FakeDriver]]:
    made = {
        name: await FakeDriver(node.registry_dir, node.plugins_dir, name=name, kube=kube).start()
        for name in (DRIVER, OTHER)
    }
    await node.wait_for(lambda: node.drivers == sorted(made), WAIT)
    try:
        yield made
    finally:
        for driver in made.values():
            await driver.stop()


async def test_one_prepare_call_per_driver_with_all_the_pods_claims(
    node: DRAKubelet, kube: FakeKube, drivers: dict[str, FakeDriver]
) -> None:
    p = pod("p1", claims={"a": "claim-a", "b": "claim-b", "n": "claim-n"})
    a = allocated_claim(kube, "claim-a", [(DRIVER, "gpu-0")], reserved_for=[p])
    b = allocated_claim(kube, "claim-b", [(DRIVER, "gpu-1")], reserved_for=[p])
    n = allocated_claim(kube, "claim-n", [(OTHER, "nic-0")], reserved_for=[p])
    await node.prepare(p)
    uid = {c["metadata"]["name"]: c["metadata"]["uid"] for c in (a, b, n)}
    assert drivers[DRIVER].prepares == [
        [("default", "claim-a", uid["claim-a"]), ("default", "claim-b", uid["claim-b"])]
    ]
    assert drivers[OTHER].prepares == [[("default", "claim-n", uid["claim-n"])]]
    assert node.cdi_devices(p, "ctr") == [
        f"k8s.{DRIVER}/claim={uid['claim-a']}-gpu-0",
        f"k8s.{DRIVER}/claim={uid['claim-b']}-gpu-1",
        f"k8s.{OTHER}/claim={uid['claim-n']}-nic-0",
    ]


async def test_cdi_devices_go_only_to_the_containers_that_use_the_claim(
    node: DRAKubelet, kube: FakeKube, drivers: dict[str, FakeDriver]
) -> None:
    p = pod("p1", claims={"a": "claim-a"}, containers={"uses": ["a"], "sidecar": []})
    claim = allocated_claim(kube, "claim-a", [(DRIVER, "gpu-0")], reserved_for=[p])
    await node.prepare(p)
    assert node.cdi_devices(p, "uses") == [f"k8s.{DRIVER}/claim={claim['metadata']['uid']}-gpu-0"]
    assert node.cdi_devices(p, "sidecar") == []


async def test_a_per_claim_error_fails_the_pod_with_the_kubelets_words(
    node: DRAKubelet, kube: FakeKube, drivers: dict[str, FakeDriver]
) -> None:
    p = pod("p1", claims={"a": "claim-a", "b": "claim-b"})
    allocated_claim(kube, "claim-a", [(DRIVER, "gpu-0")], reserved_for=[p])
    allocated_claim(kube, "claim-b", [(DRIVER, "gpu-1")], reserved_for=[p])
    drivers[DRIVER].claim_errors["claim-b"] = "GPU gpu-1 fell off the bus"
    with pytest.raises(PrepareError) as failed:
        await node.prepare(p)
    assert failed.value.reason == FAILED_PREPARE
    assert failed.value.message == (
        "Failed to prepare dynamic resources: prepare dynamic resources: "
        "NodePrepareResources failed for ResourceClaim claim-b: GPU gpu-1 fell off the bus"
    )
    # Nothing counts as prepared: the next sync sends both claims again.
    del drivers[DRIVER].claim_errors["claim-b"]
    await node.prepare(p)
    assert [[c[1] for c in call] for call in drivers[DRIVER].prepares] == [
        ["claim-a", "claim-b"],
        ["claim-a", "claim-b"],
    ]


async def test_a_failed_call_and_an_unregistered_driver_fail_the_pod(
    node: DRAKubelet, kube: FakeKube, drivers: dict[str, FakeDriver]
) -> None:
    p = pod("p1", claims={"a": "claim-a"})
    allocated_claim(kube, "claim-a", [(DRIVER, "gpu-0")], reserved_for=[p])
    drivers[DRIVER].fail_calls = grpc.StatusCode.INTERNAL
    with pytest.raises(
        PrepareError,
        match="NodePrepareResources: rpc error: code = Internal desc = driver is broken",
    ):
        await node.prepare(p)
    q = pod("q1", claims={"x": "claim-x"})
    allocated_claim(kube, "claim-x", [("missing.example.com", "d")], reserved_for=[q])
    with pytest.raises(
        PrepareError, match=re.escape("DRA driver missing.example.com is not registered")
    ):
        await node.prepare(q)
    assert node.prepared_claims() == {("default", "claim-a"): {"uid-p1"}}


async def test_a_claim_not_reserved_for_the_pod_is_refused_before_any_call(
    node: DRAKubelet, kube: FakeKube, drivers: dict[str, FakeDriver]
) -> None:
    p = pod("p1", claims={"a": "claim-a"})
    other = pod("other")
    claim = allocated_claim(kube, "claim-a", [(DRIVER, "gpu-0")], reserved_for=[other])
    with pytest.raises(PrepareError) as failed:
        await node.prepare(p)
    assert failed.value.cause == (
        f"pod p1 (uid-p1) is not allowed to use ResourceClaim claim-a ({claim['metadata']['uid']})"
    )
    assert drivers[DRIVER].prepares == []
    assert node.prepared_claims() == {}


async def test_a_shared_claim_is_unprepared_only_when_its_last_pod_goes(
    node: DRAKubelet, kube: FakeKube, drivers: dict[str, FakeDriver]
) -> None:
    p1, p2 = pod("p1", claims={"a": "shared"}), pod("p2", claims={"a": "shared"})
    allocated_claim(kube, "shared", [(DRIVER, "gpu-0")], reserved_for=[p1, p2])
    await node.prepare(p1)
    await node.prepare(p2)
    assert len(drivers[DRIVER].prepares) == 1  # already prepared for p2
    await node.unprepare(p1)
    assert drivers[DRIVER].unprepares == []
    assert node.prepared_claims() == {("default", "shared"): {"uid-p2"}}
    await node.unprepare(p2)
    assert [[c[1] for c in call] for call in drivers[DRIVER].unprepares] == [["shared"]]
    assert node.prepared_claims() == {}
    await node.unprepare(p2)  # idempotent: nothing left to unprepare
    assert len(drivers[DRIVER].unprepares) == 1


async def test_the_checkpoint_survives_a_restart_and_the_claim_is_prepared_again(
    node: DRAKubelet, kube: FakeKube, drivers: dict[str, FakeDriver], socket_dir: Path
) -> None:
    p = pod("p1", claims={"a": "claim-a"})
    claim = allocated_claim(kube, "claim-a", [(DRIVER, "gpu-0")], reserved_for=[p])
    await node.prepare(p)
    saved = (socket_dir / STATE_FILE).read_text()
    assert claim["metadata"]["uid"] in saved
    await node.restart()
    await node.wait_for(lambda: node.drivers == [DRIVER, OTHER], WAIT)
    restored = node.manager.cache.get("claim-a", "default")
    assert restored is not None and restored.pod_uids == {"uid-p1"}
    assert not restored.prepared
    # The restored devices still serve the container until the pod is synced again.
    expected = [f"k8s.{DRIVER}/claim={claim['metadata']['uid']}-gpu-0"]
    assert node.cdi_devices(p, "ctr") == expected
    await node.prepare(p)
    assert len(drivers[DRIVER].prepares) == 2
    assert node.cdi_devices(p, "ctr") == expected
    await node.unprepare(p)
    assert node.prepared_claims() == {}


async def test_the_extended_resource_claim_in_the_pod_status_is_prepared(
    node: DRAKubelet, kube: FakeKube, drivers: dict[str, FakeDriver]
) -> None:
    p: dict[str, Any] = pod("p1")
    p["spec"]["containers"][0]["resources"] = {"limits": {"example.com/gpu": "1"}}
    claim = allocated_claim(
        kube, "p1-extended-resources-abcde", [(DRIVER, "gpu-3")], reserved_for=[p]
    )
    kube.resource_claims[("default", claim["metadata"]["name"])]["status"]["allocation"]["devices"][
        "results"
    ][0]["request"] = "container-0-request-0"
    p["status"]["extendedResourceClaimStatus"] = {
        "resourceClaimName": claim["metadata"]["name"],
        "requestMappings": [
            {
                "containerName": "ctr",
                "resourceName": "example.com/gpu",
                "requestName": "container-0-request-0",
            }
        ],
    }
    await node.prepare(p)
    assert node.cdi_devices(p, "ctr") == [f"k8s.{DRIVER}/claim={claim['metadata']['uid']}-gpu-3"]


async def test_the_reconcile_loop_unprepares_claims_of_pods_no_longer_active(
    node: DRAKubelet, kube: FakeKube, drivers: dict[str, FakeDriver]
) -> None:
    p1, p2 = pod("p1", claims={"a": "claim-a"}), pod("p2", claims={"b": "claim-b"})
    allocated_claim(kube, "claim-a", [(DRIVER, "gpu-0")], reserved_for=[p1])
    allocated_claim(kube, "claim-b", [(DRIVER, "gpu-1")], reserved_for=[p2])
    await node.prepare(p1)
    await node.prepare(p2)
    assert node.manager.might_need_unprepare("uid-p1")
    await node.manager.reconcile({"uid-p2"})
    assert [[c[1] for c in call] for call in drivers[DRIVER].unprepares] == [["claim-a"]]
    assert node.prepared_claims() == {("default", "claim-b"): {"uid-p2"}}
    assert not node.manager.might_need_unprepare("uid-p1")
