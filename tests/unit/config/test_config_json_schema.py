"""`kubegpu config schema` and the copy of its output kept beside the Helm chart."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema  # type: ignore[import-untyped, unused-ignore]
import pytest

from kubegpu.cli import main
from kubegpu.cli.config import schema_text

CHART_COPY = Path(__file__).resolve().parents[3] / "deployments/helm/kubegpu/config.schema.json"


def test_the_command_prints_the_schema(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "schema"]) == 0
    printed = capsys.readouterr().out
    assert printed == schema_text()
    schema = json.loads(printed)
    jsonschema.Draft202012Validator.check_schema(schema)
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"


def test_the_charts_copy_is_what_the_command_prints() -> None:
    # Regenerate with: kubegpu config schema > deployments/helm/kubegpu/config.schema.json
    assert CHART_COPY.read_text(encoding="utf-8") == schema_text()


def test_null_means_unset_in_the_schema_as_in_the_loader() -> None:
    validator = jsonschema.Draft202012Validator(json.loads(schema_text()))
    assert validator.is_valid({"version": None, "flags": {"mpsRoot": None, "plugin": None}})
    # ...except where the loader refuses a null (NVIDIA's decoder does too).
    assert not validator.is_valid({"sharing": {"timeSlicing": None}})
    assert not validator.is_valid(
        {"sharing": {"mps": {"resources": [{"name": "gpu", "replicas": None}]}}}
    )


def test_nvidias_spellings_the_loader_reads_are_in_the_schema() -> None:
    validator = jsonschema.Draft202012Validator(json.loads(schema_text()))
    assert validator.is_valid({"flags": {"useNodeFeatureAPI": True}})  # NVIDIA's place
    assert validator.is_valid({"flags": {"plugin": {"deviceListStrategy": "envvar"}}})
    assert not validator.is_valid({"flags": {"plugin": {"deviceListStrategy": []}}})
    assert validator.is_valid({"flags": {"gfd": {"sleepInterval": 60_000_000_000}}})
