"""The DRA mode's AMD devices as ROCm's DRA driver publishes them, on ROCm's own KFD trees.

The names below were read in ROCm/k8s-gpu-dra-driver (cited per fact); kubegpu publishes
the same names with the same value types so that claims written for it select the same
devices. The device trees are ROCm's device plugin test data (peer-data).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kubegpu.config import Config
from kubegpu.devices.amd import AmdBackend
from kubegpu.dra.slices import AMD_DRIVER, Device, build_slices, device_body, dra_devices
from kubegpu.resources import build_resources
from tests.conformance.origin import Origin
from tests.conformance.rocm.sysfs import build_node

kubernetes_validate = pytest.importorskip("kubernetes_validate")

#: Where the facts below were read.
ROCM_DRA = Origin(
    repo="ROCm/k8s-gpu-dra-driver",
    ref="main",
    commit="2622427226d5ac361c3588284f4815e0dae11eaa",
)
#: pkg/consts/consts.go: `DriverName = "gpu.amd.com"`.
DRIVER = "gpu.amd.com"
#: cmd/gpu-kubeletplugin/types.go: `AmdGpuDeviceType = "amdgpu"`,
#: `AmdPartitionDeviceType = "amdgpu-partition"`.
GPU_TYPE, PARTITION_TYPE = "amdgpu", "amdgpu-partition"
#: cmd/gpu-kubeletplugin/deviceinfo.go, `(*AmdPartitionInfo).GetDevice`: name -> value field.
PARTITION_ATTRIBUTES = {
    "type": "string",
    "parentPciAddr": "string",
    "cardIndex": "int",
    "renderIndex": "int",
    "parentDeviceID": "string",
    "productName": "string",
    "partitionProfile": "string",
}
#: The same file, `(*AmdGpuInfo).GetDevice` (whole GPUs).
GPU_ATTRIBUTES = {
    "type": "string",
    "pciAddr": "string",
    "renderIndex": "int",
    "deviceID": "string",
    "productName": "string",
}
#: deviceinfo.go: capacities of both kinds of device.
CAPACITIES = {"memory", "computeUnits", "simdUnits"}
#: deviceinfo.go `CanonicalName`: `gpu-<cardIndex>-<renderIndex>`.
NAME = "gpu-{card}-{render}"


def kinds(attributes: dict[str, Any]) -> dict[str, str]:
    return {name: next(iter(value)) for name, value in attributes.items()}


def published(root: Path) -> list[Device]:
    inv = AmdBackend(str(root)).discover()
    devices = dra_devices(AMD_DRIVER, build_resources(inv, Config()))
    return [device_body(d, inv, AMD_DRIVER) for d in devices]


def test_driver_name_is_rocms() -> None:
    assert AMD_DRIVER == DRIVER


def test_cpx_partitions_are_partition_devices_of_their_gpu(tmp_path: Path) -> None:
    node = build_node("topo-mi300-cpx", tmp_path, partition_mode=("CPX", "NPS4"))
    devices = published(node.root)
    assert len(devices) == 63
    parents: dict[str, set[str]] = {}
    for body in devices:
        attributes = body["attributes"]
        assert attributes["type"] == {"string": PARTITION_TYPE}
        got = kinds(attributes)
        wanted = {n: got.get(n) for n in PARTITION_ATTRIBUTES if n != "cardIndex"}
        assert wanted == {n: k for n, k in PARTITION_ATTRIBUTES.items() if n != "cardIndex"}
        assert attributes["partitionProfile"] == {"string": "cpx_nps4"}
        assert set(body["capacity"]) >= {"memory", "simdUnits"}
        assert set(body["capacity"]) <= CAPACITIES
        parents.setdefault(attributes["parentDeviceID"]["string"], set()).add(body["name"])
        render = attributes["renderIndex"]["int"]
        card = attributes.get("cardIndex", {}).get("int")
        if card is not None:
            assert body["name"] == NAME.format(card=card, render=render)
    # ROCm's parentDeviceID is shared by every partition of one GPU: 7 GPUs of 8, one of 7.
    assert sorted(len(p) for p in parents.values()) == [7] + [8] * 7
    slices = build_slices("node-1", AMD_DRIVER, devices, generation=1)
    for obj in slices:
        kubernetes_validate.validate(obj, "1.37.0", strict=True)


def test_whole_gpus_are_amdgpu_devices(tmp_path: Path) -> None:
    node = build_node("topo-mi210-xgmi-pcie", tmp_path)
    devices = published(node.root)
    assert len(devices) == 8
    for body in devices:
        got = kinds(body["attributes"])
        assert {n: got.get(n) for n in GPU_ATTRIBUTES} == GPU_ATTRIBUTES
        assert body["attributes"]["type"] == {"string": GPU_TYPE}
