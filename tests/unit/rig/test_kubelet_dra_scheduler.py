"""The scheduler stand-in of the kubelet emulator (tests.rig.dra.scheduler).

It is not the kubelet: it allocates claims from ResourceSlices the way kube-scheduler's
structured allocator does, so the emulator's end-to-end tests run without a cluster.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any

import pytest

from tests.rig.dra.scheduler import (
    EXTENDED_CLAIM_ANNOTATION,
    SchedulerStandIn,
    UnschedulableError,
    format_quantity,
    parse_quantity,
)
from tests.rig.kube import FakeKube

NODE = "node-1"
DRIVER = "gpu.nvidia.com"
H100 = 'device.attributes["gpu.nvidia.com"].productName == "NVIDIA H100 80GB HBM3"'
BIG = 'device.capacity["gpu.nvidia.com"].memory.compareTo(quantity("40Gi")) >= 0'


def gpu(
    i: int, product: str = "NVIDIA H100 80GB HBM3", root: str = "pci0000:00", **extra: Any
) -> dict[str, Any]:
    return {
        "name": f"gpu-{i}",
        "attributes": {
            "productName": {"string": product},
            "index": {"int": i},
            "resource.kubernetes.io/pcieRoot": {"string": root},
        },
        "capacity": {"memory": {"value": "80Gi"}},
        **extra,
    }


def cluster(*devices: dict[str, Any], classes: dict[str, dict[str, Any]] | None = None) -> FakeKube:
    kube = FakeKube()
    kube.resource_slices["node-1-gpu"] = {
        "metadata": {"name": "node-1-gpu"},
        "spec": {
            "driver": DRIVER,
            "nodeName": NODE,
            "pool": {"name": NODE, "generation": 1, "resourceSliceCount": 1},
            "devices": list(devices),
        },
    }
    for name, spec in (classes or {"gpu.nvidia.com": {}}).items():
        kube.put_device_class({"metadata": {"name": name}, "spec": spec})
    return kube


def claim(
    name: str, *requests: dict[str, Any], constraints: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    devices: dict[str, Any] = {"requests": list(requests)}
    if constraints:
        devices["constraints"] = constraints
    return {"metadata": {"name": name, "namespace": "default"}, "spec": {"devices": devices}}


def request(
    name: str = "gpu", count: int = 1, cls: str = "gpu.nvidia.com", **exactly: Any
) -> dict[str, Any]:
    return {"name": name, "exactly": {"deviceClassName": cls, "count": count, **exactly}}


def devices_of(stored: dict[str, Any]) -> list[str]:
    return [r["device"] for r in stored["status"]["allocation"]["devices"]["results"]]


def test_exact_count_with_a_product_name_selector_from_the_class() -> None:
    kube = cluster(
        gpu(0, "NVIDIA A100"),
        gpu(1),
        gpu(2),
        gpu(3),
        classes={
            "h100": {
                "selectors": [
                    {"cel": {"expression": 'device.driver == "gpu.nvidia.com"'}},
                    {"cel": {"expression": H100}},
                ]
            }
        },
    )
    stand_in = SchedulerStandIn(kube, NODE)
    first = stand_in.allocate(claim("a", request(count=2, cls="h100")))
    assert devices_of(first) == ["gpu-1", "gpu-2"]
    allocation = first["status"]["allocation"]
    assert allocation["devices"]["results"][0] == {
        "request": "gpu",
        "driver": DRIVER,
        "pool": NODE,
        "device": "gpu-1",
    }
    assert allocation["nodeSelector"]["nodeSelectorTerms"][0]["matchFields"] == [
        {"key": "metadata.name", "operator": "In", "values": [NODE]}
    ]
    # Allocated devices are not given twice.
    assert devices_of(stand_in.allocate(claim("b", request(cls="h100")))) == ["gpu-3"]
    with pytest.raises(UnschedulableError, match="ResourceClaim default/c: cannot allocate"):
        stand_in.allocate(claim("c", request(cls="h100")))


def test_request_selectors_all_mode_and_quantities_in_cel() -> None:
    kube = cluster(gpu(0), gpu(1), gpu(2))
    stand_in = SchedulerStandIn(kube, NODE)
    odd = {"cel": {"expression": 'device.attributes["gpu.nvidia.com"].index % 2 == 1'}}
    assert devices_of(stand_in.allocate(claim("odd", request(selectors=[odd])))) == ["gpu-1"]
    big = {"cel": {"expression": BIG}}
    everything = stand_in.allocate(claim("all", request(allocationMode="All", selectors=[big])))
    assert devices_of(everything) == ["gpu-0", "gpu-2"]


def test_a_missing_attribute_is_a_cel_runtime_error() -> None:
    kube = cluster(gpu(0))
    bad = {"cel": {"expression": 'device.attributes["gpu.nvidia.com"].nosuch == "x"'}}
    with pytest.raises(UnschedulableError, match="CEL runtime error"):
        SchedulerStandIn(kube, NODE).allocate(claim("a", request(selectors=[bad])))


def test_a_no_schedule_taint_excludes_the_device_unless_tolerated() -> None:
    taint = {"key": "gpu.nvidia.com/xid", "value": "79", "effect": "NoSchedule"}
    kube = cluster(gpu(0, taints=[taint]), gpu(1))
    stand_in = SchedulerStandIn(kube, NODE)
    assert devices_of(stand_in.allocate(claim("a", request()))) == ["gpu-1"]
    tolerate = [{"key": "gpu.nvidia.com/xid", "operator": "Exists", "effect": "NoSchedule"}]
    tolerated = stand_in.allocate(claim("b", request(tolerations=tolerate)))
    assert devices_of(tolerated) == ["gpu-0"]
    assert tolerated["status"]["allocation"]["devices"]["results"][0]["tolerations"] == tolerate


def test_a_shared_device_serves_claims_up_to_its_capacity() -> None:
    shared = gpu(0, allowMultipleAllocations=True)
    shared["capacity"]["memory"]["requestPolicy"] = {"default": "20Gi"}
    kube = cluster(shared)
    stand_in = SchedulerStandIn(kube, NODE)
    stored = [stand_in.allocate(claim(f"c{i}", request())) for i in range(4)]
    results = [s["status"]["allocation"]["devices"]["results"][0] for s in stored]
    assert {r["device"] for r in results} == {"gpu-0"}
    assert [r["consumedCapacity"] for r in results] == [{"memory": "20Gi"}] * 4
    assert len({r["shareID"] for r in results}) == 4
    with pytest.raises(UnschedulableError):
        stand_in.allocate(claim("c4", request()))
    stand_in.release({"metadata": {"uid": "nobody"}})  # reserves nothing: changes nothing
    assert len([c for c in kube.resource_claims.values() if c["status"].get("allocation")]) == 4


def sized_gpu(i: int) -> dict[str, Any]:
    """A GPU sized by memory as kubegpu publishes one: 1Gi steps from 1Gi up to 79Gi."""
    shared = gpu(i, allowMultipleAllocations=True)
    shared["capacity"]["memory"] = {
        "value": "81559Mi",
        "requestPolicy": {
            "default": "10Gi",
            "validRange": {"min": "1Gi", "max": "79Gi", "step": "1Gi"},
        },
    }
    return shared


def memory_request(memory: str | None = None, **capacity: str) -> dict[str, Any]:
    wanted = {**({"memory": memory} if memory is not None else {}), **capacity}
    return request(capacity={"requests": wanted}) if wanted else request()


@pytest.mark.parametrize(
    ("asked", "consumed"),
    [(None, "10Gi"), ("30Gi", "30Gi"), ("1", "1Gi"), ("1500Mi", "2Gi"), ("79Gi", "79Gi")],
)
def test_a_request_is_rounded_up_by_the_capacitys_request_policy(
    asked: str | None, consumed: str
) -> None:
    """consumablecapacity.go (k8s.io/dynamic-resource-allocation, structured/internal/
    incubating, v0.36): an unrequested capacity takes `default`; a requested one is raised
    to `min`, then to `min + n * step`."""
    stand_in = SchedulerStandIn(cluster(sized_gpu(0)), NODE)
    stored = stand_in.allocate(claim("c", memory_request(asked)))
    [result] = stored["status"]["allocation"]["devices"]["results"]
    assert result["consumedCapacity"] == {"memory": consumed}


@pytest.mark.parametrize("asked", [{"memory": "80Gi"}, {"cores": "1"}])
def test_a_request_the_policy_refuses_or_the_device_lacks_does_not_fit(
    asked: dict[str, str],
) -> None:
    """Above `max` (80Gi on a device whose largest step is 79Gi) or naming a capacity the
    device does not have: the device cannot serve the request (violatesPolicy,
    requestsContainNonExistCapacity)."""
    stand_in = SchedulerStandIn(cluster(sized_gpu(0)), NODE)
    with pytest.raises(UnschedulableError, match="cannot allocate all claims"):
        stand_in.allocate(claim("c", request(capacity={"requests": asked})))


def test_valid_values_round_up_to_the_next_one() -> None:
    shared = gpu(0, allowMultipleAllocations=True)
    shared["capacity"]["memory"]["requestPolicy"] = {
        "default": "20Gi",
        "validValues": ["20Gi", "40Gi", "80Gi"],
    }
    stand_in = SchedulerStandIn(cluster(shared), NODE)
    stored = stand_in.allocate(claim("c", memory_request("30Gi")))
    [result] = stored["status"]["allocation"]["devices"]["results"]
    assert result["consumedCapacity"] == {"memory": "40Gi"}


def test_match_attribute_keeps_a_claims_gpus_under_one_pcie_root() -> None:
    kube = cluster(gpu(0, root="pci0000:00"), gpu(1, root="pci0000:80"), gpu(2, root="pci0000:80"))
    same_root = [{"matchAttribute": "resource.kubernetes.io/pcieRoot"}]
    stored = SchedulerStandIn(kube, NODE).allocate(
        claim("pair", request(count=2), constraints=same_root)
    )
    assert devices_of(stored) == ["gpu-1", "gpu-2"]


def test_a_pod_asking_for_the_extended_resource_gets_the_special_claim() -> None:
    kube = cluster(
        gpu(0),
        gpu(1),
        gpu(2),
        classes={"gpu.nvidia.com": {"extendedResourceName": "nvidia.com/gpu"}},
    )
    pod = {
        "metadata": {"name": "trainer", "namespace": "default", "uid": "uid-t"},
        "spec": {
            "initContainers": [{"name": "init", "resources": {}}],
            "containers": [
                {"name": "main", "resources": {"limits": {"cpu": "1", "nvidia.com/gpu": "2"}}}
            ],
        },
    }
    scheduled = SchedulerStandIn(kube, NODE).schedule(pod)
    status = scheduled["status"]["extendedResourceClaimStatus"]
    name = status["resourceClaimName"]
    assert (
        name.startswith("trainer-extended-resources-")
        and len(name) == len("trainer-extended-resources-") + 5
    )
    assert status["requestMappings"] == [
        {
            "containerName": "main",
            "resourceName": "nvidia.com/gpu",
            "requestName": "container-1-request-1",
        }
    ]
    stored = kube.resource_claims[("default", name)]
    assert stored["metadata"]["annotations"] == {EXTENDED_CLAIM_ANNOTATION: "true"}
    assert stored["metadata"]["ownerReferences"][0]["uid"] == "uid-t"
    assert stored["spec"]["devices"]["requests"] == [
        {
            "name": "container-1-request-1",
            "exactly": {
                "deviceClassName": "gpu.nvidia.com",
                "allocationMode": "ExactCount",
                "count": 2,
            },
        }
    ]
    assert devices_of(stored) == ["gpu-0", "gpu-1"]
    assert stored["status"]["reservedFor"] == [
        {"resource": "pods", "name": "trainer", "uid": "uid-t"}
    ]
    # Deleting the pod deletes its special claim and frees the devices.
    SchedulerStandIn(kube, NODE).release(scheduled)
    assert ("default", name) not in kube.resource_claims


def test_a_device_plugin_on_the_node_keeps_the_extended_resource() -> None:
    kube = cluster(gpu(0), classes={"gpu.nvidia.com": {"extendedResourceName": "nvidia.com/gpu"}})
    pod = {
        "metadata": {"name": "p", "uid": "u"},
        "spec": {"containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu": "1"}}}]},
    }
    scheduled = SchedulerStandIn(kube, NODE, device_plugin_allocatable=lambda r: 4).schedule(pod)
    assert "extendedResourceClaimStatus" not in scheduled.get("status", {})
    assert kube.resource_claims == {}


def test_a_named_claim_is_allocated_reserved_and_deallocated_with_its_last_pod() -> None:
    kube = cluster(gpu(0))
    kube.put_resource_claim(claim("shared", request()))
    stand_in = SchedulerStandIn(kube, NODE)
    pods = [
        {
            "metadata": {"name": n, "uid": f"uid-{n}"},
            "spec": {"resourceClaims": [{"name": "g", "resourceClaimName": "shared"}]},
        }
        for n in ("p1", "p2")
    ]
    for p in pods:
        stand_in.schedule(p)
    stored = kube.resource_claims[("default", "shared")]
    assert [r["uid"] for r in stored["status"]["reservedFor"]] == ["uid-p1", "uid-p2"]
    stand_in.release(pods[0])
    assert kube.resource_claims[("default", "shared")]["status"]["allocation"] is not None
    stand_in.release(pods[1])
    assert "allocation" not in kube.resource_claims[("default", "shared")]["status"]


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("80Gi", 80 * 2**30),
        ("500m", Fraction(1, 2)),
        ("1e3", 1000),
        ("4", 4),
        ("1.5G", 1_500_000_000),
    ],
)
def test_quantities(text: str, value: Fraction | int) -> None:
    assert parse_quantity(text) == value


def test_quantity_text_and_bad_input() -> None:
    assert format_quantity(Fraction(20 * 2**30)) == "20Gi"
    assert format_quantity(Fraction(1, 2)) == "500m"
    with pytest.raises(ValueError, match="invalid quantity 'lots'"):
        parse_quantity("lots")
