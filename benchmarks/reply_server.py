"""The floor for GetPreferredAllocation: a bare `grpc.aio` unary method that answers every
call with fixed bytes (the plugin's own serialized answer to the same request).

Run as `python -m benchmarks.reply_server <socket> <reply file>`; prints "ready" once it
serves, then serves until stdin closes or it is terminated. The client sends the very
request bytes it sends the plugin, so both move the same bytes each way; the floor has no
protobuf, no servicer and no placement: nothing but gRPC's own per-call cost.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import grpc

SERVICE = "bench.Reply"
METHOD = f"/{SERVICE}/Reply"


async def serve(socket: str, reply_file: str) -> None:
    reply = Path(reply_file).read_bytes()

    async def _reply(request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
        return reply

    server = grpc.aio.server()
    handlers: dict[str, grpc.RpcMethodHandler[Any, Any]] = {
        "Reply": grpc.unary_unary_rpc_method_handler(_reply)
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    await serve_until_stdin_closes(server, socket)


async def serve_until_stdin_closes(server: grpc.aio.Server, socket: str) -> None:
    """Listen on the unix `socket`, print "ready", serve until the parent closes our stdin
    (or kills us): how every floor server of the benchmarks runs."""
    if not server.add_insecure_port(f"unix://{socket}"):
        raise SystemExit(f"cannot listen on {socket}")
    await server.start()
    print("ready", flush=True)
    await asyncio.to_thread(sys.stdin.read)
    await server.stop(0)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit("usage: python -m benchmarks.reply_server <socket> <reply file>")
    asyncio.run(serve(sys.argv[1], sys.argv[2]))
