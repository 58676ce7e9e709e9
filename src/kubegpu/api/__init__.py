"""The kubelet device plugin API v1beta1: the .proto and its generated Python, nothing else.

Regenerate with `make proto`; tests/unit/test_proto.py proves the checked-in files match.
"""

from kubegpu.api import api_pb2 as pb
from kubegpu.api import api_pb2_grpc as pb_grpc

#: The only API version the kubelet accepts from device plugins.
VERSION = "v1beta1"
HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"
#: Where the kubelet looks for plugin sockets and serves its own.
DEVICE_PLUGIN_PATH = "/var/lib/kubelet/device-plugins/"
KUBELET_SOCKET = "kubelet.sock"

__all__ = ["DEVICE_PLUGIN_PATH", "HEALTHY", "KUBELET_SOCKET", "UNHEALTHY", "VERSION", "pb", "pb_grpc"]
