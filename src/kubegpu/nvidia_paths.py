"""NVIDIA's paths and names on a node, defined once: device nodes, driver files, sockets, MPS.

Pure data at the bottom layer (no imports), so discovery (`devices`), the Allocate answer
(`allocation`), CDI specs (`cdi`), MPS (`mps`) and the daemon all read the same lists.
Where NVIDIA's own code fixes an order, ours is NVIDIA's and a test pins it
(tests/conformance/nvidia/test_paths.py): those orders reach the kubelet and the CDI spec.
"""

from __future__ import annotations

# -- device nodes -----------------------------------------------------------------------

#: Control device nodes in NVIDIA's list and order (k8s-device-plugin
#: internal/rm/nvml_manager.go, GetDevicePaths). Discovery keeps those that exist.
CONTROL_DEVICES = (
    "/dev/nvidiactl",
    "/dev/nvidia-uvm",
    "/dev/nvidia-uvm-tools",
    "/dev/nvidia-modeset",
)
#: The control nodes every CUDA container needs: written into a CDI spec even when not
#: seen locally (the runtime resolves them on the host, and CUDA cannot start without them).
REQUIRED_CONTROL_DEVICES = CONTROL_DEVICES[:3]
#: Display/Vulkan nodes that headless drivers lack: written only when present.
OPTIONAL_CONTROL_DEVICES = CONTROL_DEVICES[3:]
#: Where the driver exposes MIG capability nodes (`nvidia-cap<minor>`).
CAPS_DIR = "/dev/nvidia-caps"
#: Where IMEX channel nodes live (`channel<N>`).
IMEX_CHANNEL_DIR = "/dev/nvidia-caps-imex-channels"
#: The driver's MIG capability files, relative to the host's root (/proc mounted there).
MIG_CAPABILITIES_DIR = "proc/driver/nvidia/capabilities"


def gpu_device_node(minor: int) -> str:
    """`/dev/nvidia<minor>`: the device node of one whole GPU."""
    return f"/dev/nvidia{minor}"


def mig_cap_node(minor: int) -> str:
    """`/dev/nvidia-caps/nvidia-cap<minor>`: a MIG capability node."""
    return f"{CAPS_DIR}/nvidia-cap{minor}"


# -- driver files -----------------------------------------------------------------------

#: The NVML library the backend loads.
NVML_LIBRARY = "libnvidia-ml.so.1"
#: Library directories searched under a driver root, first match first: NVIDIA's order
#: (k8s-device-plugin cmd/nvidia-device-plugin/root.go, tryResolveLibrary), then the
#: plain `usr/lib` and `lib` that some distributions use.
LIBRARY_DIRS = (
    "usr/lib64",
    "usr/lib/x86_64-linux-gnu",
    "usr/lib/aarch64-linux-gnu",
    "lib64",
    "lib/x86_64-linux-gnu",
    "lib/aarch64-linux-gnu",
    "usr/lib",
    "lib",
)
#: Driver libraries needed by CUDA compute and NVML, whatever their version suffix.
LIBRARY_PATTERNS = (
    "libcuda.so*",
    "libcudadebugger.so*",
    "libnvidia-ml.so*",
    "libnvidia-ptxjitcompiler.so*",
    "libnvidia-nvvm.so*",
    "libnvidia-opencl.so*",
    "libnvidia-cfg.so*",
    "libnvidia-allocator.so*",
    "libnvidia-gpucomp.so*",
)
#: Binary directories searched under a driver root, first match first.
BINARY_DIRS = ("usr/bin", "usr/sbin", "bin", "sbin")
#: The MPS control daemon's binary (run by the plugin, mounted into CDI containers).
MPS_CONTROL_BINARY = "nvidia-cuda-mps-control"
#: Driver tools mounted into containers by a CDI spec.
BINARIES = (
    "nvidia-smi",
    "nvidia-debugdump",
    "nvidia-persistenced",
    MPS_CONTROL_BINARY,
    "nvidia-cuda-mps-server",
)

# -- sockets and container paths --------------------------------------------------------

#: Host sockets that NVML/CUDA talk to when their daemons run (relative to the driver root).
IPC_SOCKETS = ("run/nvidia-persistenced/socket",)
#: Where MPS clients find the pipes inside containers (MPS's own default, so even clients
#: that drop CUDA_MPS_PIPE_DIRECTORY find it).
MPS_CONTAINER_PIPE_DIR = "/tmp/nvidia-mps"
#: Where the NVIDIA container runtime looks for volume-mount device lists.
VOLUME_MOUNT_ROOT = "/var/run/nvidia-container-devices"

# -- CDI names --------------------------------------------------------------------------

#: The CDI vendor and class of NVIDIA's device plugin: `k8s.device-plugin.nvidia.com/gpu`.
CDI_VENDOR = "k8s.device-plugin.nvidia.com"
CDI_CLASS = "gpu"
CDI_KIND = f"{CDI_VENDOR}/{CDI_CLASS}"
