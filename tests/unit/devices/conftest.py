"""The device backends (`kubegpu.devices`): the simulated node, AMD's sysfs, the PCI bus and host
facts, the stop flag, the driver tree NVML loads from, and that only `devices` reads sysfs;
`nvml/` holds NvmlBackend's on the fake pynvml.
"""
