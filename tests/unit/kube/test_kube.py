"""The Kubernetes adapter: one configuration, one error mapping, the calls, the fake.

`KubeClient` runs here on a real lightkube `Client` whose HTTP transport is an
`httpx2.MockTransport` answering as the API server would: the requests (verbs, paths,
query, headers, bodies, time limits) and the error statuses are the real ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import logging
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx2
import msgspec
import pytest

from kubegpu.errors import KubegpuError
from kubegpu.kube import RELIST, KubeClient, KubeError, owner_references
from kubegpu.kube.client import _lines, _LineTooLong
from kubegpu.kube.errors import status_object_error
from tests.rig.kube import FakeKube
from tests.waiting import WAIT, eventually

LABEL = "nvidia.com/device-plugin.config"
SERVER = "https://kube.test"
NFD = "/apis/nfd.k8s-sigs.io/v1alpha1/namespaces/gpu/nodefeatures"


def status(code: int, message: str | None = None) -> httpx2.Response:
    """The API server's error answer: a JSON Status object."""
    body: dict[str, Any] = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": code}
    if message is not None:
        body["message"] = message
    return httpx2.Response(code, json=body)


@dataclass
class ApiServer:
    """Objects by path; every request recorded; failures and watch streams scripted.

    `failures` answer (a Response) or break (an exception) the next requests, in order,
    before any object is looked at; `watch_failures` the next watch requests. Each watch
    request takes the next list of `watches` and streams it, then stays quiet (as a watch
    with nothing to say) until `closing`. Once `watches` is used up, `repeat` (when set)
    is what every further watch streams before it ends at once: `[]` is a server that
    ends every watch at once, an ERROR 410 one whose every watch expires.
    """

    objects: dict[str, dict[str, Any]] = field(default_factory=dict)
    requests: list[httpx2.Request] = field(default_factory=list)
    failures: list[httpx2.Response | BaseException] = field(default_factory=list)
    watch_failures: list[httpx2.Response | BaseException] = field(default_factory=list)
    watches: list[list[dict[str, Any]]] = field(default_factory=list)
    repeat: list[dict[str, Any]] | None = None
    closing: threading.Event = field(default_factory=threading.Event)

    def handle(self, request: httpx2.Request) -> httpx2.Response:
        self.requests.append(request)
        watch = request.url.params.get("watch") == "true"
        failures = self.watch_failures if watch and self.watch_failures else self.failures
        if failures:
            failure = failures.pop(0)
            if isinstance(failure, BaseException):
                raise failure
            return failure
        if watch:
            if self.watches or self.repeat is None:
                stream = self.stream(self.watches.pop(0) if self.watches else [])
            else:
                stream = (json.dumps(event).encode() + b"\n" for event in self.repeat)
            return httpx2.Response(
                200, headers={"Content-Type": "application/json"}, content=stream
            )
        path = request.url.path
        body: Any = json.loads(request.content) if request.content else None
        if request.method == "GET":
            if path in self.objects:
                return httpx2.Response(200, json=self.objects[path])
            return status(404, f"{path.rsplit('/', 1)[-1]} not found")
        if request.method == "PATCH":
            if path not in self.objects:
                return status(404)
            return httpx2.Response(200, json=self.objects[path])
        if request.method == "POST":
            self.objects[f"{path}/{body['metadata']['name']}"] = body
            return httpx2.Response(201, json=body)
        if request.method == "PUT":
            self.objects[path] = body
            return httpx2.Response(200, json=body)
        if self.objects.pop(path, None) is None:  # DELETE
            return status(404)
        return httpx2.Response(200, json={"kind": "Status", "status": "Success"})

    def stream(self, events: list[dict[str, Any]]) -> Iterator[bytes]:
        for event in events:
            yield json.dumps(event).encode() + b"\n"
        self.closing.wait(WAIT)

    def sent(self) -> list[tuple[str, str]]:
        return [(r.method, r.url.path) for r in self.requests]

    def count(self, method: str, path: str, *, watch: bool = False) -> int:
        """Requests of `method` on `path`: the watches, or the other requests."""
        return sum(
            (r.method, r.url.path) == (method, path)
            and (r.url.params.get("watch") == "true") == watch
            for r in self.requests
        )


class Pauses:
    """A watch thread's backoff delays, recorded instead of waited; the `limit`th blocks
    until the watch is closed, so a test reads a settled count of requests."""

    def __init__(self, limit: int = 1000) -> None:
        self.limit = limit
        self.delays: list[float] = []

    def __call__(self, stop: threading.Event, seconds: float) -> bool:
        self.delays.append(seconds)
        if len(self.delays) >= self.limit:
            return stop.wait(WAIT)
        return stop.is_set()


@pytest.fixture
def no_cluster(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No service account in sight; KUBECONFIG at a file the test may write."""
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_PORT", raising=False)
    kubeconfig = tmp_path / "kubeconfig"
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    return kubeconfig


@pytest.fixture
def api(no_cluster: Path) -> Iterator[ApiServer]:
    no_cluster.write_text(_kubeconfig(SERVER))
    server = ApiServer()
    try:
        yield server
    finally:
        server.closing.set()  # quiet watch streams end


def client_of(api: ApiServer, **options: Any) -> KubeClient:
    return KubeClient(transport=httpx2.MockTransport(api.handle), **options)


def node(name: str, labels: dict[str, str] | None, version: str = "1") -> dict[str, Any]:
    meta = {"name": name, "labels": labels, "resourceVersion": version}
    return {"apiVersion": "v1", "kind": "Node", "metadata": meta}


# -- the one error mapping --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("failure", "text"),
    [
        (status(403), "403 Forbidden"),
        (httpx2.ConnectError("[Errno 111] Connection refused"), "cannot reach the API server"),
    ],
)
def test_event_write_translates_errors(
    api: ApiServer, failure: httpx2.Response | Exception, text: str
) -> None:
    # Moved from test_events.py (KubernetesEventSink): the mapping now lives in the adapter.
    api.failures.append(failure)
    with pytest.raises(KubeError, match=text) as info:
        client_of(api).create_event("default", {"metadata": {"name": "n.1"}})
    if isinstance(failure, Exception):
        assert info.value.__cause__ is failure
    else:
        assert isinstance(info.value.__cause__, httpx2.HTTPStatusError)
    assert api.sent() == [("POST", "/api/v1/namespaces/default/events")]


UNREACHABLE = (
    "check the network and the server address "
    "(KUBERNETES_SERVICE_HOST in a pod, `server:` in the kubeconfig)"
)


@pytest.mark.parametrize(
    ("failure", "message", "status_code"),
    [
        (
            status(403),
            "get Node gpu-1: HTTP 403 Forbidden; check the ServiceAccount's RBAC",
            403,
        ),
        (
            status(404),
            "get Node gpu-1: HTTP 404 Not Found; does it exist? check NODE_NAME",
            404,
        ),
        (
            status(401),
            "get Node gpu-1: HTTP 401 Unauthorized; the credentials were refused "
            "(expired token or wrong kubeconfig user)",
            401,
        ),
        (
            status(503, "etcdserver: leader changed\nsecond line"),
            "get Node gpu-1: HTTP 503 Service Unavailable (etcdserver: leader changed); "
            "the API server failed: check its health and logs",
            503,
        ),
        (
            # Not a Status (a proxy's page, no Content-Type): still the status and the hint.
            httpx2.Response(502, content=b"<html>bad gateway</html>"),
            "get Node gpu-1: HTTP 502 Bad Gateway; the API server failed: check its health "
            "and logs",
            502,
        ),
        (
            httpx2.Response(502, text="upstream connect error"),
            "get Node gpu-1: HTTP 502 Bad Gateway; the API server failed: check its health "
            "and logs",
            502,
        ),
        (
            httpx2.ConnectError("[Errno 111] Connection refused"),
            "get Node gpu-1: cannot reach the API server ([Errno 111] Connection refused); "
            + UNREACHABLE,
            None,
        ),
        (
            httpx2.RemoteProtocolError("Server disconnected without sending a response."),
            "get Node gpu-1: cannot reach the API server (Server disconnected without sending "
            "a response.); " + UNREACHABLE,
            None,
        ),
        (
            ConnectionRefusedError(111, "Connection refused"),
            "get Node gpu-1: cannot reach the API server ([Errno 111] Connection refused); "
            + UNREACHABLE,
            None,
        ),
        (
            httpx2.ReadTimeout("The read operation timed out"),
            "get Node gpu-1: the API server did not answer within 2s; "
            "check that it is up and reachable",
            None,
        ),
        (
            httpx2.ConnectTimeout("timed out"),
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
    api: ApiServer, failure: httpx2.Response | Exception, message: str, status_code: int | None
) -> None:
    api.failures.append(failure)
    with pytest.raises(KubeError) as info:
        client_of(api, timeout=2).get_node_metadata("gpu-1")
    assert str(info.value) == message
    assert "\n" not in str(info.value)
    assert info.value.status == status_code
    if isinstance(failure, Exception):
        assert info.value.__cause__ is failure
    assert isinstance(info.value, KubegpuError)


@pytest.mark.parametrize(
    "message",
    [
        "x" * 100_000 + "\nFORGED level=INFO all is well",
        "\x1b[2K\x00\u202eFORGED level=INFO all is well" + "x" * 100_000,
    ],
)
def test_a_hostile_server_message_is_one_bounded_escaped_line(api: ApiServer, message: str) -> None:
    api.failures.append(status(500, message))
    with pytest.raises(KubeError) as info:
        client_of(api).get_node_metadata("gpu-1")
    text = str(info.value)
    assert text.isprintable()  # no line break, no escape sequence, no bidi override
    assert len(text) < 600
    assert text.startswith("get Node gpu-1: HTTP 500 Internal Server Error (")
    assert text.endswith("...); the API server failed: check its health and logs")
    # A watch's ERROR event carries a Status of its own: the same bound.
    error = status_object_error("watch Node gpu-1", {"code": 500, "reason": message})
    assert str(error).isprintable() and len(str(error)) < 300


def test_a_conflict_says_to_read_again(api: ApiServer) -> None:
    api.failures.append(status(409, 'nodefeatures "x" already exists'))
    body = {"metadata": {"name": "x"}}
    with pytest.raises(KubeError) as info:
        client_of(api).create_node_feature("gpu", body)
    assert str(info.value) == (
        'create NodeFeature gpu/x: HTTP 409 Conflict (nodefeatures "x" already exists); '
        "it was changed or created concurrently: read it again and retry"
    )
    assert info.value.status == 409


def test_a_missing_node_feature_asks_whether_nfd_is_installed(api: ApiServer) -> None:
    api.failures.append(status(404))
    with pytest.raises(KubeError, match=r"; does it exist \(is NFD installed\)\?$"):
        client_of(api).replace_node_feature("gpu", {"metadata": {"name": "x"}})
    assert api.sent() == [("PUT", f"{NFD}/x")]


def test_an_unknown_failure_is_not_disguised_as_an_outage(api: ApiServer) -> None:
    # A Node the client cannot decode (labels must be a map): a bug, not an outage.
    api.objects["/api/v1/nodes/gpu-1"] = node("gpu-1", None) | {"metadata": {"labels": [1]}}
    with pytest.raises(msgspec.ValidationError) as info:
        client_of(api).get_node_metadata("gpu-1")
    assert not isinstance(info.value, KubeError)


# -- the one client configuration -------------------------------------------------------------


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


def test_a_kubeconfig_without_the_current_context_is_a_kube_error(no_cluster: Path) -> None:
    config = json.loads(_kubeconfig(SERVER)) | {"current-context": "gone"}
    no_cluster.write_text(json.dumps(config))
    with pytest.raises(KubeError, match=r"no usable kubeconfig \(Context 'gone' not found\)"):
        KubeClient().connect()


def test_credentials_that_appear_later_are_picked_up(no_cluster: Path) -> None:
    client = KubeClient(timeout=2)
    with pytest.raises(KubeError, match="no Kubernetes credentials"):
        client.get_node_metadata("gpu-1")
    no_cluster.write_text(_kubeconfig("https://127.0.0.1:1"))  # nothing listens on port 1
    assert client.connect() is client
    with pytest.raises(KubeError) as info:
        client.get_node_metadata("gpu-1")
    assert str(info.value).startswith("get Node gpu-1: cannot reach the API server (")
    client.close()


def test_kubeconfig_is_the_first_existing_file_of_the_path_list(
    api: ApiServer, no_cluster: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    missing = no_cluster.with_name("missing")
    monkeypatch.setenv("KUBECONFIG", f"{missing}:{no_cluster}")
    api.objects["/api/v1/nodes/n1"] = node("n1", {"a": "1"})
    assert client_of(api).get_node_metadata("n1")["labels"] == {"a": "1"}
    assert api.requests[0].url.host == "kube.test"


def test_a_pod_environment_without_a_service_account_falls_back_to_kubeconfig(
    api: ApiServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # KUBERNETES_SERVICE_HOST/PORT alone (no token mounted) is not an in-cluster config.
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    api.objects["/api/v1/nodes/n1"] = node("n1", {})
    client_of(api).get_node_metadata("n1")
    assert str(api.requests[0].url).startswith(f"{SERVER}/api/v1/nodes/n1")


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


def timeouts(request: httpx2.Request) -> set[float]:
    """The time limits httpx2 applied to one request (connect, read, write, pool)."""
    return set(request.extensions["timeout"].values())


def test_node_metadata_and_merge_patch(api: ApiServer) -> None:
    api.objects["/api/v1/nodes/gpu-1"] = node("gpu-1", {"a": "1"})
    client = client_of(api, timeout=7)
    assert client.get_node_metadata("gpu-1") == {"labels": {"a": "1"}, "annotations": {}}
    client.merge_patch_node("gpu-1", {"metadata": {"labels": {"a": None}}})
    assert api.sent() == [("GET", "/api/v1/nodes/gpu-1"), ("PATCH", "/api/v1/nodes/gpu-1")]
    read, patch = api.requests
    assert patch.headers["content-type"] == "application/merge-patch+json"
    assert json.loads(patch.content) == {"metadata": {"labels": {"a": None}}}
    assert [timeouts(read), timeouts(patch)] == [{7}, {7}]
    assert patch.headers["authorization"] == "Bearer t"


def test_node_status_is_capacity_and_allocatable(api: ApiServer) -> None:
    status = {"capacity": {"nvidia.com/gpu": "8", "cpu": "4"}, "allocatable": {"cpu": "3"}}
    api.objects["/api/v1/nodes/gpu-1"] = {**node("gpu-1", None), "status": status}
    api.objects["/api/v1/nodes/bare"] = node("bare", None)
    client = client_of(api)
    assert client.get_node_status("gpu-1") == status
    assert client.get_node_status("bare") == {"capacity": {}, "allocatable": {}}
    with pytest.raises(KubeError, match=r"^get Node gone: HTTP 404") as missing:
        client.get_node_status("gone")
    assert missing.value.status == 404
    kube = FakeKube()
    kube.add_node("gpu-1")
    assert kube.get_node_status("gpu-1") == {"capacity": {}, "allocatable": {}}
    kube.set_node_status("gpu-1", {"nvidia.com/gpu": "8"})
    assert kube.get_node_status("gpu-1") == {
        "capacity": {"nvidia.com/gpu": "8"},
        "allocatable": {"nvidia.com/gpu": "8"},
    }
    with pytest.raises(KubeError, match=r"^get Node gone: HTTP 404"):
        kube.get_node_status("gone")
    assert kube.calls == ["get node/gpu-1/status"] * 2 + ["get node/gone/status"]


def test_pod_metadata_in_api_spelling(api: ApiServer) -> None:
    owner = {"apiVersion": "apps/v1", "kind": "DaemonSet", "name": "gfd", "uid": "ds-1"}
    meta = {"name": "gfd-x", "namespace": "gpu", "uid": "pod-1", "ownerReferences": [owner]}
    api.objects["/api/v1/namespaces/gpu/pods/gfd-x"] = {"kind": "Pod", "metadata": meta}
    assert client_of(api).get_pod_metadata("gpu", "gfd-x") == {
        "name": "gfd-x",
        "uid": "pod-1",
        "ownerReferences": [owner],
    }
    assert api.sent() == [("GET", "/api/v1/namespaces/gpu/pods/gfd-x")]


def test_node_feature_get_create_update_delete(api: ApiServer) -> None:
    body = {
        "apiVersion": "nfd.k8s-sigs.io/v1alpha1",
        "kind": "NodeFeature",
        "metadata": {"name": "nvidia-features-for-n1"},
        "spec": {"labels": {}},
    }
    client = client_of(api)
    client.create_node_feature("gpu", body)
    assert client.get_node_feature("gpu", "nvidia-features-for-n1") == body
    updated = body | {"spec": {"labels": {"nvidia.com/gpu.count": "2"}}}
    client.replace_node_feature("gpu", updated)
    assert client.delete_node_feature("gpu", "nvidia-features-for-n1")
    assert api.sent() == [
        ("POST", NFD),
        ("GET", f"{NFD}/nvidia-features-for-n1"),
        ("PUT", f"{NFD}/nvidia-features-for-n1"),
        ("DELETE", f"{NFD}/nvidia-features-for-n1"),
    ]
    create, _, replace, _ = api.requests
    # The bodies go out exactly as given: nothing added, nothing rewritten.
    assert [json.loads(create.content), json.loads(replace.content)] == [body, updated]
    assert body["spec"] == {"labels": {}}  # the caller's dictionary is not changed


def test_a_missing_node_feature_is_none_and_deleting_it_is_false(api: ApiServer) -> None:
    client = client_of(api)
    assert client.get_node_feature("gpu", "x") is None
    assert client.delete_node_feature("gpu", "x") is False
    api.failures.append(status(403))
    with pytest.raises(KubeError, match=r"^get NodeFeature gpu/x: HTTP 403 Forbidden; check"):
        client.get_node_feature("gpu", "x")


def test_an_event_is_a_core_v1_event_with_its_own_time_limit(api: ApiServer) -> None:
    client = client_of(api, timeout=10)
    body = {"metadata": {"name": "n.1"}, "firstTimestamp": "2026-01-01T00:00:00+00:00"}
    client.create_event("default", body, timeout=3)
    client.create_event("default", {"metadata": {"name": "n.2"}})
    assert api.sent() == [("POST", "/api/v1/namespaces/default/events")] * 2
    first, second = api.requests
    assert [timeouts(first), timeouts(second)] == [{3}, {10}]
    # Sent as given (the typed model would rewrite "+00:00" as "Z"), kind filled in.
    assert json.loads(first.content) == body | {"apiVersion": "v1", "kind": "Event"}


# -- the node label watch (moved from test_config_source.py) ----------------------------------


def watch_requests(api: ApiServer) -> list[httpx2.Request]:
    return [r for r in api.requests if r.url.params.get("watch") == "true"]


def node_reads(api: ApiServer) -> int:
    return api.sent().count(("GET", "/api/v1/nodes/node-1"))


async def test_label_watch_retries_and_follows(
    api: ApiServer, caplog: pytest.LogCaptureFixture
) -> None:
    api.failures.append(status(403))
    api.objects["/api/v1/nodes/node-1"] = node("node-1", {LABEL: "a100"})
    api.watches.append([{"type": "MODIFIED", "object": node("node-1", {LABEL: "t4"}, "2")}])
    client = client_of(api, backoff=(0.01, 0.02))
    caplog.set_level(logging.WARNING, logger="kubegpu.kube.client")
    stream = client.watch_node_label("node-1", LABEL)
    try:
        assert await asyncio.wait_for(anext(stream), WAIT) == "a100"
        assert await asyncio.wait_for(anext(stream), WAIT) == "t4"
    finally:
        await stream.aclose()  # type: ignore[attr-defined]
    (watch,) = watch_requests(api)
    assert watch.url.path == "/api/v1/nodes"
    assert watch.url.params["fieldSelector"] == "metadata.name=node-1"
    assert watch.url.params["resourceVersion"] == "1"
    # As client-go's reflector: the server ends the watch after 5 to 10 minutes (spread
    # over a fleet), sends bookmarks meanwhile.
    assert 300 <= int(watch.url.params["timeoutSeconds"]) < 600
    assert watch.url.params["allowWatchBookmarks"] == "true"
    warnings = [r.getMessage() for r in caplog.records]
    assert warnings == [
        f"node node-1: cannot watch label {LABEL}: get Node node-1: HTTP 403 Forbidden; "
        "check the ServiceAccount's RBAC; retrying in 0.0s"
    ]


async def test_label_watch_ends_its_thread_when_closed(api: ApiServer) -> None:
    api.objects["/api/v1/nodes/node-1"] = node("node-1", {LABEL: "a100"})
    stream = client_of(api).watch_node_label("node-1", LABEL)
    assert await asyncio.wait_for(anext(stream), WAIT) == "a100"
    await eventually(lambda: bool(watch_requests(api)))
    (thread,) = [t for t in threading.enumerate() if t.name == "labels-node-1"]
    await stream.aclose()  # type: ignore[attr-defined]
    api.closing.set()  # the quiet stream ends, as the server's timeoutSeconds would end it
    await asyncio.to_thread(thread.join, WAIT)
    assert not thread.is_alive()
    # Neither read again nor watched again: lightkube's renewal went nowhere.
    assert api.sent() == [("GET", "/api/v1/nodes/node-1"), ("GET", "/api/v1/nodes")]


async def test_label_watch_sees_a_missing_or_deleted_node_as_unset(
    api: ApiServer, caplog: pytest.LogCaptureFixture
) -> None:
    api.failures.append(status(404))
    api.objects["/api/v1/nodes/node-1"] = node("node-1", {LABEL: "a100"})
    api.watches.append([{"type": "DELETED", "object": node("node-1", {LABEL: "a100"}, "2")}])
    client = client_of(api, backoff=(0.01, 0.02))
    stream = client.watch_node_label("node-1", LABEL)
    try:
        assert await asyncio.wait_for(anext(stream), WAIT) is None  # 404: no such node yet
        assert await asyncio.wait_for(anext(stream), WAIT) == "a100"
        assert await asyncio.wait_for(anext(stream), WAIT) is None  # DELETED
    finally:
        await stream.aclose()  # type: ignore[attr-defined]
    assert "HTTP 404 Not Found; does it exist? check NODE_NAME" in caplog.text


async def test_label_watch_survives_a_dropped_stream(
    api: ApiServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A broken stream is watched again from the last version seen; an ERROR event
    (410 Gone: that version is too old) reads the Node again."""
    api.objects["/api/v1/nodes/node-1"] = node("node-1", {LABEL: "a100"})
    gone = {"kind": "Status", "code": 410, "reason": "Expired", "message": "too old"}
    api.watches += [
        [{"type": "ERROR", "object": gone}],
        [{"type": "MODIFIED", "object": node("node-1", {LABEL: "h100"}, "2")}],
    ]
    reset = httpx2.ReadError("[Errno 104] Connection reset by peer")
    # The first watch request breaks; the two after it stream the scripted watches.
    api.handle = _break_first_watch(api.handle, reset)  # type: ignore[method-assign]
    client = client_of(api, backoff=(0.01, 0.02))
    caplog.set_level(logging.WARNING, logger="kubegpu.kube.client")
    stream = client.watch_node_label("node-1", LABEL)
    try:
        assert await asyncio.wait_for(anext(stream), WAIT) == "a100"
        assert await asyncio.wait_for(anext(stream), WAIT) == "h100"
    finally:
        await stream.aclose()  # type: ignore[attr-defined]
    assert node_reads(api) == 2
    assert [r.getMessage() for r in caplog.records] == [
        f"node node-1: cannot watch label {LABEL}: watch Node node-1: cannot reach the API "
        f"server ([Errno 104] Connection reset by peer); {UNREACHABLE}; retrying in 0.0s"
    ]  # the ERROR event is no warning: it only means "read again"


def _break_first_watch(handle: Any, error: BaseException) -> Any:
    broken = False

    def handle_once(request: httpx2.Request) -> httpx2.Response:
        nonlocal broken
        if request.url.params.get("watch") == "true" and not broken:
            broken = True
            raise error
        return handle(request)  # type: ignore[no-any-return]

    return handle_once


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


# -- Dynamic Resource Allocation (resource.k8s.io/v1) -----------------------------------------

SLICES = "/apis/resource.k8s.io/v1/resourceslices"


def resource_slice(name: str, version: str | None = None, node: str = "n1") -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name}
    if version is not None:
        meta["resourceVersion"] = version
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": meta,
        "spec": {
            "driver": "gpu.nvidia.com",
            "nodeName": node,
            "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
            "devices": [{"name": "gpu-0", "attributes": {"type": {"string": "gpu"}}}],
        },
    }


def test_resource_slices_are_listed_by_driver_and_node_page_by_page(api: ApiServer) -> None:
    # The API server's list answer: items without kind/apiVersion, a continue token per page.
    first, second = resource_slice("n1-a", "5"), resource_slice("n1-b", "6")
    bare = [
        {k: v for k, v in s.items() if k not in ("apiVersion", "kind")} for s in (first, second)
    ]
    pages: dict[str, dict[str, Any]] = {
        "": {"kind": "ResourceSliceList", "metadata": {"continue": "p2"}, "items": bare[:1]},
        "p2": {"kind": "ResourceSliceList", "metadata": {}, "items": bare[1:]},
    }

    def handle(request: httpx2.Request) -> httpx2.Response:
        api.requests.append(request)
        return httpx2.Response(200, json=pages[request.url.params.get("continue", "")])

    listed = KubeClient(transport=httpx2.MockTransport(handle)).list_resource_slices(
        "gpu.nvidia.com", "n1"
    )
    assert [s["metadata"]["name"] for s in listed] == ["n1-a", "n1-b"]
    assert {(s["apiVersion"], s["kind"]) for s in listed} == {
        ("resource.k8s.io/v1", "ResourceSlice")
    }
    assert listed[1]["spec"] == second["spec"]
    assert api.sent() == [("GET", SLICES)] * 2
    for request in api.requests:
        assert request.url.params["fieldSelector"] == "spec.driver=gpu.nvidia.com,spec.nodeName=n1"
    assert api.requests[1].url.params["continue"] == "p2"


def test_resource_slice_create_replace_delete(api: ApiServer) -> None:
    client = client_of(api)
    body = resource_slice("n1-gpu.nvidia.com-x")
    created = client.create_resource_slice(body)
    assert created == body
    updated = resource_slice("n1-gpu.nvidia.com-x", "7")
    updated["spec"]["pool"]["generation"] = 2
    assert client.replace_resource_slice(updated)["spec"]["pool"]["generation"] == 2
    assert client.delete_resource_slice("n1-gpu.nvidia.com-x") is True
    assert client.delete_resource_slice("n1-gpu.nvidia.com-x") is False
    assert api.sent() == [
        ("POST", SLICES),
        ("PUT", f"{SLICES}/n1-gpu.nvidia.com-x"),
        ("DELETE", f"{SLICES}/n1-gpu.nvidia.com-x"),
        ("DELETE", f"{SLICES}/n1-gpu.nvidia.com-x"),
    ]
    # Sent exactly as built: nothing dropped or added by a typed model.
    assert [json.loads(r.content) for r in api.requests[:2]] == [body, updated]


def test_a_generated_slice_name_is_named_in_errors(api: ApiServer) -> None:
    api.failures.append(status(403))
    body = resource_slice("x")
    body["metadata"] = {"generateName": "n1-gpu.nvidia.com-"}
    with pytest.raises(KubeError) as info:
        client_of(api).create_resource_slice(body)
    assert str(info.value) == (
        "create ResourceSlice n1-gpu.nvidia.com-*: HTTP 403 Forbidden; check the "
        "ServiceAccount's RBAC"
    )


def test_a_stale_slice_update_is_a_409(api: ApiServer) -> None:
    api.failures.append(
        status(
            409,
            'Operation cannot be fulfilled on resourceslices.resource.k8s.io "s": the object '
            "has been modified",
        )
    )
    with pytest.raises(KubeError) as info:
        client_of(api).replace_resource_slice(resource_slice("s", "3"))
    assert (str(info.value), info.value.status) == (
        "update ResourceSlice s: HTTP 409 Conflict (Operation cannot be fulfilled on "
        'resourceslices.resource.k8s.io "s": the object has been modified); it was changed '
        "or created concurrently: read it again and retry",
        409,
    )
    assert api.sent() == [("PUT", f"{SLICES}/s")]


def test_an_api_server_without_dra_says_which_version_is_needed(api: ApiServer) -> None:
    api.failures += [status(404), status(404)]
    client = client_of(api)
    hint = (
        r"HTTP 404 Not Found; does the API server serve resource.k8s.io/v1 \(Kubernetes 1.34\+\)\?$"
    )
    with pytest.raises(KubeError, match=r"^list ResourceSlices of gpu.nvidia.com on n1: " + hint):
        client.list_resource_slices("gpu.nvidia.com", "n1")
    with pytest.raises(KubeError, match=r"^create ResourceSlice s: " + hint):
        client.create_resource_slice(resource_slice("s"))


def test_resource_claim_read_as_stored_and_missing_is_404(api: ApiServer) -> None:
    claim = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "c", "namespace": "ns", "uid": "u-1", "resourceVersion": "9"},
        "spec": {
            "devices": {
                "requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}]
            }
        },
        "status": {
            "allocation": {
                "devices": {
                    "results": [
                        {
                            "request": "gpu",
                            "driver": "gpu.nvidia.com",
                            "pool": "n1",
                            "device": "gpu-0",
                        }
                    ]
                }
            }
        },
    }
    api.objects["/apis/resource.k8s.io/v1/namespaces/ns/resourceclaims/c"] = claim
    client = client_of(api)
    assert client.get_resource_claim("ns", "c") == claim
    with pytest.raises(KubeError) as info:
        client.get_resource_claim("ns", "gone")
    assert str(info.value) == (
        "get ResourceClaim ns/gone: HTTP 404 Not Found (gone not found); does it exist (was the "
        "pod or its claim deleted)?"
    )
    assert info.value.status == 404


@pytest.mark.parametrize(
    ("namespace", "name"),
    [
        ("../../api/v1/namespaces/kube-system/secrets", "x"),
        ("ns", "../../../../../api/v1/namespaces/kube-system/secrets"),
        ("ns", "x/../../../../../../api/v1/namespaces/kube-system/secrets"),
        ("ns", "c\nkubegpu: FORGED"),
        ("ns", "c" * 254),
        ("", "c"),
    ],
)
def test_a_claim_name_kubernetes_refuses_sends_no_request(
    api: ApiServer, namespace: str, name: str
) -> None:
    """The request's path is built from the namespace and name: a `../` in either would
    send it, with the ServiceAccount's token, to another path of the API."""
    refused = r"^get ResourceClaim: not sent: the (namespace|name) '"
    with pytest.raises(KubeError, match=refused) as info:
        client_of(api).get_resource_claim(namespace, name)
    assert api.requests == []
    assert "\n" not in str(info.value) and len(str(info.value)) < 400
    fake = FakeKube()
    with pytest.raises(KubeError, match=refused):
        fake.get_resource_claim(namespace, name)
    assert fake.calls == []


def test_fake_resource_slices_as_the_api_server_keeps_them() -> None:
    kube = FakeKube()
    named = kube.create_resource_slice(resource_slice("a"))
    generated = resource_slice("x")
    generated["metadata"] = {"generateName": "n1-gpu.nvidia.com-"}
    made = kube.create_resource_slice(generated)
    other = kube.create_resource_slice(resource_slice("b", node="n2"))
    assert made["metadata"]["name"].startswith("n1-gpu.nvidia.com-")
    assert len(made["metadata"]["name"]) == len("n1-gpu.nvidia.com-") + 5
    assert named["metadata"]["generation"] == 1
    versions = [o["metadata"]["resourceVersion"] for o in (named, made, other)]
    assert len(set(versions)) == 3
    assert {s["metadata"]["name"] for s in kube.list_resource_slices("gpu.nvidia.com", "n1")} == {
        "a",
        made["metadata"]["name"],
    }
    assert kube.list_resource_slices("other.example.com", "n1") == []
    with pytest.raises(
        KubeError, match=r'HTTP 409 Conflict \(resourceslices.* "a" already exists\)'
    ):
        kube.create_resource_slice(resource_slice("a"))
    with pytest.raises(KubeError, match="resourceVersion should not be set"):
        kube.create_resource_slice(resource_slice("c", "1"))

    # Replace: the current version wins, a stale one is a 409; a spec change bumps generation.
    changed = copy.deepcopy(named)
    changed["spec"]["devices"] = []
    replaced = kube.replace_resource_slice(changed)
    assert replaced["metadata"]["generation"] == 2
    assert replaced["metadata"]["uid"] == named["metadata"]["uid"]
    assert replaced["metadata"]["resourceVersion"] != named["metadata"]["resourceVersion"]
    with pytest.raises(KubeError) as stale:
        kube.replace_resource_slice(changed)  # still carries the version it was read at
    assert stale.value.status == 409
    same = kube.replace_resource_slice(replaced)
    assert same["metadata"]["generation"] == 2  # no spec change, no new generation
    with pytest.raises(KubeError) as gone:
        kube.replace_resource_slice(resource_slice("nope", "1"))
    assert gone.value.status == 404
    assert kube.delete_resource_slice("a") is True
    assert kube.delete_resource_slice("a") is False
    assert "a" not in kube.resource_slices
    assert kube.calls[-4:] == [
        "replace resourceslice/a",
        "replace resourceslice/nope",
        "delete resourceslice/a",
        "delete resourceslice/a",
    ]


def test_fake_resource_claims_and_device_classes() -> None:
    kube = FakeKube()
    body = {"metadata": {"name": "c", "namespace": "ns"}, "spec": {"devices": {}}}
    stored = kube.put_resource_claim(body)
    assert stored["metadata"]["resourceVersion"]
    assert (stored["apiVersion"], stored["kind"]) == ("resource.k8s.io/v1", "ResourceClaim")
    assert kube.get_resource_claim("ns", "c") == stored
    with pytest.raises(KubeError) as info:
        kube.get_resource_claim("ns", "other")
    assert (str(info.value), info.value.status) == (
        "get ResourceClaim ns/other: HTTP 404 Not Found; does it exist (was the pod or its "
        "claim deleted)?",
        404,
    )
    allocated = copy.deepcopy(stored) | {"status": {"allocation": {"devices": {"results": []}}}}
    again = kube.put_resource_claim(allocated)
    assert again["metadata"]["uid"] == stored["metadata"]["uid"]
    assert kube.resource_claims[("ns", "c")]["status"] == allocated["status"]
    device_class = kube.put_device_class({"metadata": {"name": "gpu.nvidia.com"}, "spec": {}})
    assert kube.device_classes["gpu.nvidia.com"] == device_class
    assert device_class["kind"] == "DeviceClass"
    assert body == {"metadata": {"name": "c", "namespace": "ns"}, "spec": {"devices": {}}}


def test_fake_stamps_new_device_taints_as_the_api_server_does() -> None:
    kube = FakeKube(clock=lambda: "2026-02-03T04:05:06Z")
    body = resource_slice("s")
    taint = {"key": "gpu.nvidia.com/xid", "value": "79", "effect": "NoSchedule"}
    kept = taint | {"key": "gpu.nvidia.com/gpu-lost", "timeAdded": "2026-01-01T00:00:00Z"}
    body["spec"]["devices"][0]["taints"] = [taint, kept]
    stored = kube.create_resource_slice(body)
    assert stored["spec"]["devices"][0]["taints"] == [
        taint | {"timeAdded": "2026-02-03T04:05:06Z"},
        kept,
    ]
    assert "timeAdded" not in taint  # the caller's body is not changed


# -- the ResourceSlice watch ------------------------------------------------------------------


async def test_slice_watch_lists_then_watches_from_the_lists_version(
    api: ApiServer, caplog: pytest.LogCaptureFixture
) -> None:
    """An informer's list-and-watch: nothing between the list and the watch is lost."""
    listed = resource_slice("n1-a", "5")
    api.objects[SLICES] = {
        "kind": "ResourceSliceList",
        "metadata": {"resourceVersion": "9"},
        "items": [{k: v for k, v in listed.items() if k not in ("apiVersion", "kind")}],
    }
    api.failures.append(status(403))  # the first list: refused, logged, tried again
    api.watches.append(
        [
            {"type": "MODIFIED", "object": resource_slice("n1-a", "10")},
            {"type": "DELETED", "object": resource_slice("n1-a", "11")},
        ]
    )
    client = client_of(api, backoff=(0.01, 0.02))
    caplog.set_level(logging.WARNING, logger="kubegpu.kube.client")
    stream = client.watch_resource_slices("gpu.nvidia.com", "n1")
    try:
        events = [await asyncio.wait_for(anext(stream), WAIT) for _ in range(4)]
    finally:
        await stream.aclose()  # type: ignore[attr-defined]
    assert [(e.type, e.slice.get("metadata", {}).get("resourceVersion")) for e in events] == [
        (RELIST, None),
        ("ADDED", "5"),
        ("MODIFIED", "10"),
        ("DELETED", "11"),
    ]
    assert events[1].slice["kind"] == "ResourceSlice"
    (watch,) = watch_requests(api)
    assert watch.url.path == SLICES
    assert watch.url.params["fieldSelector"] == "spec.driver=gpu.nvidia.com,spec.nodeName=n1"
    assert watch.url.params["resourceVersion"] == "9"
    assert [r.getMessage() for r in caplog.records] == [
        "node n1: cannot watch ResourceSlices of gpu.nvidia.com: list ResourceSlices of "
        "gpu.nvidia.com on n1: HTTP 403 Forbidden; check the ServiceAccount's RBAC; "
        "retrying in 0.0s"
    ]


async def test_slice_watch_lists_again_after_an_expired_watch(api: ApiServer) -> None:
    """An ERROR event (410 Gone: the version is too old) starts over: RELIST, list, watch."""
    api.objects[SLICES] = {
        "kind": "ResourceSliceList",
        "metadata": {"resourceVersion": "9"},
        "items": [],
    }
    gone = {"kind": "Status", "code": 410, "reason": "Expired", "message": "too old"}
    api.watches += [
        [{"type": "ERROR", "object": gone}],
        [{"type": "ADDED", "object": resource_slice("n1-b", "12")}],
    ]
    stream = client_of(api, backoff=(0.01, 0.02)).watch_resource_slices("gpu.nvidia.com", "n1")
    try:
        events = [await asyncio.wait_for(anext(stream), WAIT) for _ in range(3)]
    finally:
        await stream.aclose()  # type: ignore[attr-defined]
    assert [e.type for e in events] == [RELIST, RELIST, "ADDED"]
    assert api.sent().count(("GET", SLICES)) == 4  # two lists, two watches


async def test_fake_slice_watch_reports_every_change_of_its_node_and_driver() -> None:
    kube = FakeKube()
    kube.create_resource_slice(resource_slice("n1-a"))
    stream = kube.watch_resource_slices("gpu.nvidia.com", "n1")
    try:
        first = [await asyncio.wait_for(anext(stream), WAIT) for _ in range(2)]
        assert [(e.type, e.slice.get("metadata", {}).get("name")) for e in first] == [
            (RELIST, None),
            ("ADDED", "n1-a"),
        ]
        await asyncio.to_thread(kube.create_resource_slice, resource_slice("n2-a", node="n2"))
        stored = await asyncio.to_thread(kube.create_resource_slice, resource_slice("n1-b"))
        stored["spec"]["pool"]["generation"] = 2
        await asyncio.to_thread(kube.replace_resource_slice, stored)
        assert kube.delete_resource_slice("n1-a")
        assert not kube.delete_resource_slice("n1-a")  # nothing deleted: no event
        later = [await asyncio.wait_for(anext(stream), WAIT) for _ in range(3)]
    finally:
        await stream.aclose()  # type: ignore[attr-defined]
    # Another node's slice is not reported; a deletion carries a version of its own.
    assert [(e.type, e.slice["metadata"]["name"]) for e in later] == [
        ("ADDED", "n1-b"),
        ("MODIFIED", "n1-b"),
        ("DELETED", "n1-a"),
    ]
    assert later[1].slice["spec"]["pool"]["generation"] == 2
    assert int(later[2].slice["metadata"]["resourceVersion"]) > int(
        later[1].slice["metadata"]["resourceVersion"]
    )
    assert "watch resourceslices/gpu.nvidia.com/n1" in kube.calls


# -- every watch has a deadline and a floor ---------------------------------------------------

GONE = {"type": "ERROR", "object": {"kind": "Status", "code": 410, "reason": "Expired"}}


def slice_list(version: str = "9", *items: dict[str, Any]) -> dict[str, Any]:
    return {"kind": "ResourceSliceList", "metadata": {"resourceVersion": version}, "items": items}


async def first_events(stream: Any, count: int) -> list[Any]:
    return [await asyncio.wait_for(anext(stream), WAIT) for _ in range(count)]


@contextlib.asynccontextmanager
async def followed(stream: Any) -> AsyncIterator[list[Any]]:
    """The watch started (its thread runs from the first read on), its events collected
    as they come; closed at the end."""
    seen: list[Any] = []

    async def pump() -> None:
        async for event in stream:
            seen.append(event)

    task = asyncio.ensure_future(pump())
    try:
        yield seen
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await stream.aclose()


async def test_a_watch_the_server_ends_at_once_is_paced_by_the_backoff(
    api: ApiServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A server (or a proxy) that answers every watch and closes it at once: each such
    stream is a failure, so the watch is sent again only after a growing delay, never in
    a busy loop; it resumes from the version it had, without listing again."""
    api.objects[SLICES] = slice_list("9")
    api.repeat = []  # every watch ends at once
    pauses = Pauses(limit=5)
    client = client_of(api, backoff=(1.0, 8.0), clock=lambda: 0.0, pause=pauses)
    caplog.set_level(logging.WARNING, logger="kubegpu.kube.client")
    stream = client.watch_resource_slices("gpu.nvidia.com", "n1")
    try:
        assert [e.type for e in await first_events(stream, 1)] == [RELIST]
        await eventually(lambda: len(pauses.delays) == 5)
    finally:
        await stream.aclose()  # type: ignore[attr-defined]
    assert pauses.delays == [1.0, 2.0, 4.0, 8.0, 8.0]
    # One watch per delay, one list in all: five failures cost five watch requests.
    assert api.count("GET", SLICES, watch=True) == 5
    assert api.count("GET", SLICES) == 1
    assert {r.url.params["resourceVersion"] for r in watch_requests(api)} == {"9"}
    assert caplog.records[0].getMessage() == (
        "node n1: the API server ended the watch of ResourceSlices of gpu.nvidia.com after "
        "0.0s (a watch lasts minutes: is a proxy in between ending it?); watching again in "
        "1.0s"
    )


async def test_an_expiry_lists_again_at_once_but_a_repeated_one_backs_off(
    api: ApiServer,
) -> None:
    """410 Gone means "list again", which the first one does at once; a server whose
    every watch expires at once gets the backoff, not a list per round trip."""
    api.objects[SLICES] = slice_list("9")
    api.repeat = [GONE]
    pauses = Pauses(limit=4)
    client = client_of(api, backoff=(1.0, 8.0), clock=lambda: 0.0, pause=pauses)
    async with followed(client.watch_resource_slices("gpu.nvidia.com", "n1")):
        await eventually(lambda: len(pauses.delays) == 4)
    assert pauses.delays == [1.0, 2.0, 4.0, 8.0]
    # The first expiry listed again at once; the four after it each waited first.
    assert api.count("GET", SLICES) == 5
    assert api.count("GET", SLICES, watch=True) == 5


async def test_a_watch_the_server_ends_in_time_goes_on_from_its_last_version(
    api: ApiServer,
) -> None:
    """A stream the server ended after its timeoutSeconds is no failure: watched again at
    once, from the last version an event or a bookmark carried, with nothing listed again
    and the bookmark not reported."""
    api.objects[SLICES] = slice_list("9")
    bookmark = {
        "type": "BOOKMARK",
        "object": {"kind": "ResourceSlice", "metadata": {"resourceVersion": "12"}},
    }
    # Three streams that end after their events (as the server's timeoutSeconds ends
    # them), then a quiet one.
    _raw_watches(
        api,
        [
            [{"type": "MODIFIED", "object": resource_slice("n1-a", "10")}],
            [bookmark],
            [{"type": "DELETED", "object": resource_slice("n1-a", "13")}],
        ],
    )
    ticks = iter(range(0, 10_000, 10))  # every stream lasts ten seconds
    pauses = Pauses()
    client = client_of(api, clock=lambda: float(next(ticks)), pause=pauses)
    stream = client.watch_resource_slices("gpu.nvidia.com", "n1")
    try:
        events = await first_events(stream, 3)
    finally:
        await stream.aclose()  # type: ignore[attr-defined]
    assert [(e.type, e.slice["metadata"].get("resourceVersion")) for e in events[1:]] == [
        ("MODIFIED", "10"),
        ("DELETED", "13"),
    ]
    versions = [r.url.params["resourceVersion"] for r in watch_requests(api)]
    assert versions[:3] == ["9", "10", "12"]
    assert api.count("GET", SLICES) == 1
    assert pauses.delays == []


async def test_the_server_s_retry_after_paces_lists_and_watches(
    api: ApiServer, caplog: pytest.LogCaptureFixture
) -> None:
    """429 and 503 with Retry-After (and a Status's retryAfterSeconds in an ERROR event)
    lengthen the backoff, up to its cap."""
    api.objects[SLICES] = slice_list("9")
    api.failures += [
        httpx2.Response(429, headers={"Retry-After": "7"}, json={"kind": "Status", "code": 429}),
        httpx2.Response(429, headers={"Retry-After": "3600"}, json={"kind": "Status"}),
    ]
    api.watch_failures.append(
        httpx2.Response(503, headers={"Retry-After": "5"}, json={"kind": "Status", "code": 503})
    )
    throttled = {"kind": "Status", "code": 429, "reason": "TooManyRequests"}
    api.watches.append(
        [{"type": "ERROR", "object": throttled | {"details": {"retryAfterSeconds": 6}}}]
    )
    pauses = Pauses(limit=4)
    client = client_of(api, backoff=(1.0, 30.0), clock=lambda: 0.0, pause=pauses)
    caplog.set_level(logging.WARNING, logger="kubegpu.kube.client")
    async with followed(client.watch_resource_slices("gpu.nvidia.com", "n1")):
        await eventually(lambda: len(pauses.delays) == 4)
    # The backoff alone waits 1, 2, 4, 8 s. The lists' 429s ask 7 s, then an hour (capped
    # at 30 s); the watch's 503 asks 5 s; its ERROR event 6 s, less than the 8 s due.
    assert pauses.delays == [7.0, 30.0, 5.0, 8.0]
    assert "HTTP 429 Too Many Requests; the API server is throttling requests" in caplog.text


async def test_unreadable_watch_events_are_skipped_and_logged_once(
    api: ApiServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A broken server or proxy: garbage lines, objects without metadata, unknown event
    types. Each is logged once (even when a later stream repeats it) and left alone; the
    events around it still arrive, and the watch goes on."""
    api.objects[SLICES] = slice_list("9")
    garbage: list[Any] = [
        "not json at all",
        [1, 2],
        {"type": "MODIFIED", "object": "a string"},
        {"type": "MODIFIED", "object": {"spec": {}}},
        {"type": "SURPRISE", "object": resource_slice("n1-x", "11")},
        {"type": "MODIFIED", "object": {"metadata": {"name": "n1-y"}}},  # no version
    ]

    _raw_watches(
        api,
        [
            [*garbage, {"type": "MODIFIED", "object": resource_slice("n1-a", "12")}],
            [*garbage, {"type": "DELETED", "object": resource_slice("n1-a", "13")}],
        ],
    )
    ticks = iter(range(0, 10_000, 10))
    client = client_of(api, clock=lambda: float(next(ticks)), pause=Pauses())
    caplog.set_level(logging.WARNING, logger="kubegpu.kube.client")
    stream = client.watch_resource_slices("gpu.nvidia.com", "n1")
    try:
        events = await first_events(stream, 3)
    finally:
        await stream.aclose()  # type: ignore[attr-defined]
    assert [(e.type, e.slice["metadata"]["resourceVersion"]) for e in events[1:]] == [
        ("MODIFIED", "12"),
        ("DELETED", "13"),
    ]
    skipped = [r.getMessage() for r in caplog.records]
    assert len(skipped) == len(garbage)  # each once, though both streams sent them all
    assert skipped[0] == (
        "node n1: skipped an unreadable event on the watch of ResourceSlices of "
        "gpu.nvidia.com (not JSON); it is left alone"
    )
    assert all("n1-x" not in line and "SURPRISE" not in line for line in skipped)


def _raw_watches(api: ApiServer, streams: list[list[Any]]) -> None:
    """The next watch requests to `api` stream `streams` line by line as given (a str as
    it is, anything else as JSON), each ending after its last line."""
    handle = api.handle

    def handle_raw(request: httpx2.Request) -> httpx2.Response:
        if request.url.params.get("watch") == "true" and streams:
            api.requests.append(request)
            lines = [
                (line if isinstance(line, str) else json.dumps(line)).encode() + b"\n"
                for line in streams.pop(0)
            ]
            return httpx2.Response(200, content=iter(lines))
        return handle(request)

    api.handle = handle_raw  # type: ignore[method-assign]


@pytest.mark.parametrize(
    "answer",
    [
        httpx2.Response(200, content=b"<html>proxy error</html>"),
        httpx2.Response(200, json={"kind": "ResourceSliceList", "items": [1, "x"]}),
    ],
)
def test_a_slice_list_answer_that_is_not_an_object_list_is_a_kube_error(
    api: ApiServer, answer: httpx2.Response
) -> None:
    """A broken answer is the server's fault, retried by the caller like an outage: not
    an exception that ends the publisher."""
    api.failures.append(answer)
    with pytest.raises(KubeError) as info:
        client_of(api).list_resource_slices("gpu.nvidia.com", "n1")
    assert str(info.value).startswith(
        "list ResourceSlices of gpu.nvidia.com on n1: the API server's answer is not a "
        "readable object ("
    )
    assert str(info.value).endswith(
        "); check the API server and any proxy between it and this node"
    )


@pytest.mark.parametrize(
    ("headers", "body", "seconds"),
    [
        ({"Retry-After": "7"}, {}, 7.0),
        ({"Retry-After": "Wed, 21 Oct 2015 07:28:00 GMT"}, {}, 0.0),  # a date long past
        ({}, {"details": {"retryAfterSeconds": 3}}, 3.0),
        ({"Retry-After": "soon"}, {}, None),
        ({}, {"details": {"retryAfterSeconds": "3"}}, None),
        ({}, {}, None),
    ],
)
def test_an_answer_that_says_when_to_retry_carries_it(
    api: ApiServer, headers: dict[str, str], body: dict[str, Any], seconds: float | None
) -> None:
    api.failures.append(
        httpx2.Response(429, headers=headers, json={"kind": "Status", "code": 429} | body)
    )
    with pytest.raises(KubeError) as info:
        client_of(api).get_node_metadata("gpu-1")
    assert (info.value.status, info.value.retry_after) == (429, seconds)


def test_watch_lines_are_split_at_newlines_only_and_bounded() -> None:
    nel = b'{"a": "x\xc2\x85y"}'  # U+0085 inside a string: no line end for JSON
    chunks = [nel + b'\n{"b"', b": 1}\n\n", b"1234567", b"890123\n", b"tail"]
    assert list(_lines(chunks, len(nel))) == [nel, b'{"b": 1}', b"", b"1234567890123", b"tail"]
    with pytest.raises(_LineTooLong):
        list(_lines([b"1234567", b"8901234\n"], 13))  # too long before its end arrives
    with pytest.raises(_LineTooLong):
        list(_lines([b"12345678901234"], 13))  # no end yet, already too long
