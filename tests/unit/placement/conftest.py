"""GetPreferredAllocation's choice (`kubegpu.placement`): the objective against brute force, the
search, replicas, the servicer, and properties over any valid config and node.

Shared here: random small topologies for hypothesis (`topologies`) and the `nvidia.com/gpu`
resource of a simulated preset (`preset_spec`).
"""

from __future__ import annotations

import itertools

from hypothesis import strategies as st

from kubegpu.config import parse_config
from kubegpu.devices import Gpu, Inventory, Link, LinkKind
from kubegpu.devices.simulated import SimulatedBackend
from kubegpu.placement import PCIE_WEIGHT
from kubegpu.resources import ResourceSpec, build_resources
from tests.builders import gpu, inventory

PCIE = list(PCIE_WEIGHT)


@st.composite
def topologies(draw: st.DrawFn, max_gpus: int = 8) -> Inventory:
    """Symmetric random wiring: per pair NVLink (1-18 links, version 1-5), a PCIe level or
    nothing; NUMA node 0, 1 or unknown; some GPUs with MIG slices."""
    n = draw(st.integers(1, max_gpus))
    uuids = [gpu(i).uuid for i in range(n)]
    relation: dict[tuple[int, int], Link | None] = {}
    for a, b in itertools.combinations(range(n), 2):
        kind = draw(st.sampled_from([None, LinkKind.NVLINK, *PCIE]))
        if kind is LinkKind.NVLINK:
            relation[a, b] = Link(
                "", kind, draw(st.integers(1, 18)), nvlink_version=draw(st.integers(0, 5))
            )
        elif kind is not None:
            relation[a, b] = Link("", kind)
    gpus: list[Gpu] = []
    for i in range(n):
        links = []
        for j in range(n):
            link = relation.get((min(i, j), max(i, j)))
            if i != j and link is not None:
                links.append(
                    Link(uuids[j], link.kind, link.count, nvlink_version=link.nvlink_version)
                )
        numa = draw(st.sampled_from([0, 1, None]))
        gpus.append(gpu(i, numa=numa, links=links))
    return inventory(*gpus)


def preset_spec(preset: str, config: str = "version: v1") -> ResourceSpec:
    """The `nvidia.com/gpu` resource of a simulated preset under `config`."""
    inv = SimulatedBackend.load(preset).discover()
    return next(s for s in build_resources(inv, parse_config(config)) if s.name.endswith("gpu"))
