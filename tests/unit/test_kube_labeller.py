"""The labeller's sinks on `kubegpu.kube`: the adapter is a drop-in for the labeller's `KubeApi`.

Copies of the labeller's sink tests (test_labeller.py), with `FakeKube` in place of
`FakeKubeApi` and, once, the real `KubeClient` over a recording custom-objects API, so
that switching the labeller to the adapter changes imports only.
"""

from __future__ import annotations

import inspect
import json
from typing import Any

from kubernetes.client.exceptions import ApiException

from kubegpu.kube import FakeKube, KubeClient
from kubegpu.labeller import MANAGED_ANNOTATION, KubeApi, NodeFeatureSink, NodePatchSink


def test_the_adapter_offers_every_call_of_the_labellers_kube_api() -> None:
    """Same names and parameters; drop this test with `KubeApi` when the labeller switches."""
    calls = [name for name in vars(KubeApi) if not name.startswith("_")]
    assert calls  # the protocol was read, not an empty namespace
    for name in calls:
        wanted = list(inspect.signature(getattr(KubeApi, name)).parameters)
        for adapter in (KubeClient, FakeKube):
            assert list(inspect.signature(getattr(adapter, name)).parameters) == wanted, (
                adapter.__name__,
                name,
            )


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


class CustomObjects:
    """A `CustomObjectsApi` holding NodeFeature objects as the API server would."""

    def __init__(self) -> None:
        self.objects: dict[str, dict[str, Any]] = {}
        self.calls: list[str] = []

    def get_namespaced_custom_object(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        self.calls.append("get")
        name = args[-1]
        if name not in self.objects:
            raise ApiException(status=404, reason="Not Found")
        return self.objects[name]

    def create_namespaced_custom_object(self, *args: Any, **kwargs: Any) -> None:
        self.calls.append("create")
        self.objects[args[-1]["metadata"]["name"]] = args[-1]

    def replace_namespaced_custom_object(self, *args: Any, **kwargs: Any) -> None:
        self.calls.append("replace")
        self.objects[args[-2]] = args[-1]


async def test_node_feature_sink_on_the_real_client_translation() -> None:
    custom = CustomObjects()
    sink = NodeFeatureSink(KubeClient(custom=custom), "gpu-1", "gpu")
    await sink.publish({"nvidia.com/gpu.count": "1"})  # 404 on get: created
    await sink.publish({"nvidia.com/gpu.count": "2"})
    assert custom.calls == ["get", "create", "get", "replace"]
    obj = custom.objects["nvidia-features-for-gpu-1"]
    assert obj["spec"] == {"labels": {"nvidia.com/gpu.count": "2"}}
