"""A tiny HTTP/1.1 endpoint for probes and Prometheus, served on the daemon's event loop.

It runs on the same asyncio loop as the gRPC servers on purpose: when `/healthz`
answers, the loop that serves the kubelet is not stuck, which is exactly what a
liveness probe should prove. Only the standard library is used; every connection
answers one request and closes (`Connection: close`), and a client that does not send
a complete request head within `request_timeout` seconds is cut off, so a slow or
half-open client costs one idle task and never delays anyone else.

`/metrics` is rendered in a thread of its own: collecting the per-container GPU metrics
calls the driver, which may block. Scrapes that arrive while one renders share its answer,
so a stuck driver holds one thread however often Prometheus asks, and a scrape that waits
longer than `metrics_timeout` gets 503 rather than hanging.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from kubegpu.metrics import CONTENT_TYPE, Metrics

log = logging.getLogger(__name__)

#: The longest request head accepted; probes and scrapers send a few hundred bytes.
MAX_HEAD_BYTES = 8192

_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    503: "Service Unavailable",
}
_TEXT = "text/plain; charset=utf-8"


class HttpServer:
    """Serves `/healthz`, `/readyz` and `/metrics`.

    `ready()` is called on every `/readyz`; it returns (ready, reason) and should be
    cheap, e.g. "not registered with the kubelet: nvidia.com/gpu" while not ready.
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        metrics: Metrics | None,
        ready: Callable[[], tuple[bool, str]],
        request_timeout: float = 5.0,
        metrics_timeout: float = 10.0,
    ) -> None:
        self.host = host
        self._port = port
        self.metrics = metrics
        self.ready = ready
        self.request_timeout = request_timeout
        #: How long a scrape waits for the render (Prometheus' default scrape timeout).
        self.metrics_timeout = metrics_timeout
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()
        self._executor: ThreadPoolExecutor | None = None
        #: The render in progress, which scrapes arriving meanwhile share.
        self._render: asyncio.Future[bytes] | None = None

    @property
    def port(self) -> int:
        """The bound port (the kernel's choice when 0 was asked for), once started."""
        if self._server is not None and self._server.sockets:
            return int(self._server.sockets[0].getsockname()[1])
        return self._port

    async def start(self) -> None:
        self._server = await asyncio.start_server(
            self._handle, self.host, self._port, limit=MAX_HEAD_BYTES
        )
        log.info("HTTP endpoint listening on %s:%d", self.host, self.port)

    async def stop(self) -> None:
        """Stop listening and cut any connection still open (probes retry)."""
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        for task in list(self._connections):
            task.cancel()
        if self._connections:
            await asyncio.gather(*self._connections, return_exceptions=True)
        await server.wait_closed()
        if self._executor is not None:
            # A render blocked in the driver is not waited for; its thread ends with it.
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        try:
            status, ctype, body, head_only = await self._respond(reader)
            await self._send(writer, status, ctype, body, head_only)
        except (ConnectionError, asyncio.CancelledError):
            pass
        except Exception:  # a bug here must not kill the server or leak a traceback
            log.exception("HTTP endpoint failed to answer a request")
            with contextlib.suppress(Exception):
                await self._send(writer, 500, _TEXT, b"internal error\n", False)
        finally:
            self._connections.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _respond(self, reader: asyncio.StreamReader) -> tuple[int, str, bytes, bool]:
        try:
            head = await asyncio.wait_for(
                reader.readuntil(b"\r\n\r\n"), timeout=self.request_timeout
            )
        except TimeoutError:
            return 408, _TEXT, b"request timeout\n", False
        except asyncio.LimitOverrunError:
            return 431, _TEXT, b"request head too large\n", False
        except asyncio.IncompleteReadError:
            return 400, _TEXT, b"incomplete request\n", False
        request_line = head.split(b"\r\n", 1)[0]
        parts = request_line.split(b" ")
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/1.") or not parts[1]:
            return 400, _TEXT, b"malformed request line\n", False
        try:
            method = parts[0].decode("ascii")
            target = parts[1].decode("ascii")
        except UnicodeDecodeError:
            return 400, _TEXT, b"malformed request line\n", False
        path = target.split("?", 1)[0]
        status, ctype, body = self._route(method, path)
        if status == 200 and path == "/metrics":
            status, ctype, body = await self._render_metrics()
        return status, ctype, body, method == "HEAD"

    async def _render_metrics(self) -> tuple[int, str, bytes]:
        assert self.metrics is not None
        if self._render is None or self._render.done():
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="metrics")
            loop = asyncio.get_running_loop()
            self._render = loop.run_in_executor(self._executor, self.metrics.render)
        try:
            body = await asyncio.wait_for(asyncio.shield(self._render), self.metrics_timeout)
        except TimeoutError:
            return 503, _TEXT, b"metrics collection timed out\n"
        return 200, CONTENT_TYPE, body

    def _route(self, method: str, path: str) -> tuple[int, str, bytes]:
        known = path in ("/healthz", "/readyz") or (path == "/metrics" and self.metrics)
        if not known:
            return 404, _TEXT, b"not found\n"
        if method not in ("GET", "HEAD"):
            return 405, _TEXT, b"method not allowed\n"
        if path == "/healthz":
            return 200, _TEXT, b"ok\n"
        if path == "/readyz":
            ok, reason = self.ready()
            text = (reason or ("ready" if ok else "not ready")) + "\n"
            return (200 if ok else 503), _TEXT, text.encode()
        return 200, CONTENT_TYPE, b""  # rendered off the loop by `_render_metrics`

    async def _send(
        self,
        writer: asyncio.StreamWriter,
        status: int,
        ctype: str,
        body: bytes,
        head_only: bool,
    ) -> None:
        head = (
            f"HTTP/1.1 {status} {_REASONS.get(status, 'Unknown')}\r\n"
            f"Content-Type: {ctype}\r\n"
            f"Content-Length: {len(body)}\r\n"
            "Connection: close\r\n" + ("Allow: GET, HEAD\r\n" if status == 405 else "") + "\r\n"
        )
        writer.write(head.encode("ascii") + (b"" if head_only else body))
        await asyncio.wait_for(writer.drain(), timeout=self.request_timeout)
