"""GFD's NodeFeature owner references (internal/lm/output_test.go), against `kubegpu.kube`.

The same cases as test_labels_output.py, run on the adapter's `owner_references` over
`FakeKube`, so the labeller keeps GFD's behaviour when it switches to the adapter.
"""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from kubegpu.kube import FakeKube, KubeError, owner_references
from tests.conformance.origin import DATA, NVIDIA_DP

CASES = yaml.safe_load((DATA / "nvidia/labels/output.yaml").read_text(encoding="utf-8"))["cases"]


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(c, id=f"{NVIDIA_DP.cite('internal/lm/output_test.go')} {c['id']}")
        for c in CASES
    ],
)
def test_owner_references(case: dict[str, Any]) -> None:
    kube = FakeKube()
    if "pod" in case:
        kube.pods[(case["namespace"], case["podName"])] = case["pod"]
    if case.get("expectError"):
        with pytest.raises(KubeError, match=case["podName"]) as info:
            owner_references(kube, case["namespace"], case["podName"])
        assert info.value.status == 404
        return
    owners = owner_references(kube, case["namespace"], case["podName"])
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
    assert kube.calls == (
        [f"get pod/{case['namespace']}/{case['podName']}"] if case["podName"] else []
    )
