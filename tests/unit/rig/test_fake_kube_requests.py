"""`FakeKube.request_counts`: what a client sent, by verb and resource (the API budget)."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import cast

import pytest

from kubegpu.kube import KubeError
from tests.rig.kube import FakeKube


async def test_requests_are_counted_by_verb_and_resource_failures_included() -> None:
    kube = FakeKube()
    kube.add_node("n1")  # set-up, as an operator's write: not a request of the client's
    kube.get_node_metadata("n1")
    kube.get_node_metadata("n1")
    kube.create_event("default", {"metadata": {"name": "n1.1"}})
    kube.fail_next("list resourceslices/", KubeError("list: HTTP 500", status=500))
    with pytest.raises(KubeError):
        kube.list_resource_slices("gpu.nvidia.com", "n1")
    watch = cast(AsyncGenerator[str | None], kube.watch_node_label("n1", "label"))
    assert await anext(watch) is None
    await watch.aclose()
    assert kube.request_counts() == {
        ("get", "node"): 2,
        ("create", "event"): 1,
        ("list", "resourceslices"): 1,
        ("watch", "node"): 1,
    }
