"""Where the kubelet keeps its device-plugin sockets: plain data, no imports.

Defined here rather than in `kubegpu.api`, whose package loads gRPC and protobuf, so the
command line can show and check these paths without loading either. `kubegpu.api`
re-exports them beside the API's other constants, as the kubelet's own v1beta1 package
does (k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1/constants.go).
"""

from __future__ import annotations

#: Where the kubelet looks for plugin sockets and serves its own.
DEVICE_PLUGIN_PATH = "/var/lib/kubelet/device-plugins/"
#: The kubelet's registration socket, in `DEVICE_PLUGIN_PATH`.
KUBELET_SOCKET = "kubelet.sock"
#: Where the kubelet serves the PodResources API (k8s.io/kubelet/pkg/apis/podresources).
POD_RESOURCES_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"
