"""kubegpu's `DevicePluginServicer` alone on a bare `grpc.aio` server (no daemon around it).

Run as `python -m benchmarks.servicer_server <socket>`; prints "ready", serves until stdin
closes. Between the bare echo and the full `kubegpu serve`, it tells what the servicer and
protobuf cost apart from the daemon's background work (kubelet watch, health, config poll).
"""

from __future__ import annotations

import asyncio
import sys

import grpc

from kubegpu.api import add_device_plugin_servicer
from kubegpu.config import Config
from kubegpu.devices.simulated import SimulatedBackend
from kubegpu.metrics import Metrics
from kubegpu.plugin.server import DevicePluginServicer
from kubegpu.resources import build_resources


async def serve(socket: str) -> None:
    config = Config()
    spec = build_resources(SimulatedBackend.load("h100-8").discover(), config)[0]
    server = grpc.aio.server()
    add_device_plugin_servicer(DevicePluginServicer(spec, config, metrics=Metrics()), server)
    if not server.add_insecure_port(f"unix://{socket}"):
        raise SystemExit(f"cannot listen on {socket}")
    await server.start()
    print("ready", flush=True)
    await asyncio.to_thread(sys.stdin.read)
    await server.stop(0)


if __name__ == "__main__":
    asyncio.run(serve(sys.argv[1]))
