"""The Registration service on `kubelet.sock`, as the kubelet's `plugin/v1beta1/server.go`.

The server wipes stale sockets from the plugin directory when it starts (which is how
plugins notice a kubelet restart), validates each `Register` request and hands valid ones
to a `RegisterHandler` (the manager), which dials the plugin before the call returns.
"""

from __future__ import annotations

import logging
import stat
import time
from pathlib import Path
from typing import Protocol

import grpc

from kubegpu.api import pb, pb_grpc
from kubegpu.kubelet.checkpoint import CHECKPOINT_FILE
from kubegpu.kubelet.validation import register_request_error

log = logging.getLogger("kubegpu.kubelet")


class RegisterHandler(Protocol):
    """Connects a validated registration; returns the error text for the plugin, or None."""

    async def __call__(self, resource: str, endpoint: str) -> str | None: ...


class RegisterRecorder(Protocol):
    """Called once per Register call: when it arrived (monotonic) and its outcome."""

    async def __call__(
        self, request: pb.RegisterRequest, arrived: float, error: str | None
    ) -> None: ...


class RegistrationServicer(pb_grpc.RegistrationServicer):
    """`Register`: validate, connect through the handler, answer as the kubelet does."""

    def __init__(self, connect: RegisterHandler, done: RegisterRecorder) -> None:
        self._connect = connect
        self._done = done

    async def register(self, request: pb.RegisterRequest) -> str | None:
        """Handle one Register call; the error text to return, or None on success."""
        arrived = time.monotonic()
        resource, endpoint = request.resource_name, request.endpoint
        log.info(
            "got registration request from device plugin with resource %s (endpoint %s)",
            resource,
            endpoint,
        )
        error = register_request_error(request.version, resource, endpoint)
        if error is None:
            error = await self._connect(resource, endpoint)
        if error is not None:
            log.warning("registration of %s from %s refused: %s", resource, endpoint, error)
        await self._done(request, arrived, error)
        return error

    async def Register(
        self,
        request: pb.RegisterRequest,
        context: grpc.aio.ServicerContext[pb.RegisterRequest, pb.Empty],
    ) -> pb.Empty:
        error = await self.register(request)
        if error is not None:
            # The kubelet returns a plain Go error, which grpc-go sends as code Unknown.
            await context.abort(grpc.StatusCode.UNKNOWN, error)
        return pb.Empty()


def remove_stale_sockets(plugin_dir: Path) -> None:
    """Delete every socket in the plugin directory but keep the checkpoint (kubelet start)."""
    for entry in plugin_dir.iterdir():
        if entry.name == CHECKPOINT_FILE:
            continue
        try:
            if stat.S_ISSOCK(entry.lstat().st_mode):
                entry.unlink(missing_ok=True)
                log.debug("removed stale socket %s", entry)
        except FileNotFoundError:
            continue


async def serve(socket_path: Path, servicer: RegistrationServicer) -> grpc.aio.Server:
    """Start the Registration server on `socket_path` (the directory must exist)."""
    server = grpc.aio.server()
    pb_grpc.add_RegistrationServicer_to_server(  # type: ignore[no-untyped-call]
        servicer, server
    )
    address = f"unix://{socket_path}"
    if not server.add_insecure_port(address):
        raise RuntimeError(f"cannot serve {address}")
    await server.start()
    return server
