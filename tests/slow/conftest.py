"""Tests that run a real engine or tool, kept out of the rooms so `pytest tests/unit` stays
quick: the Helm chart (rendered by the real Helm engine, helm_python), the container image's
definition, the generated gRPC code against protoc, the release workflow with its linters,
and the install commands of the docs against the chart.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

CHART = Path(__file__).resolve().parents[2] / "deployments" / "helm" / "kubegpu"


@pytest.fixture(scope="module")
def chart() -> Iterator[Any]:
    """The chart, loaded by the real Helm engine once per test module."""
    helm_python = pytest.importorskip("helm_python")
    with helm_python.Chart.load(str(CHART)) as loaded:
        yield loaded
