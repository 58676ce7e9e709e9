"""Facts the docs state that the code decides: metric names, the config poll interval.

Every metric name the docs and chart tell an operator to query is one kubegpu exposes.

A PromQL example with `kubegpu_allocate_errors` instead of `kubegpu_allocate_errors_total`
silently matches nothing, so an alert written from the docs would never fire.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kubegpu.metrics import Metrics

REPO = Path(__file__).resolve().parents[2]
CHART_TEMPLATES = REPO / "deployments" / "helm" / "kubegpu" / "templates"
DOCUMENTS = sorted([REPO / "README.md", *(REPO / "docs").glob("*.md"), *CHART_TEMPLATES.iterdir()])
NAME = re.compile(r"\bkubegpu_[a-z_]+[a-z]\b")


def exposed_names() -> set[str]:
    """Series names a scrape can return (counters as `_total`, histograms as `_bucket`...).

    Read from the registry's families, not a scrape: a labelled family shows no series
    until its first label set is used.
    """
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    return {
        family.name + suffix
        for family in Metrics().registry.collect()
        for suffix in suffixes.get(family.type, ("",))
    }


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(REPO)))
def test_documented_metric_names_are_exposed(document: Path) -> None:
    exposed = exposed_names()
    # A histogram's family name (without `_bucket`/`_sum`/`_count`) names it in prose.
    families = {n.removesuffix("_bucket") for n in exposed if n.endswith("_bucket")}
    mentioned = set(NAME.findall(document.read_text(encoding="utf-8")))
    unknown = sorted(mentioned - exposed - families)
    assert not unknown, f"{document.name} names metrics that are not exposed: {unknown}"


def test_the_check_sees_counters_only_with_their_total_suffix() -> None:
    exposed = exposed_names()
    assert "kubegpu_allocate_errors_total" in exposed
    assert "kubegpu_allocate_errors" not in exposed


POLL_DOCS = ["configuration.md", "sharing.md", "architecture.md"]


@pytest.mark.parametrize("name", POLL_DOCS)
def test_docs_state_the_config_poll_interval_the_code_uses(name: str) -> None:
    from kubegpu.config.source import POLL_INTERVAL

    text = (REPO / "docs" / name).read_text(encoding="utf-8")
    stated = {float(n) for n in re.findall(r"poll\w*[^.]{0,40}?\(?(?:every )?(\d+\.\d+) s", text)}
    assert stated == {POLL_INTERVAL}, f"{name} gives the config poll as {stated}"
