"""Hostile DRA calls over the real unix socket, and hostile claims in the API behind it.

Any process that reaches the plugin's socket can call it, and a broken API server (or a
proxy in front of it) can answer anything. Whatever arrives, each call gets a well-formed
answer (per-claim errors in it) or INVALID_ARGUMENT in one line, never INTERNAL; no log
line carries a control character; no file appears outside the CDI directory and the
plugin's own; and the plugin still prepares and releases a real claim afterwards.

Hypothesis runs each example synchronously, so the plugin runs on its own loop in a thread.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kubegpu.api import dra_pb2
from kubegpu.config import Config
from kubegpu.dra.checkpoint import CHECKPOINT_FILE
from kubegpu.dra.claims import claim_uid_of
from kubegpu.dra.driver import DraDriver
from kubegpu.dra.service import SERVICES, ClaimPreparer
from kubegpu.dra.state import DeviceState
from kubegpu.state import NodeStore
from kubegpu.untrusted import is_uid
from tests.builders import gpu, inventory
from tests.rig.kube import FakeKube
from tests.waiting import WAIT

DRIVER = "gpu.nvidia.com"
NODE = "node-a"
#: Claims the API holds: two whole GPUs, and one whose status each example rewrites.
#: `c1` stays prepared between examples, as a running pod's claim would.
REAL = {"c0": "0a1b2c3d-0000-4000-8000-000000000000", "c1": "0a1b2c3d-0000-4000-8000-000000000001"}
HELD = dra_pb2.Claim(namespace="ns", name="c1", uid=REAL["c1"])
GARBAGE = ("garbage", "0a1b2c3d-0000-4000-8000-00000000000f")


class Records(logging.Handler):
    """Every log record of kubegpu, rendered, from any thread."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.seen: list[tuple[int, str]] = []
        self._guard = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        with self._guard:
            self.seen.append((record.levelno, record.getMessage()))


@dataclass
class Served:
    target: str
    kube: FakeKube
    root: Path
    records: Records

    def call(self, method: str, request: Any, service: str = SERVICES[0]) -> Any:
        with grpc.insecure_channel(self.target) as channel:
            answer: Any = {
                "NodePrepareResources": dra_pb2.NodePrepareResourcesResponse,
                "NodeUnprepareResources": dra_pb2.NodeUnprepareResourcesResponse,
            }[method]
            stub = channel.unary_unary(
                f"/{service}/{method}",
                request_serializer=lambda m: m.SerializeToString(),
                response_deserializer=answer.FromString,
            )
            return stub(request, timeout=WAIT)


def allocated(results: list[dict[str, Any]]) -> dict[str, Any]:
    return {"allocation": {"devices": {"results": results}}}


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    root = Path(tempfile.mkdtemp(prefix="kg-", dir="/tmp"))
    kube = FakeKube()
    for name, uid in REAL.items():
        device = f"gpu-{name[1]}"
        result = {"request": "gpu", "driver": DRIVER, "pool": NODE, "device": device}
        kube.put_resource_claim(
            {
                "metadata": {"namespace": "ns", "name": name, "uid": uid},
                "status": allocated([result]),
            }
        )
    store = NodeStore()
    store.update(inventory=inventory(gpu(0), gpu(1)), config=Config())
    preparer = ClaimPreparer(
        DeviceState(store, data_dir=root / "plugins" / DRIVER, cdi_dir=root / "cdi", pool=NODE),
        kube,
    )
    driver = DraDriver(
        preparer, driver=DRIVER, registrar_dir=root / "registry", plugins_dir=root / "plugins"
    )
    records = Records()
    logger = logging.getLogger("kubegpu")
    level = logger.level
    logger.addHandler(records)
    logger.setLevel(logging.DEBUG)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(driver.start(), loop).result(WAIT)
    held = asyncio.run_coroutine_threadsafe(preparer.prepare([HELD]), loop).result(WAIT)
    assert held[HELD.uid][1] == ""
    try:
        yield Served(f"unix://{driver.service.path}", kube, root, records)
    finally:
        asyncio.run_coroutine_threadsafe(driver.stop(), loop).result(WAIT)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(WAIT)
        loop.close()
        logger.removeHandler(records)
        logger.setLevel(level)
        shutil.rmtree(root, ignore_errors=True)


_TEXT = st.one_of(
    st.text(max_size=30),
    st.text(alphabet=st.characters(codec="utf-8"), min_size=300, max_size=3000),
    st.sampled_from(
        [
            "",
            "\n",
            "\x00",
            "\x1b[31m",
            "\u202e",
            "\u2028",
            ".",
            "..",
            "../../../../etc",
            "a/b",
            "ns\n2026-01-01 INFO kubegpu.dra: FORGED",
            "A",
            "a" * 64,
            "a" * 254,
            " ns",
        ]
    ),
)
_NAMESPACES = st.one_of(st.just("ns"), st.just("other"), _TEXT)
_NAMES = st.one_of(st.sampled_from([*REAL, GARBAGE[0], "gone"]), _TEXT)
_UIDS = st.one_of(
    st.sampled_from([*REAL.values(), GARBAGE[1]]),
    st.uuids().map(str),
    st.uuids().map(lambda u: str(u).upper()),
    _TEXT,
)
_CLAIMS = st.builds(
    lambda ns, name, uid: dra_pb2.Claim(namespace=ns, name=name, uid=uid),
    _NAMESPACES,
    _NAMES,
    _UIDS,
)
#: A real claim's UID under any namespace and name.
_IMPOSTORS = st.builds(
    lambda ns, name, uid: dra_pb2.Claim(namespace=ns, name=name, uid=uid),
    _NAMESPACES,
    _NAMES,
    st.sampled_from(list(REAL.values())),
)
#: What a broken API server or proxy might hold as the claim's status.
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(
            st.sampled_from(["allocation", "devices", "results", "driver", "pool", "device"])
            | st.text(max_size=6),
            inner,
            max_size=3,
        )
    ),
    max_leaves=12,
)
_RESULTS = st.lists(
    st.fixed_dictionaries(
        {
            "request": st.just("gpu") | _TEXT,
            "driver": st.sampled_from([DRIVER, "nic.example.com"]),
            "pool": st.just(NODE) | _TEXT,
            "device": st.sampled_from(["gpu-0", "gpu-1", "gpu-9"]) | _TEXT,
        }
    ),
    max_size=3,
)
_STATUS = st.one_of(_RESULTS.map(allocated), _JSON)


def _expected_files(root: Path) -> set[Path]:
    return {
        root / "plugins" / DRIVER / "dra.sock",
        root / "plugins" / DRIVER / CHECKPOINT_FILE,
        root / "registry" / f"{DRIVER}-reg.sock",
    }


def _check_files(root: Path) -> None:
    """Claim specs in the CDI directory, named after real UIDs; the plugin's own files;
    nothing else, here or beside the plugin's root."""
    expected = _expected_files(root)
    for path in root.rglob("*"):
        if path.is_dir():
            assert path in {
                root / "cdi",
                root / "plugins",
                root / "plugins" / DRIVER,
                root / "registry",
            }
        elif path.parent == root / "cdi":
            uid = claim_uid_of(path.name)
            assert uid is not None and is_uid(uid), path
        else:
            assert path in expected, path
    assert not list(root.parent.glob("k8s.gpu.nvidia.com-claim_*"))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    prepare=st.booleans(),
    service=st.sampled_from(SERVICES),
    claims=st.lists(_CLAIMS | _IMPOSTORS, max_size=6),
    many=st.integers(0, 300) | st.just(0),
    status=_STATUS,
    garbage=st.booleans(),
)
def test_fuzz_dra_calls(
    served: Served,
    prepare: bool,
    service: str,
    claims: list[dra_pb2.Claim],
    many: int,
    status: Any,
    garbage: bool,
) -> None:
    served.kube.put_resource_claim(
        {"metadata": {"namespace": "ns", "name": GARBAGE[0], "uid": GARBAGE[1]}, "status": status}
    )
    if garbage:  # the claim as the API holds it, whatever its status
        claims.append(dra_pb2.Claim(namespace="ns", name=GARBAGE[0], uid=GARBAGE[1]))
    # Many claims the API does not hold (new UIDs, each read and refused).
    claims += [
        dra_pb2.Claim(namespace="ns", name=f"n{i}", uid=str(uuid.uuid4())) for i in range(many)
    ]
    before = len(served.records.seen)
    method = "NodePrepareResources" if prepare else "NodeUnprepareResources"
    request: Any = (
        dra_pb2.NodePrepareResourcesRequest(claims=claims)
        if prepare
        else dra_pb2.NodeUnprepareResourcesRequest(claims=claims)
    )
    try:
        answer = served.call(method, request, service)
    except grpc.RpcError as exc:
        assert exc.code() is grpc.StatusCode.INVALID_ARGUMENT, (exc.code(), exc.details())
        details = exc.details() or ""
        assert details.isprintable() and len(details) < 12_000
    else:
        assert set(answer.claims) == {c.uid for c in claims}
        for entry in answer.claims.values():
            assert entry.error.isprintable() and len(entry.error) < 12_000
    lines = served.records.seen[before:]
    assert all(message.isprintable() for _, message in lines), lines
    assert all(level < logging.ERROR for level, _ in lines), lines
    _check_files(served.root)
    # The held claim is released by an unprepare that names it as the API does, only.
    held = served.root / "cdi" / f"k8s.gpu.nvidia.com-claim_{HELD.uid}.json"
    released = not prepare and any(
        (c.namespace, c.name) == (HELD.namespace, HELD.name) for c in claims if c.uid == HELD.uid
    )
    assert held.exists() or released
    # Still serving, and still right: a real claim is prepared and released.
    uid = REAL["c0"]
    real = dra_pb2.Claim(namespace="ns", name="c0", uid=uid)
    done = served.call("NodePrepareResources", dra_pb2.NodePrepareResourcesRequest(claims=[real]))
    assert done.claims[uid].error == ""
    assert list(done.claims[uid].devices[0].cdi_device_ids) == [
        f"k8s.gpu.nvidia.com/claim={uid}-gpu-0"
    ]
    gone = served.call(
        "NodeUnprepareResources", dra_pb2.NodeUnprepareResourcesRequest(claims=[real])
    )
    assert gone.claims[uid].error == ""
    assert not (served.root / "cdi" / f"k8s.gpu.nvidia.com-claim_{uid}.json").exists()
    again = served.call("NodePrepareResources", dra_pb2.NodePrepareResourcesRequest(claims=[HELD]))
    assert again.claims[HELD.uid].error == "" and held.exists()
