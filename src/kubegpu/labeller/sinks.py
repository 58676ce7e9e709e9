"""Where node labels go: an NFD features.d file, an NFD `NodeFeature`, or the Node.

- `FeatureFileSink`: an NFD `features.d` file (GFD's default; NFD's worker turns it into
  node labels). Written atomically so NFD never reads half a file.
- `NodeFeatureSink`: an NFD `NodeFeature` object (`--use-node-feature-api`), owned by
  the labeller's DaemonSet (`owner_references`, from `kubegpu.kube`) as GFD's is.
- `NodePatchSink`: patches the Node directly (`--node-patch`) for clusters without NFD.
  It records the keys it set in an annotation so that it can later remove exactly
  those, and never touches labels someone else owns.

Kubernetes access goes through the one adapter, `kubegpu.kube.Kube`: API failures reach
the caller as `KubeError`, a file that cannot be written as `PublishError`; both are
`KubegpuError`s, which the labelling loop retries.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import os
import stat
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from kubegpu.config.names import is_label_key, is_label_value
from kubegpu.errors import KubegpuError
from kubegpu.kube import NFD_GROUP, NFD_VERSION, Kube
from kubegpu.kube import owner_references as owner_references  # re-exported for the CLI
from kubegpu.labels_amd import rocm_owned_keys

log = logging.getLogger("kubegpu.labeller")

#: Node annotation listing (JSON array) the label keys `NodePatchSink` set last time.
MANAGED_ANNOTATION = "kubegpu.io/managed-labels"
NFD_NODE_NAME_LABEL = "nfd.node.kubernetes.io/node-name"
NODE_FEATURE_PREFIX = "nvidia-features-for-"


class PublishError(KubegpuError):
    """Labels could not be delivered (file not writable, API call refused)."""


class LabelSink(Protocol):
    """Where labels go. `publish` replaces the previous set (labels not given disappear)."""

    async def publish(self, labels: Mapping[str, str]) -> None: ...


def format_features(labels: Mapping[str, str]) -> str:
    """NFD's features.d format: `key=value` lines, sorted so that diffs are readable."""
    return "".join(f"{key}={labels[key]}\n" for key in sorted(labels))


#: A features file kubegpu writes is a few KiB; anything far larger is something else.
MAX_LABELS_FILE_BYTES = 1 << 20


@dataclass
class FeatureFileSink:
    """An NFD features.d file; `path` "-" or "" writes to stdout (GFD: empty = stdout).

    An existing file is replaced only if it reads as a labels file (`replaceable`), unless
    `force`: the labeller runs as root, and a mistyped path must not replace a system file.
    """

    path: str
    force: bool = False

    async def publish(self, labels: Mapping[str, str]) -> None:
        text = format_features(labels)
        if self.path in ("", "-"):
            sys.stdout.write(text)
            sys.stdout.flush()
            return
        await asyncio.to_thread(write_atomically, Path(self.path), text, force=self.force)


def replaceable(path: Path) -> None:
    """PublishError unless `path` is absent, a link (`os.replace` swaps the link itself,
    never its target) or a regular file of `key=value` node labels, as NFD reads them."""
    try:
        info = path.lstat()
    except OSError:
        return  # absent, or its directory unusable: the write itself says why
    if stat.S_ISLNK(info.st_mode):
        return
    refuse = f"refusing to replace {path}: it is not a labels file"
    fix = "remove it, or pass --force-output to replace it anyway"
    if not stat.S_ISREG(info.st_mode):
        raise PublishError(f"{refuse} (not a regular file); {fix}")
    if info.st_size > MAX_LABELS_FILE_BYTES:
        raise PublishError(f"{refuse} ({info.st_size} bytes); {fix}")
    try:
        lines = path.read_bytes().decode("utf-8").splitlines()
    except UnicodeDecodeError:
        raise PublishError(f"{refuse} (not UTF-8 text); {fix}") from None
    except OSError as exc:
        raise PublishError(f"cannot read {path} before writing labels ({exc.strerror})") from exc
    for number, line in enumerate(lines, 1):
        if not line.strip() or line.startswith("#"):  # NFD's comments and directives
            continue
        key, sep, value = line.partition("=")
        if not (sep and is_label_key(key) and is_label_value(value)):
            raise PublishError(f"{refuse} (line {number} is not a node label); {fix}")


def write_atomically(path: Path, text: str, *, force: bool = False) -> None:
    """Temp file in the same directory + `os.replace`: readers see old or new, never half."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if not force:  # after mkdir: `new-dir/../passwd` names a file only once it exists
            replaceable(path)
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


@dataclass
class NodeFeatureSink:
    """One `NodeFeature` object per node, `nvidia-features-for-<node>`, as GFD names it."""

    api: Kube
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

    api: Kube
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
