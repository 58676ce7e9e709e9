"""The decoding floor for GetPreferredAllocation: a bare `grpc.aio` server of the very RPC
(`v1beta1.DevicePlugin/GetPreferredAllocation`, the generated protobuf types) that answers
every call with one constant, precomputed response.

Run as `python -m benchmarks.typed_reply_server <socket> <reply file>`; prints "ready" once
it serves, then serves until stdin closes or it is terminated. Any server of this API must
decode its request (grpc does, before the method runs) and encode its answer; this one does
nothing else: no interceptor, no daemon, no placement. `benchmarks/reply_server.py` is the
stricter floor that skips protobuf altogether.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import grpc

from benchmarks.reply_server import serve_until_stdin_closes
from kubegpu.api import add_device_plugin_servicer, pb, pb_grpc


class ConstantServicer(pb_grpc.DevicePluginServicer):
    """Answers GetPreferredAllocation with `reply`, whatever was asked."""

    def __init__(self, reply: pb.PreferredAllocationResponse) -> None:
        self._reply = reply

    async def GetPreferredAllocation(
        self,
        request: pb.PreferredAllocationRequest,
        context: grpc.aio.ServicerContext[
            pb.PreferredAllocationRequest, pb.PreferredAllocationResponse
        ],
    ) -> pb.PreferredAllocationResponse:
        return self._reply


async def serve(socket: str, reply_file: str) -> None:
    reply = pb.PreferredAllocationResponse.FromString(Path(reply_file).read_bytes())
    server = grpc.aio.server()
    add_device_plugin_servicer(ConstantServicer(reply), server)
    await serve_until_stdin_closes(server, socket)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit("usage: python -m benchmarks.typed_reply_server <socket> <reply file>")
    asyncio.run(serve(sys.argv[1], sys.argv[2]))
