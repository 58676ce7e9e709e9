"""A small DRA driver for the kubelet emulator's DRA tests, and claim/pod builders.

The driver serves the plugin-watcher Registration service on
`<registry>/<driver>-reg.sock` and the DRAPlugin service (v1, or v1beta1 under its own
method names) on `<plugins>/<driver>/dra.sock`, as drivers built on the kubeletplugin
helper do. It answers each claim with one device per allocation result and records every
request, so tests can assert what the kubelet sent. Given a `health` servicer, the DRA socket
serves the health service (`v1alpha1.DRAResourceHealth`) too; `ScriptedHealth` streams what
a test puts in its queue.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, TypeAlias

import grpc

from kubegpu.api import add_dra_health_servicer
from kubegpu.api import dra_health_pb2 as health_pb
from kubegpu.api import dra_health_pb2_grpc as health_grpc
from kubegpu.api import dra_pb2 as dra
from kubegpu.api import dra_pb2_grpc as dra_grpc
from kubegpu.api import pluginregistration_pb2 as reg
from kubegpu.api import pluginregistration_pb2_grpc as reg_grpc
from tests.rig.kube import FakeKube

Ctx: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"
DRIVER = "gpu.example.com"


class FakeDriver(reg_grpc.RegistrationServicer, dra_grpc.DRAPluginServicer):
    """Registration + DRAPlugin servicers of one driver, on two real unix sockets."""

    def __init__(
        self,
        registry: Path,
        plugins: Path,
        *,
        name: str = DRIVER,
        type: str = "DRAPlugin",
        versions: tuple[str, ...] = ("v1.DRAPlugin", "v1beta1.DRAPlugin"),
        serve: str = "v1",
        kube: FakeKube | None = None,
        reg_socket: str | None = None,
        health: health_grpc.DRAResourceHealthServicer | None = None,
    ) -> None:
        self.name = name
        self.health = health
        self.type = type
        self.versions = list(versions)
        self.serve_version = serve
        self.kube = kube
        self.reg_path = registry / (reg_socket or f"{name}-reg.sock")
        self.dra_path = plugins / name / "dra.sock"
        #: Each NotifyRegistrationStatus: (registered, error).
        self.statuses: list[tuple[bool, str]] = []
        self.prepares: list[list[tuple[str, str, str]]] = []
        self.unprepares: list[list[tuple[str, str, str]]] = []
        #: Claim name -> error to answer for it (per claim, not for the call).
        self.claim_errors: dict[str, str] = {}
        #: Set to fail whole calls with this status code.
        self.fail_calls: grpc.StatusCode | None = None
        self.changed = asyncio.Event()
        self._reg_server: grpc.aio.Server | None = None
        self._dra_server: grpc.aio.Server | None = None

    async def start(self) -> FakeDriver:
        """Serve the DRA socket first, then the registration socket (as drivers do)."""
        await self.start_service()
        self.reg_path.parent.mkdir(parents=True, exist_ok=True)
        self._reg_server = grpc.aio.server()
        reg_grpc.add_RegistrationServicer_to_server(self, self._reg_server)  # type: ignore[no-untyped-call]
        self._reg_server.add_insecure_port(f"unix://{self.reg_path}")
        await self._reg_server.start()
        return self

    async def stop_service(self) -> None:
        """Stop only the DRA service (a driver crashing while its registration stays)."""
        if self._dra_server is not None:
            await self._dra_server.stop(0)
            self._dra_server = None
        self.dra_path.unlink(missing_ok=True)

    async def start_service(self) -> None:
        self.dra_path.parent.mkdir(parents=True, exist_ok=True)
        self._dra_server = grpc.aio.server()
        if self.serve_version == "v1":
            dra_grpc.add_DRAPluginServicer_to_server(self, self._dra_server)  # type: ignore[no-untyped-call]
        else:
            self._dra_server.add_generic_rpc_handlers((self._v1beta1_handler(),))
        if self.health is not None:
            add_dra_health_servicer(self.health, self._dra_server)
        self._dra_server.add_insecure_port(f"unix://{self.dra_path}")
        await self._dra_server.start()

    async def stop(self) -> None:
        """Stop both servers and remove the registration socket (a driver shutting down)."""
        for server in (self._reg_server, self._dra_server):
            if server is not None:
                await server.stop(0)
        self._reg_server = self._dra_server = None
        self.reg_path.unlink(missing_ok=True)
        self.dra_path.unlink(missing_ok=True)

    def _v1beta1_handler(self) -> grpc.GenericRpcHandler[Any, Any]:
        return grpc.method_handlers_generic_handler(
            "k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin",
            {
                "NodePrepareResources": grpc.unary_unary_rpc_method_handler(
                    self.NodePrepareResources,
                    request_deserializer=dra.NodePrepareResourcesRequest.FromString,
                    response_serializer=dra.NodePrepareResourcesResponse.SerializeToString,
                ),
                "NodeUnprepareResources": grpc.unary_unary_rpc_method_handler(
                    self.NodeUnprepareResources,
                    request_deserializer=dra.NodeUnprepareResourcesRequest.FromString,
                    response_serializer=dra.NodeUnprepareResourcesResponse.SerializeToString,
                ),
            },
        )

    # ------------------------------------------------------------ Registration

    async def GetInfo(self, request: reg.InfoRequest, context: Ctx) -> reg.PluginInfo:
        return reg.PluginInfo(
            type=self.type,
            name=self.name,
            endpoint=str(self.dra_path),
            supported_versions=self.versions,
        )

    async def NotifyRegistrationStatus(
        self, request: reg.RegistrationStatus, context: Ctx
    ) -> reg.RegistrationStatusResponse:
        self.statuses.append((request.plugin_registered, request.error))
        self.changed.set()
        return reg.RegistrationStatusResponse()

    # ------------------------------------------------------------ DRAPlugin

    async def NodePrepareResources(
        self, request: dra.NodePrepareResourcesRequest, context: Ctx
    ) -> dra.NodePrepareResourcesResponse:
        self.prepares.append([(c.namespace, c.name, c.uid) for c in request.claims])
        if self.fail_calls is not None:
            await context.abort(self.fail_calls, "driver is broken")
        response = dra.NodePrepareResourcesResponse()
        for claim in request.claims:
            error = self.claim_errors.get(claim.name)
            if error is not None:
                response.claims[claim.uid].error = error
                continue
            for device in self._devices(claim):
                response.claims[claim.uid].devices.append(device)
        return response

    async def NodeUnprepareResources(
        self, request: dra.NodeUnprepareResourcesRequest, context: Ctx
    ) -> dra.NodeUnprepareResourcesResponse:
        self.unprepares.append([(c.namespace, c.name, c.uid) for c in request.claims])
        if self.fail_calls is not None:
            await context.abort(self.fail_calls, "driver is broken")
        response = dra.NodeUnprepareResourcesResponse()
        for claim in request.claims:
            response.claims[claim.uid].error = self.claim_errors.get(claim.name, "")
        return response

    def _devices(self, claim: dra.Claim) -> list[dra.Device]:
        """One device per allocation result of this driver, with a CDI ID per claim."""
        results: list[dict[str, Any]] = []
        if self.kube is not None:
            stored = self.kube.resource_claims.get((claim.namespace, claim.name), {})
            allocation = (stored.get("status") or {}).get("allocation") or {}
            results = (allocation.get("devices") or {}).get("results") or []
        return [
            dra.Device(
                request_names=[r["request"]],
                pool_name=r["pool"],
                device_name=r["device"],
                cdi_device_ids=[f"k8s.{self.name}/claim={claim.uid}-{r['device']}"],
            )
            for r in results
            if r["driver"] == self.name
        ]


class ScriptedHealth(health_grpc.DRAResourceHealthServicer):
    """A health service whose stream sends each response put in `responses`; None ends it."""

    def __init__(self) -> None:
        self.responses: asyncio.Queue[health_pb.NodeWatchResourcesResponse | None] = asyncio.Queue()
        #: How many streams were opened.
        self.opened = 0

    async def NodeWatchResources(
        self, request: health_pb.NodeWatchResourcesRequest, context: Ctx
    ) -> AsyncIterator[health_pb.NodeWatchResourcesResponse]:
        self.opened += 1
        while (response := await self.responses.get()) is not None:
            yield response

    def send(self, *devices: tuple[str, str, health_pb.HealthStatus, str]) -> None:
        """Queue one response: (pool, device, health, message) per device."""
        self.responses.put_nowait(
            health_pb.NodeWatchResourcesResponse(
                devices=[
                    health_pb.DeviceHealth(
                        device=health_pb.DeviceIdentifier(pool_name=pool, device_name=name),
                        health=status,
                        message=message,
                    )
                    for pool, name, status, message in devices
                ]
            )
        )


def pod(
    name: str,
    *,
    uid: str | None = None,
    claims: dict[str, str] | None = None,
    containers: dict[str, list[str]] | None = None,
    namespace: str = "default",
) -> dict[str, Any]:
    """A v1 Pod: `claims` maps pod claim name -> ResourceClaim name, `containers` maps a
    container name -> the pod claims it uses (default: one container "ctr" using all)."""
    claims = claims or {}
    containers = containers or {"ctr": list(claims)}
    return {
        "metadata": {"name": name, "namespace": namespace, "uid": uid or f"uid-{name}"},
        "spec": {
            "resourceClaims": [{"name": k, "resourceClaimName": v} for k, v in claims.items()],
            "containers": [
                {"name": c, "resources": {"claims": [{"name": k} for k in used]}}
                for c, used in containers.items()
            ],
        },
        "status": {},
    }


def allocated_claim(
    kube: FakeKube,
    name: str,
    devices: list[tuple[str, str]],
    *,
    reserved_for: list[dict[str, Any]],
    namespace: str = "default",
    pool: str = "node-1",
) -> dict[str, Any]:
    """Store an allocated ResourceClaim: `devices` are (driver, device) results of request
    "gpu", reserved for the given pods."""
    return kube.put_resource_claim(
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"devices": {"requests": [{"name": "gpu"}]}},
            "status": {
                "allocation": {
                    "devices": {
                        "results": [
                            {"request": "gpu", "driver": d, "pool": pool, "device": dev}
                            for d, dev in devices
                        ]
                    }
                },
                "reservedFor": [
                    {"resource": "pods", "name": p["metadata"]["name"], "uid": p["metadata"]["uid"]}
                    for p in reserved_for
                ],
            },
        }
    )
