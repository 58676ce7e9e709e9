"""The DRA wing's pure and in-memory parts (`kubegpu.dra`): claims to devices, sizing by memory,
the checkpoint, ResourceSlice bodies and their publisher, stale device-plugin resources. Over
real sockets: tests/integration/dra/.

Shared here: the ResourceSlice bodies of a node (`bodies`, `slices_of`) and the API server's
checks on them (`check_api_rules`: the strict resource.k8s.io/v1 schema and the limits a
JSON schema does not carry), used by the slice, sizing and label tests.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import kubernetes_validate

from kubegpu.config import Config
from kubegpu.devices import Inventory
from kubegpu.dra.slices import (
    MAX_ATTRIBUTES_AND_CAPACITIES,
    MAX_DEVICES,
    MAX_DEVICES_WITH_TAINTS,
    MAX_VALUE_LENGTH,
    NVIDIA_DRIVER,
    Device,
    Fault,
    build_slices,
    device_body,
    dra_devices,
)
from kubegpu.resources import build_resources

#: The newest Kubernetes whose schemas kubernetes-validate ships (resource.k8s.io/v1 with
#: taints, allowMultipleAllocations and capacity request policies).
KUBE_VERSION = "1.37.0"
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
C_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def bodies(
    inv: Inventory,
    config: Config | None = None,
    driver: str = NVIDIA_DRIVER,
    faults: dict[str, Fault] | None = None,
    roots: dict[str, str] | None = None,
) -> list[Device]:
    specs = build_resources(inv, config or Config())
    return [
        device_body(d, inv, driver, fault=(faults or {}).get(d.unit.uuid), pcie_roots=roots)
        for d in dra_devices(driver, specs)
    ]


def slices_of(devices: Sequence[Device], node: str = "node-1") -> list[dict[str, Any]]:
    return build_slices(node, NVIDIA_DRIVER, devices, generation=3)


def check_api_rules(slices: list[dict[str, Any]]) -> None:
    """What the API server checks beyond the schema, for every slice and device."""
    for obj in slices:
        kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
        devices = obj["spec"]["devices"]
        tainted = any(d.get("taints") for d in devices)
        assert len(devices) <= (MAX_DEVICES_WITH_TAINTS if tainted else MAX_DEVICES)
        assert obj["spec"]["pool"]["resourceSliceCount"] == len(slices)
        for device in devices:
            assert DNS_LABEL.match(device["name"]) and len(device["name"]) <= 63
            entries = len(device.get("attributes", {})) + len(device.get("capacity", {}))
            assert entries <= MAX_ATTRIBUTES_AND_CAPACITIES
            for name, value in device.get("attributes", {}).items():
                assert C_IDENTIFIER.match(name.rsplit("/", 1)[-1]), name
                assert len(name.rsplit("/", 1)[-1]) <= 32
                (kind,) = value  # exactly one of int, bool, string, version
                if kind in ("string", "version"):
                    assert len(value[kind]) <= MAX_VALUE_LENGTH
                if kind == "version":
                    assert SEMVER.match(value[kind]), value
            assert len(device.get("taints", [])) <= 16
    names = [d["name"] for obj in slices for d in obj["spec"]["devices"]]
    assert len(names) == len(set(names)), "device names are unique in a pool"


#: semver.org's own regular expression (2.0.0), as the API server validates version values.
SEMVER = re.compile(
    r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
    r"(?:-((?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*)(?:\.(?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*))*))?"
    r"(?:\+([0-9a-zA-Z-]+(?:\.[0-9a-zA-Z-]+)*))?$"
)
