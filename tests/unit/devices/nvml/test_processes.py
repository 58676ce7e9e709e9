"""NvmlBackend.processes: the driver's process lists and per-process samples, per device."""

from __future__ import annotations

import pynvml

from kubegpu.devices import ProcessKind
from kubegpu.devices.nvml import processes as nvml_processes
from kubegpu.testing import FakeNvml
from tests.unit.devices.nvml.conftest import open_backend

MIB = 1024 * 1024


def test_processes_of_each_list_with_memory_and_sm(fake: FakeNvml) -> None:
    gpu = fake.gpus[0]
    gpu.add_process(100, 1024, sm_util=30, mem_util=5)
    gpu.add_process(101, 2048, kind="compute+graphics", sm_util=10)
    gpu.add_process(102, None, kind="mps")
    backend = open_backend(fake)
    table = backend.processes()
    by_pid = {p.pid: p for p in table.processes}
    assert table.failures == {}
    assert set(by_pid) == {100, 101, 102}
    assert by_pid[100].uuid == gpu.uuid
    assert by_pid[100].used_memory_bytes == 1024 * MIB
    assert (by_pid[100].sm_percent, by_pid[100].memory_percent) == (30, 5)
    # One process on two lists is one entry with both kinds, its memory counted once.
    assert by_pid[101].kinds == (ProcessKind.COMPUTE, ProcessKind.GRAPHICS)
    assert by_pid[101].used_memory_bytes == 2048 * MIB
    # The driver does not say (NVML_VALUE_NOT_AVAILABLE): unknown, not 0.
    assert by_pid[102].used_memory_bytes is None
    assert by_pid[102].kinds == (ProcessKind.MPS,)
    assert by_pid[102].sm_percent == 0  # no sample: idle


def test_mig_processes_name_their_slice_and_have_no_samples() -> None:
    fake = FakeNvml()
    gpu = fake.add_gpu("NVIDIA A100-SXM4-40GB", memory_mib=40536, mig_capable=True)
    big, small = gpu.add_mig("3g.20gb"), gpu.add_mig("1g.5gb")
    big.add_process(200, 512, sm_util=50)
    small.add_process(201, 256, kind="mps")
    table = open_backend(fake).processes()
    by_pid = {p.pid: p for p in table.processes}
    assert by_pid[200].uuid == big.uuid and by_pid[201].uuid == small.uuid
    assert (by_pid[200].gpu_instance_id, by_pid[200].compute_instance_id) == (
        big.gi_id,
        big.ci_id,
    )
    # NVML keeps no per-process samples on MIG devices: unknown, not 0.
    assert by_pid[200].sm_percent is None and by_pid[201].sm_percent is None
    assert len(table.processes) == 2  # listed on their slice, not again on the parent


def test_each_read_asks_only_for_new_samples_and_keeps_the_latest(fake: FakeNvml) -> None:
    process = fake.gpus[0].add_process(100, 1024, sm_util=30)
    asked: list[int] = []
    real = fake.nvmlDeviceGetProcessesUtilizationInfo

    def spy(handle: object, since: int) -> object:
        if handle is fake.gpus[0]:
            asked.append(since)
        return real(handle, since)

    fake.nvmlDeviceGetProcessesUtilizationInfo = spy  # type: ignore[method-assign,assignment]
    backend = open_backend(fake)
    assert backend.processes().processes[0].sm_percent == 30
    # Nothing new since: the driver answers NOT_FOUND; the last sample still stands.
    assert backend.processes().processes[0].sm_percent == 30
    process.set_util(70, at_us=process.sample_us + 1)
    assert backend.processes().processes[0].sm_percent == 70
    assert asked == [0, process.sample_us - 1, process.sample_us - 1]


def test_a_sample_older_than_its_ttl_reads_as_idle(fake: FakeNvml) -> None:
    process = fake.gpus[0].add_process(100, 1024, sm_util=30)
    too_old = int((process.sample_us / 1e6 - nvml_processes.SAMPLE_TTL_S - 1) * 1e6)
    process.set_util(30, at_us=too_old)
    assert open_backend(fake).processes().processes[0].sm_percent == 0


def test_older_drivers_fall_back_to_nvmlDeviceGetProcessUtilization(fake: FakeNvml) -> None:
    fake.fail("nvmlDeviceGetProcessesUtilizationInfo", pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
    fake.gpus[1].add_process(300, 10, sm_util=45)
    table = open_backend(fake).processes()
    assert table.processes[0].sm_percent == 45


def test_one_gpu_failing_leaves_the_others_listed(fake: FakeNvml) -> None:
    fake.gpus[0].add_process(100, 10)
    fake.gpus[1].add_process(101, 10)
    fake.fail("nvmlDeviceGetComputeRunningProcesses", pynvml.NVML_ERROR_GPU_IS_LOST, gpu=0)
    table = open_backend(fake).processes()
    assert [p.pid for p in table.processes] == [101]
    assert set(table.failures) == {fake.gpus[0].uuid}


def test_graphics_and_mps_lists_are_optional(fake: FakeNvml) -> None:
    fake.gpus[0].add_process(100, 10)
    fake.fail("nvmlDeviceGetGraphicsRunningProcesses", pynvml.NVML_ERROR_NOT_SUPPORTED)
    fake.fail("nvmlDeviceGetMPSComputeRunningProcesses", pynvml.NVML_ERROR_NOT_SUPPORTED)
    table = open_backend(fake).processes()
    assert [p.pid for p in table.processes] == [100] and table.failures == {}
