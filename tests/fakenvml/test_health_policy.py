"""The Xid policy and the reset rule on the real pynvml and the simulated libnvidia-ml.

The simulated library injects Xids (on a GPU, or on a MIG slice by its UUID) and answers
probes; it has no "GPU lost" state and stubs the pending-reset readings as NOT_SUPPORTED, so
a reset is never observed here and a probe passes on the handle and memory queries alone.
Faults it cannot express run on the project's fake pynvml
(tests/unit/health/test_health_failsafe.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.fakenvml.conftest import fakenvml_env

HEALTH_PROBE = Path(__file__).with_name("health_probe.py")
_TIMEOUT_S = 120

H100 = {"name": "NVIDIA H100 80GB HBM3", "memory_total": "80GiB", "compute_capability": "9.0"}
#: Three H100s, the third split into two 3g.40gb slices.
MACHINE = {
    "gpus": [
        H100,
        H100,
        {**H100, "mig_mode": True, "mig_devices": [{"profile": "3g.40gb"}] * 2},
    ]
}


def run(lib: Path, tmp: Path, *lines: str) -> Any:
    events = tmp / "events"
    events.write_text("# kubegpu test\n")
    done = subprocess.run(
        [sys.executable, str(HEALTH_PROBE), *lines],
        capture_output=True,
        text=True,
        env=fakenvml_env(lib, MACHINE, events),
        timeout=_TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 0, f"health_probe failed:\n{done.stderr}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_catalog_outcomes_and_the_reset_rule_on_the_simulated_library(
    fakenvml_lib: Path, tmp_path: Path
) -> None:
    """Xid 79 (RESTART_BM) and Xid 95 on a slice (RESET_GPU) stay unhealthy through many
    passing probes; Xid 999 (not in the catalog) heals by the timer; Xid 94 (RESTART_APP,
    NVIDIA's #1014) and 13 mark nothing."""
    result = run(
        fakenvml_lib,
        tmp_path,
        "xid 0 79",
        "xid 1 999",
        "xid 1 94",
        "xid {mig0} 95",
        "xid 0 13",
    )
    gpu0, gpu1, _ = result["gpus"]
    mig0, _ = result["migs"]
    assert [x for _, x in result["xids"]] == [79, 999, 94, 95, 13]
    assert result["marked"] == sorted([gpu0, gpu1, mig0])
    assert result["remaining"] == sorted([gpu0, mig0])
    assert result["awaiting_reset"] == sorted([gpu0, mig0])
    assert result["probes_passed"][gpu0] >= 40, "probes pass on the simulated library"
