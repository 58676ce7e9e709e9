"""The placement state of a resource (`kubegpu.placement.Fabric`): built with its spec, never
by a request, its matrices the pair functions, its twin classes truly interchangeable."""

from __future__ import annotations

import importlib
import itertools

import pytest
from hypothesis import given, settings

from kubegpu.config import parse_config
from kubegpu.devices import Health, Inventory
from kubegpu.devices.simulated import SimulatedBackend
from kubegpu.placement import link_weight, numa_term
from kubegpu.resources import build_resources
from tests.unit.placement.conftest import preset_spec, topologies


@pytest.mark.parametrize("preset", ["dgx1-v100", "hgx-h100-2x8", "a10g-4", "a100-40gb-mig"])
def test_matrices_are_the_pair_functions(preset: str) -> None:
    spec = preset_spec(preset)
    fabric = spec.placement
    for a, b in itertools.product(spec.devices, repeat=2):
        i, j = fabric.row[a.id], fabric.row[b.id]
        assert fabric.link[i][j] == link_weight(a.unit, b.unit)
        assert fabric.numa[i][j] == numa_term(a.unit, b.unit)


def test_the_state_is_built_with_the_spec_not_by_a_request() -> None:
    """Set when the spec is made (not a lazy attribute filled by the first request), and
    made anew with every spec: a health flip or reload is seen by the next request."""
    inv = SimulatedBackend.load("h100-8").discover()
    config = parse_config("version: v1")
    (spec,) = build_resources(inv, config)
    assert "placement" in vars(spec)
    sick = inv.with_health({inv.gpus[0].uuid: Health.UNHEALTHY})
    (flipped,) = build_resources(sick, config)
    assert flipped.placement is not spec.placement
    # The unhealthy GPU now ranks last.
    assert max(flipped.placement.rank, key=flipped.placement.rank.__getitem__) == inv.gpus[0].uuid


def test_placement_keeps_no_module_level_state() -> None:
    """No cache beside the spec: the package's modules hold constants only (upper-case
    names), so nothing grows with the specs a long-running plugin goes through."""
    for name in ("", ".amd", ".objective", ".replicas", ".search"):
        module = importlib.import_module(f"kubegpu.placement{name}")
        mutable = [
            key
            for key, value in vars(module).items()
            if isinstance(value, dict | list | set) and not key.isupper() and key[:2] != "__"
        ]
        assert mutable == [], module.__name__


@pytest.mark.parametrize(
    ("preset", "classes"),
    [
        ("hgx-h100-2x8", [0] * 8 + [1] * 8),  # two boards, each its own NUMA node
        ("h100-8", [0] * 4 + [1] * 4),  # one NVSwitch domain over two sockets
        ("dgx1-v100", list(range(8))),  # a cube mesh: no two GPUs alike
    ],
)
def test_twin_classes_of_the_presets(preset: str, classes: list[int]) -> None:
    assert list(preset_spec(preset).placement.twins) == classes


@settings(max_examples=100, deadline=None)
@given(inv=topologies())
def test_twins_weigh_the_same_to_everyone_else(inv: Inventory) -> None:
    (spec,) = build_resources(inv, parse_config("version: v1"))
    fabric = spec.placement
    units = [d.unit for d in spec.devices]
    for (i, a), (j, b) in itertools.combinations(enumerate(units), 2):
        alike = all(
            link_weight(a, c) == link_weight(b, c) and numa_term(a, c) == numa_term(b, c)
            for k, c in enumerate(units)
            if k not in (i, j)
        )
        assert (fabric.twins[i] == fabric.twins[j]) == alike
