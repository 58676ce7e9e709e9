"""`DP_DISABLE_HEALTHCHECKS` as `kubegpu serve` reads it, against NVIDIA's own token cases.

Data: tests/conformance/data/nvidia/health-xid-tokens.yaml, from
NVIDIA/k8s-device-plugin@v0.20.0:internal/rm/health_test.go (TestNewHealthCheckXIDs).
"""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from kubegpu.cli.options import UsageError
from kubegpu.cli.serve import check_serve
from kubegpu.config.v1 import HealthFlags
from kubegpu.health import health_flags_from_env
from tests.conformance.origin import DATA, NVIDIA_DP

ORIGIN = NVIDIA_DP.cite("internal/rm/health_test.go")
CASES: list[dict[str, Any]] = yaml.safe_load(
    (DATA / "nvidia" / "health-xid-tokens.yaml").read_text(encoding="utf-8")
)["cases"]
#: `serve` values with no flag set: only the environment is under test here.
NO_FLAGS: dict[str, Any] = {"config_file": None, "config_dir": None, "simulate": None}


def _ids(cases: list[dict[str, Any]]) -> list[str]:
    return [f"{c['description']} [{ORIGIN}]" for c in cases]


ACCEPTED = [c for c in CASES if "nvidia_ignores" not in c]
MALFORMED = [c for c in CASES if "nvidia_ignores" in c]


@pytest.mark.parametrize("case", ACCEPTED, ids=_ids(ACCEPTED))
def test_well_formed_tokens_ignore_the_same_xids(case: dict[str, Any]) -> None:
    env = {"DP_DISABLE_HEALTHCHECKS": case["input"]}
    check_serve({**NO_FLAGS, "backend": "auto"}, env)  # serve starts
    base = HealthFlags()
    flags = health_flags_from_env(env, base)
    added = set(flags.ignored_xids) - set(base.ignored_xids)
    assert added == set(case["expected"]) - set(base.ignored_xids)
    assert set(case["expected"]) <= set(flags.ignored_xids)
    assert not flags.disabled


@pytest.mark.deliberate("xid-token-typos-rejected")
@pytest.mark.parametrize("case", MALFORMED, ids=_ids(MALFORMED))
def test_malformed_tokens_are_refused_naming_the_token(case: dict[str, Any]) -> None:
    env = {"DP_DISABLE_HEALTHCHECKS": case["input"]}
    with pytest.raises(UsageError) as info:
        check_serve({**NO_FLAGS, "backend": "auto"}, env)
    message = str(info.value)
    assert "DP_DISABLE_HEALTHCHECKS" in message and case["nvidia_ignores"] in message
    assert "\n" not in message
