"""`KubeClient` over the wire: the official client against a small local API server.

The unit tests drive the adapter through stand-ins for the client's API classes; here
the real client sends real HTTP to a loopback server that answers as the API server
does (paths, verbs, content types, Status bodies, a watch stream), so the paths, the
merge-patch content type, the bearer token and the error mapping are checked end to end.

The server misbehaves on demand, as servers and the proxies before them do: it stalls a
watch after its headers (a half-open connection), ends watches at once, lists a slice
without `spec.pool`, and stores ResourceSlices without the fields it does not serve while
its watches report each write before the writer has the answer. Every request is
recorded, so the tests count what the client sends.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import json
import logging
import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

from kubegpu.config import Config
from kubegpu.devices import Health
from kubegpu.dra.publisher import SlicePublisher
from kubegpu.dra.slices import NVIDIA_DRIVER, Fault
from kubegpu.events import KubernetesEventSink, NodeEvent
from kubegpu.kube import RELIST, KubeClient, KubeError
from kubegpu.kube.client import MAX_WATCH_LINE_BYTES
from kubegpu.state import NodeState, NodeStore
from kubegpu.watch.backoff import Backoff
from tests.builders import gpu, inventory
from tests.waiting import WAIT, eventually

SLICES = "/apis/resource.k8s.io/v1/resourceslices"

LABEL = "nvidia.com/device-plugin.config"
NFD = "/apis/nfd.k8s-sigs.io/v1alpha1/namespaces/gpu/nodefeatures"


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]
    body: Any


#: A slice watch's events to come, each with the flag its stream sets once it is sent.
Watcher = queue.Queue[tuple[dict[str, Any], threading.Event] | None]


@dataclass
class Slices:
    """ResourceSlices as the API server keeps them: names completed from `generateName`,
    a resourceVersion per write, 409 for a stale update, and watches that replay what
    followed their version, then see each write before its writer has the answer.

    `storage` edits each slice as it is stored (a server that drops fields it does not
    serve); a slice put straight into `items` is listed as it is (a broken server).
    """

    items: dict[str, dict[str, Any]] = field(default_factory=dict)
    storage: Callable[[dict[str, Any]], None] | None = None
    #: Every change as (version, type, object), for watches that start from a version.
    log: list[tuple[int, str, dict[str, Any]]] = field(default_factory=list)
    watchers: list[Watcher] = field(default_factory=list)
    versions: Iterator[int] = field(default_factory=lambda: itertools.count(100))
    lock: threading.Lock = field(default_factory=threading.Lock)

    def listed(self) -> dict[str, Any]:
        with self.lock:
            version = str(next(self.versions))
            items = [copy.deepcopy(obj) for obj in self.items.values()]
        return {
            "kind": "ResourceSliceList",
            "metadata": {"resourceVersion": version},
            "items": items,
        }

    def create(self, body: dict[str, Any]) -> dict[str, Any]:
        meta = body["metadata"]
        with self.lock:
            name = meta.get("name") or f"{meta['generateName']}{next(self.versions)}"
        body["metadata"] = {"name": name}
        return self._write("ADDED", body)

    def replace(self, name: str, body: dict[str, Any]) -> dict[str, Any] | None:
        """The stored slice, or None when `body`'s version is not the current one."""
        with self.lock:
            current = self.items.get(name, {}).get("metadata", {}).get("resourceVersion")
            if body["metadata"].get("resourceVersion") != current:
                return None
        return self._write("MODIFIED", body)

    def delete(self, name: str) -> dict[str, Any] | None:
        with self.lock:
            gone = self.items.pop(name, None)
        return None if gone is None else self._write("DELETED", gone)

    def _write(self, kind: str, body: dict[str, Any]) -> dict[str, Any]:
        stored = copy.deepcopy(body)
        if self.storage is not None and kind != "DELETED":
            self.storage(stored)
        with self.lock:
            version = next(self.versions)
            stored["metadata"]["resourceVersion"] = str(version)
            if kind != "DELETED":
                self.items[stored["metadata"]["name"]] = stored
            self.log.append((version, kind, stored))
            delivered = []
            for watcher in self.watchers:
                done = threading.Event()
                watcher.put(({"type": kind, "object": copy.deepcopy(stored)}, done))
                delivered.append(done)
        for done in delivered:  # the watches have sent it: only now does the writer hear
            done.wait(WAIT)
        return copy.deepcopy(stored)

    def watch(self, since: str | None) -> tuple[list[dict[str, Any]], Watcher]:
        """The events after version `since`, and a queue of those to come."""
        watcher: Watcher = queue.Queue()
        with self.lock:
            after = int(since) if since else None
            past = [
                {"type": kind, "object": copy.deepcopy(obj)}
                for version, kind, obj in self.log
                if after is not None and version > after
            ]
            self.watchers.append(watcher)
        return past, watcher

    def unwatch(self, watcher: Watcher) -> None:
        """The watch has ended: what it will not send holds up no writer."""
        with self.lock:
            self.watchers.remove(watcher)
        while not watcher.empty():
            item = watcher.get()
            if item is not None:
                item[1].set()

    def close(self) -> None:
        with self.lock:
            for watcher in self.watchers:
                watcher.put(None)


@dataclass
class ApiServer:
    """Objects by path; every request recorded; watches answered from `watch_events`;
    ResourceSlices kept by `slices`.

    `stalls`: the next that many watch requests are answered with headers and then
    nothing. `ends_watches`: every other watch (not of slices) ends right after its
    headers. `endless_line`: the next such watch sends its events, then that many bytes
    with no line end.
    """

    objects: dict[str, dict[str, Any]] = field(default_factory=dict)
    requests: list[Request] = field(default_factory=list)
    watch_events: list[dict[str, Any]] = field(default_factory=list)
    slices: Slices = field(default_factory=Slices)
    stalls: int = 0
    ends_watches: bool = False
    endless_line: int = 0
    #: Set at teardown: open watch streams end.
    closing: threading.Event = field(default_factory=threading.Event)

    def count(self, method: str, path: str, *, watch: bool = False) -> int:
        return sum(
            (r.method, r.path) == (method, path) and (r.query.get("watch") == ["true"]) == watch
            for r in self.requests
        )

    def answer_slices(self, request: Request) -> tuple[int, dict[str, Any]] | None:
        """The answer to a ResourceSlice request; None for any other path."""
        name = request.path.removeprefix(SLICES).lstrip("/")
        if not request.path.startswith(SLICES):
            return None
        if request.method == "GET" and not name:
            return 200, self.slices.listed()
        if request.method == "POST":
            return 201, self.slices.create(request.body)
        if request.method == "PUT":
            stored = self.slices.replace(name, request.body)
            if stored is None:
                return self.status(409, "Conflict", "the object has been modified")
            return 200, stored
        if request.method == "DELETE":
            if self.slices.delete(name) is None:
                return self.status(404, "NotFound", "not found")
            return 200, {"kind": "Status", "status": "Success"}
        return None

    def status(self, code: int, reason: str, message: str) -> tuple[int, dict[str, Any]]:
        body = {"kind": "Status", "apiVersion": "v1", "status": "Failure"}
        return code, body | {"message": message, "reason": reason, "code": code}

    def answer(self, request: Request) -> tuple[int, dict[str, Any]]:
        sliced = self.answer_slices(request)
        if sliced is not None:
            return sliced
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
                if api.stalls > 0:
                    api.stalls -= 1
                    self.stall()
                elif request.path == SLICES:
                    self.stream_slices(request.query.get("resourceVersion", [""])[0])
                else:
                    self.stream_watch()
                return
            code, body = api.answer(request)
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def start_stream(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            self.wfile.flush()

        def stream_watch(self) -> None:
            self.start_stream()
            events, api.watch_events = api.watch_events, []
            for event in events:
                # As the API server's encoder writes it: non-ASCII as it is, not \u-escaped.
                self.chunk(json.dumps(event, ensure_ascii=False).encode() + b"\n")
            junk, api.endless_line = api.endless_line, 0
            for _ in range(0, junk, 1 << 20):
                if not self.chunk(b"x" * (1 << 20)):
                    return  # the client took the stream for broken
            if not api.ends_watches:
                api.closing.wait(WAIT)  # a quiet watch, until the test ends
            self.chunk(b"")

        def stall(self) -> None:
            """Headers, then nothing: what a client sees of a half-open connection."""
            self.start_stream()
            api.closing.wait(WAIT)
            self.close_connection = True

        def stream_slices(self, since: str) -> None:
            past, events = api.slices.watch(since)
            try:
                self.start_stream()
                for event in past:
                    if not self.chunk(json.dumps(event).encode() + b"\n"):
                        return
                while (item := events.get()) is not None:
                    event, delivered = item
                    sent = self.chunk(json.dumps(event).encode() + b"\n")
                    delivered.set()
                    if not sent:
                        return
                self.chunk(b"")
            finally:
                api.slices.unwatch(events)

        def chunk(self, data: bytes) -> bool:
            """Send one chunk; False when the client has gone (it took the stream for dead)."""
            try:
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                self.wfile.flush()
            except OSError:
                self.close_connection = True
                return False
            return True

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
        state.slices.close()
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


@pytest.mark.parametrize(
    "annotations",
    [
        {},
        # JSON carries U+0085 (NEL) unescaped inside a string, and the API server writes it
        # so: it split the Node's event in two unreadable halves, and its label was missed.
        {"note": "one\u0085two"},
    ],
)
async def test_the_label_watch_reads_then_watches_the_node_by_name(
    api: ApiServer, annotations: dict[str, str]
) -> None:
    api.objects["/api/v1/nodes/n1"] = node("n1", {LABEL: "a100"})
    changed = node("n1", {LABEL: "t4"}, "8")
    changed["metadata"]["annotations"] = annotations
    api.watch_events.append({"type": "MODIFIED", "object": changed})
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


# -- every watch has a deadline and a floor, and the API's objects are data -------------------


class Pauses:
    """A watch thread's backoff delays, recorded instead of waited; the `limit`th blocks
    until the watch is closed."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.delays: list[float] = []

    def __call__(self, stop: threading.Event, seconds: float) -> bool:
        self.delays.append(seconds)
        return stop.wait(WAIT) if len(self.delays) >= self.limit else stop.is_set()


def resource_slice(name: str, *, pool: bool = True) -> dict[str, Any]:
    spec: dict[str, Any] = {"driver": NVIDIA_DRIVER, "nodeName": "n1", "devices": []}
    if pool:
        spec["pool"] = {"name": "n1", "generation": 1, "resourceSliceCount": 1}
    return {"metadata": {"name": name, "resourceVersion": "7"}, "spec": spec}


async def test_a_stalled_slice_watch_is_noticed_and_replaced(
    api: ApiServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Headers, then nothing: a half-open connection. Past the read deadline the watch is
    sent again from the list's version, and a slice deleted meanwhile is reported (it
    came back only with the ten-minute comparison)."""
    api.slices.items["n1-a"] = resource_slice("n1-a")
    api.stalls = 1
    caplog.set_level(logging.INFO, logger="kubegpu.kube.client")
    client = KubeClient(timeout=WAIT, watch_deadline_s=0.5)
    stream = client.watch_resource_slices(NVIDIA_DRIVER, "n1")
    try:
        listed = [await asyncio.wait_for(anext(stream), WAIT) for _ in range(2)]
        assert [e.type for e in listed] == [RELIST, "ADDED"]
        await asyncio.to_thread(api.slices.delete, "n1-a")
        deleted = await asyncio.wait_for(anext(stream), WAIT)
    finally:
        await stream.aclose()  # type: ignore[attr-defined]
    assert (deleted.type, deleted.slice["metadata"]["name"]) == ("DELETED", "n1-a")
    stalled = next(r for r in api.requests if r.query.get("watch") == ["true"])
    assert stalled.query["allowWatchBookmarks"] == ["true"]
    assert 300 <= int(stalled.query["timeoutSeconds"][0]) < 600
    assert api.count("GET", SLICES) == 1  # watched again from its version: no new list
    assert "taking its connection for dead and watching again" in caplog.text


async def test_a_stalled_label_watch_is_noticed_and_replaced(api: ApiServer) -> None:
    """The Node label watch (named configs) reads through the same client."""
    api.objects["/api/v1/nodes/n1"] = node("n1", {LABEL: "a100"})
    api.stalls = 1
    api.watch_events.append({"type": "MODIFIED", "object": node("n1", {LABEL: "t4"}, "8")})
    stream = KubeClient(timeout=WAIT, watch_deadline_s=0.5).watch_node_label("n1", LABEL)
    try:
        assert await asyncio.wait_for(anext(stream), WAIT) == "a100"
        assert await asyncio.wait_for(anext(stream), WAIT) == "t4"
    finally:
        await stream.aclose()  # type: ignore[attr-defined]
    assert api.count("GET", "/api/v1/nodes", watch=True) >= 2
    assert api.count("GET", "/api/v1/nodes/n1") == 1


async def test_watches_the_server_ends_at_once_wait_between_tries(api: ApiServer) -> None:
    """200, then the end of the stream, every time: a backoff between tries, where every
    watch was sent again at once (20 requests a second)."""
    api.objects["/api/v1/nodes/n1"] = node("n1", {LABEL: "a100"})
    api.ends_watches = True
    pauses = Pauses(limit=4)
    client = KubeClient(timeout=WAIT, backoff=(1.0, 30.0), clock=lambda: 0.0, pause=pauses)
    stream = client.watch_node_label("n1", LABEL)
    try:
        assert await asyncio.wait_for(anext(stream), WAIT) == "a100"
        await eventually(lambda: len(pauses.delays) == 4)
    finally:
        await stream.aclose()  # type: ignore[attr-defined]
    assert pauses.delays == [1.0, 2.0, 4.0, 8.0]
    assert api.count("GET", "/api/v1/nodes", watch=True) == 4
    assert api.count("GET", "/api/v1/nodes/n1") == 1


async def test_an_endless_watch_line_is_a_broken_stream_resumed_after_the_backoff(
    api: ApiServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A line past any object the API server stores, and no end to it: it was read into
    memory for as long as the server sent it. Now the stream is dropped at the bound and
    watched again, after the backoff, from the last version it delivered."""
    api.objects["/api/v1/nodes/n1"] = node("n1", {LABEL: "a100"})
    api.watch_events.append({"type": "MODIFIED", "object": node("n1", {LABEL: "t4"}, "8")})
    api.endless_line = MAX_WATCH_LINE_BYTES + (4 << 20)
    pauses = Pauses(limit=1000)
    client = KubeClient(timeout=WAIT, backoff=(1.0, 30.0), pause=pauses)
    stream = client.watch_node_label("n1", LABEL)
    try:
        assert await asyncio.wait_for(anext(stream), WAIT) == "a100"
        assert await asyncio.wait_for(anext(stream), WAIT) == "t4"
        await eventually(lambda: api.count("GET", "/api/v1/nodes", watch=True) == 2)
    finally:
        await stream.aclose()  # type: ignore[attr-defined]
    first, again = (r for r in api.requests if r.query.get("watch") == ["true"])
    assert first.query["resourceVersion"] == ["7"]
    assert again.query["resourceVersion"] == ["8"]  # from the last event, not the read
    assert pauses.delays == [1.0]
    assert api.count("GET", "/api/v1/nodes/n1") == 1  # no new read
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert f"sent a line of over {MAX_WATCH_LINE_BYTES} bytes" in warning
    assert warning.endswith("taking the stream for broken; retrying in 1.0s")


def without_taints(body: dict[str, Any]) -> None:
    """An API server without the DRADeviceTaints feature gate: it drops device taints."""
    for device in body.get("spec", {}).get("devices") or []:
        device.pop("taints", None)


def generations(api: ApiServer) -> set[int]:
    return {s["spec"]["pool"]["generation"] for s in api.slices.items.values()}


async def test_a_server_that_drops_taints_is_written_once_per_change(api: ApiServer) -> None:
    """An Xid on a GPU, a server that drops taints and reports each write on its watch
    before the writer has the answer: was 91 writes in 15 s, the pool's generation 1 ->
    92. Now one write for the change, then nothing."""
    api.slices.storage = without_taints
    faults = {gpu(0).uuid: Fault(xid=79)}
    store = NodeStore(NodeState(inventory=inventory(gpu(0), gpu(1)), config=Config(), version=1))
    pub = SlicePublisher(
        KubeClient(timeout=WAIT),
        store,
        "n1",
        drivers=(NVIDIA_DRIVER,),
        backoff=Backoff(0.01, 0.02),
    )
    task = asyncio.ensure_future(pub.run())
    try:
        await eventually(lambda: generations(api) == {1})
        store.update(health={gpu(0).uuid: Health.UNHEALTHY}, faults=faults)
        await eventually(lambda: generations(api) == {2})
        # One sync at a time: this one follows any the watch's events started.
        assert await asyncio.to_thread(pub.sync, store.state) is False
        assert not task.done()
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert generations(api) == {2}
    (name,) = api.slices.items
    assert (api.count("POST", SLICES), api.count("PUT", f"{SLICES}/{name}")) == (1, 1)


async def test_a_listed_slice_without_a_pool_is_left_alone(api: ApiServer) -> None:
    """A broken server or proxy lists a slice without spec.pool: it ended the daemon
    (`task 'resource slices' failed: 'pool'`); now it is left alone and the pool is
    published beside it."""
    api.slices.items["broken"] = broken = resource_slice("broken", pool=False)
    store = NodeStore(NodeState(inventory=inventory(gpu(0)), config=Config(), version=1))
    pub = SlicePublisher(
        KubeClient(timeout=WAIT), store, "n1", drivers=(NVIDIA_DRIVER,), backoff=Backoff(0.01, 0.02)
    )
    task = asyncio.ensure_future(pub.run())
    try:
        await eventually(lambda: len(api.slices.items) == 2)
        assert await asyncio.to_thread(pub.sync, store.state) is False
        assert not task.done()
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert api.slices.items["broken"] == broken
