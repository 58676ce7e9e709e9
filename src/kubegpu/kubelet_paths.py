"""Where the kubelet keeps its plugin sockets, in either mode: plain data, no imports.

Defined here rather than in `kubegpu.api`, whose package loads gRPC and protobuf, or in a
mode's front, which loads that whole mode, so the command line can show and check these
paths and the daemon can default them without loading either. `kubegpu.api` re-exports the
device-plugin ones beside the API's other constants, as the kubelet's own v1beta1 package
does (k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1/constants.go).
"""

from __future__ import annotations

#: Where the kubelet looks for plugin sockets and serves its own.
DEVICE_PLUGIN_PATH = "/var/lib/kubelet/device-plugins/"
#: The kubelet's registration socket, in `DEVICE_PLUGIN_PATH`.
KUBELET_SOCKET = "kubelet.sock"
#: Where the kubelet serves the PodResources API (k8s.io/kubelet/pkg/apis/podresources).
POD_RESOURCES_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"
#: DRA: where the kubelet's plugin watcher looks for registration sockets, and the
#: kubelet's plugins directory (a driver's sockets and state in `<it>/<driver>`): the
#: defaults of NVIDIA's DRA driver's flags.
REGISTRAR_DIRECTORY = "/var/lib/kubelet/plugins_registry"
PLUGINS_DIRECTORY = "/var/lib/kubelet/plugins"
