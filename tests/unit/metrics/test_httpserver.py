"""The probe/metrics endpoint over a real localhost socket."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from kubegpu.httpserver import HttpServer
from kubegpu.metrics import Metrics
from tests.waiting import WAIT

Ready = list[tuple[bool, str]]


async def exchange(port: int, raw: bytes, wait: float = WAIT) -> tuple[int, dict[str, str], bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(raw)
    await writer.drain()
    data = await asyncio.wait_for(reader.read(), wait)  # server closes: read to EOF
    writer.close()
    return parse(data)


def parse(data: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    assert int(headers["content-length"]) == len(body)
    assert headers["connection"] == "close"
    return status, headers, body


def get(path: str, method: str = "GET") -> bytes:
    return f"{method} {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode()


@pytest.fixture
def readiness() -> Ready:
    return [(False, "not registered with the kubelet: nvidia.com/gpu")]


@pytest.fixture
async def server(readiness: Ready) -> AsyncIterator[HttpServer]:
    metrics = Metrics()
    metrics.set_devices("nvidia.com/gpu", 4, 3)
    srv = HttpServer(
        "127.0.0.1", 0, metrics=metrics, ready=lambda: readiness[-1], request_timeout=0.5
    )
    await srv.start()
    yield srv
    await srv.stop()


async def test_port_zero_binds_a_real_port(server: HttpServer) -> None:
    assert server.port > 0


async def test_healthz(server: HttpServer) -> None:
    status, headers, body = await exchange(server.port, get("/healthz"))
    assert (status, body) == (200, b"ok\n")
    assert headers["content-type"].startswith("text/plain")


async def test_readyz_follows_the_callback(server: HttpServer, readiness: Ready) -> None:
    status, _, body = await exchange(server.port, get("/readyz"))
    assert status == 503
    assert b"not registered with the kubelet: nvidia.com/gpu" in body
    readiness.append((True, ""))
    status, _, body = await exchange(server.port, get("/readyz?verbose=1"))
    assert (status, body) == (200, b"ready\n")


async def test_metrics_exposition(server: HttpServer) -> None:
    status, headers, body = await exchange(server.port, get("/metrics"))
    assert status == 200
    assert headers["content-type"].startswith("text/plain; version=")
    assert b'kubegpu_devices_healthy{resource="nvidia.com/gpu"} 3.0' in body


async def test_metrics_absent_is_404() -> None:
    srv = HttpServer("127.0.0.1", 0, metrics=None, ready=lambda: (True, ""))
    await srv.start()
    try:
        status, _, _ = await exchange(srv.port, get("/metrics"))
        assert status == 404
        status, _, _ = await exchange(srv.port, get("/healthz"))
        assert status == 200
    finally:
        await srv.stop()


async def test_head_sends_headers_only(server: HttpServer) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(get("/healthz", "HEAD"))
    data = await asyncio.wait_for(reader.read(), WAIT)
    writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ")
    assert b"Content-Length: 3" in head
    assert body == b""


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (get("/nope"), 404),
        (get("/healthz", "POST"), 405),
        (get("/metrics", "DELETE"), 405),
        (b"GARBAGE\r\n\r\n", 400),
        (b"GET /healthz SPDY/3\r\n\r\n", 400),
        (b"GET  HTTP/1.1\r\n\r\n", 400),
        (b"GET /\xff HTTP/1.1\r\n\r\n", 400),
        (b"GET /healthz HTTP/1.1\r\nX: " + b"a" * 10000 + b"\r\n\r\n", 431),
    ],
)
async def test_bad_requests(server: HttpServer, raw: bytes, expected: int) -> None:
    status, headers, _ = await exchange(server.port, raw)
    assert status == expected
    if expected == 405:
        assert headers["allow"] == "GET, HEAD"


async def test_client_closing_early_gets_400(server: HttpServer) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(b"GET /healthz HTTP/1.1\r\n")
    writer.write_eof()
    data = await asyncio.wait_for(reader.read(), WAIT)
    writer.close()
    assert parse(data)[0] == 400


async def test_slow_client_is_cut_off(server: HttpServer) -> None:
    slow_reader, slow_writer = await asyncio.open_connection("127.0.0.1", server.port)
    slow_writer.write(b"GET /healthz HTTP/1.1\r\nHost:")  # never finishes its head
    await slow_writer.drain()
    data = await asyncio.wait_for(slow_reader.read(), WAIT)
    slow_writer.close()
    assert parse(data)[0] == 408


async def test_slow_client_blocks_nobody(readiness: Ready) -> None:
    """Others are answered while the slow one is pending. Its cut-off is as long as the
    test's wait, so an answer held up behind it would time out instead of arriving."""
    srv = HttpServer(
        "127.0.0.1", 0, metrics=None, ready=lambda: readiness[-1], request_timeout=WAIT
    )
    await srv.start()
    slow_reader, slow_writer = await asyncio.open_connection("127.0.0.1", srv.port)
    slow_writer.write(b"GET /healthz HTTP/1.1\r\nHost:")  # never finishes its head
    await slow_writer.drain()
    for _ in range(3):
        status, _, _ = await exchange(srv.port, get("/healthz"))
        assert status == 200
    await asyncio.wait_for(srv.stop(), WAIT)
    # Still pending when the server stopped: cut without an answer, not with a 408.
    assert await asyncio.wait_for(slow_reader.read(), WAIT) == b""
    slow_writer.close()


async def test_stop_cuts_open_connections_and_frees_the_port(readiness: Ready) -> None:
    srv = HttpServer("127.0.0.1", 0, metrics=None, ready=lambda: readiness[-1], request_timeout=30)
    await srv.start()
    port = srv.port
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /")
    await writer.drain()
    await asyncio.wait_for(srv.stop(), WAIT)
    assert await asyncio.wait_for(reader.read(), WAIT) == b""
    writer.close()
    with pytest.raises(OSError):
        await asyncio.open_connection("127.0.0.1", port)
    await srv.stop()  # idempotent


async def test_ready_callback_failure_is_500_not_a_dead_server(readiness: Ready) -> None:
    def broken() -> tuple[bool, str]:
        raise RuntimeError("boom")

    srv = HttpServer("127.0.0.1", 0, metrics=None, ready=broken)
    await srv.start()
    try:
        status, _, body = await exchange(srv.port, get("/readyz"))
        assert status == 500
        assert b"boom" not in body
        status, _, _ = await exchange(srv.port, get("/healthz"))
        assert status == 200
    finally:
        await srv.stop()
