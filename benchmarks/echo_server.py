"""The floor for Allocate: a bare `grpc.aio` unary echo on a unix socket.

Run as `python -m benchmarks.echo_server <socket> [<list payload file>]`; prints "ready"
once it serves, then serves until stdin closes or it is terminated. Bytes in, the same bytes
out: no protobuf, no servicer class, nothing but gRPC's own per-call cost.

With a payload file it also serves `List`, the floor for a first ListAndWatch: a server
stream that sends the file's bytes (a serialized list, built once) and then stays open, as
ListAndWatch does, until the client goes away.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc

from benchmarks.reply_server import serve_until_stdin_closes

SERVICE = "bench.Echo"
METHOD = f"/{SERVICE}/Echo"
LIST_METHOD = f"/{SERVICE}/List"


async def _echo(request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
    return request


def _lister(payload: bytes) -> Callable[[bytes, Any], AsyncIterator[bytes]]:
    async def _list(request: bytes, context: Any) -> AsyncIterator[bytes]:
        yield payload
        await asyncio.Event().wait()  # open until the client cancels, as ListAndWatch

    return _list


async def serve(socket: str, payload_file: str | None = None) -> None:
    server = grpc.aio.server()
    handlers: dict[str, grpc.RpcMethodHandler[Any, Any]] = {
        "Echo": grpc.unary_unary_rpc_method_handler(_echo)
    }
    if payload_file is not None:
        payload = Path(payload_file).read_bytes()
        handlers["List"] = grpc.unary_stream_rpc_method_handler(_lister(payload))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    await serve_until_stdin_closes(server, socket)


if __name__ == "__main__":
    asyncio.run(serve(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None))
