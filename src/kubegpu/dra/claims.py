"""A ResourceClaim's allocation on this node -> the devices to prepare and their CDI spec.

Pure: plain functions over the claim (`kubegpu.dra.resourceclaim.Claim`, parsed where it
is read) and the node's state.
The device model is the device plugin's (`ResourceSpec` units, whole GPUs and MIG
slices); a DRA device is the one `kubegpu.dra.slices` publishes under that name (`gpu-0`,
as NVIDIA's DRA driver names them), and a GPU shared by time-slicing or MPS is one device
that several claims get.

The CDI spec of a claim is built from the same pieces as the device plugin's answer: each
device's entry holds its device nodes from `cdi.generate_spec` (the spec the device plugin
writes for its CDI strategies), the spec's common edits hold the control device nodes and
driver mounts from there, plus what `allocation.build_response` adds for the config in
force (GDS/MOFED/GDRCopy env, the MPS pipe and shm mounts of an MPS-shared GPU). No hook
is written, so no host binary is needed. The kind is `k8s.gpu.nvidia.com/claim` with
devices named `<claim UID>-<device>`, as NVIDIA's DRA driver writes them: a CDI name is
never reused for another claim, so a runtime's cached spec can never name the wrong GPU.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Required, TypedDict

import msgspec

from kubegpu import cdi, mps
from kubegpu.allocation import ContainerEdits, build_response, merge
from kubegpu.config import Config, DeviceListStrategy
from kubegpu.devices import Vendor
from kubegpu.dra.resourceclaim import Claim, ClaimError, DeviceResult
from kubegpu.dra.sizing import (
    ClaimLimits,
    DeviceLimit,
    SizingError,
    device_limit,
    mechanisms,
    sized,
)
from kubegpu.dra.slices import AMD_DRIVER, NVIDIA_DRIVER, DraDevice, dra_devices
from kubegpu.resources import ResourceSpec, SharingKind

#: The CDI vendor and class of the per-claim specs (NVIDIA's DRA driver's).
CLAIM_CDI_VENDOR = "k8s.gpu.nvidia.com"
CLAIM_CDI_CLASS = "claim"
CLAIM_CDI_KIND = f"{CLAIM_CDI_VENDOR}/{CLAIM_CDI_CLASS}"


def node_devices(driver: str, specs: Iterable[ResourceSpec]) -> dict[str, DraDevice]:
    """Every device `driver` publishes for these resources, by its name in the slices."""
    return {d.name: d for d in dra_devices(driver, specs)}


class CdiDeviceNode(TypedDict, total=False):
    path: Required[str]
    hostPath: str
    permissions: str


class CdiMount(TypedDict):
    hostPath: str
    containerPath: str
    options: list[str]


class CdiEdits(TypedDict, total=False):
    env: list[str]
    deviceNodes: list[CdiDeviceNode]
    mounts: list[CdiMount]


class CdiDevice(TypedDict):
    name: str
    containerEdits: CdiEdits


class CdiSpec(TypedDict, total=False):
    """A claim's CDI spec, as `cdi.write_spec` writes it (CDI's JSON spelling)."""

    cdiVersion: Required[str]
    kind: Required[str]
    devices: Required[list[CdiDevice]]
    containerEdits: CdiEdits


class PreparedDeviceJson(TypedDict):
    """A `PreparedDevice` as the checkpoint file holds it."""

    requests: list[str]
    pool: str
    device: str
    cdiDeviceIDs: list[str]


@dataclass(frozen=True)
class PreparedDevice:
    """One device of a prepared claim, as NodePrepareResources answers it."""

    requests: tuple[str, ...]
    pool: str
    device: str
    cdi_ids: tuple[str, ...]

    def to_json(self) -> PreparedDeviceJson:
        return {
            "requests": list(self.requests),
            "pool": self.pool,
            "device": self.device,
            "cdiDeviceIDs": list(self.cdi_ids),
        }

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> PreparedDevice:
        return cls(
            requests=tuple(str(r) for r in raw["requests"]),
            pool=str(raw["pool"]),
            device=str(raw["device"]),
            cdi_ids=tuple(str(i) for i in raw["cdiDeviceIDs"]),
        )


def spec_file_name(claim_uid: str) -> str:
    """The claim's CDI spec file: CDI's transient spec name `<vendor>-<class>_<uid>`."""
    return f"{CLAIM_CDI_VENDOR}-{CLAIM_CDI_CLASS}_{claim_uid}.json"


def claim_uid_of(file_name: str) -> str | None:
    """The claim UID a spec file of ours is named after, or None for any other file."""
    prefix = f"{CLAIM_CDI_VENDOR}-{CLAIM_CDI_CLASS}_"
    if file_name.startswith(prefix) and file_name.endswith(".json"):
        return file_name[len(prefix) : -len(".json")] or None
    return None


def cdi_id(claim_uid: str, device: str) -> str:
    return f"{CLAIM_CDI_KIND}={claim_uid}-{device}"


def cdi_strategy_config(config: Config) -> Config:
    """`config` with the device list strategy the DRA answer uses: CDI alone, so
    `build_response` adds only what a CDI device does not carry (extras' env, MPS)."""
    plugin = config.flags.plugin
    if plugin.device_list_strategy == (DeviceListStrategy.CDI_CRI,):
        return config
    plugin = msgspec.structs.replace(plugin, device_list_strategy=(DeviceListStrategy.CDI_CRI,))
    return msgspec.structs.replace(
        config, flags=msgspec.structs.replace(config.flags, plugin=plugin)
    )


@dataclass(frozen=True)
class ClaimPlan:
    """What preparing one claim writes and answers."""

    uid: str
    devices: tuple[PreparedDevice, ...]
    #: The CDI spec (None when the claim has no device of ours: nothing to write).
    spec: CdiSpec | None
    #: The limits of a claim on memory-sized devices, to apply before its spec is written.
    limits: ClaimLimits | None = None
    #: The pods it is reserved for: the kernel memory limit goes on their cgroups, and the
    #: GPU usage metrics tell its users' processes from a neighbour claim's by them.
    pods: tuple[str, ...] = ()


def plan_claim(
    claim: Claim,
    driver: str,
    pool: str,
    devices: Mapping[str, DraDevice],
    node_spec: Mapping[str, Any],
    config: Config,
    *,
    kernel_limits: bool = False,
    daemon_dir: str = "",
) -> ClaimPlan:
    """The CDI spec and answer of a claim allocated `devices` of this node.

    `node_spec` is `cdi.generate_spec` of the node's inventory (the device plugin's CDI
    spec), `config` the one in force; `ClaimError` names a result this node cannot serve.
    On memory-sized devices the plan carries the claim's limits (`kubegpu.dra.sizing`;
    `kernel_limits`: the node has per-cgroup memory limits), and its containers reach the
    claim's own MPS daemon: in `daemon_dir`, by default `mps.claim_dir` of the MPS root.
    """
    uid = claim.uid
    label = claim.label
    picked: list[tuple[DeviceResult, DraDevice]] = []
    for r in claim.allocation.of(driver):
        if r.pool != pool:
            raise ClaimError(
                f"claim {label}: device {r.device} is from pool {r.pool!r}, not this node's "
                f"({pool!r}); the claim was allocated for another node"
            )
        found = devices.get(r.device)
        if found is None:
            raise ClaimError(
                f"claim {label}: device {r.device!r} does not exist on this node "
                f"(it has {', '.join(sorted(devices)) or 'none'}); was it removed by a "
                f"MIG or config change?"
            )
        picked.append((r, found))
    if not picked:
        return ClaimPlan(uid, (), None)
    limits = _limits(label, picked, kernel_limits)
    claim_mps: ContainerEdits | None = None
    if limits is not None and limits.mps:
        root = config.flags.mps_root
        if not daemon_dir and root is None:
            raise ClaimError(
                f"claim {label}: its MPS limits need an MPS root (flags.mpsRoot, --mps-root) "
                f"for its control daemon's pipes; set it"
            )
        daemon_dir = daemon_dir or str(mps.claim_dir(root or "", uid))
        limits = limits.with_applied(daemon_dir=daemon_dir)
        claim_mps = mps.claim_edits(daemon_dir, limits.thread_percentage)
    by_uuid = {d["name"]: d for d in node_spec.get("devices", [])}
    cdi_config = cdi_strategy_config(config)
    entries: dict[str, CdiDevice] = {}
    edits: ContainerEdits | None = None
    answers = []
    for r, nd in picked:
        answers.append(PreparedDevice((r.request,), r.pool, r.device, (cdi_id(uid, r.device),)))
        if r.device in entries:
            continue  # several requests sharing one device: one CDI device
        advertised = next(d for d in nd.resource.devices if d.unit.uuid == nd.unit.uuid)
        if sized(nd.resource):
            extra, claim_mps = claim_mps, None  # the claim's daemon, once
        else:
            extra = mps.resource_edits(nd.resource, config)
        own = build_response(
            nd.resource,
            [advertised],
            cdi_config,
            response_id=uid,
            extra=extra,
            cdi_classes=frozenset(),
        )
        edits = own if edits is None else merge(edits, own)
        entries[r.device] = _device_entry(uid, nd, by_uuid, config)
    assert edits is not None
    nodes = [n for e in entries.values() for n in e["containerEdits"].get("deviceNodes", [])]
    vendor = picked[0][1].resource.vendor
    common = _common_edits(node_spec, edits, {n["path"] for n in nodes}, vendor=vendor)
    spec: CdiSpec = {
        "cdiVersion": cdi.CDI_VERSION,
        "kind": CLAIM_CDI_KIND,
        "devices": list(entries.values()),
    }
    if common:
        spec["containerEdits"] = common
    return ClaimPlan(uid, tuple(answers), spec, limits, claim.reserved_for)


def _limits(
    label: str, picked: list[tuple[DeviceResult, DraDevice]], kernel: bool
) -> ClaimLimits | None:
    """The claim's limits on the memory-sized devices it got (None without any).

    One container reaches one MPS daemon (`/tmp/nvidia-mps`), so a claim's sized devices
    must be held the same way, and a sized device (the claim's own daemon) cannot be
    combined with one MPS-shared by a resource-wide daemon.
    """
    consumed: dict[str, list[Mapping[str, object]]] = {}
    found: dict[str, DraDevice] = {}
    for r, nd in picked:
        if sized(nd.resource):
            consumed.setdefault(r.device, []).append(r.consumed)
            found[r.device] = nd
    if not found:
        return None
    kinds = {mechanisms(nd.resource, nd.unit, kernel) for nd in found.values()}
    shared_mps = sorted(
        r.device
        for r, nd in picked
        if nd.resource.sharing is SharingKind.MPS and not sized(nd.resource)
    )
    if len(kinds) > 1 or shared_mps:
        raise ClaimError(
            f"claim {label}: its devices are limited in different ways "
            f"({', '.join(sorted(found))} sized by memory"
            f"{'; ' + ', '.join(shared_mps) + ' by a shared MPS daemon' if shared_mps else ''}); "
            f"a container reaches one MPS daemon: ask for them in separate claims"
        )
    devices: list[DeviceLimit] = []
    for name, nd in found.items():
        try:
            devices.append(device_limit(name, nd.resource, nd.unit, consumed[name]))
        except SizingError as exc:
            raise ClaimError(
                f"claim {label}: {exc}; the scheduler wrote an allocation this node cannot limit"
            ) from None
    [(memory, compute)] = kinds
    return ClaimLimits(tuple(devices), memory, compute)


def _device_entry(
    uid: str, nd: DraDevice, node_devices: Mapping[str, Mapping[str, Any]], config: Config
) -> CdiDevice:
    """The claim's CDI device for `nd`: its device nodes, as the node spec has them."""
    strategy = config.flags.plugin.device_id_strategy.value
    key = nd.unit.index if strategy == "index" else nd.unit.uuid
    node_entry = node_devices.get(key)
    if node_entry is not None:
        edits: CdiEdits = node_entry["containerEdits"]
    else:  # AMD: no NVIDIA node spec; its own device nodes
        root = config.flags.dev_root
        edits = {"deviceNodes": [_node(p, root) for p in nd.unit.device_paths]}
    return {"name": f"{uid}-{nd.name}", "containerEdits": edits}


def _node(path: str, dev_root: str, permissions: str | None = None) -> CdiDeviceNode:
    entry: CdiDeviceNode = {"path": path}
    if dev_root not in ("", "/"):
        entry["hostPath"] = f"{dev_root.rstrip('/')}/{path.lstrip('/')}"
    if permissions:
        entry["permissions"] = permissions
    return entry


def _common_edits(
    node_spec: Mapping[str, Any],
    edits: ContainerEdits,
    own_nodes: Collection[str],
    *,
    vendor: Vendor,
) -> CdiEdits:
    """The node spec's common edits (NVIDIA) plus the answer's env, mounts and nodes; a
    device node one of the claim's devices already carries is not named twice."""
    base: Mapping[str, Any] = node_spec.get("containerEdits", {}) if vendor is Vendor.NVIDIA else {}
    env = list(base.get("env", []))
    env += [f"{k}={v}" for k, v in edits.envs.items()]
    nodes = list(base.get("deviceNodes", []))
    seen = {n["path"] for n in nodes} | set(own_nodes)
    for d in edits.device_specs:
        if d.container_path not in seen:
            seen.add(d.container_path)
            nodes.append(
                {"path": d.container_path, "hostPath": d.host_path, "permissions": d.permissions}
            )
    mounts = list(base.get("mounts", []))
    mounts += [
        {
            "hostPath": m.host_path,
            "containerPath": m.container_path,
            "options": ["ro", "bind"] if m.read_only else ["rw", "bind"],
        }
        for m in edits.mounts
    ]
    out: CdiEdits = {}
    if env:
        out["env"] = env
    if nodes:
        out["deviceNodes"] = nodes
    if mounts:
        out["mounts"] = mounts
    return out


__all__ = [
    "AMD_DRIVER",
    "CLAIM_CDI_KIND",
    "NVIDIA_DRIVER",
    "CdiSpec",
    "ClaimError",
    "ClaimPlan",
    "PreparedDevice",
    "PreparedDeviceJson",
    "claim_uid_of",
    "node_devices",
    "plan_claim",
    "spec_file_name",
]
