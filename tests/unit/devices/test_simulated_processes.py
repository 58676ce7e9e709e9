"""The simulated node's process table: from the node file, started and stopped at run time."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from kubegpu.devices import ProcessKind
from kubegpu.devices.simulated import SimulatedBackend, parse_node
from kubegpu.errors import DeviceError

MIB = 1024 * 1024

NODE = {
    "gpus": [
        {"processes": [{"pid": 10, "memory_mib": 100, "sm_util": 50, "mem_util": 5}]},
        {
            "mig_capable": True,
            "mig": ["3g.40gb", "1g.10gb"],
            "processes": [{"pid": 11, "memory_mib": 10, "type": "mps", "mig": 1}],
        },
    ]
}


def test_processes_from_the_node_file() -> None:
    backend = SimulatedBackend(parse_node(NODE, "n", "n"))
    inventory = backend.discover()
    table = backend.processes()
    whole, on_slice = table.processes
    assert (whole.pid, whole.uuid) == (10, inventory.gpus[0].uuid)
    assert whole.used_memory_bytes == 100 * MIB
    assert (whole.sm_percent, whole.memory_percent) == (50, 5)
    small = inventory.gpus[1].mig_devices[1]
    assert (on_slice.pid, on_slice.uuid, on_slice.kinds) == (11, small.uuid, (ProcessKind.MPS,))
    assert (on_slice.gpu_instance_id, on_slice.compute_instance_id) == (small.gi_id, small.ci_id)
    assert on_slice.sm_percent is None  # as NVML: no per-process samples on MIG


def test_start_and_stop_processes() -> None:
    backend = SimulatedBackend(parse_node(NODE, "n", "n"))
    backend.start_process(0, 20, 300, kind="compute+graphics", sm_util=7)
    backend.start_process(1, 21, 5, mig=0)
    started = {p.pid: p for p in backend.processes().processes}
    assert started[20].kinds == (ProcessKind.COMPUTE, ProcessKind.GRAPHICS)
    assert started[21].uuid == backend.discover().gpus[1].mig_devices[0].uuid
    backend.stop_process(10)
    backend.stop_process(21)
    assert sorted(p.pid for p in backend.processes().processes) == [11, 20]


def test_a_process_on_a_slice_that_is_gone_is_not_reported() -> None:
    backend = SimulatedBackend(parse_node(NODE, "n", "n"))
    backend.set_mig_layout(1, ["3g.40gb"])
    assert [p.pid for p in backend.processes().processes] == [10]


def test_editing_the_node_file_changes_the_processes_without_rediscovery(
    tmp_path: Path,
) -> None:
    path = tmp_path / "node.yaml"
    path.write_text(yaml.safe_dump(NODE))
    backend = SimulatedBackend.load(str(path))
    edited = {"gpus": [{"processes": [{"pid": 30}]}, NODE["gpus"][1]]}
    path.write_text(yaml.safe_dump(edited))
    backend._reload_if_changed()
    assert sorted(p.pid for p in backend.processes().processes) == [11, 30]


@pytest.mark.parametrize(
    ("processes", "message"),
    [
        ([{"memory_mib": 1}], "expected a mapping with a pid"),
        ([{"pid": 0}], "pid: expected a whole number from 1"),
        ([{"pid": 1, "sm_util": 101}], "sm_util: expected a whole number from 0 to 100"),
        ([{"pid": 1, "type": "cuda"}], "'cuda' is not one of compute"),
        ([{"pid": 1, "colour": 1}], "unknown key 'colour'"),
        ({"pid": 1}, "expected a list of at most 512 processes"),
    ],
)
def test_bad_processes_name_the_field(processes: object, message: str) -> None:
    with pytest.raises(DeviceError, match=message):
        parse_node({"gpus": [{"processes": processes}]}, "n", "n")
