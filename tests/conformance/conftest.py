"""Conformance suite: every deliberate difference from a peer must be documented.

A test that asserts kubegpu *differs* from NVIDIA or ROCm on purpose carries
``@pytest.mark.deliberate("<id>")``; the id must appear as `` `<id>` `` in the
"Deliberate differences" table of ``docs/migrating-from-nvidia.md``, or collection fails.
"""

from __future__ import annotations

from pathlib import Path

import pytest

MIGRATION_DOC = Path(__file__).resolve().parents[2] / "docs" / "migrating-from-nvidia.md"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    text = MIGRATION_DOC.read_text(encoding="utf-8")
    undocumented = sorted(
        {
            str(mark.args[0])
            for item in items
            for mark in item.iter_markers("deliberate")
            if f"`{mark.args[0]}`" not in text
        }
    )
    if undocumented:
        raise pytest.UsageError(
            f"deliberate differences not listed in {MIGRATION_DOC.name}: {', '.join(undocumented)}"
            " (add a row to its 'Deliberate differences' table)"
        )
