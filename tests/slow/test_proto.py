"""The checked-in generated code matches the .proto files; the wire contract is the kubelet's."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from kubegpu.api import dra_health_pb2, dra_pb2, pb, pluginregistration_pb2, podresources_pb2

SRC = Path(__file__).resolve().parents[2] / "src"
PROTOS = ("api", "pluginregistration", "dra", "dra_health", "podresources")
GENERATED = tuple(
    f"{proto}{suffix}" for proto in PROTOS for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
)


def test_generated_files_match_the_proto(tmp_path: Path) -> None:
    proto_dir = tmp_path / "kubegpu" / "api"
    proto_dir.mkdir(parents=True)
    for proto in PROTOS:
        shutil.copy(SRC / "kubegpu" / "api" / f"{proto}.proto", proto_dir)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{tmp_path}",
            f"--python_out={tmp_path}",
            f"--grpc_python_out={tmp_path}",
            f"--pyi_out={tmp_path}",
            *(f"kubegpu/api/{proto}.proto" for proto in PROTOS),
        ],
        check=True,
    )
    for name in GENERATED:
        fresh = (proto_dir / name).read_text()
        checked_in = (SRC / "kubegpu" / "api" / name).read_text()
        assert fresh == checked_in, f"{name} is stale: run `make proto`"


def test_package_and_method_paths() -> None:
    services = pb.DESCRIPTOR.services_by_name
    assert pb.DESCRIPTOR.package == "v1beta1"
    assert [m.full_name for m in services["Registration"].methods] == [
        "v1beta1.Registration.Register"
    ]
    assert [m.name for m in services["DevicePlugin"].methods] == [
        "GetDevicePluginOptions",
        "ListAndWatch",
        "GetPreferredAllocation",
        "Allocate",
        "PreStartContainer",
    ]
    assert services["DevicePlugin"].methods_by_name["ListAndWatch"].server_streaming


def test_field_numbers_are_the_kubelets() -> None:
    def numbers(message: str) -> dict[str, int]:
        return {f.name: f.number for f in pb.DESCRIPTOR.message_types_by_name[message].fields}

    assert numbers("ContainerAllocateResponse") == {
        "envs": 1,
        "mounts": 2,
        "devices": 3,
        "annotations": 4,
        "cdi_devices": 5,
    }
    assert numbers("Device") == {"ID": 1, "health": 2, "topology": 3}
    assert numbers("RegisterRequest") == {
        "version": 1,
        "endpoint": 2,
        "resource_name": 3,
        "options": 4,
    }
    assert numbers("ContainerPreferredAllocationRequest") == {
        "available_deviceIDs": 1,
        "must_include_deviceIDs": 2,
        "allocation_size": 3,
    }
    assert numbers("ContainerAllocateRequest") == {"devices_ids": 1}
    assert numbers("DevicePluginOptions") == {
        "pre_start_required": 1,
        "get_preferred_allocation_available": 2,
    }
    assert numbers("Mount") == {"container_path": 1, "host_path": 2, "read_only": 3}
    assert numbers("DeviceSpec") == {"container_path": 1, "host_path": 2, "permissions": 3}


def test_dra_and_registration_method_paths() -> None:
    registration = pluginregistration_pb2.DESCRIPTOR.services_by_name["Registration"]
    assert [m.full_name for m in registration.methods] == [
        "pluginregistration.Registration.GetInfo",
        "pluginregistration.Registration.NotifyRegistrationStatus",
    ]
    dra = dra_pb2.DESCRIPTOR.services_by_name["DRAPlugin"]
    assert dra.full_name == "k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin"
    assert [m.name for m in dra.methods] == ["NodePrepareResources", "NodeUnprepareResources"]


def test_dra_field_numbers_are_the_kubelets() -> None:
    def numbers(module: object, message: str) -> dict[str, int]:
        descriptor = module.DESCRIPTOR.message_types_by_name[message]  # type: ignore[attr-defined]
        return {f.name: f.number for f in descriptor.fields}

    assert numbers(pluginregistration_pb2, "PluginInfo") == {
        "type": 1,
        "name": 2,
        "endpoint": 3,
        "supported_versions": 4,
    }
    assert numbers(pluginregistration_pb2, "RegistrationStatus") == {
        "plugin_registered": 1,
        "error": 2,
    }
    assert numbers(dra_pb2, "Device") == {
        "request_names": 1,
        "pool_name": 2,
        "device_name": 3,
        "cdi_device_ids": 4,
        "share_id": 5,
    }
    assert numbers(dra_pb2, "Claim") == {"namespace": 1, "uid": 2, "name": 3}
    assert numbers(dra_pb2, "NodePrepareResourceResponse") == {"devices": 1, "error": 2}
    assert numbers(dra_pb2, "NodeUnprepareResourceResponse") == {"error": 1}


def test_dra_health_is_the_kubelets_wire_contract() -> None:
    service = dra_health_pb2.DESCRIPTOR.services_by_name["DRAResourceHealth"]
    # The kubelet calls /v1alpha1.DRAResourceHealth/NodeWatchResources, a server stream.
    assert service.full_name == "v1alpha1.DRAResourceHealth"
    (method,) = service.methods
    assert method.name == "NodeWatchResources"
    assert method.server_streaming and not method.client_streaming

    def numbers(message: str) -> dict[str, int]:
        descriptor = dra_health_pb2.DESCRIPTOR.message_types_by_name[message]
        return {f.name: f.number for f in descriptor.fields}

    assert numbers("NodeWatchResourcesRequest") == {}
    assert numbers("DeviceIdentifier") == {"pool_name": 1, "device_name": 2}
    assert numbers("DeviceHealth") == {
        "device": 1,
        "health": 2,
        "last_updated_time": 3,
        "health_check_timeout_seconds": 4,
        "message": 5,
    }
    assert numbers("NodeWatchResourcesResponse") == {"devices": 1}
    health = dra_health_pb2.DESCRIPTOR.enum_types_by_name["HealthStatus"]
    assert {v.name: v.number for v in health.values} == {
        "UNKNOWN": 0,
        "HEALTHY": 1,
        "UNHEALTHY": 2,
    }


def test_pod_resources_is_the_kubelets_wire_contract() -> None:
    service = podresources_pb2.DESCRIPTOR.services_by_name["PodResourcesLister"]
    # The kubelet serves /v1.PodResourcesLister/List on pod-resources/kubelet.sock.
    assert service.full_name == "v1.PodResourcesLister"
    assert [m.name for m in service.methods] == ["List", "GetAllocatableResources", "Get"]

    def numbers(message: str) -> dict[str, int]:
        descriptor = podresources_pb2.DESCRIPTOR.message_types_by_name[message]
        return {f.name: f.number for f in descriptor.fields}

    assert numbers("ListPodResourcesResponse") == {"pod_resources": 1}
    assert numbers("PodResources") == {"name": 1, "namespace": 2, "containers": 3}
    assert numbers("ContainerResources") == {
        "name": 1,
        "devices": 2,
        "cpu_ids": 3,
        "memory": 4,
        "dynamic_resources": 5,
    }
    assert numbers("ContainerDevices") == {"resource_name": 1, "device_ids": 2, "topology": 3}
    assert numbers("DynamicResource") == {
        "claim_name": 2,
        "claim_namespace": 3,
        "claim_resources": 4,
    }
    assert numbers("ClaimResource") == {
        "cdi_devices": 1,
        "driver_name": 2,
        "pool_name": 3,
        "device_name": 4,
        "share_id": 5,
    }
    assert numbers("GetPodResourcesRequest") == {"pod_name": 1, "pod_namespace": 2}
