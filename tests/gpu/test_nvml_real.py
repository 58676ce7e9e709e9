"""NvmlBackend against the real driver: what the plugin advertises is what CUDA sees."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from kubegpu.devices.model import Health, HealthEvent
from kubegpu.devices.nvml import NvmlBackend
from kubegpu.devices.stop import Stop
from tests.waiting import WAIT

# Counts CUDA devices with the driver API only (no torch needed): libcuda.so.1 is part of
# the driver. The UUID is read with cuDeviceGetUuid and printed in nvidia-smi's form.
CUDA_PROBE = r"""
import ctypes, sys
cuda = ctypes.CDLL("libcuda.so.1")
assert cuda.cuInit(0) == 0, "cuInit failed"
count = ctypes.c_int()
assert cuda.cuDeviceGetCount(ctypes.byref(count)) == 0
print(count.value)
for i in range(count.value):
    dev = ctypes.c_int()
    cuda.cuDeviceGet(ctypes.byref(dev), i)
    raw = (ctypes.c_ubyte * 16)()
    fn = getattr(cuda, "cuDeviceGetUuid_v2", None) or cuda.cuDeviceGetUuid
    assert fn(ctypes.byref(raw), dev) == 0
    h = bytes(raw).hex()
    print(f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}")
"""


def _smi_list() -> list[tuple[str, str]]:
    if shutil.which("nvidia-smi") is None:
        pytest.skip("nvidia-smi not installed")
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=True).stdout
    return re.findall(r"^GPU \d+: (.+?) \(UUID: (GPU-[0-9a-f-]+)\)", out, flags=re.M)


def test_discovery_matches_nvidia_smi(nvml_backend: NvmlBackend) -> None:
    inventory = nvml_backend.discover()
    assert [(g.product, g.uuid) for g in inventory.gpus] == _smi_list()
    for gpu in inventory.gpus:
        assert gpu.health is Health.HEALTHY
        assert gpu.memory_mib > 1024
        assert re.fullmatch(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]", gpu.pci_bus_id)
        assert gpu.compute_capability >= (3, 0)
        assert gpu.device_paths == (f"/dev/nvidia{gpu.minor}",)
        assert Path(gpu.device_paths[0]).exists()
    assert inventory.driver_version
    assert inventory.cuda_driver_version >= (11, 0)
    assert "/dev/nvidiactl" in inventory.control_device_paths


def test_probe_passes_on_every_gpu(nvml_backend: NvmlBackend) -> None:
    inventory = nvml_backend.discover()
    for gpu in inventory.gpus:
        assert nvml_backend.probe(gpu.uuid) is None
    assert nvml_backend.probe("GPU-00000000-0000-0000-0000-000000000000") is not None


@pytest.mark.parametrize("which", [0, -1])
def test_cuda_visible_devices_uuid_isolates_one_gpu(nvml_backend: NvmlBackend, which: int) -> None:
    """What the NVIDIA container hook does with NVIDIA_VISIBLE_DEVICES=<uuid>."""
    gpu = nvml_backend.discover().gpus[which]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpu.uuid}
    result = subprocess.run(
        [sys.executable, "-c", CUDA_PROBE], env=env, capture_output=True, text=True, timeout=120
    )
    if result.returncode != 0 and "libcuda" in result.stderr:
        pytest.skip(f"CUDA driver library not loadable: {result.stderr.strip()[-200:]}")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.split()
    assert lines == ["1", gpu.uuid]


def test_watch_starts_and_stops_cleanly(nvml_backend: NvmlBackend) -> None:
    events: list[HealthEvent] = []
    stop = Stop()
    thread = threading.Thread(target=nvml_backend.watch, args=(stop, events.append))
    thread.start()
    stop.set()
    thread.join(WAIT)
    assert not thread.is_alive()
    assert events == []  # a healthy GPU idles without Xids
