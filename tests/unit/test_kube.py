"""The Kubernetes adapter: one configuration, one error mapping, the calls, the fake."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import MaxRetryError, NewConnectionError, ReadTimeoutError

from kubegpu.errors import KubegpuError
from kubegpu.kube import FakeKube, KubeClient, KubeError, owner_references
from tests.waiting import WAIT

#: What urllib3 says when nothing listens; it prefixes the connection object's repr.
REFUSED = "Failed to establish a new connection: [Errno 111] Connection refused"
CONN = SimpleNamespace(host="10.96.0.1")
LABEL = "nvidia.com/device-plugin.config"


def api_error(status: int, reason: str, message: str | None = None) -> ApiException:
    error = ApiException(status=status, reason=reason)
    if message is not None:
        error.body = json.dumps({"kind": "Status", "message": message})
    return error


def meta(**fields: Any) -> SimpleNamespace:
    """A client model's `metadata`: every field the adapter reads, unset ones None."""
    base: dict[str, Any] = {
        "name": None,
        "uid": None,
        "labels": None,
        "annotations": None,
        "owner_references": None,
        "resource_version": "1",
    }
    return SimpleNamespace(**(base | fields))


class RecordingApi:
    """Stands in for `CoreV1Api` / `CustomObjectsApi`: records calls, answers or raises."""

    def __init__(self, answers: dict[str, Any] | None = None) -> None:
        self.calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []
        self.answers = answers or {}
        #: Raised by the next calls, in order, before any answer.
        self.errors: list[BaseException] = []

    def __getattr__(self, method: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls.append((method, args, kwargs))
            if self.errors:
                raise self.errors.pop(0)
            return self.answers.get(method)

        return call


# -- the one error mapping --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("error", "text"),
    [
        (ApiException(status=403, reason="Forbidden"), "403 Forbidden"),
        (ConnectionRefusedError("refused"), "cannot reach the API server"),
    ],
)
def test_event_write_translates_errors(error: Exception, text: str) -> None:
    # Moved from test_events.py (KubernetesEventSink): the mapping now lives in the adapter.
    core = RecordingApi()
    core.errors.append(error)
    with pytest.raises(KubeError, match=text) as info:
        KubeClient(core=core).create_event("default", {"metadata": {"name": "n.1"}})
    assert info.value.__cause__ is error


@pytest.mark.parametrize(
    ("error", "message", "status"),
    [
        (
            api_error(403, "Forbidden"),
            "get Node gpu-1: HTTP 403 Forbidden; check the ServiceAccount's RBAC",
            403,
        ),
        (
            api_error(404, "Not Found"),
            "get Node gpu-1: HTTP 404 Not Found; does it exist? check NODE_NAME",
            404,
        ),
        (
            api_error(401, "Unauthorized"),
            "get Node gpu-1: HTTP 401 Unauthorized; the credentials were refused "
            "(expired token or wrong kubeconfig user)",
            401,
        ),
        (
            api_error(503, "Service Unavailable", "etcdserver: leader changed"),
            "get Node gpu-1: HTTP 503 Service Unavailable (etcdserver: leader changed); "
            "the API server failed: check its health and logs",
            503,
        ),
        (
            ConnectionRefusedError(111, "Connection refused"),
            "get Node gpu-1: cannot reach the API server ([Errno 111] Connection refused); "
            "check the network and the server address "
            "(KUBERNETES_SERVICE_HOST in a pod, `server:` in the kubeconfig)",
            None,
        ),
        (
            MaxRetryError(None, "/api/v1/nodes/gpu-1", NewConnectionError(CONN, REFUSED)),  # type: ignore[arg-type]
            f"get Node gpu-1: cannot reach the API server ({REFUSED}); check the network and the "
            "server address (KUBERNETES_SERVICE_HOST in a pod, `server:` in the kubeconfig)",
            None,
        ),
        (
            ReadTimeoutError(None, "/api/v1/nodes/gpu-1", "read timed out"),  # type: ignore[arg-type]
            "get Node gpu-1: the API server did not answer within 2s; "
            "check that it is up and reachable",
            None,
        ),
        (
            TimeoutError(),
            "get Node gpu-1: the API server did not answer within 2s; "
            "check that it is up and reachable",
            None,
        ),
    ],
)
def test_every_client_failure_is_one_line_naming_the_call_and_a_fix(
    error: Exception, message: str, status: int | None
) -> None:
    core = RecordingApi()
    core.errors.append(error)
    with pytest.raises(KubeError) as info:
        KubeClient(core=core, timeout=2).get_node_metadata("gpu-1")
    assert str(info.value) == message
    assert "\n" not in str(info.value)
    assert info.value.status == status
    assert info.value.__cause__ is error
    assert isinstance(info.value, KubegpuError)


def test_a_conflict_says_to_read_again() -> None:
    custom = RecordingApi()
    custom.errors.append(api_error(409, "Conflict", 'nodefeatures "x" already exists'))
    body = {"metadata": {"name": "x"}}
    with pytest.raises(KubeError) as info:
        KubeClient(custom=custom).create_node_feature("gpu", body)
    assert str(info.value) == (
        'create NodeFeature gpu/x: HTTP 409 Conflict (nodefeatures "x" already exists); '
        "it was changed or created concurrently: read it again and retry"
    )
    assert info.value.status == 409


def test_a_missing_node_feature_asks_whether_nfd_is_installed() -> None:
    custom = RecordingApi()
    custom.errors.append(api_error(404, "Not Found"))
    with pytest.raises(KubeError, match=r"; does it exist \(is NFD installed\)\?$"):
        KubeClient(custom=custom).replace_node_feature("gpu", {"metadata": {"name": "x"}})


def test_an_unknown_failure_is_not_disguised_as_an_outage() -> None:
    core = RecordingApi()
    bug = ValueError("Invalid value for `conditions`, must not be `None`")
    core.errors.append(bug)
    with pytest.raises(ValueError) as info:
        KubeClient(core=core).get_node_metadata("gpu-1")
    assert info.value is bug


# -- the one client configuration -------------------------------------------------------------


@pytest.fixture
def no_cluster(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No service account in sight; KUBECONFIG at a file the test may write."""
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_PORT", raising=False)
    kubeconfig = tmp_path / "kubeconfig"
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    return kubeconfig


def test_no_credentials_is_one_line_saying_what_to_set(no_cluster: Path) -> None:
    with pytest.raises(KubeError) as info:
        KubeClient().connect()
    text = str(info.value)
    assert text.startswith(
        "no Kubernetes credentials: no in-cluster config and no usable kubeconfig ("
    )
    assert text.endswith("); run in a pod with a ServiceAccount or set KUBECONFIG")
    assert "\n" not in text


def test_a_broken_kubeconfig_is_a_kube_error(no_cluster: Path) -> None:
    no_cluster.write_text("clusters: [unclosed\n")
    with pytest.raises(KubeError, match="no usable kubeconfig"):
        KubeClient().get_node_metadata("gpu-1")


def test_credentials_that_appear_later_are_picked_up(no_cluster: Path) -> None:
    client = KubeClient(timeout=2)
    with pytest.raises(KubeError, match="no Kubernetes credentials"):
        client.get_node_metadata("gpu-1")
    no_cluster.write_text(_kubeconfig("https://127.0.0.1:1"))  # nothing listens on port 1
    assert client.connect() is client
    with pytest.raises(KubeError) as info:
        client.get_node_metadata("gpu-1")
    assert str(info.value).startswith("get Node gpu-1: cannot reach the API server (")


def _kubeconfig(server: str) -> str:
    return json.dumps(
        {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "c", "cluster": {"server": server}}],
            "users": [{"name": "u", "user": {"token": "t"}}],
            "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
            "current-context": "x",
        }
    )


# -- the calls --------------------------------------------------------------------------------


def test_node_metadata_and_merge_patch() -> None:
    node = SimpleNamespace(metadata=meta(labels={"a": "1"}))
    core = RecordingApi({"read_node": node})
    client = KubeClient(core=core, timeout=7)
    assert client.get_node_metadata("gpu-1") == {"labels": {"a": "1"}, "annotations": {}}
    client.merge_patch_node("gpu-1", {"metadata": {"labels": {"a": None}}})
    assert core.calls == [
        ("read_node", ("gpu-1",), {"_request_timeout": 7}),
        (
            "patch_node",
            ("gpu-1", {"metadata": {"labels": {"a": None}}}),
            {"_request_timeout": 7, "_content_type": "application/merge-patch+json"},
        ),
    ]


def test_pod_metadata_in_api_spelling() -> None:
    owner = SimpleNamespace(api_version="apps/v1", kind="DaemonSet", name="gfd", uid="ds-1")
    pod = SimpleNamespace(metadata=meta(name="gfd-x", uid="pod-1", owner_references=[owner]))
    core = RecordingApi({"read_namespaced_pod": pod})
    assert KubeClient(core=core).get_pod_metadata("gpu", "gfd-x") == {
        "name": "gfd-x",
        "uid": "pod-1",
        "ownerReferences": [
            {"apiVersion": "apps/v1", "kind": "DaemonSet", "name": "gfd", "uid": "ds-1"}
        ],
    }
    ((method, args, _),) = core.calls
    assert (method, args) == ("read_namespaced_pod", ("gfd-x", "gpu"))


def test_node_feature_get_create_update_delete() -> None:
    nfd = ("nfd.k8s-sigs.io", "v1alpha1", "gpu", "nodefeatures")
    body = {"metadata": {"name": "nvidia-features-for-n1"}, "spec": {"labels": {}}}
    custom = RecordingApi({"get_namespaced_custom_object": body})
    client = KubeClient(custom=custom)
    assert client.get_node_feature("gpu", "nvidia-features-for-n1") == body
    client.create_node_feature("gpu", body)
    client.replace_node_feature("gpu", body)
    assert client.delete_node_feature("gpu", "nvidia-features-for-n1")
    assert [(m, a) for m, a, _ in custom.calls] == [
        ("get_namespaced_custom_object", (*nfd, "nvidia-features-for-n1")),
        ("create_namespaced_custom_object", (*nfd, body)),
        ("replace_namespaced_custom_object", (*nfd, "nvidia-features-for-n1", body)),
        ("delete_namespaced_custom_object", (*nfd, "nvidia-features-for-n1")),
    ]


def test_a_missing_node_feature_is_none_and_deleting_it_is_false() -> None:
    custom = RecordingApi()
    custom.errors += [api_error(404, "Not Found"), api_error(404, "Not Found")]
    client = KubeClient(custom=custom)
    assert client.get_node_feature("gpu", "x") is None
    assert client.delete_node_feature("gpu", "x") is False
    custom.errors.append(api_error(403, "Forbidden"))
    with pytest.raises(KubeError, match=r"^get NodeFeature gpu/x: HTTP 403 Forbidden; check"):
        client.get_node_feature("gpu", "x")


def test_event_write_has_its_own_time_limit() -> None:
    core = RecordingApi()
    client = KubeClient(core=core, timeout=10)
    client.create_event("default", {"metadata": {"name": "n.1"}}, timeout=3)
    client.create_event("default", {"metadata": {"name": "n.2"}})
    assert [kwargs["_request_timeout"] for _, _, kwargs in core.calls] == [3, 10]


# -- the node label watch (moved from test_config_source.py) ----------------------------------


def node(labels: dict[str, str] | None, version: str = "1") -> SimpleNamespace:
    return SimpleNamespace(metadata=meta(labels=labels, resource_version=version))


class ScriptedWatch:
    """Yields scripted events, then blocks like a quiet watch until stopped."""

    def __init__(self, events: list[dict[str, Any]]) -> None:
        self.events = events
        self.stopped = threading.Event()
        self.kwargs: dict[str, Any] = {}

    def stream(self, func: Any, **kwargs: Any) -> Iterator[dict[str, Any]]:
        self.kwargs = kwargs
        yield from self.events
        self.events = []
        self.stopped.wait(WAIT)

    def stop(self) -> None:
        self.stopped.set()


async def test_label_watch_retries_and_follows(caplog: pytest.LogCaptureFixture) -> None:
    core = RecordingApi({"read_node": node({LABEL: "a100"})})
    core.errors.append(api_error(403, "Forbidden"))
    fake_watch = ScriptedWatch([{"type": "MODIFIED", "object": node({LABEL: "t4"})}])
    client = KubeClient(core=core, watch_factory=lambda: fake_watch, backoff=(0.01, 0.02))
    caplog.set_level(logging.WARNING, logger="kubegpu.kube.client")
    stream = client.watch_node_label("node-1", LABEL)
    try:
        assert await asyncio.wait_for(anext(stream), WAIT) == "a100"
        assert await asyncio.wait_for(anext(stream), WAIT) == "t4"
    finally:
        await stream.aclose()  # type: ignore[attr-defined]
    assert fake_watch.stopped.is_set()
    assert fake_watch.kwargs["field_selector"] == "metadata.name=node-1"
    assert fake_watch.kwargs["resource_version"] == "1"
    warnings = [r.getMessage() for r in caplog.records]
    assert warnings == [
        f"node node-1: cannot watch label {LABEL}: get Node node-1: HTTP 403 Forbidden; "
        "check the ServiceAccount's RBAC; retrying in 0.0s"
    ]


async def test_label_watch_sees_a_missing_or_deleted_node_as_unset(
    caplog: pytest.LogCaptureFixture,
) -> None:
    core = RecordingApi({"read_node": node({LABEL: "a100"})})
    core.errors.append(api_error(404, "Not Found"))
    fake_watch = ScriptedWatch([{"type": "DELETED", "object": node({LABEL: "a100"})}])
    client = KubeClient(core=core, watch_factory=lambda: fake_watch, backoff=(0.01, 0.02))
    stream = client.watch_node_label("node-1", LABEL)
    try:
        assert await asyncio.wait_for(anext(stream), WAIT) is None  # 404: no such node yet
        assert await asyncio.wait_for(anext(stream), WAIT) == "a100"
        assert await asyncio.wait_for(anext(stream), WAIT) is None  # DELETED
    finally:
        await stream.aclose()  # type: ignore[attr-defined]
    assert "HTTP 404 Not Found; does it exist? check NODE_NAME" in caplog.text


async def test_label_watch_survives_a_dropped_stream(caplog: pytest.LogCaptureFixture) -> None:
    """An ERROR event (410 Gone) or a broken stream: read the Node again, watch again."""
    core = RecordingApi({"read_node": node({LABEL: "a100"})})
    watches = [
        ScriptedWatch([{"type": "ERROR", "object": {"code": 410}}]),
        ScriptedWatch([{"type": "MODIFIED", "object": node({LABEL: "h100"})}]),
    ]

    class Broken:
        def stream(self, func: Any, **kwargs: Any) -> Iterator[dict[str, Any]]:
            raise ConnectionResetError(104, "Connection reset by peer")

        def stop(self) -> None:
            pass

    queue: list[Any] = [Broken(), *watches]
    client = KubeClient(core=core, watch_factory=lambda: queue.pop(0), backoff=(0.01, 0.02))
    stream = client.watch_node_label("node-1", LABEL)
    try:
        assert await asyncio.wait_for(anext(stream), WAIT) == "a100"
        assert await asyncio.wait_for(anext(stream), WAIT) == "h100"
    finally:
        await stream.aclose()  # type: ignore[attr-defined]
    assert [m for m, _, _ in core.calls] == ["read_node"] * 3
    assert "watch Node node-1: cannot reach the API server" in caplog.text


# -- the fake ---------------------------------------------------------------------------------


def test_fake_answers_as_the_api_server_would() -> None:
    kube = FakeKube()
    kube.add_node("n1", {"keep": "1", "drop": "2"})
    kube.merge_patch_node("n1", {"metadata": {"labels": {"drop": None, "new": "3"}}})
    assert kube.get_node_metadata("n1") == {"labels": {"keep": "1", "new": "3"}, "annotations": {}}
    with pytest.raises(KubeError) as missing:
        kube.get_node_metadata("n2")
    assert (str(missing.value), missing.value.status) == (
        "get Node n2: HTTP 404 Not Found; does it exist? check NODE_NAME",
        404,
    )
    body = {"metadata": {"name": "f"}, "spec": {"labels": {"a": "1"}}}
    kube.create_node_feature("ns", body)
    with pytest.raises(KubeError, match="HTTP 409 Conflict") as conflict:
        kube.create_node_feature("ns", body)
    assert conflict.value.status == 409
    assert kube.get_node_feature("ns", "f") == body
    assert kube.delete_node_feature("ns", "f") is True
    assert kube.delete_node_feature("ns", "f") is False
    assert kube.get_node_feature("ns", "f") is None
    assert kube.calls == [
        "patch node/n1",
        "get node/n1",
        "get node/n2",
        "create nodefeature/ns/f",
        "create nodefeature/ns/f",
        "get nodefeature/ns/f",
        "delete nodefeature/ns/f",
        "delete nodefeature/ns/f",
        "get nodefeature/ns/f",
    ]


def test_fake_returns_copies_not_its_own_objects() -> None:
    kube = FakeKube()
    kube.add_node("n1", {"a": "1"})
    kube.get_node_metadata("n1")["labels"]["a"] = "changed"
    assert kube.nodes["n1"]["labels"] == {"a": "1"}


def test_fake_fails_on_demand() -> None:
    kube = FakeKube()
    kube.add_node("n1")
    down = KubeError("get Node n1: cannot reach the API server")
    kube.fail_next("get node/", down)
    with pytest.raises(KubeError) as info:
        kube.get_node_metadata("n1")
    assert info.value is down
    kube.merge_patch_node("n1", {})  # another call: unaffected
    assert kube.get_node_metadata("n1")["labels"] == {}  # only the next one failed
    kube.fail_with = KubeError("every call fails")
    with pytest.raises(KubeError, match="every call fails"):
        kube.create_event("default", {"metadata": {"name": "e"}})
    assert kube.events == []


async def test_fake_watch_follows_patches_from_worker_threads() -> None:
    kube = FakeKube()
    kube.add_node("n1", {LABEL: "a100"})
    stream = kube.watch_node_label("n1", LABEL)
    try:
        assert await asyncio.wait_for(anext(stream), WAIT) == "a100"
        await asyncio.to_thread(
            kube.merge_patch_node, "n1", {"metadata": {"labels": {"other": "x"}}}
        )
        await asyncio.to_thread(
            kube.merge_patch_node, "n1", {"metadata": {"labels": {LABEL: "t4"}}}
        )
        # The unrelated patch changed nothing this watch reports: the next value is t4.
        assert await asyncio.wait_for(anext(stream), WAIT) == "t4"
        kube.delete_node("n1")
        assert await asyncio.wait_for(anext(stream), WAIT) is None
    finally:
        await stream.aclose()  # type: ignore[attr-defined]
    assert kube.watched == [("n1", LABEL)]


# -- owner references -------------------------------------------------------------------------


def test_owner_references_of_a_daemonset_pod() -> None:
    kube = FakeKube()
    daemonset = {"apiVersion": "apps/v1", "kind": "DaemonSet", "name": "gfd", "uid": "ds-1"}
    kube.pods[("gpu", "gfd-x")] = {"name": "gfd-x", "uid": "pod-1", "ownerReferences": [daemonset]}
    kube.pods[("gpu", "bare")] = {"name": "bare", "uid": "pod-2", "ownerReferences": []}
    assert owner_references(kube, "gpu", "gfd-x") == [
        {**daemonset, "controller": True},
        {"apiVersion": "v1", "kind": "Pod", "name": "gfd-x", "uid": "pod-1"},
    ]
    assert owner_references(kube, "gpu", "bare") == []
    assert owner_references(kube, "gpu", None) == []
    with pytest.raises(KubeError, match=r"^get Pod gpu/gone: HTTP 404 Not Found; .*POD_NAME"):
        owner_references(kube, "gpu", "gone")
