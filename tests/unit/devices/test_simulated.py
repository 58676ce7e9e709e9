"""The simulated node: presets, node files, fault injection and live file edits."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml

from kubegpu.devices import open_backend
from kubegpu.devices.model import Health, HealthEvent, HealthEventKind, LinkKind
from kubegpu.devices.simulated import PRESET_DIR, PRESETS, SimulatedBackend, parse_node
from kubegpu.devices.stop import Stop
from kubegpu.errors import DeviceError
from tests.waiting import WAIT


def test_h100_8_preset() -> None:
    inv = SimulatedBackend.load("h100-8").discover()
    assert inv.backend == "simulated"
    assert len(inv.gpus) == 8
    assert {g.product for g in inv.gpus} == {"NVIDIA H100 80GB HBM3"}
    assert {g.memory_mib for g in inv.gpus} == {81559}
    assert {g.compute_capability for g in inv.gpus} == {(9, 0)}
    assert [g.numa_node for g in inv.gpus] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [g.device_paths for g in inv.gpus][:2] == [("/dev/nvidia0",), ("/dev/nvidia1",)]
    assert inv.control_device_paths == (
        "/dev/nvidiactl",
        "/dev/nvidia-uvm",
        "/dev/nvidia-uvm-tools",
    )
    for gpu in inv.gpus:
        assert gpu.uuid.startswith("GPU-")
        assert len(gpu.links) == 7
        assert {(link.kind, link.count) for link in gpu.links} == {(LinkKind.NVLINK, 18)}


def test_a10g_is_pcie_on_one_numa_node() -> None:
    inv = SimulatedBackend.load("a10g-4").discover()
    assert [g.product for g in inv.gpus] == ["NVIDIA A10G"] * 4
    assert {g.compute_capability for g in inv.gpus} == {(8, 6)}
    assert {g.numa_node for g in inv.gpus} == {0}
    assert {link.kind for link in inv.gpus[0].links} == {LinkKind.HOST_BRIDGE}


def test_t4() -> None:
    (gpu,) = SimulatedBackend.load("t4-1").discover().gpus
    assert (gpu.product, gpu.memory_mib, gpu.compute_capability) == ("Tesla T4", 15360, (7, 5))


def test_a100_mig_preset() -> None:
    inv = SimulatedBackend.load("a100-40gb-mig").discover()
    zero, one = inv.gpus
    assert zero.mig_enabled and zero.mig_capable
    assert [m.profile for m in zero.mig_devices] == ["1g.5gb"] * 7
    assert [m.profile for m in one.mig_devices] == ["3g.20gb", "2g.10gb", "2g.10gb"]
    mig = one.mig_devices[0]
    assert mig.uuid.startswith("MIG-") and mig.parent_uuid == one.uuid and mig.index == "1:0"
    assert mig.attributes["slices.gi"] == 3
    assert len({m.uuid for m in inv.mig_devices()}) == 10


def test_h100_mig_preset() -> None:
    (gpu,) = SimulatedBackend.load("h100-mig").discover().gpus
    assert sorted({m.profile for m in gpu.mig_devices}) == ["1g.10gb", "2g.20gb", "3g.40gb"]


def test_every_preset_file_is_named_and_every_name_has_a_file() -> None:
    assert sorted(p.stem for p in PRESET_DIR.glob("*.yaml")) == sorted(PRESETS)


@pytest.mark.parametrize("preset", PRESETS)
def test_presets_read_the_same_with_libyaml_and_pure_python(preset: str) -> None:
    # Presets are parsed by libyaml (PRESET_LOADER) where PyYAML has it; the nodes must be
    # what PyYAML's own safe loader reads from the same files.
    text = (PRESET_DIR / f"{preset}.yaml").read_text(encoding="utf-8")
    pure = SimulatedBackend(parse_node(yaml.safe_load(text), preset, "pure")).discover()
    assert SimulatedBackend.load(preset).discover() == pure


@pytest.mark.parametrize("preset", PRESETS)
def test_uuids_are_deterministic_and_distinct(preset: str) -> None:
    first = SimulatedBackend.load(preset).discover()
    second = SimulatedBackend.load(preset).discover()
    assert first == second
    assert len({g.uuid for g in first.gpus}) == len(first.gpus)


def test_presets_differ_in_uuids() -> None:
    a = SimulatedBackend.load("h100-8").discover().gpus[0].uuid
    b = SimulatedBackend.load("h100-mig").discover().gpus[0].uuid
    assert a != b


def test_factory_uses_simulated() -> None:
    assert open_backend(simulate="t4-1").name == "simulated"


def test_unknown_spec() -> None:
    with pytest.raises(DeviceError, match="neither a preset"):
        SimulatedBackend.load("nope-3")


# -- node files -------------------------------------------------------------------------


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_node_file_with_count_and_defaults(tmp_path: Path) -> None:
    node = write(
        tmp_path / "lab.yaml",
        """
interconnect: NODE
defaults: {product: NVIDIA L4, memory_mib: 23034, compute_capability: "8.9"}
gpus:
  - {count: 2, numa_node: 0}
  - {numa_node: 1, uuid: GPU-fixed}
""",
    )
    inv = SimulatedBackend.load(str(node)).discover()
    assert [g.numa_node for g in inv.gpus] == [0, 0, 1]
    assert inv.gpus[2].uuid == "GPU-fixed"
    assert inv.gpus[0].link_to(inv.gpus[1].uuid).kind is LinkKind.SAME_NUMA  # type: ignore[union-attr]
    assert inv.gpus[0].link_to("GPU-fixed").kind is LinkKind.CROSS_NUMA  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("gpus: []", "non-empty list"),
        ("gpus: [{prodcut: X}]", r"gpus\[0\]: unknown key 'prodcut'"),
        ("gpus: [{memory_mib: lots}]", r"gpus\[0\]"),
        ("gpus: [{mig: [1g.10gb]}]", "not MIG-capable"),
        ("gpus: [{mig_capable: true, mig: [9x.1gb]}]", "'9x.1gb' is not a MIG profile"),
        ("gpus: [{mig_capable: true, mig: [4g.40gb, 4g.40gb]}]", "7 compute slices"),
        ("gpus: [{}]\ninterconnect: warp", "interconnect 'warp'"),
        ("gpus: [{compute_capability: nine}]", "compute_capability"),
        ("colour: blue\ngpus: [{}]", "unknown key 'colour'"),
    ],
)
def test_bad_node_file_names_the_field(tmp_path: Path, text: str, message: str) -> None:
    node = write(tmp_path / "bad.yaml", text)
    with pytest.raises(DeviceError, match=message):
        SimulatedBackend.load(str(node))


# -- fault injection --------------------------------------------------------------------


class Watch:
    def __init__(self, backend: SimulatedBackend) -> None:
        self.events: list[HealthEvent] = []
        self._cond = threading.Condition()
        self.stop = Stop()
        self.thread = threading.Thread(target=backend.watch, args=(self.stop, self._emit))
        self.thread.start()

    def _emit(self, event: HealthEvent) -> None:
        with self._cond:
            self.events.append(event)
            self._cond.notify_all()

    def until(self, predicate: Callable[[list[HealthEvent]], bool], timeout: float = WAIT) -> None:
        with self._cond:
            assert self._cond.wait_for(lambda: predicate(self.events), timeout), self.events

    def close(self) -> None:
        self.stop.set()
        self.thread.join(WAIT)
        assert not self.thread.is_alive()


@pytest.fixture
def watched() -> Iterator[tuple[SimulatedBackend, Watch]]:
    backend = SimulatedBackend.load("a100-40gb-mig")
    watch = Watch(backend)
    try:
        yield backend, watch
    finally:
        watch.close()


def test_the_watch_is_woken_by_stop_without_a_helper_thread() -> None:
    backend = SimulatedBackend.load("t4-1")
    before = set(threading.enumerate())
    watch = Watch(backend)
    try:
        backend.inject_xid(0, 79)  # the watch is running and has handled an injection
        watch.until(lambda events: len(events) == 1)
        assert set(threading.enumerate()) - before == {watch.thread}
    finally:
        watch.close()  # joins: setting the flag alone woke the blocked watch


def test_inject_xid_by_index_and_uuid(watched: tuple[SimulatedBackend, Watch]) -> None:
    backend, watch = watched
    inv = backend.discover()
    mig = inv.gpus[1].mig_devices[0].uuid
    backend.inject_xid(0, 79)
    backend.inject_xid(mig, 94)
    watch.until(lambda events: len(events) == 2)
    assert [(e.uuid, e.kind, e.xid) for e in watch.events] == [
        (inv.gpus[0].uuid, HealthEventKind.XID, 79),
        (mig, HealthEventKind.XID, 94),
    ]


def test_fail_probe_and_heal(watched: tuple[SimulatedBackend, Watch]) -> None:
    backend, watch = watched
    inv = backend.discover()
    gpu = inv.gpus[1]
    backend.fail_probe(1, "GPU is lost")
    assert backend.probe(gpu.uuid) == "GPU is lost"
    assert backend.probe(gpu.mig_devices[0].uuid) == "GPU is lost", "a slice fails with its GPU"
    assert backend.probe(inv.gpus[0].uuid) is None
    assert backend.discover().gpus[1].health is Health.UNHEALTHY
    backend.heal(gpu.uuid)
    assert backend.probe(gpu.uuid) is None
    watch.until(lambda events: any(e.kind is HealthEventKind.HEALED for e in events))
    kinds = [(e.uuid, e.kind) for e in watch.events]
    assert kinds[0] == (gpu.uuid, HealthEventKind.PROBE_FAILED)
    assert (gpu.uuid, HealthEventKind.HEALED) in kinds


def test_set_mig_layout(watched: tuple[SimulatedBackend, Watch]) -> None:
    backend, watch = watched
    backend.set_mig_layout(0, ["7g.40gb"])
    watch.until(lambda events: len(events) == 1)
    gpu = backend.discover().gpus[0]
    assert watch.events == [HealthEvent(gpu.uuid, HealthEventKind.RECONFIGURED)]
    assert [m.profile for m in gpu.mig_devices] == ["7g.40gb"]


def test_bad_mig_layout_is_refused() -> None:
    backend = SimulatedBackend.load("t4-1")
    with pytest.raises(DeviceError, match="not MIG-capable"):
        backend.set_mig_layout(0, ["1g.5gb"])
    with pytest.raises(DeviceError, match="no GPU 3"):
        backend.inject_xid(3, 79)


def test_probe_unknown_device() -> None:
    assert "no GPU" in (SimulatedBackend.load("t4-1").probe("GPU-unknown") or "")


def test_injection_is_thread_safe(watched: tuple[SimulatedBackend, Watch]) -> None:
    backend, watch = watched

    def hammer(gpu: int) -> None:
        for _ in range(50):
            backend.inject_xid(gpu, 48)

    threads = [threading.Thread(target=hammer, args=(i % 2,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    watch.until(lambda events: len(events) == 200)


# -- live node file ---------------------------------------------------------------------


NODE = """
name: edit-me
defaults: {{product: NVIDIA A100-SXM4-40GB, memory_mib: 40960, mig_capable: true}}
gpus:
  - {{{first}}}
  - {{}}
"""


def edit(path: Path, first: str) -> None:
    path.write_text(NODE.format(first=first))
    # Make the change visible even on filesystems with coarse timestamps.
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))


def test_file_edits_inject_faults(tmp_path: Path) -> None:
    node = tmp_path / "node.yaml"
    edit(node, "")
    backend = SimulatedBackend.load(str(node))
    uuid = backend.discover().gpus[0].uuid
    watch = Watch(backend)
    try:
        edit(node, "xid: 79")
        watch.until(lambda events: len(events) == 1)
        assert watch.events[-1] == HealthEvent(uuid, HealthEventKind.XID, 79, "node file")
        edit(node, "xid: 79, healthy: false, probe_error: fell off the bus")
        watch.until(lambda events: len(events) == 2)
        assert watch.events[-1].kind is HealthEventKind.PROBE_FAILED
        assert backend.probe(uuid) == "fell off the bus"
        edit(node, "healthy: true, mig: [3g.20gb]")
        watch.until(lambda events: len(events) == 4)
        assert {e.kind for e in watch.events[2:]} == {
            HealthEventKind.HEALED,
            HealthEventKind.RECONFIGURED,
        }
        assert [m.profile for m in backend.discover().gpus[0].mig_devices] == ["3g.20gb"]
        node.write_text("gpus: [{bogus: 1}]")
        edit(node, "mig: [9g.9gb]")  # invalid edits are logged and ignored
        assert backend.probe(uuid) is None
    finally:
        watch.close()


def test_file_replaced_by_rename_injects_faults(tmp_path: Path) -> None:
    """Editors and ConfigMap-style writers replace the file: a new inode, seen by the watch."""
    node = tmp_path / "node.yaml"
    edit(node, "")
    backend = SimulatedBackend.load(str(node))
    uuid = backend.discover().gpus[0].uuid
    watch = Watch(backend)
    try:
        for xid in (79, 48):
            staged = tmp_path / ".node.yaml.swp"
            staged.write_text(NODE.format(first=f"xid: {xid}"))
            staged.rename(node)

            def arrived(events: list[HealthEvent], xid: int = xid) -> bool:
                return bool(events) and events[-1].xid == xid

            watch.until(arrived)
            assert watch.events[-1] == HealthEvent(uuid, HealthEventKind.XID, xid, "node file")
    finally:
        watch.close()


def test_file_faults_present_at_load(tmp_path: Path) -> None:
    node = tmp_path / "node.yaml"
    edit(node, "healthy: false, xid: 48")
    backend = SimulatedBackend.load(str(node))
    uuid = backend.discover().gpus[0].uuid
    assert backend.probe(uuid) == f"marked unhealthy in {node}"
    watch = Watch(backend)
    try:
        watch.until(lambda events: len(events) == 2)
        assert {e.kind for e in watch.events} == {HealthEventKind.PROBE_FAILED, HealthEventKind.XID}
    finally:
        watch.close()
