"""NVIDIA's Allocate answers (internal/plugin) against kubegpu.

The cases live in ``data/nvidia/plugin/allocate.yaml`` (and, for IMEX channels,
``data/nvidia/config/imex.yaml``); each builds a four-GPU node with
tests.builders, a config from the case's `flags`, and compares kubegpu's answer
(`allocation.build_response`) field by field. Cases that need no fixed response ID also
go end to end through the real gRPC servicer on a unix socket.
"""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from kubegpu import cdi
from kubegpu.allocation import (
    ContainerEdits,
    ImexChannel,
    build_response,
    select_imex_channels,
    validate_request,
)
from kubegpu.api import device_plugin_stub, pb
from kubegpu.config import Config, parse_config
from kubegpu.errors import PreconditionError
from kubegpu.plugin.server import ResourceServer
from kubegpu.resources import ResourceSpec, build_resources
from tests import builders
from tests.conformance.origin import DATA, NVIDIA_DP

CASES: list[dict[str, Any]] = [
    *yaml.safe_load((DATA / "nvidia" / "plugin" / "allocate.yaml").read_text())["cases"],
    # Allocate with IMEX channels, kept with the other IMEX facts.
    *yaml.safe_load((DATA / "nvidia" / "config" / "imex.yaml").read_text())["allocate"],
]
FIELDS = ("envs", "mounts", "device_specs", "annotations", "cdi_devices")
GPUS = [builders.gpu(i) for i in range(4)]
SUBST = {f"gpu{i}": g.uuid for i, g in enumerate(GPUS)} | {
    f"idx{i}": str(g.index) for i, g in enumerate(GPUS)
}


def case_id(case: dict[str, Any]) -> str:
    return f"{case['id']}@{NVIDIA_DP.cite(case['source'])}"


def resolve(value: Any) -> Any:
    """Symbolic `{gpuN}` / `{idxN}` in expectations -> this node's UUIDs / indices."""
    if isinstance(value, str):
        return value.format(**SUBST)
    if isinstance(value, list):
        return [resolve(v) for v in value]
    if isinstance(value, dict):
        return {resolve(k): resolve(v) for k, v in value.items()}
    return value


def request_ids(case: dict[str, Any]) -> list[str]:
    return [SUBST[i] for i in case["ids"]]


def setup(case: dict[str, Any]) -> tuple[ResourceSpec, Config]:
    inv = builders.inventory(*GPUS)
    if "control" in case:
        inv = dataclasses.replace(inv, control_device_paths=tuple(case["control"]))
    config = parse_config(yaml.safe_dump({"version": "v1", "flags": case["flags"]}))
    spec = next(s for s in build_resources(inv, config) if s.name == "nvidia.com/gpu")
    return spec, config


def as_data(edits: ContainerEdits) -> dict[str, Any]:
    """The answer in the data's shape (default permissions/read-only elided)."""
    return {
        "envs": dict(edits.envs),
        "mounts": [
            {"container_path": m.container_path, "host_path": m.host_path}
            | ({"read_only": True} if m.read_only else {})
            for m in edits.mounts
        ],
        "device_specs": [
            {"container_path": d.container_path, "host_path": d.host_path}
            | ({} if d.permissions == "rw" else {"permissions": d.permissions})
            for d in edits.device_specs
        ],
        "annotations": dict(edits.annotations),
        "cdi_devices": list(edits.cdi_devices),
    }


def expected(case: dict[str, Any]) -> dict[str, Any]:
    want = resolve(case["expect"])
    empty: dict[str, Any] = {"envs": {}, "mounts": [], "device_specs": [], "annotations": {}}
    return {f: want.get(f, empty.get(f, [])) for f in case.get("only", FIELDS)}


@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_allocate_response(case: dict[str, Any]) -> None:
    spec, config = setup(case)
    ids = request_ids(case)
    devices = validate_request(spec, ids) if ids else ()
    channels = [ImexChannel(c) for c in case.get("imex_channels", [])]
    edits = build_response(spec, devices, config, response_id="uuid", imex_channels=channels)
    got = as_data(edits)
    assert {f: got[f] for f in case.get("only", FIELDS)} == expected(case)


# -- end to end: the same cases through the gRPC servicer --------------------------------------

# Annotation keys carry a random response ID and IMEX channels need device nodes: those
# cases are checked over gRPC separately below.
E2E = [
    c
    for c in CASES
    if c["ids"] and not {"only", "imex_channels"} & set(c) and "annotations" not in c["expect"]
]


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="kg-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@contextlib.asynccontextmanager
async def serving(
    directory: Path, spec: ResourceSpec, config: Config, cdi_classes: tuple[str, ...] = ()
) -> AsyncIterator[Any]:
    cdi_dir = directory / "cdi"
    cdi_dir.mkdir()
    for cdi_class in cdi_classes:
        (cdi_dir / cdi.spec_name(cdi_class)).write_text("{}")
    server = ResourceServer(spec, config, directory, cdi_dir=cdi_dir)
    await server.serve()
    try:
        async with grpc.aio.insecure_channel(f"unix://{server.socket_path}") as channel:
            yield device_plugin_stub(channel)
    finally:
        await server.stop(grace=0)


def pb_as_data(resp: pb.ContainerAllocateResponse) -> dict[str, Any]:
    return {
        "envs": dict(resp.envs),
        "mounts": [
            {"container_path": m.container_path, "host_path": m.host_path}
            | ({"read_only": True} if m.read_only else {})
            for m in resp.mounts
        ],
        "device_specs": [
            {"container_path": d.container_path, "host_path": d.host_path}
            | ({} if d.permissions == "rw" else {"permissions": d.permissions})
            for d in resp.devices
        ],
        "annotations": dict(resp.annotations),
        "cdi_devices": [c.name for c in resp.cdi_devices],
    }


@pytest.mark.parametrize("case", E2E, ids=[case_id(c) for c in E2E])
async def test_allocate_over_grpc(socket_dir: Path, case: dict[str, Any]) -> None:
    spec, config = setup(case)
    request = pb.AllocateRequest(
        container_requests=[pb.ContainerAllocateRequest(devices_ids=request_ids(case))]
    )
    # The node has a spec for every CDI class NVIDIA would name (see the next test).
    async with serving(socket_dir, spec, config, ("gpu", "gds", "mofed", "gdrcopy")) as stub:
        resp = await stub.Allocate(request)
    assert len(resp.container_responses) == 1
    assert pb_as_data(resp.container_responses[0]) == expected(case)


async def test_modes_without_a_cdi_spec_are_not_named(socket_dir: Path) -> None:
    """NVIDIA drops a mode whose spec came out empty (no nvidia-fs / infiniband nodes) from
    the names it sends (NVIDIA_DP internal/cdi/cdi.go CreateSpecFile, AdditionalDevices)."""
    case = next(c for c in CASES if c["id"] == "gds-mofed-env-also-with-cdi-only")
    spec, config = setup(case)
    request = pb.AllocateRequest(
        container_requests=[pb.ContainerAllocateRequest(devices_ids=request_ids(case))]
    )
    async with serving(socket_dir, spec, config, ("gpu", "mofed")) as stub:
        resp = await stub.Allocate(request)
    got = pb_as_data(resp.container_responses[0])
    assert got["cdi_devices"] == [
        f"k8s.device-plugin.nvidia.com/gpu={GPUS[0].uuid}",
        "k8s.device-plugin.nvidia.com/mofed=all",
    ]
    assert got["envs"] == {"NVIDIA_GDS": "enabled", "NVIDIA_MOFED": "enabled"}


async def test_cdi_annotation_key_over_grpc_is_unique_per_response(socket_dir: Path) -> None:
    """`cdi.k8s.io/nvidia-device-plugin_<response id>`, a fresh ID per container
    (NVIDIA_DP internal/plugin/server.go: uuid.New() per getAllocateResponse)."""
    case = next(c for c in CASES if c["id"] == "cdi-single-device-annotation")
    spec, config = setup(case)
    creq = pb.ContainerAllocateRequest(devices_ids=[GPUS[0].uuid])
    async with serving(socket_dir, spec, config) as stub:
        resp = await stub.Allocate(pb.AllocateRequest(container_requests=[creq, creq]))
    keys = [next(iter(r.annotations)) for r in resp.container_responses]
    assert all(k.startswith("cdi.k8s.io/nvidia-device-plugin_") for k in keys)
    assert len(set(keys)) == 2
    assert all(
        list(r.annotations.values()) == [f"k8s.device-plugin.nvidia.com/gpu={GPUS[0].uuid}"]
        for r in resp.container_responses
    )
    assert all("NVIDIA_VISIBLE_DEVICES" not in r.envs for r in resp.container_responses)


# -- internal/imex/imex.go GetChannels: which configured channels are used -------------------

IMEX = NVIDIA_DP.cite("internal/imex/imex.go")


@pytest.mark.parametrize(
    ("present", "want"),
    [
        ({"/dev/nvidia-caps-imex-channels/channel0"}, ["0"]),
        (set(), []),
        # Only channel 0 can be configured (api/config/v1/imex.go AssertChannelIDsValid).
        ({"/dev/nvidia-caps-imex-channels/channel2"}, []),
    ],
    ids=[f"{n}@{IMEX}" for n in ("present", "missing-skipped", "other-channel-ignored")],
)
def test_imex_channels_selected(present: set[str], want: list[str]) -> None:
    config = parse_config(yaml.safe_dump({"version": "v1", "imex": {"channelIDs": [0]}}))
    got = select_imex_channels(config, present.__contains__)
    assert [c.id for c in got] == want


def test_imex_required_channel_missing_is_refused() -> None:
    """`imex.required` with a missing channel is an error (NVIDIA_DP internal/imex/imex.go)."""
    config = parse_config(
        yaml.safe_dump({"version": "v1", "imex": {"channelIDs": [0], "required": True}})
    )
    with pytest.raises(PreconditionError, match=r"IMEX channel 0 does not exist"):
        select_imex_channels(config, lambda _: False)
