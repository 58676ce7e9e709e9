"""Registration through the kubelet's plugin watcher (`pluginregistration.Registration`).

Unlike a device plugin, a DRA plugin never calls the kubelet: it serves this service on
`<registrar dir>/<driver>-reg.sock` (`/var/lib/kubelet/plugins_registry/`) and the
kubelet's plugin watcher finds the socket (inotify on that directory, and a walk of it
when the kubelet starts), calls `GetInfo`, validates the answer, connects to the
endpoint it names and reports the outcome with `NotifyRegistrationStatus`.

What follows from the kubelet's code (pkg/kubelet/pluginmanager):
- A restarting kubelet walks the directory and calls `GetInfo` again: re-registration
  needs nothing from us but a socket that still answers.
- Deleting the socket makes the kubelet deregister the driver (and, after a grace
  period, delete the node's ResourceSlices of it); a socket created again is a new
  registration. So `DraDriver` serves the socket again whenever it disappears.
- The kubelet uses the first entry of `supported_versions` it knows, so the newest
  service comes first.
- A starting kubelet deletes every ResourceSlice of its node, and one whose driver stays
  away too long deletes that driver's: `on_registered` runs on every registration the
  kubelet confirms, so the daemon publishes the slices again at once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import grpc

from kubegpu import rpc
from kubegpu.api import pluginregistration_pb2 as reg_pb
from kubegpu.api import pluginregistration_pb2_grpc as reg_grpc
from kubegpu.dra.service import SUPPORTED_VERSIONS

log = logging.getLogger("kubegpu.dra")

#: `PluginInfo.type` of a DRA plugin (the kubelet's pluginregistration.DRAPlugin).
PLUGIN_TYPE = "DRAPlugin"


def registration_socket_name(driver: str) -> str:
    """`<driver>-reg.sock`, as k8s.io/dynamic-resource-allocation/kubeletplugin names it."""
    return f"{driver}-reg.sock"


class RegistrationServicer(reg_grpc.RegistrationServicer):
    """Answers the plugin watcher: who we are, where the DRA service listens."""

    def __init__(
        self, driver: str, endpoint: str, *, on_registered: Callable[[], None] | None = None
    ) -> None:
        self.driver = driver
        #: The DRA service's socket path, as the kubelet sees it.
        self.endpoint = endpoint
        #: The kubelet's last verdict: None until it reported one.
        self.registered: bool | None = None
        self.error = ""
        #: Set on every verdict the kubelet reports (tests, readiness).
        self.notified = asyncio.Event()
        #: Called on each registration the kubelet confirms (a new kubelet, or the
        #: socket served again).
        self.on_registered = on_registered

    async def GetInfo(
        self, request: reg_pb.InfoRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> reg_pb.PluginInfo:
        return reg_pb.PluginInfo(
            type=PLUGIN_TYPE,
            name=self.driver,
            endpoint=self.endpoint,
            supported_versions=list(SUPPORTED_VERSIONS),
        )

    async def NotifyRegistrationStatus(
        self, request: reg_pb.RegistrationStatus, context: grpc.aio.ServicerContext[Any, Any]
    ) -> reg_pb.RegistrationStatusResponse:
        self.registered = request.plugin_registered
        self.error = request.error
        if request.plugin_registered:
            log.info("the kubelet registered DRA driver %s (%s)", self.driver, self.endpoint)
            if self.on_registered is not None:
                self.on_registered()
        else:
            log.error(
                "the kubelet refused to register DRA driver %s: %s",
                self.driver,
                rpc.bounded(request.error or "no reason given"),
            )
        self.notified.set()
        return reg_pb.RegistrationStatusResponse()


def _status(exc: Exception, rpc_name: str) -> tuple[grpc.StatusCode, str]:
    return rpc.status_for(exc, rpc_name, log)


#: Registration requests are tiny (an empty message, or a verdict with one error line).
MAX_REQUEST_BYTES = 64 * 1024


def registration_server(servicer: RegistrationServicer) -> grpc.aio.Server:
    server = grpc.aio.server(
        interceptors=[
            rpc.Boundary(lambda: MAX_REQUEST_BYTES, status=_status, subject="the registration")
        ]
    )
    reg_grpc.add_RegistrationServicer_to_server(servicer, server)  # type: ignore[no-untyped-call]
    return server


__all__ = [
    "PLUGIN_TYPE",
    "RegistrationServicer",
    "registration_server",
    "registration_socket_name",
]
