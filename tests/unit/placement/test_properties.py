"""Properties over any valid config and node: IDs unique, replicas real, answers exact."""

from __future__ import annotations

from typing import Any

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kubegpu.allocation import build_response, validate_request
from kubegpu.config import AllocationPolicy, Config, build_config
from kubegpu.devices import Inventory
from kubegpu.errors import ConfigError
from kubegpu.placement import preferred_allocation
from kubegpu.resources import build_resources
from tests.builders import gpu, inventory

PROFILES = ["1g.10gb", "2g.20gb", "3g.40gb"]


@st.composite
def nodes(draw: st.DrawFn) -> Inventory:
    count = draw(st.integers(1, 8))
    gpus = []
    for i in range(count):
        migs = draw(
            st.one_of(st.just([]), st.lists(st.sampled_from(PROFILES), min_size=1, max_size=4))
        )
        product = draw(st.sampled_from(["NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-40GB"]))
        gpus.append(gpu(i, numa=draw(st.sampled_from([None, 0, 1])), migs=migs, product=product))
    return inventory(*gpus)


@st.composite
def configs(draw: st.DrawFn, node: Inventory) -> Config:
    raw: dict[str, Any] = {
        "version": "v1",
        "flags": {
            "migStrategy": draw(st.sampled_from(["none", "single", "mixed"])),
            "plugin": {"deviceIDStrategy": draw(st.sampled_from(["uuid", "index"]))},
        },
    }
    if draw(st.booleans()):
        raw["resources"] = {"gpus": [{"pattern": "*A100*", "name": "a100"}]}
    if draw(st.booleans()):
        devices: Any = draw(
            st.one_of(
                st.just("all"),
                st.integers(1, len(node.gpus)),
                st.lists(st.integers(0, len(node.gpus) - 1), min_size=1, unique=True),
            )
        )
        entry: dict[str, Any] = {
            "name": "nvidia.com/gpu",
            "replicas": draw(st.integers(2, 12)),
            "devices": devices,
        }
        raw["sharing"] = {
            "timeSlicing": {
                "renameByDefault": draw(st.booleans()),
                "failRequestsGreaterThanOne": draw(st.booleans()),
                "resources": [entry],
            }
        }
    return build_config(raw, {}, source="test")


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_ids_unique_replicas_real_and_allocate_exact(data: st.DataObject) -> None:
    node = data.draw(nodes())
    config = data.draw(configs(node))
    try:
        specs = build_resources(node, config)
    except ConfigError:
        assume(False)  # a config that can't apply to this node is refused, not served
        return
    real = {g.uuid for g in node.gpus} | {m.uuid for g in node.gpus for m in g.mig_devices}
    all_ids = [d.id for s in specs for d in s.devices]
    assert len(all_ids) == len(set(all_ids))
    assert all(len(i) <= 63 for i in all_ids)
    for spec in specs:
        for d in spec.devices:
            assert d.unit.uuid in real
            assert d.id.split("::")[0] == d.unit.uuid
        if not spec.devices:
            continue
        ids = [d.id for d in spec.devices]
        wanted = data.draw(
            st.lists(st.sampled_from(ids), min_size=1, max_size=len(ids), unique=True)
        )
        if spec.fail_requests_greater_than_one and len(wanted) > 1:
            continue
        edits = build_response(spec, validate_request(spec, wanted), config, response_id="x")
        named = edits.envs["NVIDIA_VISIBLE_DEVICES"].split(",")
        requested = {spec.by_id[i].unit for i in wanted}
        expected = {
            u.index if config.flags.plugin.device_id_strategy == "index" else u.uuid
            for u in requested
        }
        assert set(named) == expected


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_preferred_allocation_is_always_a_valid_hint(data: st.DataObject) -> None:
    node = data.draw(nodes())
    config = data.draw(configs(node))
    try:
        specs = build_resources(node, config)
    except ConfigError:
        assume(False)
        return
    assume(specs)
    spec = data.draw(st.sampled_from(specs))
    ids = [d.id for d in spec.devices]
    available = data.draw(st.lists(st.sampled_from(ids), min_size=1, unique=True))
    must = data.draw(st.lists(st.sampled_from(available), unique=True, max_size=len(available)))
    size = data.draw(st.integers(max(1, len(must)), len(available)))
    policy = data.draw(st.sampled_from(list(AllocationPolicy)))
    got = preferred_allocation(spec, available, must, size, policy)
    assert len(got) == size == len(set(got))
    assert set(got) <= set(available)
    assert got[: len(must)] == must
