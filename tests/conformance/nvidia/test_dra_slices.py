"""The DRA mode's devices as NVIDIA's DRA driver publishes them, so selectors carry over.

Each fact below was read in NVIDIA's own driver source (cited with repo, path, commit);
kubegpu's ResourceSlices must carry the same names with the same value types, because a
CEL selector such as `device.attributes["gpu.nvidia.com"].productName == "..."` or a
`matchAttribute` fails (or silently matches nothing) on a name or type that differs.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from kubegpu.config import Config, parse_config
from kubegpu.devices import Health
from kubegpu.devices.simulated import SimulatedBackend
from kubegpu.dra.slices import NVIDIA_DRIVER, Device, Fault, device_body, dra_devices
from kubegpu.resources import build_resources
from tests.builders import gpu, inventory
from tests.conformance.origin import Origin

#: Where the facts below were read; `cite(path)` names a fact's file.
NVIDIA_DRA = Origin(
    repo="kubernetes-sigs/dra-driver-nvidia-gpu",
    ref="main",
    commit="95932046683719c43b6a0dd9613c2e5aad5d6703",
)
GO_NVLIB = Origin(
    repo="NVIDIA/go-nvlib", ref="main", commit="3c161560521e3208792199f2ed0d559a5f3ae4f4"
)

#: cmd/gpu-kubelet-plugin/main.go: `DriverName = "gpu.nvidia.com"`.
DRIVER = "gpu.nvidia.com"

#: cmd/gpu-kubelet-plugin/deviceinfo.go, `(*GpuInfo).Attributes`: name -> value field
#: (`StringValue` is "string", `VersionValue` "version", `IntValue` "int"), and
#: `addNumaNodeAttribute` / `standardNumaNodeAttribute`; pciBusID and pcieRoot come from
#: k8s.io/dynamic-resource-allocation/deviceattribute (pcieRoot only where sysfs shows it).
GPU_ATTRIBUTES = {
    "type": "string",
    "uuid": "string",
    "productName": "string",
    "brand": "string",
    "architecture": "string",
    "cudaComputeCapability": "version",
    "driverVersion": "version",
    "cudaDriverVersion": "version",
    "resource.kubernetes.io/pciBusID": "string",
    "resource.kubernetes.io/numaNode": "int",
}
#: cmd/gpu-kubelet-plugin/mig.go, `CommonAttributesMig`, plus `uuid` from
#: deviceinfo.go `(*MigDeviceInfo).GetDevice`.
MIG_ATTRIBUTES = {
    "type": "string",
    "uuid": "string",
    "parentUUID": "string",
    "profile": "string",
    "productName": "string",
    "brand": "string",
    "architecture": "string",
    "cudaComputeCapability": "version",
    "driverVersion": "version",
    "cudaDriverVersion": "version",
    "resource.kubernetes.io/pciBusID": "string",
}
#: mig.go, `CommonCapacitiesMig`.
MIG_CAPACITIES = {
    "multiprocessors",
    "copyEngines",
    "decoders",
    "encoders",
    "jpegEngines",
    "ofaEngines",
    "memory",
}
#: types.go: `GpuDeviceType = "gpu"`, `MigStaticDeviceType = "mig"`.
TYPES = {"gpu": "gpu", "mig": "mig"}
#: deviceinfo.go `(*GpuInfo).CanonicalName`: `gpu-%d` of the minor number.
GPU_NAME = "gpu-{minor}"
#: mig.go `canonicalMigNameRegex`: how NVIDIA's driver parses its MIG device names back.
MIG_NAME = re.compile(r"^gpu-(\d+)-mig-(.+)-(\d+)-(\d+)$")
#: device_health.go: `TaintKeyXID = DriverName + "/xid"` (value: the Xid, base 10),
#: `TaintKeyGPULost = DriverName + "/gpu-lost"`; `healthEventToTaint` gives a fatal Xid
#: and a lost GPU the effect `NoSchedule`.
XID_TAINT = {"key": "gpu.nvidia.com/xid", "effect": "NoSchedule"}
LOST_TAINT = {"key": "gpu.nvidia.com/gpu-lost", "effect": "NoSchedule"}
#: nvlib.go: `cudaDriverVersion: fmt.Sprintf("%v.%v", v/1000, (v%1000)/10)` of NVML's
#: integer, then semver's `MustParse(...).String()` (deviceinfo.go): 12040 -> "12.4.0".
CUDA_12040 = "12.4.0"
#: go-nvlib pkg/nvlib/device/device.go, `GetBrandAsString` and `GetArchitectureAsString`.
BRANDS = {"NVIDIA": "Nvidia", "Tesla": "Tesla", "NVIDIA RTX": "NvidiaRTX", "GRID": "Grid"}
ARCHITECTURES = {(9, 0): "Hopper", (8, 0): "Ampere", (8, 9): "Ada Lovelace"}
#: consumable_shares.go `applyConsumableShares`, the integer ("N shares") layout.
SHARES_POLICY = {"default": "1", "validRange": {"min": "1", "max": "4", "step": "1"}}
MEMORY_POLICY_DEFAULT = "0"
MEMORY_POLICY_STEP = "1Mi"


def kinds(attributes: dict[str, Any]) -> dict[str, str]:
    return {name: next(iter(value)) for name, value in attributes.items()}


def published(config: Config | None = None) -> list[Device]:
    inv = SimulatedBackend.load("h100-mig").discover()
    specs = build_resources(inv, config or Config())
    return [device_body(d, inv, NVIDIA_DRIVER) for d in dra_devices(NVIDIA_DRIVER, specs)]


def test_driver_name_is_nvidias() -> None:
    assert NVIDIA_DRIVER == DRIVER


def test_whole_gpus_carry_nvidias_attributes_with_nvidias_types() -> None:
    inv = SimulatedBackend.load("h100-8").discover()
    specs = build_resources(inv, Config())
    for device, g in zip(dra_devices(NVIDIA_DRIVER, specs), inv.gpus, strict=True):
        body = device_body(device, inv, NVIDIA_DRIVER)
        assert body["name"] == GPU_NAME.format(minor=g.minor)
        got = kinds(body["attributes"])
        assert {n: got.get(n) for n in GPU_ATTRIBUTES} == GPU_ATTRIBUTES
        assert body["attributes"]["type"]["string"] == TYPES["gpu"]
        assert body["attributes"]["cudaDriverVersion"]["version"] == CUDA_12040
        assert set(body["capacity"]) == {"memory"}


def test_mig_devices_carry_nvidias_names_attributes_and_capacities() -> None:
    config = parse_config("version: v1\nflags:\n  migStrategy: mixed\n")
    migs = [d for d in published(config) if d["attributes"]["type"]["string"] == TYPES["mig"]]
    assert migs
    for body in migs:
        match = MIG_NAME.match(body["name"])
        assert match is not None, body["name"]
        got = kinds(body["attributes"])
        assert {n: got.get(n) for n in MIG_ATTRIBUTES} == MIG_ATTRIBUTES
        assert set(body["capacity"]) == MIG_CAPACITIES
        # NVIDIA's name carries the profile without dots: `1g.10gb` -> `1g10gb`.
        profile = body["attributes"]["profile"]["string"]
        assert match.group(2).startswith(profile.split("+")[0].replace(".", ""))


def test_brands_and_architectures_are_spelled_as_go_nvlib_spells_them() -> None:
    for ours, theirs in BRANDS.items():
        inv = inventory(dataclasses.replace(gpu(0), brand=ours))
        (device,) = dra_devices(NVIDIA_DRIVER, build_resources(inv, Config()))
        assert device_body(device, inv, NVIDIA_DRIVER)["attributes"]["brand"] == {"string": theirs}
    for capability, name in ARCHITECTURES.items():
        inv = inventory(gpu(0, cc=capability))
        (device,) = dra_devices(NVIDIA_DRIVER, build_resources(inv, Config()))
        assert device_body(device, inv, NVIDIA_DRIVER)["attributes"]["architecture"] == {
            "string": name
        }


def test_health_taints_are_nvidias() -> None:
    inv = inventory(gpu(0), gpu(1)).with_health(
        {gpu(0).uuid: Health.UNHEALTHY, gpu(1).uuid: Health.UNHEALTHY}
    )
    xid, lost = dra_devices(NVIDIA_DRIVER, build_resources(inv, Config()))
    assert device_body(xid, inv, NVIDIA_DRIVER, fault=Fault(xid=48))["taints"] == [
        XID_TAINT | {"value": "48"}
    ]
    assert device_body(lost, inv, NVIDIA_DRIVER)["taints"] == [LOST_TAINT]


def test_time_slicing_replicas_use_nvidias_consumable_shares_layout() -> None:
    text = (
        "version: v1\nsharing:\n  timeSlicing:\n    resources:\n"
        "    - name: nvidia.com/gpu\n      replicas: 4\n"
    )
    inv = inventory(gpu(0))
    (device,) = dra_devices(NVIDIA_DRIVER, build_resources(inv, parse_config(text)))
    body = device_body(device, inv, NVIDIA_DRIVER)
    assert body["allowMultipleAllocations"] is True
    assert body["capacity"]["shares"]["requestPolicy"] == SHARES_POLICY
    memory = body["capacity"]["memory"]["requestPolicy"]
    assert memory["default"] == MEMORY_POLICY_DEFAULT
    assert memory["validRange"]["step"] == MEMORY_POLICY_STEP
