"""NvmlBackend against the fake pynvml module in kubegpu.testing."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pynvml
import pytest

from kubegpu.devices.model import Health, HealthEvent, HealthEventKind, LinkKind
from kubegpu.devices.nvml import (
    NvmlBackend,
    cuda_version,
    mig_profile_name,
    normalize_bus_id,
)
from kubegpu.errors import InitError
from kubegpu.testing import FakeNvml


def _open(fake: FakeNvml, **kwargs: object) -> NvmlBackend:
    kwargs.setdefault("exists", lambda path: True)
    kwargs.setdefault("wait_timeout_ms", 20)
    return NvmlBackend.open(nvml=fake, **kwargs)  # type: ignore[arg-type]


@pytest.fixture
def fake() -> FakeNvml:
    nvml = FakeNvml()
    for i in range(2):
        nvml.add_gpu(numa_node=i)
    return nvml


# -- pure helpers -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (b"00000000:17:00.0", "0000:17:00.0"),
        ("00000001:AB:00.0", "0001:ab:00.0"),
        ("0000:3B:00.0\x00", "0000:3b:00.0"),
        ("garbage", "garbage"),
    ],
)
def test_normalize_bus_id(raw: bytes | str, expected: str) -> None:
    assert normalize_bus_id(raw) == expected


def test_cuda_version() -> None:
    assert cuda_version(12040) == (12, 4)
    assert cuda_version(11080) == (11, 8)


@pytest.mark.parametrize(
    ("gi", "ci", "memory", "total", "suffix", "name"),
    [
        (1, 1, 4864, 40960, "", "1g.5gb"),
        (3, 3, 19968, 40960, "", "3g.20gb"),
        (4, 4, 19968, 40960, "", "4g.20gb"),
        (7, 7, 40192, 40960, "", "7g.40gb"),
        (1, 1, 9856, 81559, "", "1g.10gb"),
        (3, 3, 40192, 81559, "", "3g.40gb"),
        (3, 1, 40192, 81559, "", "1c.3g.40gb"),
        (1, 1, 9856, 81559, "+me", "1g.10gb+me"),
    ],
)
def test_mig_profile_names_match_nvidia(
    gi: int, ci: int, memory: int, total: int, suffix: str, name: str
) -> None:
    assert mig_profile_name(gi, ci, memory, total, suffix) == name


# -- open -----------------------------------------------------------------------------------


def test_open_translates_missing_library() -> None:
    fake = FakeNvml()
    fake.init_error = pynvml.NVML_ERROR_LIBRARY_NOT_FOUND
    with pytest.raises(
        InitError, match=r"libnvidia-ml.so.1 not found under /: .*NVIDIA_DRIVER_ROOT"
    ):
        _open(fake)


def test_open_translates_driver_not_loaded() -> None:
    fake = FakeNvml()
    fake.init_error = pynvml.NVML_ERROR_DRIVER_NOT_LOADED
    with pytest.raises(InitError, match="driver is not loaded"):
        _open(fake)


def test_open_with_zero_gpus_fails_and_shuts_down() -> None:
    fake = FakeNvml()
    with pytest.raises(InitError, match="no GPUs"):
        _open(fake)
    assert fake.shutdowns == 1


def test_driver_root_without_library(tmp_path: Path, fake: FakeNvml) -> None:
    with pytest.raises(InitError, match=f"not found under {tmp_path}"):
        _open(fake, driver_root=str(tmp_path))


def test_driver_root_loads_library_from_root(tmp_path: Path, fake: FakeNvml) -> None:
    lib = tmp_path / "usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1"
    lib.parent.mkdir(parents=True)
    lib.write_bytes(b"")
    loaded: list[str] = []

    def load(path: str) -> object:
        loaded.append(path)
        return object()

    backend = _open(fake, driver_root=str(tmp_path), load_library=load)
    assert loaded == [str(lib)]
    assert fake.nvmlLib is not None
    backend.close()


def test_driver_root_unloadable_library(tmp_path: Path, fake: FakeNvml) -> None:
    lib = tmp_path / "usr/lib64/libnvidia-ml.so.1"
    lib.parent.mkdir(parents=True)
    lib.write_bytes(b"not an ELF file")
    with pytest.raises(InitError, match="cannot load"):
        _open(fake, driver_root=str(tmp_path))


# -- discover -------------------------------------------------------------------------------


def test_discover_fills_the_model(fake: FakeNvml) -> None:
    fake.gpus[0].brand = pynvml.NVML_BRAND_TESLA
    inventory = _open(fake).discover()
    assert inventory.backend == "nvml"
    assert inventory.driver_version == "550.54.15"
    assert inventory.cuda_driver_version == (12, 4)
    first, second = inventory.gpus
    assert first.uuid == fake.gpus[0].uuid
    assert (first.index, first.minor, first.device_paths) == (0, 0, ("/dev/nvidia0",))
    assert first.product == "NVIDIA H100 80GB HBM3"
    assert first.memory_mib == 81559
    assert first.pci_bus_id == "0000:17:00.0"
    assert (first.numa_node, second.numa_node) == (0, 1)
    assert first.compute_capability == (9, 0)
    assert first.brand == "Tesla"
    assert first.health is Health.HEALTHY
    assert not first.mig_capable and not first.mig_enabled


def test_control_paths_only_those_that_exist(tmp_path: Path, fake: FakeNvml) -> None:
    (tmp_path / "dev").mkdir()
    (tmp_path / "dev/nvidiactl").touch()
    (tmp_path / "dev/nvidia-uvm").touch()
    backend = NvmlBackend.open(nvml=fake, dev_root=str(tmp_path))
    assert backend.discover().control_device_paths == ("/dev/nvidiactl", "/dev/nvidia-uvm")


def test_numa_from_sysfs_when_nvml_cannot_tell(tmp_path: Path, fake: FakeNvml) -> None:
    fake.fail("nvmlDeviceGetNumaNodeId", pynvml.NVML_ERROR_NOT_SUPPORTED)
    node = tmp_path / "sys/bus/pci/devices/0000:17:00.0"
    node.mkdir(parents=True)
    (node / "numa_node").write_text("1\n")
    other = tmp_path / "sys/bus/pci/devices/0000:27:00.0"
    other.mkdir(parents=True)
    (other / "numa_node").write_text("-1\n")
    gpus = _open(fake, host_root=str(tmp_path)).discover().gpus
    assert [g.numa_node for g in gpus] == [1, None]


def test_negative_nvml_numa_is_none() -> None:
    fake = FakeNvml()
    fake.add_gpu(numa_node=None)
    assert _open(fake).discover().gpus[0].numa_node is None


def test_optional_failures_fall_back(fake: FakeNvml) -> None:
    fake.fail("nvmlDeviceGetCudaComputeCapability", pynvml.NVML_ERROR_UNKNOWN, gpu=0)
    fake.fail("nvmlDeviceGetBrand", pynvml.NVML_ERROR_NOT_SUPPORTED)
    fake.fail("nvmlSystemGetDriverVersion", pynvml.NVML_ERROR_UNKNOWN)
    inventory = _open(fake).discover()
    assert inventory.driver_version == ""
    assert inventory.gpus[0].compute_capability == (0, 0)
    assert inventory.gpus[0].health is Health.HEALTHY
    assert inventory.gpus[1].compute_capability == (9, 0)


def test_essential_failure_marks_gpu_unhealthy(
    fake: FakeNvml, caplog: pytest.LogCaptureFixture
) -> None:
    fake.fail("nvmlDeviceGetMemoryInfo", pynvml.NVML_ERROR_GPU_IS_LOST, gpu=1)
    with caplog.at_level(logging.WARNING, "kubegpu.devices.nvml"):
        gpus = _open(fake).discover().gpus
    assert [g.health for g in gpus] == [Health.HEALTHY, Health.UNHEALTHY]
    assert gpus[1].memory_mib == 0
    assert "memory: GPU is lost" in caplog.text


def test_gpu_without_uuid_is_skipped(fake: FakeNvml, caplog: pytest.LogCaptureFixture) -> None:
    fake.fail("nvmlDeviceGetUUID", pynvml.NVML_ERROR_GPU_IS_LOST, gpu=0)
    with caplog.at_level(logging.WARNING, "kubegpu.devices.nvml"):
        gpus = _open(fake).discover().gpus
    assert [g.uuid for g in gpus] == [fake.gpus[1].uuid]
    assert "skipping GPU 0" in caplog.text


def test_lost_gpu_is_skipped_not_fatal(fake: FakeNvml) -> None:
    backend = _open(fake)
    fake.gpus[0].lost = True
    assert [g.index for g in backend.discover().gpus] == [1]


def test_mig_devices() -> None:
    fake = FakeNvml()
    gpu = fake.add_gpu("NVIDIA A100-SXM4-40GB", memory_mib=40960, compute_capability=(8, 0))
    gpu.add_mig("3g.20gb", memory_mib=19968, multiprocessors=42)
    gpu.add_mig("2g.10gb", memory_mib=9728)
    gpu.add_mig("1g.5gb+me", memory_mib=4864)
    gpu.add_mig("1c.1g.5gb", memory_mib=4864, gi_id=9, ci_id=1)
    (found,) = _open(fake).discover().gpus
    assert found.mig_capable and found.mig_enabled
    assert [m.profile for m in found.mig_devices] == ["3g.20gb", "2g.10gb", "1g.5gb+me", "1g.5gb"]
    first = found.mig_devices[0]
    assert first.uuid == gpu.migs[0].uuid
    assert (first.parent_uuid, first.parent_index, first.gi_id, first.ci_id) == (gpu.uuid, 0, 1, 0)
    assert first.memory_mib == 19968
    assert first.multiprocessors == 42
    assert first.attributes["slices.gi"] == 3
    assert first.attributes["engines.copy"] == 1


def test_compute_instance_profile_name() -> None:
    fake = FakeNvml()
    gpu = fake.add_gpu(memory_mib=81559)
    gpu.add_mig("1c.3g.40gb", memory_mib=40192, gi_id=2, ci_id=0)
    gpu.add_mig("2c.3g.40gb", memory_mib=40192, gi_id=2, ci_id=1)
    (found,) = _open(fake).discover().gpus
    assert [m.profile for m in found.mig_devices] == ["1c.3g.40gb", "2c.3g.40gb"]


@pytest.mark.parametrize(
    ("profile", "memory_mib"),
    [
        # The A100's 2g has profile ID 14, the index of NVML_GPU_INSTANCE_PROFILE_2_SLICE_NO_ME;
        # the 1g with two memory slices has ID 15, the index of 1_SLICE_ALL_ME: a backend
        # comparing IDs with index constants names them 2g.10gb-me and 1g.10gb+me.all.
        ("2g.10gb", 9728),
        ("1g.10gb", 9728),
        ("1g.5gb", 4864),
        ("1g.5gb+me", 4864),
        ("1g.5gb-me", 4864),
        ("1g.5gb+me.all", 4864),
        ("2g.10gb+me.all", 9728),
        ("1g.5gb+gfx", 4864),
        ("4g.20gb+gfx", 19968),
        ("3g.20gb", 19968),
        ("4g.20gb", 19968),
        ("7g.40gb", 40192),
    ],
)
def test_mig_profile_named_from_profile_id_via_index_lookup(profile: str, memory_mib: int) -> None:
    """go-nvlib mig_device.go GetProfile: the GI's profile ID is matched against the ID of
    each profile index's info, and the index carries the name's attribute."""
    fake = FakeNvml()
    gpu = fake.add_gpu("NVIDIA A100-SXM4-40GB", memory_mib=40536)
    mig = gpu.add_mig(profile, memory_mib=memory_mib)
    (found,) = _open(fake).discover().gpus
    assert [m.profile for m in found.mig_devices] == [profile]
    # The simulation is only faithful if IDs and indices differ where the driver's do.
    if profile == "2g.10gb":
        assert mig.gi_profile_id != pynvml.NVML_GPU_INSTANCE_PROFILE_2_SLICE


def test_unknown_profile_id_is_named_from_slice_counts() -> None:
    fake = FakeNvml()
    gpu = fake.add_gpu("NVIDIA A100-SXM4-40GB", memory_mib=40536)
    gpu.add_mig("2g.10gb+me", memory_mib=9728).gi_profile_id = 99
    (found,) = _open(fake).discover().gpus
    assert [m.profile for m in found.mig_devices] == ["2g.10gb"]


def test_compute_instance_slices_come_from_its_profile() -> None:
    fake = FakeNvml()
    gpu = fake.add_gpu(memory_mib=81559)
    mig = gpu.add_mig("1c.3g.40gb", memory_mib=40192, gi_id=2)
    # Attributes disagreeing with the profile: the profile wins, as in go-nvlib.
    mig.ci_slices = 3
    (found,) = _open(fake).discover().gpus
    assert [m.profile for m in found.mig_devices] == ["1c.3g.40gb"]


def test_mig_index_is_the_mig_device_slot_not_the_gpu_instance_id() -> None:
    """NVIDIA internal/rm nvml_devices.go: `fmt.Sprintf("%d:%d", gpuIndex, migIndex)`, the
    index given to GetMigDeviceHandleByIndex; 7x 1g.5gb on an A100 have GI IDs 7..13."""
    fake = FakeNvml()
    fake.add_gpu()
    gpu = fake.add_gpu("NVIDIA A100-SXM4-40GB", memory_mib=40536)
    for gi_id in range(7, 14):
        gpu.add_mig("1g.5gb", memory_mib=4864, gi_id=gi_id)
    found = _open(fake).discover().gpus[1]
    assert [m.index for m in found.mig_devices] == [f"1:{n}" for n in range(7)]
    assert [m.gi_id for m in found.mig_devices] == list(range(7, 14))


def test_mig_capable_but_disabled() -> None:
    fake = FakeNvml()
    fake.add_gpu(mig_capable=True)
    (found,) = _open(fake).discover().gpus
    assert found.mig_capable and not found.mig_enabled and found.mig_devices == ()


def test_unreadable_mig_device_is_skipped() -> None:
    fake = FakeNvml()
    gpu = fake.add_gpu()
    gpu.add_mig("1g.10gb")
    fake.fail("nvmlDeviceGetAttributes", pynvml.NVML_ERROR_UNKNOWN)
    (found,) = _open(fake).discover().gpus
    assert found.mig_enabled and found.mig_devices == ()


def test_mig_capability_device_nodes(tmp_path: Path) -> None:
    fake = FakeNvml()
    gpu = fake.add_gpu()
    gpu.add_mig("1g.10gb", gi_id=7)
    base = tmp_path / "proc/driver/nvidia/capabilities/gpu0/mig/gi7"
    (base / "ci0").mkdir(parents=True)
    (base / "access").write_text("DeviceFileMinor: 66\nDeviceFileMode: 292\n")
    (base / "ci0/access").write_text("DeviceFileMinor: 67\nDeviceFileMode: 292\n")
    (found,) = _open(fake, host_root=str(tmp_path)).discover().gpus
    assert found.mig_devices[0].device_paths == (
        "/dev/nvidia-caps/nvidia-cap66",
        "/dev/nvidia-caps/nvidia-cap67",
    )


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


# -- probe ----------------------------------------------------------------------------------


def test_probe(fake: FakeNvml) -> None:
    backend = _open(fake)
    uuid = fake.gpus[0].uuid
    assert backend.probe(uuid) is None
    fake.gpus[0].lost = True
    assert backend.probe(uuid) == f"{uuid}: GPU is lost"
    assert "Not Found" in (backend.probe("GPU-nope") or "")


def test_probe_mig_uuid() -> None:
    fake = FakeNvml()
    mig = fake.add_gpu().add_mig("1g.10gb")
    assert _open(fake).probe(mig.uuid) is None


def test_close_is_idempotent(fake: FakeNvml) -> None:
    backend = _open(fake)
    backend.close()
    backend.close()
    assert fake.shutdowns == 1


# -- watch ----------------------------------------------------------------------------------


class InstantBackoff(threading.Event):
    """A stop flag whose timed waits (the watch's back-off) return at once, recorded.

    The back-off is a length of time, not a behaviour worth waiting for in real time.
    """

    def __init__(self) -> None:
        super().__init__()
        self.waits: list[float | None] = []

    def wait(self, timeout: float | None = None) -> bool:
        if timeout is None:
            return super().wait()
        self.waits.append(timeout)
        return self.is_set()


class Watcher:
    """Runs backend.watch in a thread and collects events; waits on a condition."""

    def __init__(self, backend: NvmlBackend) -> None:
        self.events: list[HealthEvent] = []
        self._cond = threading.Condition()
        self.stop = InstantBackoff()
        self.thread = threading.Thread(target=backend.watch, args=(self.stop, self._emit))

    def _emit(self, event: HealthEvent) -> None:
        with self._cond:
            self.events.append(event)
            self._cond.notify_all()

    def wait_for(self, predicate: Callable[[list[HealthEvent]], bool], timeout: float = 5) -> None:
        with self._cond:
            assert self._cond.wait_for(lambda: predicate(self.events), timeout), self.events


@pytest.fixture
def watching(fake: FakeNvml) -> Iterator[tuple[FakeNvml, Watcher]]:
    watcher = Watcher(_open(fake))
    watcher.thread.start()
    try:
        yield fake, watcher
    finally:
        watcher.stop.set()
        watcher.thread.join(5)
        assert not watcher.thread.is_alive()


def _wait_registered(fake: FakeNvml, count: int) -> None:
    assert fake.wait_registered(count), fake.registered()


def test_watch_registers_xid_and_ecc_events(watching: tuple[FakeNvml, Watcher]) -> None:
    fake, _ = watching
    _wait_registered(fake, 2)
    mask = fake.registered()[fake.gpus[0].uuid]
    assert mask & pynvml.nvmlEventTypeXidCriticalError
    assert mask & pynvml.nvmlEventTypeDoubleBitEccError


def test_watch_reports_xid(watching: tuple[FakeNvml, Watcher]) -> None:
    fake, watcher = watching
    _wait_registered(fake, 2)
    fake.emit_xid(1, 79)
    watcher.wait_for(lambda events: len(events) >= 1)
    assert watcher.events == [HealthEvent(fake.gpus[1].uuid, HealthEventKind.XID, xid=79)]


def test_double_bit_ecc_is_xid_48_and_single_bit_ignored(
    watching: tuple[FakeNvml, Watcher],
) -> None:
    fake, watcher = watching
    _wait_registered(fake, 2)
    fake.emit_event(0, pynvml.nvmlEventTypeSingleBitEccError, 0)
    fake.emit_event(0, pynvml.nvmlEventTypeDoubleBitEccError, 0)
    watcher.wait_for(lambda events: len(events) >= 1)
    assert [(e.uuid, e.xid) for e in watcher.events] == [(fake.gpus[0].uuid, 48)]


def test_event_without_device_hits_every_gpu(watching: tuple[FakeNvml, Watcher]) -> None:
    fake, watcher = watching
    _wait_registered(fake, 2)
    fake.emit_xid(None, 119)
    watcher.wait_for(lambda events: len(events) >= 2)
    assert {(e.uuid, e.xid) for e in watcher.events} == {(g.uuid, 119) for g in fake.gpus}


def test_failing_wait_reports_probe_failures_and_recovers(
    watching: tuple[FakeNvml, Watcher],
) -> None:
    fake, watcher = watching
    _wait_registered(fake, 2)
    fake.fail_wait(pynvml.NVML_ERROR_UNKNOWN)
    watcher.wait_for(lambda events: len(events) >= 2)
    assert {e.kind for e in watcher.events} == {HealthEventKind.PROBE_FAILED}
    assert "Unknown Error" in watcher.events[0].detail
    # After the back-off (its first step, 1 s) the set is registered again and events flow.
    _wait_registered(fake, 2)
    fake.emit_xid(0, 94)
    watcher.wait_for(lambda events: any(e.xid == 94 for e in events))
    assert watcher.stop.waits == [1.0]


def test_not_supported_gpu_is_skipped(fake: FakeNvml, caplog: pytest.LogCaptureFixture) -> None:
    fake.gpus[0].supported_events = 0
    watcher = Watcher(_open(fake))
    with caplog.at_level(logging.INFO, "kubegpu.devices.nvml"):
        watcher.thread.start()
        try:
            _wait_registered(fake, 1)
            fake.emit_xid(1, 79)
            watcher.wait_for(lambda events: len(events) >= 1)
        finally:
            watcher.stop.set()
            watcher.thread.join(5)
    assert list(fake.registered()) == []  # freed on exit
    assert [e.uuid for e in watcher.events] == [fake.gpus[1].uuid]
    assert "does not report Xid events" in caplog.text


def test_mig_event_maps_to_slice() -> None:
    fake = FakeNvml()
    gpu = fake.add_gpu()
    gpu.add_mig("3g.40gb")
    other = gpu.add_mig("3g.40gb")
    watcher = Watcher(_open(fake))
    watcher.thread.start()
    try:
        _wait_registered(fake, 1)
        fake.emit_xid(0, 31, mig=other)
        watcher.wait_for(lambda events: len(events) >= 1)
    finally:
        watcher.stop.set()
        watcher.thread.join(5)
    assert watcher.events[0].uuid == other.uuid


def test_mig_layout_change_reports_reconfigured() -> None:
    fake = FakeNvml()
    gpu = fake.add_gpu()
    gpu.add_mig("3g.40gb")
    fake.add_gpu()
    now = [0.0]
    backend = NvmlBackend(
        fake,
        exists=lambda p: True,
        wait_timeout_ms=10,
        layout_check_seconds=5,
        clock=lambda: now[0],
    )
    fake.nvmlInit()
    watcher = Watcher(backend)
    watcher.thread.start()
    try:
        _wait_registered(fake, 2)
        gpu.add_mig("2g.20gb")
        now[0] = 10.0
        watcher.wait_for(lambda events: len(events) >= 1)
    finally:
        watcher.stop.set()
        watcher.thread.join(5)
    assert watcher.events == [HealthEvent(gpu.uuid, HealthEventKind.RECONFIGURED)]


def test_watch_never_raises_when_event_set_cannot_be_created(fake: FakeNvml) -> None:
    fake.fail("nvmlEventSetCreate", pynvml.NVML_ERROR_UNKNOWN)
    backend = _open(fake)
    stop = threading.Event()
    thread = threading.Thread(target=backend.watch, args=(stop, lambda e: None))
    thread.start()
    stop.set()
    thread.join(5)
    assert not thread.is_alive()
