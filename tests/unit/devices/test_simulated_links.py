"""The simulated node's fabric: per-GPU NVLink wiring, NVSwitch domains, links down, PCIe
switches and NUMA, and the presets that use them (docs/simulated-node.md)."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from kubegpu.config import parse_config
from kubegpu.devices import Inventory, LinkKind
from kubegpu.devices.simulated import SimulatedBackend, parse_node
from kubegpu.errors import DeviceError
from kubegpu.placement import preferred_allocation
from kubegpu.resources import build_resources


def node(text: str) -> Inventory:
    return SimulatedBackend(parse_node(yaml.safe_load(text), "t", "t.yaml")).discover()


def relation(inv: Inventory, a: int, b: int) -> tuple[str, int]:
    link = inv.gpus[a].link_to(inv.gpus[b].uuid)
    assert link is not None
    return str(link.kind), link.count


def place(inv: Inventory, size: int) -> list[int]:
    (spec,) = build_resources(inv, parse_config("version: v1"))
    got = preferred_allocation(spec, [d.id for d in spec.devices], [], size)
    return sorted(spec.by_id[i].unit.gpu.index for i in got)


def test_wiring_counts_per_peer_either_side_declares() -> None:
    inv = node(
        """
gpus:
  - {nvlinks: {1: 2, 2: 1}, numa_node: 0}
  - {numa_node: 0}
  - {nvlinks: {0: 1}, numa_node: 1}
  - {numa_node: 1, pcie_switch: 3}
"""
    )
    assert relation(inv, 0, 1) == relation(inv, 1, 0) == ("NV", 2)
    assert relation(inv, 2, 0) == ("NV", 1)
    assert relation(inv, 1, 2)[0] == "SYS"
    assert inv.gpus[0].links[0].nvlink_version == 4  # H100 default: NVLink 4


def test_links_down_and_nvswitch_domains() -> None:
    inv = node(
        """
defaults: {nvswitch_links: 18}
gpus:
  - {nvswitch: a, links_down: {nvswitch: 4}}
  - {nvswitch: a}
  - {nvswitch: b}
  - {nvswitch: b, nvlinks: {0: 2}, links_down: {0: 1}}
"""
    )
    assert relation(inv, 0, 1) == ("NV", 14)
    assert relation(inv, 2, 3) == ("NV", 18)
    assert relation(inv, 0, 3) == ("NV", 1)
    assert relation(inv, 1, 2)[0] == "PHB"  # different domains: the node's PCIe relation
    assert place(inv, 2) == [2, 3]


def test_pcie_switches_and_host_bridges() -> None:
    inv = node(
        """
interconnect: PHB
gpus:
  - {pcie_switch: 0, pcie_host_bridge: 0}
  - {pcie_switch: 0, pcie_host_bridge: 0}
  - {pcie_switch: 1, pcie_host_bridge: 0}
  - {pcie_switch: 2, pcie_host_bridge: 1}
"""
    )
    assert relation(inv, 0, 1)[0] == LinkKind.SINGLE_SWITCH
    assert relation(inv, 0, 2)[0] == LinkKind.HOST_BRIDGE
    assert relation(inv, 0, 3)[0] == LinkKind.SAME_NUMA
    assert place(inv, 2) == [0, 1]


def test_dgx1_preset_wiring_and_placement() -> None:
    inv = SimulatedBackend.load("dgx1-v100").discover()
    lanes = [sum(link.count for link in g.links if link.kind is LinkKind.NVLINK) for g in inv.gpus]
    assert lanes == [6] * 8  # six NVLinks per V100
    versions = {x.nvlink_version for g in inv.gpus for x in g.links if x.kind is LinkKind.NVLINK}
    assert versions == {2}
    # Four GPUs: a fully NVLinked quad of one socket (0-3 or 4-7) carries the most.
    assert place(inv, 4) in ([0, 1, 2, 3], [4, 5, 6, 7])


def test_two_board_preset_keeps_pods_on_one_board() -> None:
    inv = SimulatedBackend.load("hgx-h100-2x8").discover()
    assert relation(inv, 0, 7) == ("NV", 18)
    assert relation(inv, 0, 8)[0] == "SYS"
    for size in (2, 4, 8):
        assert len({g // 8 for g in place(inv, size)}) == 1


@pytest.mark.parametrize(
    ("gpus", "message"),
    [
        ([{"nvlinks": {0: 1}}], "peer 0 is not another GPU"),
        ([{"nvlinks": {5: 1}}, {}], "peer 5 is not another GPU"),
        ([{"nvlinks": [1, 2]}, {}], "expected a mapping of peer GPU index"),
        ([{"nvlinks": {1: 99}}, {}], "lanes: expected a whole number from 0 to 64"),
        ([{"links_down": {"switch": 1}}, {}], "links_down key.peer"),
        ([{"pcie_switch": "x"}], "pcie_switch"),
    ],
)
def test_bad_wiring_is_one_clear_error(gpus: list[dict[str, Any]], message: str) -> None:
    with pytest.raises(DeviceError, match=message) as err:
        parse_node({"gpus": gpus}, "t", "t.yaml")
    assert "\n" not in str(err.value)
