"""The pure NVML vocabulary (devices/nvml/names.py): bus IDs, CUDA versions, MIG profile names."""

from __future__ import annotations

import pytest

from kubegpu.devices.nvml import (
    cuda_version,
    mig_profile_name,
    normalize_bus_id,
)

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
