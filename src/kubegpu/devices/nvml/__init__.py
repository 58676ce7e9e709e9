"""NVIDIA GPUs through NVML (nvidia-ml-py, imported as `pynvml`).

This package is the only place that calls NVML and the only place `pynvml.NVMLError` is
seen: `open` and `discover` raise `InitError`/`DeviceError`, `probe` returns the failure
text and `watch` turns failures into health events. One GPU misbehaving never takes down
discovery of the others: optional fields fall back to defaults, a GPU whose essential
fields fail is reported `Unhealthy`, and a GPU without a readable UUID is skipped.

The rooms: `backend` (`NvmlBackend`: open, close, and the seams below), `discovery`
(GPUs, MIG slices and profile names), `links` (NVLink/NVSwitch/PCIe between GPUs),
`health` (probes, the Xid/ECC event set, the MIG layout check), `processes` (who runs
on each GPU and MIG device, their memory and SM utilization), `names` (pure NVML
vocabulary) and `session` (the NVML handle they share). Paths come from
`kubegpu.nvidia_paths`.

The `nvml` module is injectable (`kubegpu.testing.FakeNvml`), as are the roots of /dev and
/sys, so everything here runs in unit tests without a GPU.
"""

from kubegpu.devices.nvml.backend import NvmlBackend, find_library
from kubegpu.devices.nvml.names import cuda_version, mig_profile_name, normalize_bus_id

__all__ = [
    "NvmlBackend",
    "cuda_version",
    "find_library",
    "mig_profile_name",
    "normalize_bus_id",
]
