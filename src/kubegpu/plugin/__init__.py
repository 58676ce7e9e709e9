"""The gRPC side: device plugin servers, kubelet registration, restart detection;
`front` (`PluginFront`) assembles them as the daemon's front in device plugin mode."""

from kubegpu.plugin.manager import PluginManager
from kubegpu.plugin.server import DevicePluginServicer, ResourceServer, device_list, to_pb

__all__ = ["DevicePluginServicer", "PluginManager", "ResourceServer", "device_list", "to_pb"]
