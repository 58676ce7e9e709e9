"""`kubegpu labels`: GPU Feature Discovery's job, with GFD's flags and env vars.

Labels are computed by `kubegpu.labels` (pure) and delivered by one of three sinks:

- `FeatureFileSink`: an NFD `features.d` file (GFD's default; NFD's worker turns it into
  node labels). Written atomically so NFD never reads half a file.
- `NodeFeatureSink`: an NFD `NodeFeature` object (`--use-node-feature-api`).
- `NodePatchSink`: patches the Node directly (`--node-patch`) for clusters without NFD.
  It records the keys it set in an annotation so that it can later remove exactly
  those, and never touches labels someone else owns.

Kubernetes access goes through the small `KubeApi` protocol: `KubernetesApi` wraps the
official client (blocking, so the sinks call it in a thread), `FakeKubeApi` keeps objects
in memory for tests and for anyone embedding the labeller.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import json
import logging
import math
import os
import re
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from kubegpu.config import Config, load_file, resolve
from kubegpu.config.names import parse_go_duration
from kubegpu.config.source import (
    DEFAULT_NODE_LABEL,
    ConfigSource,
    ConfigUpdate,
    KubernetesNodeLabels,
    NamedConfigs,
    NodeLabels,
)
from kubegpu.config.v1 import GfdFlags, MigStrategy
from kubegpu.devices.model import Inventory
from kubegpu.errors import ConfigError, InitError, KubegpuError
from kubegpu.gosyntax import parse_bool
from kubegpu.labels import gpu_labels, pci_classes, pci_configs, pci_present
from kubegpu.labels_amd import amd_labels, rocm_owned_keys
from kubegpu.supervisor import spawn

log = logging.getLogger(__name__)

#: Node annotation listing (JSON array) the label keys `NodePatchSink` set last time.
MANAGED_ANNOTATION = "kubegpu.io/managed-labels"
NFD_GROUP = "nfd.k8s-sigs.io"
NFD_VERSION = "v1alpha1"
NFD_PLURAL = "nodefeatures"
NFD_NODE_NAME_LABEL = "nfd.node.kubernetes.io/node-name"
NODE_FEATURE_PREFIX = "nvidia-features-for-"
SERVICE_ACCOUNT_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


class PublishError(KubegpuError):
    """Labels could not be delivered (file not writable, API call refused)."""


# --- Kubernetes access ---------------------------------------------------------------


class KubeApi(Protocol):
    """The few Kubernetes calls the sinks make; blocking, called from a worker thread."""

    def get_node_metadata(self, name: str) -> dict[str, Any]:
        """`metadata` of the Node (`labels`, `annotations`)."""
        ...

    def merge_patch_node(self, name: str, patch: dict[str, Any]) -> None:
        """Apply a JSON merge patch (RFC 7386: `null` deletes a key) to the Node."""
        ...

    def get_node_feature(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The NodeFeature object, or None when there is none."""
        ...

    def get_pod_metadata(self, namespace: str, name: str) -> dict[str, Any]:
        """`metadata` of a Pod (`name`, `uid`, `ownerReferences` in API spelling)."""
        ...

    def create_node_feature(self, namespace: str, body: dict[str, Any]) -> None: ...

    def replace_node_feature(self, namespace: str, body: dict[str, Any]) -> None:
        """Replace the object named in `body` (carries `metadata.resourceVersion`)."""
        ...


class KubernetesApi:
    """`KubeApi` over the official client: in-cluster config first, then kubeconfig."""

    def __init__(self) -> None:
        import kubernetes

        # The client's config loaders are untyped; keep them behind `Any` here.
        client: Any = kubernetes.client
        config: Any = kubernetes.config
        try:
            config.load_incluster_config()
        except config.ConfigException:
            try:
                config.load_kube_config()
            except (config.ConfigException, OSError) as exc:
                raise PublishError(
                    f"no Kubernetes credentials: not in a pod and no kubeconfig ({exc})"
                ) from exc
        self._core = client.CoreV1Api()
        self._custom = client.CustomObjectsApi()

    def get_node_metadata(self, name: str) -> dict[str, Any]:
        node = self._call(f"get Node {name}", self._core.read_node, name)
        meta = node.metadata
        return {"labels": dict(meta.labels or {}), "annotations": dict(meta.annotations or {})}

    def merge_patch_node(self, name: str, patch: dict[str, Any]) -> None:
        self._call(
            f"patch Node {name}",
            self._core.patch_node,
            name,
            patch,
            _content_type="application/merge-patch+json",
        )

    def get_node_feature(self, namespace: str, name: str) -> dict[str, Any] | None:
        from kubernetes.client.exceptions import ApiException

        try:
            obj: Any = self._custom.get_namespaced_custom_object(
                NFD_GROUP, NFD_VERSION, namespace, NFD_PLURAL, name
            )
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise PublishError(f"get NodeFeature {namespace}/{name}: {_api_reason(exc)}") from exc
        return dict(obj)

    def get_pod_metadata(self, namespace: str, name: str) -> dict[str, Any]:
        pod = self._call(
            f"get Pod {namespace}/{name}", self._core.read_namespaced_pod, name, namespace
        )
        meta = pod.metadata
        owners = [
            {"apiVersion": o.api_version, "kind": o.kind, "name": o.name, "uid": o.uid}
            for o in meta.owner_references or []
        ]
        return {"name": meta.name, "uid": meta.uid, "ownerReferences": owners}

    def create_node_feature(self, namespace: str, body: dict[str, Any]) -> None:
        self._call(
            f"create NodeFeature {namespace}/{body['metadata']['name']}",
            self._custom.create_namespaced_custom_object,
            NFD_GROUP,
            NFD_VERSION,
            namespace,
            NFD_PLURAL,
            body,
        )

    def replace_node_feature(self, namespace: str, body: dict[str, Any]) -> None:
        name = body["metadata"]["name"]
        self._call(
            f"update NodeFeature {namespace}/{name}",
            self._custom.replace_namespaced_custom_object,
            NFD_GROUP,
            NFD_VERSION,
            namespace,
            NFD_PLURAL,
            name,
            body,
        )

    @staticmethod
    def _call(what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Translate the client's exceptions into `PublishError`, at this one boundary."""
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        try:
            return fn(*args, **kwargs)
        except ApiException as exc:
            raise PublishError(f"{what}: {_api_reason(exc)}") from exc
        except HTTPError as exc:
            raise PublishError(f"{what}: API server unreachable ({exc})") from exc


def _api_reason(exc: Any) -> str:
    hint = {403: "; check the ServiceAccount's RBAC", 404: "; does it exist (is NFD installed)?"}
    return f"HTTP {exc.status} {exc.reason}{hint.get(exc.status, '')}"


@dataclass
class FakeKubeApi:
    """In-memory `KubeApi`: Nodes' metadata and NodeFeature objects, with a call log."""

    nodes: dict[str, dict[str, Any]] = field(default_factory=dict)
    node_features: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    #: Pods' metadata by (namespace, name), as `get_pod_metadata` returns it.
    pods: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    calls: list[str] = field(default_factory=list)
    #: When set, every call raises it (to test error paths).
    fail_with: PublishError | None = None

    def add_node(self, name: str, labels: Mapping[str, str] | None = None) -> None:
        self.nodes[name] = {"labels": dict(labels or {}), "annotations": {}}

    def _enter(self, call: str) -> None:
        self.calls.append(call)
        if self.fail_with is not None:
            raise self.fail_with

    def get_node_metadata(self, name: str) -> dict[str, Any]:
        self._enter(f"get node/{name}")
        if name not in self.nodes:
            raise PublishError(f"get Node {name}: HTTP 404 Not Found")
        return copy.deepcopy(self.nodes[name])

    def merge_patch_node(self, name: str, patch: dict[str, Any]) -> None:
        self._enter(f"patch node/{name}")
        if name not in self.nodes:
            raise PublishError(f"patch Node {name}: HTTP 404 Not Found")
        meta = self.nodes[name]
        for section in ("labels", "annotations"):
            for key, value in patch.get("metadata", {}).get(section, {}).items():
                if value is None:
                    meta[section].pop(key, None)
                else:
                    meta[section][key] = value

    def get_node_feature(self, namespace: str, name: str) -> dict[str, Any] | None:
        self._enter(f"get nodefeature/{namespace}/{name}")
        obj = self.node_features.get((namespace, name))
        return copy.deepcopy(obj) if obj is not None else None

    def get_pod_metadata(self, namespace: str, name: str) -> dict[str, Any]:
        self._enter(f"get pod/{namespace}/{name}")
        if (namespace, name) not in self.pods:
            raise PublishError(f"get Pod {namespace}/{name}: HTTP 404 Not Found")
        return copy.deepcopy(self.pods[(namespace, name)])

    def create_node_feature(self, namespace: str, body: dict[str, Any]) -> None:
        name = body["metadata"]["name"]
        self._enter(f"create nodefeature/{namespace}/{name}")
        if (namespace, name) in self.node_features:
            raise PublishError(f"create NodeFeature {namespace}/{name}: HTTP 409 Conflict")
        self.node_features[(namespace, name)] = copy.deepcopy(body)

    def replace_node_feature(self, namespace: str, body: dict[str, Any]) -> None:
        name = body["metadata"]["name"]
        self._enter(f"replace nodefeature/{namespace}/{name}")
        self.node_features[(namespace, name)] = copy.deepcopy(body)


# --- sinks -----------------------------------------------------------------------------


class LabelSink(Protocol):
    """Where labels go. `publish` replaces the previous set (labels not given disappear)."""

    async def publish(self, labels: Mapping[str, str]) -> None: ...


def format_features(labels: Mapping[str, str]) -> str:
    """NFD's features.d format: `key=value` lines, sorted so that diffs are readable."""
    return "".join(f"{key}={labels[key]}\n" for key in sorted(labels))


@dataclass
class FeatureFileSink:
    """An NFD features.d file; `path` "-" or "" writes to stdout (GFD: empty = stdout)."""

    path: str

    async def publish(self, labels: Mapping[str, str]) -> None:
        text = format_features(labels)
        if self.path in ("", "-"):
            sys.stdout.write(text)
            sys.stdout.flush()
            return
        await asyncio.to_thread(write_atomically, Path(self.path), text)


def write_atomically(path: Path, text: str) -> None:
    """Temp file in the same directory + `os.replace`: readers see old or new, never half."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as out:
                out.write(text)
                out.flush()
                os.fsync(out.fileno())
            Path(tmp).chmod(0o644)
            Path(tmp).replace(path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as exc:
        raise PublishError(
            f"cannot write labels to {path} ({exc.strerror}); is the NFD features.d "
            "directory mounted read-write?"
        ) from exc


def owner_references(api: KubeApi, namespace: str, pod_name: str | None) -> list[dict[str, Any]]:
    """The labeller's DaemonSet (as controller) and Pod, to own the NodeFeature object.

    As GFD: Kubernetes then deletes the object with the DaemonSet, so an uninstall leaves
    no stale GPU labels behind. No pod name, or a pod no DaemonSet owns: no owners.
    Raises `PublishError` when the pod cannot be read.
    """
    if not pod_name:
        return []
    pod = api.get_pod_metadata(namespace, pod_name)
    daemonset = next(
        (o for o in pod.get("ownerReferences") or [] if o.get("kind") == "DaemonSet"), None
    )
    if daemonset is None:
        return []
    return [
        {
            "apiVersion": daemonset.get("apiVersion"),
            "kind": "DaemonSet",
            "name": daemonset.get("name"),
            "uid": daemonset.get("uid"),
            "controller": True,
        },
        {"apiVersion": "v1", "kind": "Pod", "name": pod.get("name"), "uid": pod.get("uid")},
    ]


@dataclass
class NodeFeatureSink:
    """One `NodeFeature` object per node, `nvidia-features-for-<node>`, as GFD names it."""

    api: KubeApi
    node_name: str
    namespace: str
    #: From `owner_references`; empty leaves the object unowned.
    owners: list[dict[str, Any]] = field(default_factory=list)

    @property
    def object_name(self) -> str:
        return NODE_FEATURE_PREFIX + self.node_name

    def body(self, labels: Mapping[str, str]) -> dict[str, Any]:
        return {
            "apiVersion": f"{NFD_GROUP}/{NFD_VERSION}",
            "kind": "NodeFeature",
            "metadata": {
                "name": self.object_name,
                "namespace": self.namespace,
                "labels": {NFD_NODE_NAME_LABEL: self.node_name},
                **({"ownerReferences": copy.deepcopy(self.owners)} if self.owners else {}),
            },
            "spec": {"labels": dict(labels)},
        }

    async def publish(self, labels: Mapping[str, str]) -> None:
        await asyncio.to_thread(self._publish, labels)

    def _publish(self, labels: Mapping[str, str]) -> None:
        current = self.api.get_node_feature(self.namespace, self.object_name)
        wanted = self.body(labels)
        if current is None:
            self.api.create_node_feature(self.namespace, wanted)
            return
        meta = current.get("metadata", {})
        same_labels = meta.get("labels", {}).get(NFD_NODE_NAME_LABEL) == self.node_name
        same_owners = (meta.get("ownerReferences") or []) == self.owners
        same_spec = current.get("spec", {}).get("labels") == wanted["spec"]["labels"]
        if same_labels and same_owners and same_spec:
            return  # unchanged: no write, no NFD churn
        updated = copy.deepcopy(current)
        updated.setdefault("metadata", {}).setdefault("labels", {})[NFD_NODE_NAME_LABEL] = (
            self.node_name
        )
        # The owners are this labeller's, as GFD sets them on every update.
        if self.owners:
            updated["metadata"]["ownerReferences"] = copy.deepcopy(self.owners)
        else:
            updated["metadata"].pop("ownerReferences", None)
        # Keep `spec.features` (NFD's) and anything else; replace only our labels.
        updated.setdefault("spec", {})["labels"] = dict(labels)
        self.api.replace_node_feature(self.namespace, updated)


@dataclass
class NodePatchSink:
    """Labels patched straight onto the Node; only keys this sink set are ever removed."""

    api: KubeApi
    node_name: str

    async def publish(self, labels: Mapping[str, str]) -> None:
        await asyncio.to_thread(self._publish, labels)

    def patch_for(self, metadata: Mapping[str, Any], labels: Mapping[str, str]) -> dict[str, Any]:
        """The merge patch from the Node's current metadata to `labels`; {} if nothing to do."""
        current: Mapping[str, str] = metadata.get("labels") or {}
        annotations: Mapping[str, str] = metadata.get("annotations") or {}
        previous = _managed_keys(annotations.get(MANAGED_ANNOTATION))
        changes: dict[str, str | None] = {
            key: value for key, value in labels.items() if current.get(key) != value
        }
        # ROCm's labeller's keys are replaced too, so switching from it leaves none stale.
        previous |= rocm_owned_keys(current)
        changes |= {key: None for key in previous - set(labels) if key in current}
        managed = json.dumps(sorted(labels), separators=(",", ":"))
        patch: dict[str, Any] = {}
        if changes:
            patch.setdefault("metadata", {})["labels"] = changes
        if annotations.get(MANAGED_ANNOTATION) != managed:
            patch.setdefault("metadata", {})["annotations"] = {MANAGED_ANNOTATION: managed}
        return patch

    def _publish(self, labels: Mapping[str, str]) -> None:
        patch = self.patch_for(self.api.get_node_metadata(self.node_name), labels)
        if patch:
            self.api.merge_patch_node(self.node_name, patch)


def _managed_keys(annotation: str | None) -> set[str]:
    if not annotation:
        return set()
    try:
        keys = json.loads(annotation)
    except ValueError:
        log.warning("ignoring unreadable %s annotation %r", MANAGED_ANNOTATION, annotation)
        return set()
    return {k for k in keys if isinstance(k, str)} if isinstance(keys, list) else set()


# --- the loop --------------------------------------------------------------------------

#: Labels of one vendor's GPUs from the same snapshot and config (pure, no I/O).
VendorLabels = Callable[[Inventory, Config], Mapping[str, str]]
#: Vendors labelled besides NVIDIA (GFD's labels are built in, since they need the
#: labeller's sysfs reads). Another vendor's label module adds its function here.
VENDOR_LABELS: tuple[VendorLabels, ...] = (
    # AMD GPUs get ROCm's node labeller labels (none without AMD GPUs).
    lambda inventory, _config: amd_labels(inventory),
)


async def run_labeller(
    discover: Callable[[], Inventory],
    config: Callable[[], Config],
    sink: LabelSink,
    *,
    interval: float | None,
    machine_type: Callable[[], str | None] = lambda: None,
    timestamps: bool = True,
    sysfs_root: str | None = "/",
    clock: Callable[[], float] = time.time,
    stop: asyncio.Event | None = None,
    vendor_labels: Sequence[VendorLabels] = VENDOR_LABELS,
) -> int:
    """Label now, then every `interval` seconds until `stop` is set; returns publishes done.

    `interval` None labels once and returns (`--oneshot`); `math.inf` labels once and
    then waits for `stop` (`--sleep-interval=infinite`). A failure on the first pass
    propagates (the pod restarts and says why); later failures are logged and retried
    on the next pass, so an API server blip does not kill a healthy labeller.
    `sysfs_root` None skips the PCI scan (no `gpu.present` from the bus, no PCI class).
    """
    stop = stop or asyncio.Event()
    published = 0
    # GFD stamps the time its labelling loop started, not each pass: the label changes
    # only on a restart, so NFD does not rewrite the Node every interval.
    started = int(clock()) if timestamps else None
    while True:
        try:
            labels = await asyncio.to_thread(
                _compute, discover, config, machine_type, started, sysfs_root, vendor_labels
            )
            await sink.publish(labels)
            published += 1
            log.info("published %d labels", len(labels))
        except KubegpuError as exc:
            if published == 0 or interval is None:
                raise
            log.error("labelling failed, retrying in %ss: %s", interval, exc)
        if interval is None:
            return published
        timeout = None if math.isinf(interval) else interval
        try:
            await asyncio.wait_for(stop.wait(), timeout)
        except TimeoutError:
            continue
        return published


def _compute(
    discover: Callable[[], Inventory],
    config: Callable[[], Config],
    machine_type: Callable[[], str | None],
    timestamp: int | None,
    sysfs_root: str | None,
    vendor_labels: Sequence[VendorLabels] = (),
) -> dict[str, str]:
    cfg = config()
    try:
        inventory = discover()
    except InitError as exc:
        if cfg.flags.fail_on_init_error:
            raise
        # GFD's behaviour with --fail-on-init-error=false: keep running, label what we know.
        log.warning("no GPUs could be read (%s); labelling without them", exc)
        inventory = Inventory(gpus=())
    labels = gpu_labels(
        inventory,
        cfg,
        machine_type=machine_type(),
        timestamp=timestamp,
        present=pci_present(sysfs_root) if sysfs_root is not None else None,
        pci_classes=pci_classes(sysfs_root) if sysfs_root is not None else None,
        pci_configs=pci_configs(sysfs_root) if sysfs_root is not None else None,
    )
    for vendor in vendor_labels:
        labels.update(vendor(inventory, cfg))
    return labels


def read_machine_type(path: str) -> str:
    """The DMI product name, trimmed; `unknown` when no file is set or it is unreadable.

    As GFD: an empty file gives an empty value (labels sanitise it later).
    """
    if not path:
        return "unknown"
    try:
        return Path(path).read_text(encoding="utf-8", errors="replace").strip()
    except OSError as exc:
        log.warning("cannot read machine type from %s: %s", path, exc.strerror)
        return "unknown"


# --- CLI -------------------------------------------------------------------------------

_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")
_UNIT_SECONDS = {
    "ns": 1e-9,
    "us": 1e-6,
    "µs": 1e-6,
    "ms": 1e-3,
    "s": 1.0,
    "m": 60.0,
    "h": 3600.0,
}


def parse_duration(text: str) -> float:
    """Go-style duration (`60s`, `1m30s`, `500ms`) or `infinite`, in seconds."""
    value = text.strip().lower()
    if value in ("infinite", "inf"):
        return math.inf
    pos, total = 0, 0.0
    for match in _DURATION_PART.finditer(value):
        if match.start() != pos:
            break
        total += float(match[1]) * _UNIT_SECONDS[match[2]]
        pos = match.end()
    # 0s is valid (NVIDIA's GFD relabels without pause); a bare number is not (no unit).
    if not value or pos != len(value) or total < 0:
        raise ValueError(f"invalid duration {text!r}; use e.g. 60s, 5m, 1h30m or infinite")
    return total


@dataclass(frozen=True)
class _Option:
    flag: str
    env: str
    dest: str
    help: str
    boolean: bool = False
    short: str | None = None
    #: Other flag names (GFD's `Aliases`).
    aliases: tuple[str, ...] = ()
    #: Every env var read, in GFD's precedence order (the first one set wins), when
    #: there is more than `env`.
    env_names: tuple[str, ...] = ()

    @property
    def envs(self) -> tuple[str, ...]:
        return self.env_names or (self.env,)


_OPTIONS = (
    _Option("--oneshot", "GFD_ONESHOT", "oneshot", "label once and exit", boolean=True),
    _Option(
        "--no-timestamp",
        "GFD_NO_TIMESTAMP",
        "no_timestamp",
        "leave out nvidia.com/gfd.timestamp (labels then change only when the GPUs do)",
        boolean=True,
    ),
    _Option(
        "--sleep-interval",
        "GFD_SLEEP_INTERVAL",
        "sleep_interval",
        "time between labellings, e.g. 60s; 'infinite' labels once and keeps running",
    ),
    _Option(
        "--output-file",
        "GFD_OUTPUT_FILE",
        "output_file",
        "NFD features.d file to write; '-' for stdout",
        short="-o",
        aliases=("--output",),
    ),
    _Option(
        "--machine-type-file",
        "GFD_MACHINE_TYPE_FILE",
        "machine_type_file",
        "file with the machine type for nvidia.com/gpu.machine",
    ),
    _Option(
        "--use-node-feature-api",
        "GFD_USE_NODE_FEATURE_API",
        "use_node_feature_api",
        "publish an NFD NodeFeature object instead of a file",
        boolean=True,
        env_names=("GFD_USE_NODE_FEATURE_API", "USE_NODE_FEATURE_API"),
    ),
    _Option(
        "--node-patch",
        "GFD_NODE_PATCH",
        "node_patch",
        "patch the Node's labels directly (no NFD needed)",
        boolean=True,
    ),
    _Option(
        "--mig-strategy",
        "MIG_STRATEGY",
        "mig_strategy",
        "none, single or mixed",
        env_names=("GFD_MIG_STRATEGY", "MIG_STRATEGY"),
    ),
    _Option(
        "--fail-on-init-error",
        "FAIL_ON_INIT_ERROR",
        "fail_on_init_error",
        "exit when no GPU can be read (false: keep labelling without GPU labels)",
        boolean=True,
        env_names=("GFD_FAIL_ON_INIT_ERROR", "FAIL_ON_INIT_ERROR"),
    ),
    _Option(
        "--config-file",
        "CONFIG_FILE",
        "config_file",
        "kubegpu/NVIDIA v1 config file",
        env_names=("GFD_CONFIG_FILE", "CONFIG_FILE"),
    ),
    _Option(
        "--device-discovery-strategy",
        "DEVICE_DISCOVERY_STRATEGY",
        "device_discovery_strategy",
        "GFD's auto, nvml, tegra or vfio; checked only: --backend picks kubegpu's backend",
    ),
    _Option(
        "--mps-root",
        "MPS_ROOT",
        "mps_root",
        "MPS control daemon directory (the config needs it when sharing.mps is set)",
    ),
    _Option(
        "--simulate",
        "SIMULATE",
        "simulate",
        "use the simulated backend: a preset name (t4-1, h100-8, ...) or a YAML path",
    ),
    _Option(
        "--node-name",
        "NODE_NAME",
        "node_name",
        "this node's name (NodeFeature, patch, the named-config label)",
    ),
    _Option(
        "--config-dir",
        "CONFIG_FILE_SRCDIR",
        "config_dir",
        "directory of named configs; the node label picks one, as for `kubegpu serve`",
    ),
    _Option(
        "--default-config",
        "DEFAULT_CONFIG",
        "default_config",
        "named config used when the node has no label",
    ),
    _Option(
        "--fallback-strategies",
        "FALLBACK_STRATEGIES",
        "fallback_strategies",
        "named, single, empty (comma list) when the node has no label",
    ),
    _Option("--node-label", "NODE_LABEL", "node_label", "node label that picks a named config"),
    _Option(
        "--namespace",
        "NAMESPACE",
        "namespace",
        "namespace of the NodeFeature object (default: POD_NAMESPACE, the pod's own)",
    ),
    _Option(
        "--pod-name",
        "POD_NAME",
        "pod_name",
        "this pod's name, to make its DaemonSet own the NodeFeature object",
    ),
    _Option("--backend", "BACKEND", "backend", "GPU backend: auto, nvml, amd or simulated"),
    # GFD's names; no `--driver-root`, which means the host's root in serve and cdi.
    _Option(
        "--driver-root-ctr-path",
        "CONTAINER_DRIVER_ROOT",
        "driver_root",
        "where the host's driver root is mounted in this container",
        aliases=("--container-driver-root",),
        env_names=("DRIVER_ROOT_CTR_PATH", "CONTAINER_DRIVER_ROOT"),
    ),
    _Option(
        "--sysfs-root",
        "KUBEGPU_SYSFS_ROOT",
        "sysfs_root",
        "root under which sys/bus/pci is read (for gpu.present and gpu.mode)",
    ),
)

# Options whose value lands in the config file's schema (dotted alias paths).
_GFD = GfdFlags.model_fields
_CONFIG_KEYS = {
    "oneshot": f"flags.gfd.{_GFD['oneshot'].alias}",
    "no_timestamp": f"flags.gfd.{_GFD['no_timestamp'].alias}",
    "sleep_interval": f"flags.gfd.{_GFD['sleep_interval'].alias}",
    "output_file": f"flags.gfd.{_GFD['output_file'].alias}",
    "machine_type_file": f"flags.gfd.{_GFD['machine_type_file'].alias}",
    "use_node_feature_api": f"flags.gfd.{_GFD['use_node_feature_api'].alias}",
    "mig_strategy": "flags.migStrategy",
    "fail_on_init_error": "flags.failOnInitError",
    "mps_root": "flags.mpsRoot",
}


def register_cli(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `kubegpu labels`; every flag also reads the env var NVIDIA's GFD reads."""
    parser = subparsers.add_parser(
        "labels",
        help="label the node with its GPUs (GPU Feature Discovery compatible)",
        description=(
            "Label this node with its GPUs, in GPU Feature Discovery's label names. "
            "Precedence: flag, environment variable, config file, default."
        ),
    )
    for opt in _OPTIONS:
        names = [opt.flag, *opt.aliases, *([opt.short] if opt.short else [])]
        help_text = f"{opt.help} [env {', '.join(opt.envs)}]"
        if opt.boolean:
            # `--oneshot` and `--oneshot=false` both work, as with GFD's flags.
            parser.add_argument(
                *names, dest=opt.dest, nargs="?", const="true", default=None, help=help_text
            )
        else:
            parser.add_argument(*names, dest=opt.dest, default=None, help=help_text)
    parser.set_defaults(func=labels_main)


class _UsageError(Exception):
    """A bad flag or env value: one line, exit status 2."""


def _raw(args: argparse.Namespace, opt: _Option, environ: Mapping[str, str]) -> str | None:
    value: str | None = getattr(args, opt.dest, None)
    if value is None:
        found = _env(opt, environ)
        value = None if found is None else found[1]
    return value


def _env(opt: _Option, environ: Mapping[str, str]) -> tuple[str, str] | None:
    """GFD's first env var that is set, and its text. Empty counts as unset, except for a
    boolean, which urfave/cli reads as false."""
    for name in opt.envs:
        if name in environ and (environ[name] != "" or opt.boolean):
            return name, environ[name]
    return None


def _source(args: argparse.Namespace, opt: _Option, environ: Mapping[str, str]) -> str:
    if getattr(args, opt.dest, None) is not None:
        return opt.flag
    found = _env(opt, environ)
    return opt.env if found is None else found[0]


#: GFD's accepted device discovery strategies (cmd/gpu-feature-discovery validateFlags).
_DISCOVERY_STRATEGIES = ("auto", "nvml", "tegra", "vfio")


def _options(args: argparse.Namespace, environ: Mapping[str, str]) -> dict[str, Any]:
    """Flag/env values, parsed; raises `_UsageError` naming the flag (or env var)."""
    values: dict[str, Any] = {}
    for opt in _OPTIONS:
        raw = _raw(args, opt, environ)
        if raw is None:
            continue
        try:
            if opt.boolean:
                values[opt.dest] = False if raw == "" else parse_bool(raw)
            elif opt.dest == "sleep_interval":
                _check_go_duration(raw)
                values[opt.dest] = raw
            elif opt.dest == "mig_strategy":
                values[opt.dest] = MigStrategy(raw).value
            elif opt.dest == "device_discovery_strategy" and raw not in _DISCOVERY_STRATEGIES:
                raise ValueError(
                    f"invalid value {raw!r}; use one of {', '.join(_DISCOVERY_STRATEGIES)}"
                )
            else:
                values[opt.dest] = raw
        except ValueError as exc:
            reason = str(exc)
            if opt.dest == "mig_strategy":
                reason = f"invalid value {raw!r}; use none, single or mixed"
            raise _UsageError(f"{_source(args, opt, environ)}: {reason}") from exc
    return values


def _check_go_duration(text: str) -> None:
    """GFD's `--sleep-interval`: Go's time.ParseDuration (`60s`, `1h30m`, a bare `0`) or
    `infinite`, exactly as written."""
    try:
        parse_go_duration(text)
    except ValueError:
        raise ValueError(
            f"invalid duration {text!r}; use e.g. 60s, 5m, 1h30m, 0 or infinite"
        ) from None


def _config_loader(path: str | None, overrides: Mapping[str, Any]) -> Callable[[], Config]:
    """Re-read the config file on every pass (ConfigMap updates), keeping the last good one."""
    last: list[Config] = []

    def load() -> Config:
        try:
            base = load_file(path) if path else None
            cfg = resolve(base, overrides)
        except ConfigError:
            if not last:
                raise
            log.exception("config became invalid; keeping the previous one")
            return last[0]
        last[:] = [cfg]
        return cfg

    return load


def _namespace(environ: Mapping[str, str]) -> str | None:
    for var in ("POD_NAMESPACE", "KUBERNETES_NAMESPACE"):
        if environ.get(var):
            return environ[var]
    try:
        return Path(SERVICE_ACCOUNT_NAMESPACE).read_text(encoding="utf-8").strip() or None
    except OSError:
        return None


def labels_main(
    args: argparse.Namespace,
    *,
    environ: Mapping[str, str] | None = None,
    api_factory: Callable[[], KubeApi] = KubernetesApi,
    node_labels: NodeLabels | None = None,
) -> int:
    """`kubegpu labels`: 0 on success, 1 on a runtime failure, 2 on bad flags or config.

    With `--config-dir` the config is the named one `kubegpu serve` picks for this node
    (node label, then fallbacks), followed live, so the replica and `-SHARED` labels say
    what the device plugin advertises. `node_labels` replaces the Kubernetes watch (tests).
    """
    env = os.environ if environ is None else environ
    try:
        opts = _options(args, env)
        overrides = {_CONFIG_KEYS[k]: v for k, v in opts.items() if k in _CONFIG_KEYS}
        named = _named_configs(opts, node_labels)
    except (_UsageError, ConfigError) as exc:
        print(f"kubegpu labels: {exc}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(_labels(opts, overrides, named, env, api_factory))
    except (_UsageError, ConfigError) as exc:
        print(f"kubegpu labels: {exc}", file=sys.stderr)
        return 2
    except KubegpuError as exc:
        print(f"kubegpu labels: {exc}", file=sys.stderr)
        return 1


def _named_configs(opts: Mapping[str, Any], node_labels: NodeLabels | None) -> NamedConfigs | None:
    """The same named-config selection `kubegpu serve` makes, from the same flags."""
    directory = opts.get("config_dir")
    if not directory:
        return None
    node = opts.get("node_name")
    if node_labels is None and node:
        node_labels = KubernetesNodeLabels()
    fallbacks = opts.get("fallback_strategies")
    return NamedConfigs(
        directory=Path(directory),
        default=opts.get("default_config"),
        fallback_strategies=(
            tuple(s.strip() for s in fallbacks.split(",") if s.strip())
            if fallbacks is not None
            else ("named", "single")
        ),
        node_name=node,
        label=opts.get("node_label") or DEFAULT_NODE_LABEL,
        labels=node_labels if node else None,
    )


class LiveConfig:
    """The config a `ConfigSource` says is in force now; a callable for `run_labeller`.

    Reloads and label changes arrive in the background; a reload that fails keeps the
    last good config (and logs why), as the device plugin does.
    """

    def __init__(self, source: ConfigSource) -> None:
        self._source = source
        self._updates: AsyncIterator[ConfigUpdate] | None = None
        self._task: asyncio.Task[None] | None = None
        self._current: Config | None = None
        self._changed = asyncio.Event()

    async def start(self) -> Config:
        """The first config; raises its `ConfigError` when there is none to start with."""
        self._updates = aiter(self._source.updates())
        first = await anext(self._updates)
        if first.config is None:
            await self.close()
            raise first.error or ConfigError(f"{first.origin}: no config")
        log.info("config: %s", first.origin)
        self._current = first.config
        self._task = spawn("labeller-config", self._follow(self._updates))
        return first.config

    async def _follow(self, updates: AsyncIterator[ConfigUpdate]) -> None:
        async for update in updates:
            if update.config is None:
                log.error("config reload failed, keeping the previous one: %s", update.error)
                continue
            log.info("config: %s", update.origin)
            self._current = update.config
            self._changed.set()

    async def changed(self) -> Config:
        """Wait for the next config change (a reload or the node label); the new config."""
        self._changed.clear()
        await self._changed.wait()
        return self()

    def __call__(self) -> Config:
        if self._current is None:
            raise ConfigError("labeller config read before it was loaded")
        return self._current

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        closer = getattr(self._updates, "aclose", None)
        if closer is not None:
            await closer()


async def _labels(
    opts: Mapping[str, Any],
    overrides: Mapping[str, Any],
    named: NamedConfigs | None,
    env: Mapping[str, str],
    api_factory: Callable[[], KubeApi],
) -> int:
    live: LiveConfig | None = None
    load_config: Callable[[], Config]
    if named is not None:
        config_file = opts.get("config_file")
        live = LiveConfig(
            ConfigSource(
                config_file=Path(config_file) if config_file else None,
                overrides=overrides,
                named=named,
            )
        )
        load_config = live
        cfg = await live.start()
    else:
        load_config = _config_loader(opts.get("config_file"), overrides)
        cfg = load_config()
    try:
        gfd = cfg.flags.gfd
        try:
            interval = None if gfd.oneshot else parse_duration(gfd.sleep_interval)
        except ValueError as exc:  # only a config file can get here: flags were checked
            raise _UsageError(f"flags.gfd.sleepInterval: {exc}") from exc
        sink = _make_sink(opts, gfd, opts.get("node_name"), env, api_factory)
        machine_file = gfd.machine_type_file
        await _run_until_signalled(
            _discoverer(opts, cfg),
            load_config,
            sink,
            interval=interval,
            machine_type=lambda: read_machine_type(machine_file),
            timestamps=not gfd.no_timestamp,
            sysfs_root=opts.get("sysfs_root", "/"),
        )
    finally:
        if live is not None:
            await live.close()
    return 0


def _make_sink(
    opts: Mapping[str, Any],
    gfd: GfdFlags,
    node_name: str | None,
    environ: Mapping[str, str],
    api_factory: Callable[[], KubeApi],
) -> LabelSink:
    if gfd.use_node_feature_api and opts.get("node_patch"):
        raise _UsageError("--node-patch: cannot be combined with --use-node-feature-api")
    if not (gfd.use_node_feature_api or opts.get("node_patch")):
        return FeatureFileSink(gfd.output_file)
    flag = "--use-node-feature-api" if gfd.use_node_feature_api else "--node-patch"
    if not node_name:
        raise _UsageError(f"--node-name: required with {flag} (set NODE_NAME from spec.nodeName)")
    if gfd.use_node_feature_api:
        namespace = opts.get("namespace") or _namespace(environ)
        if not namespace:
            raise _UsageError(
                "--use-node-feature-api: no namespace; set POD_NAMESPACE "
                "(downward API metadata.namespace)"
            )
        api = api_factory()
        try:
            owners = owner_references(api, namespace, opts.get("pod_name"))
        except PublishError as exc:  # as GFD: label anyway, just without owners
            log.warning("NodeFeature will have no owner (garbage collection off): %s", exc)
            owners = []
        return NodeFeatureSink(api, node_name, namespace, owners)
    return NodePatchSink(api_factory(), node_name)


def _discoverer(opts: Mapping[str, Any], cfg: Config) -> Callable[[], Inventory]:
    """Open the backend on each pass and close it again, as GFD does: no NVML handle is
    held between passes, so driver upgrades and MIG reconfigurations are picked up."""
    from kubegpu.devices import open_backend

    simulate = opts.get("simulate")
    kind = opts.get("backend") or "auto"
    driver_root = opts.get("driver_root") or cfg.flags.nvidia_driver_root
    sysfs_root = opts.get("sysfs_root") or "/"

    def discover() -> Inventory:
        backend = open_backend(
            kind, simulate=simulate, driver_root=driver_root, sysfs_root=sysfs_root
        )
        try:
            return backend.discover()
        finally:
            backend.close()

    return discover


async def _run_until_signalled(
    discover: Callable[[], Inventory],
    config: Callable[[], Config],
    sink: LabelSink,
    **kwargs: Any,
) -> int:
    """`run_labeller` with SIGTERM/SIGINT setting the stop flag (handlers only set it)."""
    import signal

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):  # not the main thread
            loop.add_signal_handler(sig, stop.set)
    return await run_labeller(discover, config, sink, stop=stop, **kwargs)


__all__ = [
    "MANAGED_ANNOTATION",
    "VENDOR_LABELS",
    "FakeKubeApi",
    "FeatureFileSink",
    "KubeApi",
    "KubernetesApi",
    "LabelSink",
    "LiveConfig",
    "NodeFeatureSink",
    "NodePatchSink",
    "PublishError",
    "VendorLabels",
    "format_features",
    "labels_main",
    "owner_references",
    "parse_duration",
    "read_machine_type",
    "register_cli",
    "run_labeller",
    "write_atomically",
]
