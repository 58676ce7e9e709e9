"""The exceptions kubegpu raises, all rooted at `KubegpuError`.

    KubegpuError
    ├── ConfigError          a flag, env var or config file is invalid (names the key and value)
    ├── DeviceError          a GPU backend failed (NVML, sysfs, simulated node file)
    │   ├── InitError        no GPU backend could start (no driver, no library, no devices)
    │   ├── MpsError         an MPS control daemon could not start or answer (kubegpu.mps)
    │   └── MemoryLimitError the driver refused a cgroup's memory limit, or a pod's cgroup
    │                        is not where the kubelet puts one (kubegpu.devices.nvml)
    ├── AllocationError      an Allocate / GetPreferredAllocation request is malformed
    │                        (gRPC INVALID_ARGUMENT)
    ├── PreconditionError    a request is well-formed but cannot be served now
    │   │                    (gRPC FAILED_PRECONDITION)
    │   ├── ClaimError       a DRA claim this node cannot prepare (kubegpu.dra)
    │   └── LimitError       a sized claim's limits cannot be applied (kubegpu.dra.limits)
    ├── RegistrationError    the kubelet refused or did not answer a registration
    ├── PublishError         node labels could not be written (kubegpu.labeller)
    ├── KubeError            a Kubernetes API call failed: refused, unreachable, timed out or
    │                        no credentials (kubegpu.kube; `events.EventError` is its old name)
    ├── UsageError           a bad flag or env var value; exit 2 (kubegpu.cli)
    ├── StartupError         the node cannot host `serve` as asked: port in use, address
    │                        not this host's, socket path too long; exit 1 (kubegpu.daemon and
    │                        its fronts, kubegpu.plugin.front and kubegpu.dra.front)
    ├── DirectoryLockError   a directory `serve` owns is locked by another serve; exit 1
    │   │                    (kubegpu.dirlock: a DRA driver's directory)
    │   └── PluginDirectoryError the device-plugin directory is taken: another serve, a
    │                        handover under way, both socket slots served
    │                        (kubegpu.plugin.directory)
    ├── DraCheckpointError   the DRA checkpoint's path holds no regular file, or its
    │                        directory cannot be written; exit 1 (kubegpu.dra.checkpoint)
    └── AdmissionError, ContainerStartError, CheckpointError, PrepareError,
        UnprepareError, UnschedulableError
                             the kubelet emulator's own failures (kubegpu.kubelet;
                             its DRA side and scheduler stand-in: test rig, tests/rig/dra)

The subclasses outside this module live beside the only code that raises them.

Third-party errors (pynvml.NVMLError, grpc.RpcError, kubernetes ApiException) are
translated into these at the one module that talks to that library, raised `from` the
cause, so callers never need to import a vendor library to handle failures.

Towards the kubelet, `kubegpu.rpc.status_for` is the one mapping of these to gRPC
status codes, used by all five DevicePlugin RPCs and both DRAPlugin ones: AllocationError
INVALID_ARGUMENT, PreconditionError and ConfigError FAILED_PRECONDITION, DeviceError
UNAVAILABLE, anything else INTERNAL (logged with its traceback); nothing reaches the
kubelet as UNKNOWN.
"""


class KubegpuError(Exception):
    """Base of every error kubegpu raises on purpose."""


class ConfigError(KubegpuError):
    """Invalid configuration: the message names the key path, the bad value and a fix."""


class DeviceError(KubegpuError):
    """A device backend call failed; the message names the device when one is involved."""


class InitError(DeviceError):
    """No usable GPU backend: no driver/library, or no devices found."""


class AllocationError(KubegpuError):
    """A malformed allocation request (unknown, duplicate or empty device IDs)."""


class PreconditionError(KubegpuError):
    """A valid request that cannot be served in the current state."""


class RegistrationError(KubegpuError):
    """Registration with the kubelet failed."""


class StartupError(KubegpuError):
    """This node cannot host the daemon as asked: the plugin directory is taken, a port is
    in use, an address is not this host's (exit 1: the environment, not the flags)."""


class DirectoryLockError(KubegpuError):
    """A directory this `serve` must own is locked by another process, or cannot be locked
    (exit 1: the node, not the flags)."""
