"""The floor for Allocate: a bare `grpc.aio` unary echo on a unix socket.

Run as `python -m benchmarks.echo_server <socket>`; prints "ready" once it serves, then
serves until stdin closes or it is terminated. Bytes in, the same bytes out: no protobuf,
no servicer class, nothing but gRPC's own per-call cost.
"""

from __future__ import annotations

import asyncio
import sys

import grpc

SERVICE = "bench.Echo"
METHOD = f"/{SERVICE}/Echo"


async def _echo(request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
    return request


async def serve(socket: str) -> None:
    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                SERVICE, {"Echo": grpc.unary_unary_rpc_method_handler(_echo)}
            ),
        )
    )
    if not server.add_insecure_port(f"unix://{socket}"):
        raise SystemExit(f"cannot listen on {socket}")
    await server.start()
    print("ready", flush=True)
    # Stop when the parent closes our stdin (or kills us).
    await asyncio.to_thread(sys.stdin.read)
    await server.stop(0)


if __name__ == "__main__":
    asyncio.run(serve(sys.argv[1]))
