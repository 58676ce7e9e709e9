"""The host's own facts read from sysfs (`kubegpu.devices.host`): GFD's machine type.

`test_machine_type_file` moved from tests/unit/labels/test_labeller_loop.py with the reader.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from kubegpu.devices.host import read_machine_type


def test_machine_type_file(tmp_path: Path) -> None:
    f = tmp_path / "product_name"
    f.write_text("Standard PC (Q35 + ICH9, 2009)\n")
    assert read_machine_type(str(f)) == "Standard PC (Q35 + ICH9, 2009)"
    assert read_machine_type(str(tmp_path / "missing")) == "unknown"


def test_no_file_set_is_unknown_and_an_empty_file_is_empty(tmp_path: Path) -> None:
    assert read_machine_type("") == "unknown"
    empty = tmp_path / "product_name"
    empty.write_text("\n")
    assert read_machine_type(str(empty)) == ""  # as GFD: labels sanitise it later


def test_an_unreadable_file_is_logged_with_its_path(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="kubegpu.devices.host"):
        assert read_machine_type(str(tmp_path)) == "unknown"  # a directory: EISDIR
    (record,) = caplog.records
    assert str(tmp_path) in record.getMessage()
    assert "cannot read machine type" in record.getMessage()


def test_the_labeller_re_exports_the_reader() -> None:
    import kubegpu.labeller

    assert kubegpu.labeller.read_machine_type is read_machine_type
