"""Label delivery: the features.d file, the NodeFeature object, the Node patch.

The API sinks run on `kubegpu.kube`: its `FakeKube`, and once the real `KubeClient` over an
HTTP transport holding NodeFeature objects as the API server would, so the adapter's
requests and translation are what the sinks see.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import httpx2
import pytest

from kubegpu.kube import KubeClient, KubeError
from kubegpu.labeller import (
    MANAGED_ANNOTATION,
    FeatureFileSink,
    NodeFeatureSink,
    NodePatchSink,
    PublishError,
    format_features,
)
from tests.rig.kube import FakeKube


def test_features_file_format_is_sorted_key_value_lines() -> None:
    assert format_features({"b": "2", "a": "1"}) == "a=1\nb=2\n"


async def test_feature_file_sink_replaces_file_atomically(tmp_path: Path) -> None:
    target = tmp_path / "features.d" / "gfd"
    sink = FeatureFileSink(str(target))
    await sink.publish({"nvidia.com/gpu.count": "1"})
    await sink.publish({"nvidia.com/gpu.count": "2", "nvidia.com/gpu.present": "true"})
    assert target.read_text() == "nvidia.com/gpu.count=2\nnvidia.com/gpu.present=true\n"
    assert sorted(p.name for p in target.parent.iterdir()) == ["gfd"]  # no temp files left
    assert target.stat().st_mode & 0o777 == 0o644


async def test_feature_file_sink_unwritable_dir_says_what_to_fix(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(PublishError, match=r"features\.d"):
        await FeatureFileSink(str(blocker / "gfd")).publish({"a": "b"})


SYSTEM_LIKE = {
    "passwd": b"root:x:0:0:root:/root:/bin/bash\ndaemon:x:1:1::/usr/sbin:/usr/sbin/nologin\n",
    "environment": b'PATH="/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin"\n',
    "binary": b"\x7fELF\x02\x01\x01\x00\xff\xfe",
    "half-labels": b"nvidia.com/gpu.count=2\nnot a label line\n",
}


@pytest.mark.parametrize("name", sorted(SYSTEM_LIKE))
async def test_feature_file_sink_refuses_to_replace_a_file_that_is_not_labels(
    tmp_path: Path, name: str
) -> None:
    """The labeller runs as root: `-o ../../etc/passwd` must not replace a system file."""
    target = tmp_path / name
    target.write_bytes(SYSTEM_LIKE[name])
    with pytest.raises(PublishError, match=r"refusing to replace .* --force-output"):
        await FeatureFileSink(str(target)).publish({"nvidia.com/gpu.count": "1"})
    assert target.read_bytes() == SYSTEM_LIKE[name]
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]  # no temp file left behind


async def test_feature_file_sink_refuses_a_fifo_or_a_directory_without_blocking(
    tmp_path: Path,
) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    (tmp_path / "dir").mkdir()
    for target in (fifo, tmp_path / "dir"):
        with pytest.raises(PublishError, match="not a regular file"):
            await FeatureFileSink(str(target)).publish({"a": "b"})


async def test_feature_file_sink_replaces_labels_files_and_forced_paths(tmp_path: Path) -> None:
    labels = tmp_path / "gfd"
    labels.write_text("# +expiry-time=2030-01-01T00:00:00Z\n\nnvidia.com/gpu.count=2\nplain=\n")
    await FeatureFileSink(str(labels)).publish({"nvidia.com/gpu.count": "1"})
    assert labels.read_text() == "nvidia.com/gpu.count=1\n"
    other = tmp_path / "notes"
    other.write_text("not labels\n")
    await FeatureFileSink(str(other), force=True).publish({"a": "b"})
    assert other.read_text() == "a=b\n"
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "notes-target")
    (tmp_path / "notes-target").write_text("kept: a link is replaced, never its target\n")
    await FeatureFileSink(str(link)).publish({"a": "c"})
    assert not link.is_symlink() and link.read_text() == "a=c\n"
    assert (tmp_path / "notes-target").read_text().startswith("kept")


async def test_node_patch_sets_and_later_removes_only_its_own_labels() -> None:
    api = FakeKube()
    api.add_node("n1", {"kubernetes.io/hostname": "n1", "nvidia.com/custom": "mine"})
    sink = NodePatchSink(api, "n1")
    await sink.publish({"nvidia.com/gpu.count": "2", "nvidia.com/gpu.product": "Tesla-T4"})
    labels = api.nodes["n1"]["labels"]
    assert labels["nvidia.com/gpu.count"] == "2"
    assert json.loads(api.nodes["n1"]["annotations"][MANAGED_ANNOTATION]) == [
        "nvidia.com/gpu.count",
        "nvidia.com/gpu.product",
    ]

    await sink.publish({"nvidia.com/gpu.count": "1"})
    labels = api.nodes["n1"]["labels"]
    assert "nvidia.com/gpu.product" not in labels  # ours, gone from the set: removed
    assert labels["nvidia.com/custom"] == "mine"  # never ours: untouched
    assert labels["kubernetes.io/hostname"] == "n1"
    assert labels["nvidia.com/gpu.count"] == "1"


async def test_node_patch_skips_the_write_when_nothing_changed() -> None:
    api = FakeKube()
    api.add_node("n1")
    sink = NodePatchSink(api, "n1")
    await sink.publish({"a.io/x": "1"})
    await sink.publish({"a.io/x": "1"})
    assert api.calls == ["get node/n1", "patch node/n1", "get node/n1"]


def test_node_patch_is_a_minimal_merge_patch() -> None:
    sink = NodePatchSink(FakeKube(), "n1")
    meta = {
        "labels": {"a.io/keep": "1", "a.io/old": "x", "a.io/foreign": "y"},
        "annotations": {MANAGED_ANNOTATION: '["a.io/keep","a.io/old"]'},
    }
    patch = sink.patch_for(meta, {"a.io/keep": "1", "a.io/new": "2"})
    assert patch["metadata"]["labels"] == {"a.io/new": "2", "a.io/old": None}
    assert patch["metadata"]["annotations"] == {MANAGED_ANNOTATION: '["a.io/keep","a.io/new"]'}


async def test_node_feature_object_created_then_updated_keeping_features() -> None:
    api = FakeKube()
    sink = NodeFeatureSink(api, "gpu-1", "kube-system")
    await sink.publish({"nvidia.com/gpu.count": "1"})
    obj = api.node_features[("kube-system", "nvidia-features-for-gpu-1")]
    assert obj["apiVersion"] == "nfd.k8s-sigs.io/v1alpha1"
    assert obj["kind"] == "NodeFeature"
    assert obj["metadata"]["labels"] == {"nfd.node.kubernetes.io/node-name": "gpu-1"}
    assert obj["spec"] == {"labels": {"nvidia.com/gpu.count": "1"}}

    obj["spec"]["features"] = {"flags": {}}  # NFD's part must survive our updates
    await sink.publish({"nvidia.com/gpu.count": "2"})
    obj = api.node_features[("kube-system", "nvidia-features-for-gpu-1")]
    assert obj["spec"] == {"labels": {"nvidia.com/gpu.count": "2"}, "features": {"flags": {}}}

    api.calls.clear()
    await sink.publish({"nvidia.com/gpu.count": "2"})
    assert api.calls == ["get nodefeature/kube-system/nvidia-features-for-gpu-1"]


async def test_api_sinks_pass_the_adapters_error_on() -> None:
    """A missing Node or a refused write leaves as the adapter's one-line `KubeError`."""
    with pytest.raises(KubeError, match=r"get Node gone: HTTP 404 .*check NODE_NAME") as info:
        await NodePatchSink(FakeKube(), "gone").publish({"a.io/x": "1"})
    assert info.value.status == 404

    api = FakeKube()
    api.fail_next("create nodefeature/", KubeError("create NodeFeature: HTTP 403", status=403))
    with pytest.raises(KubeError, match="HTTP 403"):
        await NodeFeatureSink(api, "gpu-1", "gpu").publish({"a.io/x": "1"})
    assert api.node_features == {}


class NodeFeatures:
    """The API server's NodeFeature endpoints (as an `httpx2.MockTransport` handler)."""

    PATH = "/apis/nfd.k8s-sigs.io/v1alpha1/namespaces/gpu/nodefeatures"

    def __init__(self) -> None:
        self.objects: dict[str, dict[str, Any]] = {}
        self.calls: list[str] = []

    def handle(self, request: httpx2.Request) -> httpx2.Response:
        collection, _, name = request.url.path.rpartition("/")
        if request.method == "POST":
            collection, name = request.url.path, json.loads(request.content)["metadata"]["name"]
        assert collection == self.PATH
        self.calls.append(request.method)
        if request.method == "GET":
            if name not in self.objects:
                status = {"kind": "Status", "code": 404, "message": f"{name} not found"}
                return httpx2.Response(404, json=status)
            return httpx2.Response(200, json=self.objects[name])
        self.objects[name] = json.loads(request.content)  # POST, PUT
        return httpx2.Response(201 if request.method == "POST" else 200, content=request.content)


async def test_node_feature_sink_on_the_real_client_translation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    kubeconfig = {
        "clusters": [{"name": "c", "cluster": {"server": "https://kube.test"}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "x",
    }
    (tmp_path / "kubeconfig").write_text(json.dumps(kubeconfig))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "kubeconfig"))
    api = NodeFeatures()
    sink = NodeFeatureSink(KubeClient(transport=httpx2.MockTransport(api.handle)), "gpu-1", "gpu")
    await sink.publish({"nvidia.com/gpu.count": "1"})  # 404 on get: created
    await sink.publish({"nvidia.com/gpu.count": "2"})
    assert api.calls == ["GET", "POST", "GET", "PUT"]
    obj = api.objects["nvidia-features-for-gpu-1"]
    assert obj["spec"] == {"labels": {"nvidia.com/gpu.count": "2"}}
