"""Real-NVML tests: every test here is skipped unless NVML finds at least one GPU."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kubegpu.devices.nvml import NvmlBackend
from kubegpu.errors import InitError


def _open() -> NvmlBackend | None:
    try:
        return NvmlBackend.open()
    except InitError:
        return None


@pytest.fixture(scope="session")
def nvml_backend() -> Iterator[NvmlBackend]:
    backend = _open()
    if backend is None:
        pytest.skip("no NVIDIA GPU visible to NVML")
    yield backend
    backend.close()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.gpu)
