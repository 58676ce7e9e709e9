"""A faithful emulator of the kubelet's device manager, for integration tests and `demo`.

from kubegpu.kubelet import KubeletEmulator

async with KubeletEmulator(tmp_dir, grace_period=0.2) as kubelet:
    ...  # start a plugin that registers on tmp_dir/kubelet.sock
    await kubelet.wait_for_resource("nvidia.com/gpu", capacity=4, allocatable=4)
    allocation = await kubelet.allocate("nvidia.com/gpu", 2, pod="p1")

The modules follow the kubelet's devicemanager: `emulator` (the manager, `KubeletEmulator`),
`registration`, `endpoint`, `admission`, `pod_devices`, `checkpoint`; `changes` is how
callers wait on it. `KubeletEmulator(dra=...)` runs a kubelet's DRA side (`DRASide`)
beside it; the one the tests use (plugin watcher, DRA manager, and a scheduler stand-in) is
test rig and lives in the repository, not the package (`tests.rig.dra`).
`KubeletEmulator(version="1.37")` models the newer device manager (an endpoint per plugin
socket) instead of 1.36's (one client per resource), the default.
"""

from kubegpu.kubelet.checkpoint import CHECKPOINT_FILE
from kubegpu.kubelet.emulator import (
    DEFAULT_VERSION,
    DIAL_TIMEOUT,
    GRACE_PERIOD,
    PRE_START_TIMEOUT,
    DRASide,
    KubeletEmulator,
    go_error,
)
from kubegpu.kubelet.model import (
    AdmissionError,
    Allocation,
    CheckpointError,
    ContainerStartError,
    DeviceState,
    RegistrationRecord,
    RpcRecord,
    merge_responses,
)
from kubegpu.kubelet.validation import (
    device_id_error,
    is_extended_resource_name,
    register_request_error,
    resource_name_errors,
)

__all__ = [
    "CHECKPOINT_FILE",
    "DEFAULT_VERSION",
    "DIAL_TIMEOUT",
    "GRACE_PERIOD",
    "PRE_START_TIMEOUT",
    "AdmissionError",
    "Allocation",
    "CheckpointError",
    "ContainerStartError",
    "DRASide",
    "DeviceState",
    "KubeletEmulator",
    "RegistrationRecord",
    "RpcRecord",
    "device_id_error",
    "go_error",
    "is_extended_resource_name",
    "merge_responses",
    "register_request_error",
    "resource_name_errors",
]
