"""The `Allocate` answer for one container: env, device nodes, mounts, annotations, CDI.

Pure: it takes the resource being served, the requested IDs and the config, and returns a
`ContainerEdits` value; the gRPC layer only copies it into the protobuf message. Every
requested ID is checked first, so a bad request is refused whole (INVALID_ARGUMENT) and
never half-answered. For NVIDIA GPUs the answer is the one NVIDIA's plugin gives for the
same flags (device list strategies, device specs, GDS/MOFED/GDRCopy, IMEX channels).
"""

from __future__ import annotations

import posixpath
import stat
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kubegpu.config import Config, DeviceIDStrategy, DeviceListStrategy
from kubegpu.devices import Vendor
from kubegpu.errors import AllocationError, PreconditionError
from kubegpu.nvidia_paths import CDI_VENDOR as CDI_VENDOR
from kubegpu.nvidia_paths import IMEX_CHANNEL_DIR as IMEX_CHANNEL_DIR
from kubegpu.nvidia_paths import VOLUME_MOUNT_ROOT as VOLUME_MOUNT_ROOT
from kubegpu.resources import AdvertisedDevice, ResourceSpec, Unit
from kubegpu.untrusted import ECHO_CHARS
from kubegpu.untrusted import escape as escape

VISIBLE_DEVICES = "NVIDIA_VISIBLE_DEVICES"
#: The plugin name in CDI annotation keys (`cdi.k8s.io/<name>_<response id>`), as NVIDIA's.
CDI_ANNOTATION_PLUGIN = "nvidia-device-plugin"
IMEX_CHANNELS = "NVIDIA_IMEX_CHANNELS"
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


def cdi_device_name(device_id: str, cdi_class: str = "gpu") -> str:
    """The fully qualified CDI name, in NVIDIA's vendor so existing runtime configs match."""
    return f"{CDI_VENDOR}/{cdi_class}={device_id}"


def validate_request(spec: ResourceSpec, ids: Sequence[str]) -> tuple[AdvertisedDevice, ...]:
    """The advertised devices named by `ids`, first occurrence kept, or `AllocationError`.

    A repeated ID is answered once, as NVIDIA's plugin does (the kubelet never repeats
    one, but a retried or hand-made request may). Unknown IDs are echoed bounded and
    escaped: the message reaches the kubelet's logs and the gRPC status, which a request
    must not be able to flood or forge lines in.
    """
    if not ids:
        raise AllocationError(f"{spec.name}: the request lists no device IDs; ask for at least one")
    unique = list(dict.fromkeys(ids))
    unknown = [i for i in unique if i not in spec.by_id]
    if unknown:
        raise AllocationError(
            f"{spec.name}: unknown device ID(s) {describe_ids(unknown)}; "
            f"this plugin advertises {len(spec.devices)} devices"
        )
    # Counted before de-duplication, as NVIDIA counts the request's length.
    if spec.fail_requests_greater_than_one and len(ids) > 1:
        raise AllocationError(
            f"request for '{spec.name}: {len(ids)}' too large: shared devices are time-sliced "
            f"or MPS replicas and more than one does not add capacity; request 1 "
            f"(failRequestsGreaterThanOne is set)"
        )
    return tuple(spec.by_id[i] for i in unique)


#: At most this many IDs, each cut to this many characters, are echoed in an error.
ECHO_IDS = 5
ECHO_ID_CHARS = ECHO_CHARS


def describe_ids(ids: Sequence[str]) -> str:
    """A bounded, escaped rendering of offending IDs for errors and logs."""
    shown = ", ".join(f"'{escape(i)}'" for i in ids[:ECHO_IDS])
    more = f" and {len(ids) - ECHO_IDS} more" if len(ids) > ECHO_IDS else ""
    return shown + more


def unique_units(devices: Sequence[AdvertisedDevice]) -> tuple[Unit, ...]:
    """Replicas collapsed to the physical GPU or MIG slice they stand for, order kept."""
    out: dict[str, Unit] = {}
    for d in devices:
        out.setdefault(d.unit.uuid, d.unit)
    return tuple(out.values())


@dataclass(frozen=True)
class ImexChannel:
    """An IMEX channel given to every container (`imex.channelIDs`)."""

    id: str

    @property
    def path(self) -> str:
        return f"{IMEX_CHANNEL_DIR}/channel{self.id}"


def select_imex_channels(
    config: Config, exists: Callable[[str], bool] | None = None
) -> tuple[ImexChannel, ...]:
    """The configured IMEX channels on this node, where NVIDIA's plugin looks for them: a
    character device under the dev root (the host's /dev as mounted here) or at its own
    path (a /dev this container was given). `exists` (a path -> bool) replaces that check.

    A missing channel is skipped, unless `imex.required` is set: then `PreconditionError`,
    on one line naming the places looked at; `serve` refuses to start on it (and a reload
    keeps its last good config), as NVIDIA's plugin refuses to start.
    """
    present = _is_char_device if exists is None else exists
    root = config.flags.dev_root
    out = []
    for n in config.imex.channel_ids:
        channel = ImexChannel(str(n))
        places = list(dict.fromkeys((under_root(root, channel.path), channel.path)))
        if any(present(place) for place in places):
            out.append(channel)
        elif config.imex.required:
            raise PreconditionError(
                f"imex.required: IMEX channel {n} does not exist on this node (no character "
                f"device at {' or '.join(places)}); create the channel on the node or unset "
                "imex.required"
            )
    return tuple(out)


def _is_char_device(path: str) -> bool:
    try:
        return stat.S_ISCHR(Path(path).stat().st_mode)
    except (OSError, ValueError):  # ValueError: a NUL in a configured root
        return False


#: The strategies that name devices by CDI (built once: `build_response` runs per Allocate).
#: The device-list strategies that name CDI devices (and need a CDI spec on the node).
CDI_STRATEGIES = frozenset({DeviceListStrategy.CDI_ANNOTATIONS, DeviceListStrategy.CDI_CRI})
#: The optional driver features NVIDIA's plugin passes on, in its order: the `Flags`
#: attribute that enables one, its CDI device class, its environment variable.
EXTRA_FEATURES = (
    ("gdrcopy_enabled", "gdrcopy", "NVIDIA_GDRCOPY"),
    ("gds_enabled", "gds", "NVIDIA_GDS"),
    ("mofed_enabled", "mofed", "NVIDIA_MOFED"),
)


def build_response(
    spec: ResourceSpec,
    devices: Sequence[AdvertisedDevice],
    config: Config,
    *,
    response_id: str,
    extra: ContainerEdits | None = None,
    imex_channels: Sequence[ImexChannel] = (),
    cdi_classes: Collection[str] | None = None,
) -> ContainerEdits:
    """The container edits for already-validated `devices` of `spec`, as NVIDIA answers.

    `response_id` names the CDI annotation (unique per response, as annotation keys
    from several containers of a pod must not collide). `cdi_classes` are the CDI
    classes (`imex-channel`, `gds`, ...) that have a spec on this node: a name without a
    spec would fail the container, so NVIDIA's plugin names only those; None assumes
    every enabled one has a spec.
    """

    def has_spec(cdi_class: str) -> bool:
        return cdi_classes is None or cdi_class in cdi_classes

    if spec.vendor is Vendor.AMD:
        edits = _amd_response(spec, devices, config)
        return merge(edits, extra) if extra is not None else edits
    units = unique_units(devices)
    flags = config.flags
    plugin = flags.plugin
    strategies = plugin.device_list_strategy
    use_index = plugin.device_id_strategy is DeviceIDStrategy.INDEX
    ids = [u.index if use_index else u.uuid for u in units]

    envs: dict[str, str] = {}
    mounts: list[MountSpec] = []
    annotations: dict[str, str] = {}
    cdi: tuple[str, ...] = ()
    specs: tuple[DeviceNodeSpec, ...] = ()

    extras = [(mode, var) for attr, mode, var in EXTRA_FEATURES if getattr(flags, attr)]
    if not CDI_STRATEGIES.isdisjoint(strategies):
        names = [cdi_device_name(i) for i in ids]
        if has_spec("imex-channel"):
            names += [cdi_device_name(c.id, "imex-channel") for c in imex_channels]
        # The same modes NVIDIA's CDI handler adds, in its order.
        names += [cdi_device_name("all", mode) for mode, _ in extras if has_spec(mode)]
        if names and DeviceListStrategy.CDI_ANNOTATIONS in strategies:
            key = f"{plugin.cdi_annotation_prefix}{CDI_ANNOTATION_PLUGIN}_{response_id}"
            annotations[key] = ",".join(names)
        if DeviceListStrategy.CDI_CRI in strategies:
            cdi = tuple(names)

    envs.update((var, "enabled") for _, var in extras)

    # CDI only: the runtime injects everything from the CDI spec; no env list, mounts or
    # device nodes (NVIDIA answers the same), so a legacy hook has nothing to act on.
    if not CDI_STRATEGIES.issuperset(strategies):
        if DeviceListStrategy.ENVVAR in strategies:
            envs[VISIBLE_DEVICES] = ",".join(ids)
            if imex_channels:
                envs[IMEX_CHANNELS] = ",".join(c.id for c in imex_channels)
        if DeviceListStrategy.VOLUME_MOUNTS in strategies:
            # The hook reads the list from the mount names; the env var points at them
            # (replacing an `envvar` list, as in NVIDIA's answer).
            envs[VISIBLE_DEVICES] = VOLUME_MOUNT_ROOT
            mounts.extend(
                MountSpec(
                    container_path=posixpath.join(VOLUME_MOUNT_ROOT, i), host_path="/dev/null"
                )
                for i in ids
            )
            mounts.extend(
                MountSpec(
                    container_path=posixpath.join(VOLUME_MOUNT_ROOT, "imex", c.id),
                    host_path="/dev/null",
                )
                for c in imex_channels
            )
        if plugin.pass_device_specs:
            specs = device_node_specs(
                units,
                spec.control_device_paths,
                flags.dev_root,
                [c.path for c in imex_channels],
                stand_in=stands_in(spec.simulated, flags.nvidia_dev_root),
            )

    edits = ContainerEdits(
        envs=envs,
        mounts=tuple(mounts),
        device_specs=specs,
        annotations=annotations,
        cdi_devices=cdi,
    )
    return merge(edits, extra) if extra is not None else edits


def _amd_response(
    spec: ResourceSpec, devices: Sequence[AdvertisedDevice], config: Config
) -> ContainerEdits:
    """AMD runtimes have no hook that reads an env var by default: the device nodes
    (/dev/kfd, /dev/dri/renderD*) are how a container gets an AMD GPU at all."""
    units = unique_units(devices)
    use_index = config.flags.plugin.device_id_strategy is DeviceIDStrategy.INDEX
    ids = [u.index if use_index else u.uuid for u in units]
    return ContainerEdits(
        envs={AMD_VISIBLE_DEVICES: ",".join(ids)},
        device_specs=device_node_specs(
            units,
            spec.control_device_paths,
            config.flags.dev_root,
            control_first=False,
            stand_in=stands_in(spec.simulated, config.flags.nvidia_dev_root),
        ),
    )


def device_node_specs(
    units: Sequence[Unit],
    control_paths: Sequence[str],
    dev_root: str,
    extra_paths: Sequence[str] = (),
    *,
    control_first: bool = True,
    stand_in: bool = False,
) -> tuple[DeviceNodeSpec, ...]:
    """Device nodes for runtimes without the NVIDIA hook.

    NVIDIA's order: control nodes (nvidiactl, uvm, uvm-tools, modeset), then per-GPU
    nodes, then IMEX channels. Host paths sit under the dev root (the driver
    container's /dev when it owns the nodes); container paths are the plain /dev paths
    the driver libraries expect. With `stand_in` (`stands_in`) the GPUs' and control
    nodes are bound from `SIMULATED_DEVICE_NODE`; `extra_paths` (IMEX channels, named
    only when the host has them) never are.
    """
    own = [p for unit in units for p in unit.device_paths]
    ordered = [*control_paths, *own] if control_first else [*own, *control_paths]
    simulated = frozenset(ordered) if stand_in else frozenset()
    paths = dict.fromkeys([*ordered, *extra_paths])
    return tuple(
        DeviceNodeSpec(
            container_path=p,
            host_path=SIMULATED_DEVICE_NODE if p in simulated else under_root(dev_root, p),
            permissions="rw",
        )
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


#: What a simulated GPU's device nodes are bound from when no device root of nodes made for
#: it is configured (`nvidiaDevRoot`): a character device every Linux host has. Runtimes
#: stat each device node's host path (CDI's `hostPath`, or its `path` when absent; the
#: device plugin's `host_path`) and refuse the container when it is missing, and a node
#: without GPUs has no `/dev/nvidia*`. The container still sees the GPU's own path
#: (`/dev/nvidia0`), as a null device: nothing there pretends to be a GPU, and no real GPU
#: of the host is handed out under a simulated one's name.
SIMULATED_DEVICE_NODE = "/dev/null"


def stands_in(simulated: bool, nvidia_dev_root: str | None) -> bool:
    """Whether device nodes are bound from `SIMULATED_DEVICE_NODE`: those of simulated
    devices, unless `nvidiaDevRoot` names a tree of nodes made for them (`mknod`)."""
    return simulated and nvidia_dev_root in (None, "", "/")


def under_root(root: str, path: str) -> str:
    """`path` (absolute) as seen under `root`; "" or "/" means the path itself."""
    if root in ("", "/"):
        return path
    return posixpath.join(root, path.lstrip("/"))
