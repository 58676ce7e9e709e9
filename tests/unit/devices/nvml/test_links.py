"""NVLink, NVSwitch and PCIe links from NVML (devices/nvml/links.py) against the fake pynvml."""

from __future__ import annotations

import pynvml
import pytest

from kubegpu.devices.model import LinkKind
from kubegpu.testing import FakeNvml
from tests.unit.devices.nvml.conftest import open_backend as _open


def test_direct_nvlinks_counted_per_peer() -> None:
    fake = FakeNvml()
    for _ in range(3):
        fake.add_gpu()
    fake.connect_nvlink(0, 1, links=4)
    fake.connect_nvlink(0, 2, links=2)
    fake.topology[frozenset((1, 2))] = pynvml.NVML_TOPOLOGY_SINGLE
    gpus = _open(fake).discover().gpus
    zero = gpus[0]
    assert zero.link_to(gpus[1].uuid) is not None
    assert [(link.kind, link.count) for link in zero.links] == [
        (LinkKind.NVLINK, 4),
        (LinkKind.NVLINK, 2),
    ]
    link = gpus[1].link_to(gpus[2].uuid)
    assert link is not None and link.kind is LinkKind.SINGLE_SWITCH


def test_nvswitch_connects_every_pair() -> None:
    fake = FakeNvml()
    for _ in range(4):
        fake.add_gpu()
    fake.connect_nvswitch(links=18)
    gpus = _open(fake).discover().gpus
    for gpu in gpus:
        assert len(gpu.links) == 3
        assert {(link.kind, link.count) for link in gpu.links} == {(LinkKind.NVLINK, 18)}


@pytest.mark.parametrize(
    ("level", "kind"),
    [
        (pynvml.NVML_TOPOLOGY_SINGLE, LinkKind.SINGLE_SWITCH),
        (pynvml.NVML_TOPOLOGY_MULTIPLE, LinkKind.MULTI_SWITCH),
        (pynvml.NVML_TOPOLOGY_HOSTBRIDGE, LinkKind.HOST_BRIDGE),
        (pynvml.NVML_TOPOLOGY_NODE, LinkKind.SAME_NUMA),
        (pynvml.NVML_TOPOLOGY_SYSTEM, LinkKind.CROSS_NUMA),
    ],
)
def test_pcie_relation(fake: FakeNvml, level: int, kind: LinkKind) -> None:
    fake.topology[frozenset((0, 1))] = level
    gpus = _open(fake).discover().gpus
    assert [(link.peer_uuid, link.kind) for link in gpus[0].links] == [(gpus[1].uuid, kind)]


def test_topology_failure_leaves_link_out(fake: FakeNvml) -> None:
    fake.fail("nvmlDeviceGetTopologyCommonAncestor", pynvml.NVML_ERROR_NOT_SUPPORTED)
    assert _open(fake).discover().gpus[0].links == ()
