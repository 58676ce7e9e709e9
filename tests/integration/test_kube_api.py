"""`KubeClient` over the wire: the official client against a small local API server.

The unit tests drive the adapter through stand-ins for the client's API classes; here
the real client sends real HTTP to a loopback server that answers as the API server
does (paths, verbs, content types, Status bodies, a watch stream), so the paths, the
merge-patch content type, the bearer token and the error mapping are checked end to end.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

from kubegpu.events import KubernetesEventSink, NodeEvent
from kubegpu.kube import KubeClient, KubeError
from tests.waiting import WAIT

LABEL = "nvidia.com/device-plugin.config"
NFD = "/apis/nfd.k8s-sigs.io/v1alpha1/namespaces/gpu/nodefeatures"


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]
    body: Any


@dataclass
class ApiServer:
    """Objects by path; every request recorded; watches answered from `watch_events`."""

    objects: dict[str, dict[str, Any]] = field(default_factory=dict)
    requests: list[Request] = field(default_factory=list)
    watch_events: list[dict[str, Any]] = field(default_factory=list)
    #: Set at teardown: open watch streams end.
    closing: threading.Event = field(default_factory=threading.Event)

    def status(self, code: int, reason: str, message: str) -> tuple[int, dict[str, Any]]:
        body = {"kind": "Status", "apiVersion": "v1", "status": "Failure"}
        return code, body | {"message": message, "reason": reason, "code": code}

    def answer(self, request: Request) -> tuple[int, dict[str, Any]]:
        path = request.path
        if request.method == "GET":
            if path in self.objects:
                return 200, self.objects[path]
            return self.status(404, "NotFound", f"{path.rsplit('/', 1)[-1]} not found")
        if request.method == "PATCH":
            if path not in self.objects:
                return self.status(404, "NotFound", "not found")
            meta = self.objects[path]["metadata"]
            for section, changes in request.body["metadata"].items():
                for key, value in changes.items():
                    if value is None:
                        meta.setdefault(section, {}).pop(key, None)
                    else:
                        meta.setdefault(section, {})[key] = value
            return 200, self.objects[path]
        if request.method == "POST":
            name = f"{path}/{request.body['metadata']['name']}"
            if name in self.objects:
                return self.status(409, "AlreadyExists", f"{name} already exists")
            self.objects[name] = request.body
            return 201, request.body
        if request.method == "PUT":
            self.objects[path] = request.body
            return 200, request.body
        if request.method == "DELETE":
            if self.objects.pop(path, None) is None:
                return self.status(404, "NotFound", "not found")
            return 200, {"kind": "Status", "status": "Success"}
        return self.status(405, "MethodNotAllowed", request.method)


def handler_for(api: ApiServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        # HTTP/1.1: a watch is a chunked stream, one chunk per event, as the API server sends it.
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass  # quiet: the requests are recorded instead

        def handle_one(self) -> None:
            url = urlsplit(self.path)
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            request = Request(
                self.command,
                url.path,
                parse_qs(url.query),
                {k.lower(): v for k, v in self.headers.items()},
                json.loads(raw) if raw else None,
            )
            api.requests.append(request)
            if request.query.get("watch") == ["true"]:
                self.stream_watch()
                return
            code, body = api.answer(request)
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def stream_watch(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            events, api.watch_events = api.watch_events, []
            for event in events:
                self.chunk(json.dumps(event).encode() + b"\n")
            api.closing.wait(WAIT)  # a quiet watch, until the test ends
            self.chunk(b"")

        def chunk(self, data: bytes) -> None:
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()

        do_GET = do_PATCH = do_POST = do_PUT = do_DELETE = handle_one

    return Handler


@pytest.fixture
def api(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ApiServer]:
    state = ApiServer()
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler_for(state))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    host, port = server.server_address[:2]
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": f"http://{host!s}:{port}"}}],
                "users": [{"name": "u", "user": {"token": "secret-token"}}],
                "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "x",
            }
        )
    )
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    try:
        yield state
    finally:
        state.closing.set()
        server.shutdown()
        server.server_close()
        thread.join(WAIT)


def node(name: str, labels: dict[str, str], version: str = "7") -> dict[str, Any]:
    meta = {"name": name, "labels": labels, "resourceVersion": version}
    return {"apiVersion": "v1", "kind": "Node", "metadata": meta}


def test_node_read_and_merge_patch(api: ApiServer) -> None:
    api.objects["/api/v1/nodes/n1"] = node("n1", {"keep": "1", "drop": "2"})
    client = KubeClient(timeout=WAIT)
    assert client.get_node_metadata("n1") == {
        "labels": {"keep": "1", "drop": "2"},
        "annotations": {},
    }
    client.merge_patch_node("n1", {"metadata": {"labels": {"drop": None, "new": "3"}}})
    patch = api.requests[-1]
    assert (patch.method, patch.path) == ("PATCH", "/api/v1/nodes/n1")
    assert patch.headers["content-type"] == "application/merge-patch+json"
    assert patch.headers["authorization"] == "Bearer secret-token"
    assert patch.body == {"metadata": {"labels": {"drop": None, "new": "3"}}}
    assert client.get_node_metadata("n1")["labels"] == {"keep": "1", "new": "3"}


def test_a_missing_node_is_a_404_naming_it(api: ApiServer) -> None:
    with pytest.raises(KubeError) as info:
        KubeClient(timeout=WAIT).get_node_metadata("ghost")
    assert str(info.value) == (
        "get Node ghost: HTTP 404 Not Found (ghost not found); does it exist? check NODE_NAME"
    )
    assert info.value.status == 404


def test_node_feature_life_cycle(api: ApiServer) -> None:
    client = KubeClient(timeout=WAIT)
    body = {
        "apiVersion": "nfd.k8s-sigs.io/v1alpha1",
        "kind": "NodeFeature",
        "metadata": {"name": "nvidia-features-for-n1", "namespace": "gpu"},
        "spec": {"labels": {"nvidia.com/gpu.count": "1"}},
    }
    assert client.get_node_feature("gpu", "nvidia-features-for-n1") is None
    client.create_node_feature("gpu", body)
    with pytest.raises(
        KubeError, match=r"^create NodeFeature gpu/nvidia-features-for-n1: HTTP 409"
    ):
        client.create_node_feature("gpu", body)
    assert client.get_node_feature("gpu", "nvidia-features-for-n1") == body
    updated = body | {"spec": {"labels": {"nvidia.com/gpu.count": "2"}}}
    client.replace_node_feature("gpu", updated)
    assert api.objects[f"{NFD}/nvidia-features-for-n1"] == updated
    assert client.delete_node_feature("gpu", "nvidia-features-for-n1") is True
    assert client.delete_node_feature("gpu", "nvidia-features-for-n1") is False
    assert [(r.method, r.path) for r in api.requests] == [
        ("GET", f"{NFD}/nvidia-features-for-n1"),
        ("POST", NFD),
        ("POST", NFD),
        ("GET", f"{NFD}/nvidia-features-for-n1"),
        ("PUT", f"{NFD}/nvidia-features-for-n1"),
        ("DELETE", f"{NFD}/nvidia-features-for-n1"),
        ("DELETE", f"{NFD}/nvidia-features-for-n1"),
    ]


def test_pod_owner_references_in_api_spelling(api: ApiServer) -> None:
    owner = {"apiVersion": "apps/v1", "kind": "DaemonSet", "name": "gfd", "uid": "ds-1"}
    meta = {"name": "gfd-x", "namespace": "gpu", "uid": "pod-1", "ownerReferences": [owner]}
    api.objects["/api/v1/namespaces/gpu/pods/gfd-x"] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": meta,
    }
    assert KubeClient(timeout=WAIT).get_pod_metadata("gpu", "gfd-x") == {
        "name": "gfd-x",
        "uid": "pod-1",
        "ownerReferences": [owner],
    }


def test_a_node_event_as_the_kubelet_records_one(api: ApiServer) -> None:
    sink = KubernetesEventSink(KubeClient(timeout=WAIT))
    sink.create(NodeEvent("n1", "GPUUnhealthy", "GPU-1 Xid 79"))
    (post,) = api.requests
    assert (post.method, post.path) == ("POST", "/api/v1/namespaces/default/events")
    assert post.body["involvedObject"] == {
        "kind": "Node",
        "name": "n1",
        "uid": "n1",
        "apiVersion": "v1",
    }
    assert post.body["reason"] == "GPUUnhealthy"
    assert post.body["firstTimestamp"].endswith("+00:00")


async def test_the_label_watch_reads_then_watches_the_node_by_name(api: ApiServer) -> None:
    api.objects["/api/v1/nodes/n1"] = node("n1", {LABEL: "a100"})
    api.watch_events.append({"type": "MODIFIED", "object": node("n1", {LABEL: "t4"}, "8")})
    stream = KubeClient(timeout=WAIT).watch_node_label("n1", LABEL)
    try:
        assert await asyncio.wait_for(anext(stream), WAIT) == "a100"
        assert await asyncio.wait_for(anext(stream), WAIT) == "t4"
    finally:
        await stream.aclose()  # type: ignore[attr-defined]
    read, watch = api.requests[:2]
    assert (read.method, read.path) == ("GET", "/api/v1/nodes/n1")
    assert (watch.method, watch.path) == ("GET", "/api/v1/nodes")
    assert watch.query["fieldSelector"] == ["metadata.name=n1"]
    assert watch.query["resourceVersion"] == ["7"]
    assert watch.query["watch"] == ["true"]
