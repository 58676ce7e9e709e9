"""Fixtures for NvmlBackend's unit tests: the fake pynvml of kubegpu.testing with two GPUs."""

from __future__ import annotations

import pytest

from kubegpu.devices.nvml import NvmlBackend
from kubegpu.testing import FakeNvml


def open_backend(fake: FakeNvml, **kwargs: object) -> NvmlBackend:
    """`NvmlBackend.open` on the fake, every path existing, short event waits."""
    kwargs.setdefault("exists", lambda path: True)
    kwargs.setdefault("wait_timeout_ms", 20)
    return NvmlBackend.open(nvml=fake, **kwargs)  # type: ignore[arg-type]


@pytest.fixture
def fake() -> FakeNvml:
    nvml = FakeNvml()
    for i in range(2):
        nvml.add_gpu(numa_node=i)
    return nvml
