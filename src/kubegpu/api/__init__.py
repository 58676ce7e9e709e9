"""The kubelet APIs kubegpu serves: the .proto files and their generated Python, nothing else.

The device plugin API v1beta1 (`pb`), the plugin-watcher registration API
(`pluginregistration_pb2`), the DRA plugin API v1 (`dra_pb2`), the DRA device health API
v1alpha1 (`dra_health_pb2`), and the kubelet's PodResources API v1 (`podresources_pb2`),
which kubegpu calls to learn which container holds which device.

Regenerate with `make proto`; tests/slow/test_proto.py proves the checked-in files match.
"""

import grpc

from kubegpu.api import api_pb2 as pb
from kubegpu.api import api_pb2_grpc as pb_grpc
from kubegpu.api import dra_health_pb2_grpc, dra_pb2_grpc, podresources_pb2_grpc
from kubegpu.kubelet_paths import DEVICE_PLUGIN_PATH, KUBELET_SOCKET, POD_RESOURCES_SOCKET

#: The only API version the kubelet accepts from device plugins.
VERSION = "v1beta1"
HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"


# Typed doors into the untyped generated gRPC module.
def registration_stub(channel: grpc.aio.Channel) -> pb_grpc.RegistrationStub:
    return pb_grpc.RegistrationStub(channel)


def device_plugin_stub(channel: grpc.Channel | grpc.aio.Channel) -> pb_grpc.DevicePluginStub:
    return pb_grpc.DevicePluginStub(channel)


def add_device_plugin_servicer(
    servicer: pb_grpc.DevicePluginServicer, server: grpc.aio.Server
) -> None:
    pb_grpc.add_DevicePluginServicer_to_server(servicer, server)


def add_registration_servicer(
    servicer: pb_grpc.RegistrationServicer, server: grpc.aio.Server
) -> None:
    pb_grpc.add_RegistrationServicer_to_server(servicer, server)


def add_dra_health_servicer(
    servicer: dra_health_pb2_grpc.DRAResourceHealthServicer, server: grpc.aio.Server
) -> None:
    dra_health_pb2_grpc.add_DRAResourceHealthServicer_to_server(servicer, server)


def dra_stub(channel: grpc.Channel | grpc.aio.Channel) -> dra_pb2_grpc.DRAPluginStub:
    """The DRA plugin API v1, as the kubelet calls it."""
    return dra_pb2_grpc.DRAPluginStub(channel)


def dra_health_stub(channel: grpc.aio.Channel) -> dra_health_pb2_grpc.DRAResourceHealthStub:
    return dra_health_pb2_grpc.DRAResourceHealthStub(channel)


def pod_resources_stub(channel: grpc.Channel) -> podresources_pb2_grpc.PodResourcesListerStub:
    return podresources_pb2_grpc.PodResourcesListerStub(channel)


def add_pod_resources_servicer(
    servicer: podresources_pb2_grpc.PodResourcesListerServicer,
    server: grpc.Server | grpc.aio.Server,
) -> None:
    podresources_pb2_grpc.add_PodResourcesListerServicer_to_server(servicer, server)


__all__ = [
    "DEVICE_PLUGIN_PATH",
    "HEALTHY",
    "KUBELET_SOCKET",
    "POD_RESOURCES_SOCKET",
    "UNHEALTHY",
    "VERSION",
    "add_device_plugin_servicer",
    "add_dra_health_servicer",
    "add_pod_resources_servicer",
    "add_registration_servicer",
    "device_plugin_stub",
    "dra_health_stub",
    "dra_stub",
    "pb",
    "pb_grpc",
    "pod_resources_stub",
    "registration_stub",
]
