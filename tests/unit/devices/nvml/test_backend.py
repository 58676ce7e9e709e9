"""Opening and closing NVML (devices/nvml/backend.py) against the fake pynvml of kubegpu.testing."""

from __future__ import annotations

from pathlib import Path

import pynvml
import pytest

from kubegpu.errors import InitError
from kubegpu.testing import FakeNvml
from tests.unit.devices.nvml.conftest import open_backend as _open

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


def test_close_is_idempotent(fake: FakeNvml) -> None:
    backend = _open(fake)
    backend.close()
    backend.close()
    assert fake.shutdowns == 1
