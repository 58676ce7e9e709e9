"""The `Allocate` answer for one container: env, device nodes, mounts, annotations, CDI.

Pure: it takes the resource being served, the requested IDs and the config, and returns a
`ContainerEdits` value; the gRPC layer only copies it into the protobuf message. Every
requested ID is checked first, so a bad request is refused whole (INVALID_ARGUMENT) and
never half-answered.
"""

from __future__ import annotations

import posixpath
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kubegpu.config import Config, DeviceIDStrategy, DeviceListStrategy
from kubegpu.devices import Vendor
from kubegpu.errors import AllocationError
from kubegpu.resources import AdvertisedDevice, ResourceSpec, Unit

VISIBLE_DEVICES = "NVIDIA_VISIBLE_DEVICES"
#: Where the NVIDIA container runtime looks for volume-mount device lists.
VOLUME_MOUNT_ROOT = "/var/run/nvidia-container-devices"
CDI_KIND = "k8s.device-plugin.nvidia.com/gpu"
AMD_VISIBLE_DEVICES = "AMD_VISIBLE_DEVICES"


@dataclass(frozen=True)
class MountSpec:
    container_path: str
    host_path: str
    read_only: bool = False


@dataclass(frozen=True)
class DeviceNodeSpec:
    container_path: str
    host_path: str
    permissions: str = "rw"


@dataclass(frozen=True)
class ContainerEdits:
    """What a container must get; also used for extra edits (MPS pipes) merged in."""

    envs: Mapping[str, str] = field(default_factory=dict)
    mounts: tuple[MountSpec, ...] = ()
    device_specs: tuple[DeviceNodeSpec, ...] = ()
    annotations: Mapping[str, str] = field(default_factory=dict)
    cdi_devices: tuple[str, ...] = ()


def cdi_device_name(device_id: str) -> str:
    """The fully qualified CDI name, in NVIDIA's kind so existing runtime configs match."""
    return f"{CDI_KIND}={device_id}"


def validate_request(spec: ResourceSpec, ids: Sequence[str]) -> tuple[AdvertisedDevice, ...]:
    """The advertised devices named by `ids`, or `AllocationError` naming the bad ones."""
    if not ids:
        raise AllocationError(f"{spec.name}: the request lists no device IDs; ask for at least one")
    dupes = sorted(i for i, n in Counter(ids).items() if n > 1)
    if dupes:
        raise AllocationError(f"{spec.name}: device ID(s) requested twice: {', '.join(dupes)}")
    unknown = [i for i in ids if i not in spec.by_id]
    if unknown:
        shown = ", ".join(repr(i) for i in unknown[:5])
        more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
        raise AllocationError(
            f"{spec.name}: unknown device ID(s) {shown}{more}; "
            f"this plugin advertises {len(spec.devices)} devices"
        )
    if spec.fail_requests_greater_than_one and len(ids) > 1:
        raise AllocationError(
            f"request for '{spec.name}: {len(ids)}' too large: shared devices are time-sliced "
            f"or MPS replicas and more than one does not add capacity; request 1 "
            f"(failRequestsGreaterThanOne is set)"
        )
    return tuple(spec.by_id[i] for i in ids)


def unique_units(devices: Sequence[AdvertisedDevice]) -> tuple[Unit, ...]:
    """Replicas collapsed to the physical GPU or MIG slice they stand for, order kept."""
    out: dict[str, Unit] = {}
    for d in devices:
        out.setdefault(d.unit.uuid, d.unit)
    return tuple(out.values())


def build_response(
    spec: ResourceSpec,
    devices: Sequence[AdvertisedDevice],
    config: Config,
    *,
    response_id: str,
    extra: ContainerEdits | None = None,
) -> ContainerEdits:
    """The container edits for already-validated `devices` of `spec`.

    `response_id` names the CDI annotation (unique per response, as annotation keys
    from several containers of a pod must not collide).
    """
    units = unique_units(devices)
    plugin = config.flags.plugin
    strategies = plugin.device_list_strategy
    use_index = plugin.device_id_strategy is DeviceIDStrategy.INDEX
    ids = [u.index if use_index else u.uuid for u in units]

    envs: dict[str, str] = {}
    mounts: list[MountSpec] = []
    annotations: dict[str, str] = {}
    cdi: tuple[str, ...] = ()

    if spec.vendor is Vendor.AMD:
        envs[AMD_VISIBLE_DEVICES] = ",".join(ids)
    elif DeviceListStrategy.ENVVAR in strategies:
        envs[VISIBLE_DEVICES] = ",".join(ids)
    elif DeviceListStrategy.VOLUME_MOUNTS in strategies:
        envs[VISIBLE_DEVICES] = VOLUME_MOUNT_ROOT
    else:
        # CDI only: CUDA base images set NVIDIA_VISIBLE_DEVICES=all, which a legacy-mode
        # runtime hook would honour; "void" keeps it from injecting every GPU.
        envs[VISIBLE_DEVICES] = "void"
    if DeviceListStrategy.VOLUME_MOUNTS in strategies:
        mounts.extend(
            MountSpec(container_path=posixpath.join(VOLUME_MOUNT_ROOT, i), host_path="/dev/null")
            for i in ids
        )
    names = tuple(cdi_device_name(i) for i in ids)
    if DeviceListStrategy.CDI_ANNOTATIONS in strategies:
        annotations[f"{plugin.cdi_annotation_prefix}kubegpu_{response_id}"] = ",".join(names)
    if DeviceListStrategy.CDI_CRI in strategies:
        cdi = names

    flags = config.flags
    for enabled, var in (
        (flags.gds_enabled, "NVIDIA_GDS"),
        (flags.mofed_enabled, "NVIDIA_MOFED"),
        (flags.gdrcopy_enabled, "NVIDIA_GDRCOPY"),
    ):
        if enabled:
            envs[var] = "enabled"

    specs: tuple[DeviceNodeSpec, ...] = ()
    # AMD runtimes have no hook that reads an env var by default: the device nodes
    # (/dev/kfd, /dev/dri/renderD*) are how a container gets an AMD GPU at all.
    if plugin.pass_device_specs or spec.vendor is Vendor.AMD:
        specs = device_node_specs(units, spec.control_device_paths, flags.dev_root)

    edits = ContainerEdits(
        envs=envs,
        mounts=tuple(mounts),
        device_specs=specs,
        annotations=annotations,
        cdi_devices=cdi,
    )
    return merge(edits, extra) if extra is not None else edits


def device_node_specs(
    units: Sequence[Unit], control_paths: Sequence[str], dev_root: str
) -> tuple[DeviceNodeSpec, ...]:
    """Device nodes for runtimes without the NVIDIA hook: per-GPU nodes, then control nodes.

    Host paths sit under the dev root (the driver container's /dev when it owns the
    nodes); container paths are the plain /dev paths the driver libraries expect.
    """
    paths: dict[str, None] = {}
    for unit in units:
        paths.update(dict.fromkeys(unit.device_paths))
    paths.update(dict.fromkeys(control_paths))
    return tuple(
        DeviceNodeSpec(container_path=p, host_path=_under(dev_root, p), permissions="rw")
        for p in paths
    )


def merge(first: ContainerEdits, second: ContainerEdits) -> ContainerEdits:
    """Combine edits; on conflicting env keys or paths the first wins (as the kubelet does)."""
    mount_paths = {m.container_path for m in first.mounts}
    spec_paths = {d.container_path for d in first.device_specs}
    return ContainerEdits(
        envs={**second.envs, **first.envs},
        mounts=first.mounts
        + tuple(m for m in second.mounts if m.container_path not in mount_paths),
        device_specs=first.device_specs
        + tuple(d for d in second.device_specs if d.container_path not in spec_paths),
        annotations={**second.annotations, **first.annotations},
        cdi_devices=first.cdi_devices
        + tuple(c for c in second.cdi_devices if c not in first.cdi_devices),
    )


def _under(root: str, path: str) -> str:
    if root in ("", "/"):
        return path
    return posixpath.join(root, path.lstrip("/"))
