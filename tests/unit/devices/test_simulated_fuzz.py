"""The simulated node file is a parser of user input too: any bytes give a node or one line.

`--simulate FILE` and the file a running node re-reads when it is edited must never crash
the process or eat its memory, whatever the file says.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kubegpu.devices.simulated import MAX_GPUS, NodeSpec, SimulatedBackend, parse_node
from kubegpu.errors import DeviceError

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**30), max_value=10**30),
    st.floats(allow_nan=True),
    st.text(max_size=20),
    st.sampled_from(["9.0", "1g.10gb", "nvlink", "PIX", "1e999", "0x10", "-1", "∞"]),
)
keys = st.sampled_from(
    ["name", "gpus", "defaults", "interconnect", "nvlinks", "cuda_version", "driver_version",
     "product", "memory_mib", "compute_capability", "count", "mig", "mig_capable", "numa_node",
     "healthy", "xid", "uuid", "bogus", "links_down", "nvswitch", "nvswitch_links",
     "pcie_switch", "pcie_host_bridge", "nvlink_version"]
)  # fmt: skip
trees = st.recursive(
    scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(st.one_of(keys, st.integers()), children, max_size=5),
    ),
    max_leaves=30,
)


def one_line_or_node(call: Any) -> None:
    try:
        result = call()
    except DeviceError as err:
        assert "\n" not in str(err) and str(err)
        return
    spec = result if isinstance(result, NodeSpec) else None
    if spec is not None:
        assert 1 <= len(spec.gpus) <= MAX_GPUS


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(keys, trees, max_size=6))
def test_any_tree_is_a_node_or_one_device_error(data: dict[str, Any]) -> None:
    one_line_or_node(lambda: parse_node(data, "fuzz", "fuzz.yaml"))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.dictionaries(keys, trees, max_size=6), min_size=1, max_size=3))
def test_any_gpu_list_is_a_node_or_one_device_error(gpus: list[dict[str, Any]]) -> None:
    one_line_or_node(lambda: parse_node({"gpus": gpus}, "fuzz", "fuzz.yaml"))


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.binary(max_size=300))
def test_any_bytes_in_a_node_file_load_or_give_one_line(tmp_path: Path, raw: bytes) -> None:
    path = tmp_path / "node.yaml"
    path.write_bytes(raw)
    one_line_or_node(lambda: SimulatedBackend.load(str(path)))


BAD_FILES = {
    "a billion GPUs": "gpus: [{product: X, memory_mib: 1024, count: 1000000000}]",
    "4,301-digit memory": "gpus: [{product: X, memory_mib: " + "9" * 4301 + "}]",
    "nesting 3,000 deep": "gpus: " + "[" * 3000 + "]" * 3000,
    "alias bomb in a text field": (
        "a: &a [x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]\n"
        "c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b]\nd: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c]\n"
        "gpus: [{product: *d, memory_mib: 1024}]"
    ),
    "mapping keys of mixed types": "gpus: [{product: X}]\n1: 2\nbogus: 3",
    "non-UTF-8": b"gpus: [{product: \xff}]",
    "lone surrogate escape": 'gpus: [{product: "\\ud800", memory_mib: 1024}]',
    "nvlinks not a number": "nvlinks: many\ngpus: [{product: X, memory_mib: 1024}]",
    "version as a mapping": "cuda_version: {12: 4}\ngpus: [{product: X, memory_mib: 1024}]",
}


@pytest.mark.parametrize("text", BAD_FILES.values(), ids=BAD_FILES.keys())
def test_known_bad_node_files_are_one_line_errors(tmp_path: Path, text: str | bytes) -> None:
    path = tmp_path / "node.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode("utf-8", "surrogatepass"))
    with pytest.raises(DeviceError) as caught:
        SimulatedBackend.load(str(path))
    assert "\n" not in str(caught.value)
    assert str(path) in str(caught.value)


def test_an_oversized_file_is_refused_before_it_is_parsed(tmp_path: Path) -> None:
    path = tmp_path / "node.yaml"
    path.write_text("gpus:\n" + "  - {product: X, memory_mib: 1024}\n" * 40000)
    with pytest.raises(DeviceError, match="larger than"):
        SimulatedBackend.load(str(path))
