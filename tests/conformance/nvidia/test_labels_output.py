"""GFD's NodeFeature owner references (internal/lm/output_test.go), against the labeller.

The labeller's `owner_references` is `kubegpu.kube`'s, run here over `FakeKube`, which
answers a missing Pod as the API server does (a 404 `KubeError`).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import yaml

from kubegpu.kube import KubeError
from kubegpu.labeller import NodeFeatureSink, owner_references
from tests.conformance.origin import DATA, NVIDIA_DP
from tests.rig.kube import FakeKube

CASES = yaml.safe_load((DATA / "nvidia/labels/output.yaml").read_text(encoding="utf-8"))["cases"]


def api_with(case: dict[str, Any]) -> FakeKube:
    api = FakeKube()
    if "pod" in case:
        api.pods[(case["namespace"], case["podName"])] = case["pod"]
    return api


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(c, id=f"{NVIDIA_DP.cite('internal/lm/output_test.go')} {c['id']}")
        for c in CASES
    ],
)
def test_owner_references(case: dict[str, Any]) -> None:
    api = api_with(case)
    if case.get("expectError"):
        with pytest.raises(KubeError, match=case["podName"]) as info:
            owner_references(api, case["namespace"], case["podName"])
        assert info.value.status == 404
        return
    owners = owner_references(api, case["namespace"], case["podName"])
    assert len(owners) == case["expectedOwnerRefs"]
    if case["expectedOwnerRefs"] == 2:
        pod = case["pod"]
        daemonset = pod["ownerReferences"][0]
        # The DaemonSet is the controller; then the Pod itself.
        assert owners[0]["kind"] == "DaemonSet"
        assert owners[0]["controller"] is True
        assert (owners[0]["name"], owners[0]["uid"]) == (daemonset["name"], daemonset["uid"])
        assert owners[1]["kind"] == "Pod"
        assert (owners[1]["name"], owners[1]["uid"]) == (pod["name"], pod["uid"])
    # GFD reads the pod only when it has a name.
    assert api.calls == (
        [f"get pod/{case['namespace']}/{case['podName']}"] if case["podName"] else []
    )


def test_node_feature_object_carries_the_owners_on_create_and_update() -> None:
    """NVIDIA/k8s-device-plugin@v0.20.0:internal/lm/output.go sets them on both paths."""
    case = next(c for c in CASES if c["expectedOwnerRefs"] == 2)
    api = api_with(case)
    owners = owner_references(api, case["namespace"], case["podName"])
    sink = NodeFeatureSink(api, "gpu-node-1", case["namespace"], owners)
    asyncio.run(sink.publish({"nvidia.com/gpu.count": "1"}))
    key = (case["namespace"], "nvidia-features-for-gpu-node-1")
    assert api.node_features[key]["metadata"]["ownerReferences"] == owners
    del api.node_features[key]["metadata"]["ownerReferences"]  # e.g. created by an older labeller
    asyncio.run(sink.publish({"nvidia.com/gpu.count": "1"}))
    assert api.node_features[key]["metadata"]["ownerReferences"] == owners
