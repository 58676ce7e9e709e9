"""ResourceSlice bodies from the device model: shapes checked against the Kubernetes schemas
(kubernetes-validate's resource.k8s.io/v1, strict) and the API's limits.

The limits are k8s.io/api's (kubernetes/api @ v0.36.2, resource/v1/types.go, commit
2f4cefdbec4e): ResourceSliceMaxDevices 128, ResourceSliceMaxDevicesWithAdvancedFeatures 64
(devices with taints), ResourceSliceMaxAttributesAndCapacitiesPerDevice 32,
DeviceAttributeMaxValueLength 64, DeviceTaintsMaxLength 16. A JSON schema does not carry
them, so the tests below check them beside the schema.
"""

from __future__ import annotations

import dataclasses

import pytest

from kubegpu.config import parse_config
from kubegpu.devices import Health
from kubegpu.devices.simulated import SimulatedBackend
from kubegpu.dra.slices import (
    AMD_DRIVER,
    MAX_VALUE_LENGTH,
    NVIDIA_DRIVER,
    Device,
    Fault,
    Taint,
    architecture,
    binary,
    carry_taint_times,
    decimal,
    semver,
    slice_prefix,
)
from tests.builders import gpu, inventory, nvlinked
from tests.unit.dra.conftest import SEMVER, bodies, check_api_rules, slices_of


def test_eight_h100s_are_one_slice_of_eight_gpus_in_the_nodes_pool() -> None:
    inv = SimulatedBackend.load("h100-8").discover()
    (obj,) = slices_of(bodies(inv))
    check_api_rules([obj])
    assert obj["metadata"] == {"generateName": "node-1-gpu.nvidia.com-"}
    assert obj["spec"]["driver"] == "gpu.nvidia.com"
    assert obj["spec"]["nodeName"] == "node-1"
    assert obj["spec"]["pool"] == {"name": "node-1", "generation": 3, "resourceSliceCount": 1}
    devices = obj["spec"]["devices"]
    assert [d["name"] for d in devices] == [f"gpu-{g.minor}" for g in inv.gpus]
    first, gpu0 = devices[0], inv.gpus[0]
    assert first["attributes"]["uuid"] == {"string": gpu0.uuid}
    assert first["attributes"]["productName"] == {"string": gpu0.product}
    assert first["attributes"]["type"] == {"string": "gpu"}
    assert first["attributes"]["cudaComputeCapability"] == {"version": "9.0.0"}
    assert first["attributes"]["resource.kubernetes.io/pciBusID"] == {"string": gpu0.pci_bus_id}
    assert first["capacity"] == {"memory": {"value": f"{gpu0.memory_mib}Mi"}}
    assert "allowMultipleAllocations" not in first and "taints" not in first


def test_pcie_root_is_published_where_known() -> None:
    inv = inventory(gpu(0), gpu(1))
    devices = bodies(inv, roots={"0000:10:00.0": "pci0000:0f"})
    assert devices[0]["attributes"]["resource.kubernetes.io/pcieRoot"] == {"string": "pci0000:0f"}
    assert "resource.kubernetes.io/pcieRoot" not in devices[1]["attributes"]
    check_api_rules(slices_of(devices))


def test_numa_node_is_left_out_when_the_platform_reports_none() -> None:
    devices = bodies(inventory(gpu(0, numa=None), gpu(1, numa=1)))
    assert "resource.kubernetes.io/numaNode" not in devices[0]["attributes"]
    assert devices[1]["attributes"]["resource.kubernetes.io/numaNode"] == {"int": 1}


def test_mig_slices_are_devices_of_their_own_under_mixed_strategy() -> None:
    inv = inventory(gpu(0, migs=("1g.10gb", "1g.10gb+me", "3g.40gb")), gpu(1))
    config = parse_config("version: v1\nflags:\n  migStrategy: mixed\n")
    devices = bodies(inv, config)
    check_api_rules(slices_of(devices))
    names = [d["name"] for d in devices]
    assert names == [
        "gpu-0-mig-1g10gb-1-0",
        "gpu-0-mig-1g10gb-me-2-0",
        "gpu-0-mig-3g40gb-3-0",
        "gpu-1",
    ]
    mig = devices[1]["attributes"]
    parent = inv.gpus[0]
    assert mig["type"] == {"string": "mig"}
    assert mig["uuid"] == {"string": parent.mig_devices[1].uuid}
    assert mig["parentUUID"] == {"string": parent.uuid}
    assert mig["profile"] == {"string": "1g.10gb+me"}
    assert mig["kubegpu.io/resource"] == {"string": "nvidia.com/mig-1g.10gb.me"}
    assert mig["kubegpu.io/index"] == {"string": "0:2"}
    assert devices[1]["capacity"]["memory"] == {"value": "10Gi"}
    assert set(devices[1]["capacity"]) == {
        "multiprocessors",
        "copyEngines",
        "decoders",
        "encoders",
        "jpegEngines",
        "ofaEngines",
        "memory",
    }


def test_mig_strategy_none_publishes_the_whole_gpu_as_the_plugin_advertises_it() -> None:
    inv = inventory(gpu(0, migs=("1g.10gb",)))
    assert [d["name"] for d in bodies(inv)] == ["gpu-0"]


def test_a_simulated_mig_node_validates() -> None:
    inv = SimulatedBackend.load("h100-mig").discover()
    config = parse_config("version: v1\nflags:\n  migStrategy: mixed\n")
    devices = bodies(inv, config)
    assert any(d["attributes"]["type"] == {"string": "mig"} for d in devices)
    check_api_rules(slices_of(devices))


TIME_SLICED = """
version: v1
sharing:
  timeSlicing:
    resources:
    - name: nvidia.com/gpu
      replicas: 4
"""


def test_time_sliced_replicas_make_one_device_that_many_claims_share() -> None:
    inv = inventory(gpu(0), gpu(1))
    devices = bodies(inv, parse_config(TIME_SLICED))
    check_api_rules(slices_of(devices))
    assert len(devices) == 2  # one device per GPU, not one per replica
    shared = devices[0]
    assert shared["allowMultipleAllocations"] is True
    assert shared["attributes"]["kubegpu.io/sharing"] == {"string": "time-slicing"}
    assert shared["capacity"]["shares"] == {
        "value": "4",
        "requestPolicy": {"default": "1", "validRange": {"min": "1", "max": "4", "step": "1"}},
    }
    # A claim that does not ask for memory takes none of it, so four fit.
    assert shared["capacity"]["memory"] == {
        "value": "81559Mi",
        "requestPolicy": {
            "default": "0",
            "validRange": {"min": "0", "max": "81559Mi", "step": "1Mi"},
        },
    }


def test_shared_mig_slices_take_no_engines_unless_asked() -> None:
    inv = inventory(gpu(0, migs=("1g.10gb", "1g.10gb")))
    text = (
        "version: v1\nflags:\n  migStrategy: mixed\nsharing:\n  timeSlicing:\n    resources:\n"
        "    - name: nvidia.com/mig-1g.10gb\n      replicas: 2\n"
    )
    devices = bodies(inv, parse_config(text))
    check_api_rules(slices_of(devices))
    for name, entry in devices[0]["capacity"].items():
        default = entry["requestPolicy"]["default"]
        assert default == ("1" if name == "shares" else "0"), name


def test_a_renamed_shared_resource_is_named_in_its_attribute() -> None:
    text = TIME_SLICED + "      rename: gpu.shared\n"
    devices = bodies(inventory(gpu(0)), parse_config(text))
    assert devices[0]["attributes"]["kubegpu.io/resource"] == {"string": "nvidia.com/gpu.shared"}


def test_an_unhealthy_gpu_carries_nvidias_taint_and_a_healthy_one_none() -> None:
    inv = inventory(gpu(0), gpu(1), gpu(2)).with_health(
        {gpu(1).uuid: Health.UNHEALTHY, gpu(2).uuid: Health.UNHEALTHY}
    )
    devices = bodies(inv, faults={gpu(1).uuid: Fault(xid=79)})
    check_api_rules(slices_of(devices))
    assert "taints" not in devices[0]
    assert devices[1]["taints"] == [
        {"key": "gpu.nvidia.com/xid", "value": "79", "effect": "NoSchedule"}
    ]
    # No Xid known (a failed probe): the GPU is lost to new claims.
    assert devices[2]["taints"] == [{"key": "gpu.nvidia.com/gpu-lost", "effect": "NoSchedule"}]


def test_an_xid_on_the_parent_taints_every_mig_slice() -> None:
    parent = gpu(0, migs=("1g.10gb", "1g.10gb"))
    inv = inventory(parent).with_health({parent.uuid: Health.UNHEALTHY})
    config = parse_config("version: v1\nflags:\n  migStrategy: mixed\n")
    devices = bodies(inv, config)
    assert [d["taints"][0]["key"] for d in devices] == ["gpu.nvidia.com/gpu-lost"] * 2


def test_many_devices_split_into_slices_within_the_limits() -> None:
    devices: list[Device] = [{"name": f"gpu-{i}", "attributes": {}} for i in range(300)]
    slices = slices_of(devices)
    assert [len(s["spec"]["devices"]) for s in slices] == [128, 128, 44]
    check_api_rules(slices)
    devices[5]["taints"] = [{"key": "gpu.nvidia.com/gpu-lost", "effect": "NoSchedule"}]
    tainted = slices_of(devices)
    assert [len(s["spec"]["devices"]) for s in tainted] == [64] * 4 + [44]
    check_api_rules(tainted)
    assert [d["name"] for s in tainted for d in s["spec"]["devices"]] == [
        d["name"] for d in devices
    ]


def test_no_devices_no_slices() -> None:
    assert slices_of([]) == []
    assert bodies(inventory(gpu(0)), driver=AMD_DRIVER) == []


def test_a_long_node_name_leaves_room_for_the_generated_suffix() -> None:
    node = ("n" * 60 + ".") * 4
    prefix = slice_prefix(node[:253], NVIDIA_DRIVER)
    assert prefix.endswith("-") and len(prefix) + 5 <= 253


def test_nvlink_domains_follow_the_nvlink_graph() -> None:
    meshed = bodies(nvlinked(4))
    assert {d["attributes"]["kubegpu.io/nvlinkDomain"]["int"] for d in meshed} == {0}
    lone = bodies(inventory(gpu(0), gpu(1)))
    assert all("kubegpu.io/nvlinkDomain" not in d["attributes"] for d in lone)
    pairs = SimulatedBackend.load("dgx1-v100").discover()
    domains = {d["attributes"]["kubegpu.io/nvlinkDomain"]["int"] for d in bodies(pairs)}
    assert domains == {0}  # the hybrid cube mesh joins all eight


def test_taint_times_are_kept_for_taints_that_stay() -> None:
    taint: Taint = {"key": "gpu.nvidia.com/xid", "value": "79", "effect": "NoSchedule"}
    stored = [
        {
            "spec": {
                "devices": [
                    {"name": "gpu-1", "taints": [taint | {"timeAdded": "2026-01-01T00:00:00Z"}]},
                    {"name": "gpu-2", "taints": [taint | {"timeAdded": "2026-01-02T00:00:00Z"}]},
                ]
            }
        }
    ]
    other: Taint = {**taint, "value": "48"}
    devices: list[Device] = [
        {"name": "gpu-0"},
        {"name": "gpu-1", "taints": [taint]},
        {"name": "gpu-2", "taints": [other]},  # another Xid: a new taint, a new time
    ]
    carried = carry_taint_times(devices, stored)
    assert carried[0] == {"name": "gpu-0"}
    assert carried[1]["taints"] == [taint | {"timeAdded": "2026-01-01T00:00:00Z"}]
    assert carried[2]["taints"] == [other]
    assert devices[1]["taints"] == [taint]  # the input is not changed


@pytest.mark.parametrize(
    ("version", "expected"),
    [
        ("550.54.15", "550.54.15"),
        ("535.104.05", "535.104.5"),
        ("12.4", "12.4.0"),
        ("6.8.5-rc1", "6.8.5"),
        ("", None),
        ("unknown", None),
    ],
)
def test_versions_become_semver(version: str, expected: str | None) -> None:
    assert semver(version) == expected
    if expected is not None:
        assert SEMVER.match(expected)


@pytest.mark.parametrize(
    ("capability", "name"),
    [
        ((7, 0), "Volta"),
        ((7, 5), "Turing"),
        ((8, 0), "Ampere"),
        ((8, 9), "Ada Lovelace"),
        ((9, 0), "Hopper"),
        ((10, 0), "Blackwell"),
        ((12, 0), "Blackwell"),
        ((99, 0), "Unknown"),
    ],
)
def test_architecture_names_are_nvmls(capability: tuple[int, int], name: str) -> None:
    assert architecture(capability) == name


def test_quantities_are_in_the_api_servers_canonical_form() -> None:
    assert [binary(v) for v in (0, 7, 1024, 1536, 81559 * 2**20, 80 * 2**30)] == [
        "0",
        "7",
        "1Ki",
        "1536",
        "81559Mi",
        "80Gi",
    ]
    assert [decimal(v) for v in (1, 8, 1000, 48)] == ["1", "8", "1k", "48"]


def test_long_product_names_are_cut_to_the_api_limit() -> None:
    long = dataclasses.replace(gpu(0), product="NVIDIA " + "X" * 80)
    (device,) = bodies(inventory(long))
    assert len(device["attributes"]["productName"]["string"]) == MAX_VALUE_LENGTH
    check_api_rules(slices_of([device]))
