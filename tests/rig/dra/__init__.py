"""The kubelet emulator's DRA side: plugin watcher, DRA manager, and a scheduler stand-in.

from tests.rig.dra import DRAKubelet

async with DRAKubelet(root, kube) as node:        # root stands for /var/lib/kubelet
    ...  # a driver registers on root/plugins_registry/<driver>-reg.sock
    await node.wait_for_driver("gpu.nvidia.com")
    await node.prepare(pod)                        # pod: a v1 Pod as a dict
    node.cdi_devices(pod, "ctr")

Modules follow the kubelet's code: `watcher` (pkg/kubelet/pluginmanager), `plugins`
(cm/dra/plugin), `manager` (cm/dra/manager.go), `state` (claim info + `dra_manager_state`),
`health` (cm/dra/healthinfo.go: the drivers' health streams, pods' allocatedResourcesStatus);
`node` composes them. `scheduler` is NOT the kubelet: it stands in for kube-scheduler's DRA
allocator so tests can allocate claims without a cluster.
"""

from tests.rig.dra.health import HEALTHY, UNHEALTHY, UNKNOWN, HealthInfoCache
from tests.rig.dra.manager import (
    FAILED_PREPARE,
    ClaimReader,
    DRACall,
    DRAManager,
    PrepareError,
    UnprepareError,
)
from tests.rig.dra.node import PLUGINS, PLUGINS_REGISTRY, DRAKubelet, node_slice_wiper
from tests.rig.dra.plugins import (
    SUPPORTED_SERVICES,
    V1_SERVICE,
    V1BETA1_SERVICE,
    DRAPlugin,
    DRAPluginManager,
    SliceWiper,
)
from tests.rig.dra.state import STATE_FILE, ClaimInfo, PreparedDevice
from tests.rig.dra.watcher import DRA_PLUGIN_TYPE, PluginWatcher, RegistrationAttempt

__all__ = [
    "DRA_PLUGIN_TYPE",
    "FAILED_PREPARE",
    "HEALTHY",
    "PLUGINS",
    "PLUGINS_REGISTRY",
    "STATE_FILE",
    "SUPPORTED_SERVICES",
    "UNHEALTHY",
    "UNKNOWN",
    "V1BETA1_SERVICE",
    "V1_SERVICE",
    "ClaimInfo",
    "ClaimReader",
    "DRACall",
    "DRAKubelet",
    "DRAManager",
    "DRAPlugin",
    "DRAPluginManager",
    "HealthInfoCache",
    "PluginWatcher",
    "PrepareError",
    "PreparedDevice",
    "RegistrationAttempt",
    "SliceWiper",
    "UnprepareError",
    "node_slice_wiper",
]
