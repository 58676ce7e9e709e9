"""The published JSON Schema (`kubegpu config schema`) against NVIDIA's own config data.

Every config example of NVIDIA's README and chart (`../shared/peer-data/nvidia/readme-
configs/`, origins in that folder's README) validates against the schema, as an editor or
CI check would run it (the `jsonschema` library, draft 2020-12). Every config case of
NVIDIA's Go tests (`tests/conformance/data/nvidia/config/`, see `test_config.py`) gets the
same verdict from the schema as from kubegpu's loader, except the refusals listed in
`BEYOND_THE_SCHEMA`: rules on values (name, duration and device syntax) and across keys,
which JSON Schema does not express here and the loader alone enforces, and `2.0` for a
whole number (an integer to JSON Schema, not to Go's decoder).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped, unused-ignore]
import pytest
import yaml

from kubegpu.config import build_config
from kubegpu.config.loader import parse_raw
from kubegpu.config.v1 import json_schema
from kubegpu.errors import ConfigError
from tests.conformance.origin import DATA

CONFIG_DATA = DATA / "nvidia" / "config"
README_CONFIGS = (
    Path(__file__).resolve().parents[3].parent
    / "shared"
    / "peer-data"
    / "nvidia"
    / "readme-configs"
)
VALIDATOR = jsonschema.Draft202012Validator(json_schema())

#: Conformance refusals the schema accepts, by case id: what only the loader checks.
BEYOND_THE_SCHEMA = {
    # Go duration syntax (a number-and-unit grammar with `infinite`): a value rule.
    "duration.go:parse '60' has no unit": "duration syntax",
    "duration.go:parse 5x": "duration syntax",
    "duration.go:parse empty": "duration syntax",
    "duration.go:parse Infinite (case matters)": "duration syntax",
    # Device entries: indices, MIG `i:j` and well-formed GPU/MIG UUIDs (a value rule).
    "replicas_test.go:TestUnmarshalReplicatedDevices/5": "device selector syntax",
    "replicas_test.go:TestUnmarshalReplicatedDevices/6": "device selector syntax",
    "replicas_test.go:TestUnmarshalReplicatedDevices/7": "device selector syntax",
    "replicas_test.go:TestUnmarshalReplicatedDevices/8": "device selector syntax",
    "replicas_test.go:TestUnmarshalReplicatedDevices/9": "device selector syntax",
    "replicas.go:IsMigIndex gi/ci must be unsigned": "device selector syntax",
    "replicas.go:IsMigUUID gi/ci must be numbers": "device selector syntax",
    "replicas.go:IsMigUUID one part missing": "device selector syntax",
    # Extended resource names: the kubelet's and NVIDIA's name rules (a value rule).
    "replicas_test.go:TestUnmarshalReplicatedResource/11": "resource name syntax",
    "replicas_test.go:TestUnmarshalReplicatedResource/12": "resource name syntax",
    "replicas_test.go:TestUnmarshalReplicatedResources/5": "resource name syntax",
    "resources.go:NewResourceName 64 characters": "resource name syntax",
    "resources.go:NewResourceName upper case": "resource name syntax",
    "resources.go:NewResourceName underscore": "resource name syntax",
    # JSON Schema's integer includes 2.0; Go's JSON decoding (and the loader) refuse it.
    "replicas_test.go:TestUnmarshalReplicatedDevices/3": "2.0 is an integer to JSON Schema",
    "replicas.go:replicas 2.0": "2.0 is an integer to JSON Schema",
    # Rules across keys, some of which a flag or env var can satisfy (--mps-root).
    "main.go:validateFlags MPS with migStrategy mixed": "across keys",
    "main.go:validateFlags MPS without mpsRoot": "across keys (a flag may set mpsRoot)",
    "sharing.go:ReplicatedResources MPS hides timeSlicing": "across keys",
}


def _cases() -> list[Any]:
    """(id, the file's data) of every NVIDIA config case, placed where the Go test decodes
    it, as `test_config.py` places it."""
    out = []

    def load(name: str) -> dict[str, Any]:
        data: dict[str, Any] = yaml.safe_load((CONFIG_DATA / name).read_text(encoding="utf-8"))
        return data

    places: dict[tuple[str, str], Callable[[Any], dict[str, Any]]] = {
        ("flags.yaml", "unmarshal"): lambda f: {"flags": f},
        ("imex.yaml", "cases"): lambda f: {"imex": f},
        ("replicas.yaml", "devices"): lambda f: {
            "sharing": {
                "timeSlicing": {"resources": [{"name": "gpu", "replicas": 2, "devices": f}]}
            }
        },
        ("replicas.yaml", "resource"): lambda f: {"sharing": {"timeSlicing": {"resources": [f]}}},
        ("replicas.yaml", "resources"): lambda f: {"sharing": {"timeSlicing": f}},
    }
    for (name, group), place in places.items():
        for case in load(name)[group]:
            out.append(pytest.param(place(yaml.safe_load(case["input"])), id=case["id"]))
    for group in ("cases", "deliberate"):
        for case in load("validation.yaml")[group]:
            out.append(pytest.param(parse_raw(case["config"]), id=case["id"]))
    return out


@pytest.mark.parametrize("raw", _cases())
def test_the_schema_and_the_loader_agree_on_nvidias_cases(
    raw: dict[str, Any], request: pytest.FixtureRequest
) -> None:
    case_id = request.node.callspec.id
    try:
        build_config(raw, {}, source="cm.yaml")
        loader_accepts = True
    except ConfigError:
        loader_accepts = False
    errors = [e.message for e in VALIDATOR.iter_errors(raw)]
    if loader_accepts:
        assert errors == [], f"{case_id}: the loader accepts it, the schema says {errors}"
    elif case_id in BEYOND_THE_SCHEMA:
        assert errors == [], f"{case_id} is listed as beyond the schema, which refuses it"
    else:
        assert errors, f"{case_id}: the loader refuses it, the schema accepts it"


def _readme_configs() -> list[Path]:
    return sorted(README_CONFIGS.glob("*.yaml")) if README_CONFIGS.is_dir() else []


@pytest.mark.skipif(not _readme_configs(), reason=f"no NVIDIA config examples at {README_CONFIGS}")
@pytest.mark.parametrize("path", _readme_configs(), ids=lambda p: p.name)
def test_every_nvidia_readme_and_chart_config_example_validates(path: Path) -> None:
    VALIDATOR.validate(parse_raw(path.read_bytes(), path.name))


def test_a_shape_error_is_refused_by_the_schema_at_its_key() -> None:
    # What an editor shows: the key path and the allowed values.
    errors = VALIDATOR.iter_errors({"version": "v1", "flags": {"migStrategy": "Mixed"}})
    error = jsonschema.exceptions.best_match(errors)
    assert error is not None and list(error.absolute_path) == ["flags", "migStrategy"]
    assert "'Mixed' is not one of ['none', 'single', 'mixed']" in error.message
