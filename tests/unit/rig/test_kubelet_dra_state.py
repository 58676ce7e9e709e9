"""The kubelet emulator's DRA checkpoint and service choice, without sockets.

`dra_manager_state` is written in the kubelet's own layout (pkg/kubelet/cm/dra/checkpoint):
a JSON object whose `Data` is the JSON of the claim list as Go's encoding/json writes it,
and whose `Checksum` is the CRC-32 (IEEE) of `Data`.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import pytest

from kubegpu.kubelet import CheckpointError
from tests.rig.dra.plugins import validate_services
from tests.rig.dra.state import ClaimInfo, ClaimInfoCache, PreparedDevice, decode, encode

#: A checkpoint as the kubelet writes it: one claim used by two pods, one device.
KUBELET_WRITTEN_DATA = (
    '{"kind":"DRACheckpoint","apiVersion":"checkpoint.dra.kubelet.k8s.io/v1","Entries":'
    '[{"ClaimUID":"c-uid","ClaimName":"gpu","Namespace":"ml","PodUIDs":{"p1":{},"p2":{}},'
    '"DriverState":{"gpu.nvidia.com":{"Devices":[{"PoolName":"node-1","DeviceName":"gpu-0",'
    '"ShareID":null,"RequestNames":["r"],"CDIDeviceIDs":["k8s.gpu.nvidia.com/claim=c-uid"]}]}}}]}'
)


def claim() -> ClaimInfo:
    return ClaimInfo(
        claim_uid="c-uid",
        claim_name="gpu",
        namespace="ml",
        pod_uids={"p2", "p1"},
        driver_state={
            "gpu.nvidia.com": [
                PreparedDevice("node-1", "gpu-0", ("r",), ("k8s.gpu.nvidia.com/claim=c-uid",))
            ]
        },
    )


def test_the_file_is_the_kubelets_layout() -> None:
    doc = json.loads(encode([claim()]))
    assert doc["Data"] == KUBELET_WRITTEN_DATA
    assert doc["Checksum"] == zlib.crc32(KUBELET_WRITTEN_DATA.encode())


def test_a_kubelet_written_checkpoint_reads_back_unprepared() -> None:
    text = json.dumps(
        {"Data": KUBELET_WRITTEN_DATA, "Checksum": zlib.crc32(KUBELET_WRITTEN_DATA.encode())}
    )
    [restored] = decode(text)
    assert restored == claim()
    assert not restored.prepared
    assert restored.cdi_devices("r") == ["k8s.gpu.nvidia.com/claim=c-uid"]
    assert restored.cdi_devices("other") == []


def test_a_changed_checkpoint_is_refused(tmp_path: Path) -> None:
    text = encode([claim()]).replace("gpu-0", "gpu-1")
    with pytest.raises(CheckpointError, match="DRA checkpoint is corrupted: checksum"):
        decode(text)
    with pytest.raises(CheckpointError, match="corrupted"):
        decode("{not json")


def test_the_cache_creates_an_empty_checkpoint_and_syncs(tmp_path: Path) -> None:
    cache = ClaimInfoCache(tmp_path)
    cache.load()
    assert json.loads(json.loads(cache.path.read_text())["Data"])["Entries"] == []
    cache.add(claim())
    cache.sync()
    again = ClaimInfoCache(tmp_path)
    again.load()
    assert [c.key for c in again] == [("ml", "gpu")]


@pytest.mark.parametrize(
    ("listed", "chosen"),
    [
        (["v1.DRAPlugin", "v1beta1.DRAPlugin"], "v1.DRAPlugin"),
        (["v1beta1.DRAPlugin", "v1.DRAPlugin"], "v1beta1.DRAPlugin"),
        (["v2.DRAPlugin", "v1beta1.DRAPlugin"], "v1beta1.DRAPlugin"),
    ],
)
def test_the_first_service_the_kubelet_knows_is_chosen(listed: list[str], chosen: str) -> None:
    assert validate_services("d", "/e", listed) == (chosen, None)


def test_unknown_services_are_refused_with_the_kubelets_text() -> None:
    assert validate_services("d", "/e", ["1.0.0"]) == (
        "",
        "invalid supported gRPC versions of DRA driver plugin d at endpoint /e: none of "
        'services supported by the plugin (["1.0.0"]) are supported by the kubelet '
        '(["v1.DRAPlugin" "v1beta1.DRAPlugin"])',
    )
