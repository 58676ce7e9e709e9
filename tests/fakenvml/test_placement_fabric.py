"""NVLink fabrics through real NVML (../shared/fakenvml): which GPUs really share NVLink.

Two NVSwitch boards in one node (2 x 8 H100) must not look NVLinked across the boards; GPUs
in different fabric cliques neither; links that are down do not count. Each machine is
described by a fakenvml JSON config written here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kubegpu.devices.simulated import SimulatedBackend
from tests.fakenvml.conftest import FAKENVML, Probe
from tests.fakenvml.probe import links_and_placement

H100 = {"name": "NVIDIA H100 80GB HBM3", "memory_total": "80GiB", "compute_capability": "9.0"}


def _switch(board: int, n: int) -> str:
    return f"0000:{0xA0 + 0x10 * board + n:02x}:00.0"


def two_boards(down: dict[int, int] | None = None) -> dict[str, Any]:
    """2 x 8 H100, each board with its own 4 NVSwitches; GPUs 0-7 on NUMA 0, 8-15 on 1.
    `down` maps a GPU index to how many of its 18 links are down."""
    down = down or {}
    gpus = []
    for i in range(16):
        board = i // 8
        peers = [p for p in range(8 * board, 8 * board + 8) if p != i]
        links: list[Any] = [
            {"peers": peers, "remote_pci_bus_id": _switch(board, link % 4)} for link in range(18)
        ]
        for link in range(down.get(i, 0)):
            links[link] = None
        gpus.append(
            {
                **H100,
                "pci_bus_id": f"0000:{0x10 + 3 * i:02x}:00.0",
                "numa_node": board,
                "pcie_host_bridge": i // 4,
                "nvlinks": links,
            }
        )
    return {"nvswitches": [_switch(b, n) for b in (0, 1) for n in range(4)], "gpus": gpus}


def test_two_nvswitch_boards_are_not_nvlinked_to_each_other(probe: Probe) -> None:
    result = probe(two_boards(), "place", "2", "8", "9")
    for i, links in enumerate(result["links"]):
        for peer, (kind, lanes, version) in links.items():
            same_board = int(peer) // 8 == i // 8
            assert (kind == "NV") == same_board, (i, peer, kind)
            if same_board:
                assert (lanes, version) == (18, 4)
    place = result["place"]
    assert len({g // 8 for g in place["2"]}) == 1
    assert place["8"] in (list(range(8)), list(range(8, 16)))
    # Nine GPUs: eight of one board and one more, never split 4 + 5.
    assert sorted(sum(1 for g in place["9"] if g // 8 == b) for b in (0, 1)) == [1, 8]


def test_links_that_are_down_do_not_count(probe: Probe) -> None:
    result = probe(two_boards(down={0: 6}), "place", "2")
    assert result["links"][0]["1"][:2] == ["NV", 12]
    assert result["links"][1]["0"][:2] == ["NV", 12]
    assert result["links"][1]["2"][:2] == ["NV", 18]
    # The pair with GPU 0 carries less: a 2-GPU pod gets a full-bandwidth pair.
    assert 0 not in result["place"]["2"]


def test_fabric_cliques_split_one_switch_domain(probe: Probe) -> None:
    """Sixteen GPUs all wired to the same NVSwitches, but the fabric manager put them in two
    cliques: NVLink only within a clique."""
    gpus = [
        {
            **H100,
            "pci_bus_id": f"0000:{0x10 + 3 * i:02x}:00.0",
            "numa_node": 0,
            "nvlinks": {"count": 18, "peers": "all"},
            "fabric": {
                "cluster_uuid": "6a3f1e2c-0000-4000-8000-00000000c11e",
                "clique_id": 1 + i // 8,
                "state": "completed",
            },
        }
        for i in range(16)
    ]
    result = probe({"gpus": gpus}, "place", "4")
    for i, links in enumerate(result["links"]):
        nv = {int(p) for p, (kind, _, _) in links.items() if kind == "NV"}
        assert nv == set(range(8 * (i // 8), 8 * (i // 8) + 8)) - {i}
    assert len({g // 8 for g in result["place"]["4"]}) == 1


EXAMPLES = FAKENVML / "examples"


def _simulated(preset: str, sizes: list[int]) -> dict[str, Any]:
    """What probe.py's `place` prints, for a simulated-node preset instead of NVML."""
    return links_and_placement(SimulatedBackend.load(preset).discover(), sizes)


@pytest.mark.parametrize(
    ("preset", "machine"),
    [
        ("dgx1-v100", EXAMPLES / "v100x8-dgx1.json"),
        ("hgx-h100", EXAMPLES / "h100x8.json"),
        ("hgx-h100-2x8", None),
    ],
)
def test_simulated_node_and_simulated_nvml_place_alike(
    probe: Probe, preset: str, machine: Path | None
) -> None:
    """The same machine described twice, as a simulated-node preset and as a fakenvml config
    read through real NVML: the same links, and the same GPUs for every request size."""
    config: dict[str, Any] | Path = two_boards() if machine is None else machine
    n = len(SimulatedBackend.load(preset).discover().gpus)
    sizes = [str(s) for s in range(1, n + 1)]
    assert probe(config, "place", *sizes) == _simulated(preset, list(range(1, n + 1)))


def test_p2p_status_overrides_a_shared_switch(probe: Probe) -> None:
    """Four GPUs whose links all report the same NVSwitch, but NVML's NVLink P2P status
    says only 0-1 and 2-3 can talk (a partitioned fabric): NVLink only for those pairs."""
    gpus = []
    for i in range(4):
        peers = [p for p in ((0, 1) if i < 2 else (2, 3)) if p != i]
        links = [{"peers": peers, "remote_pci_bus_id": _switch(0, 0)} for _ in range(4)]
        gpus.append({**H100, "numa_node": 0, "nvlinks": links})
    result = probe({"gpus": gpus}, "place", "2")
    for i, links in enumerate(result["links"]):
        nv = {int(p) for p, (kind, _, _) in links.items() if kind == "NV"}
        assert nv == ({0, 1} if i < 2 else {2, 3}) - {i}
