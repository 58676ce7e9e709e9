"""Build the simulated libnvidia-ml.so.1 of ../shared/fakenvml once per session.

The tests here run kubegpu's NVML backend through the real `pynvml` on that library, each
machine layout in a fresh interpreter (`probe.py`). A fresh clone without the `shared`
checkout beside it skips them; a checkout whose library does not build fails them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
FAKENVML = REPO_ROOT.parent / "shared" / "fakenvml"
PROBE = Path(__file__).with_name("probe.py")
#: Upper bound for one probe process; a hang fails the test instead of blocking the suite.
_PROBE_TIMEOUT_S = 120

Probe = Callable[..., Any]


@pytest.fixture(scope="session")
def fakenvml_lib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The directory holding the built `libnvidia-ml.so.1`."""
    if not (FAKENVML / "build.sh").is_file():
        pytest.skip(f"simulated NVML not found at {FAKENVML} (the shared checkout is absent)")
    out = tmp_path_factory.mktemp("fakenvml-lib")
    built = subprocess.run(
        ["bash", str(FAKENVML / "build.sh"), str(out)],
        capture_output=True,
        text=True,
        timeout=_PROBE_TIMEOUT_S,
        check=False,
    )
    if built.returncode != 0 or not (out / "libnvidia-ml.so.1").is_file():
        pytest.fail(f"building {FAKENVML} failed (gcc needed):\n{built.stdout}{built.stderr}")
    return out


def _config_text(config: dict[str, Any] | Path) -> str:
    return str(config) if isinstance(config, Path) else json.dumps(config)


def fakenvml_env(
    lib: Path, config: dict[str, Any] | Path, events: Path | None = None
) -> dict[str, str]:
    """The environment of a process that sees the simulated machine `config` through NVML."""
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = str(lib)
    env["FAKENVML_CONFIG"] = _config_text(config)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT / "src"), str(REPO_ROOT)])
    if events is not None:
        env["FAKENVML_EVENTS"] = str(events)
    return env


@pytest.fixture
def probe(fakenvml_lib: Path) -> Probe:
    """probe(config, *args, events=None) -> the JSON probe.py prints, run on that machine."""

    def run(config: dict[str, Any] | Path, *args: str, events: Path | None = None) -> Any:
        env = fakenvml_env(fakenvml_lib, config, events)
        done = subprocess.run(
            [sys.executable, str(PROBE), *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=_PROBE_TIMEOUT_S,
            check=False,
        )
        assert done.returncode == 0, f"probe {args} failed:\n{done.stderr}"
        return json.loads(done.stdout.strip().splitlines()[-1])

    return run
