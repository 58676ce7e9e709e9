"""Suite-wide rules: time limits by kind of test, and a fast `python3` for fake binaries.

The default limit is `timeout` in pyproject.toml (a few seconds). A test that needs longer
says so with `@pytest.mark.timeout(N)` and a reason next to it; the one kind handled here
is property-based tests, whose run time is set by their example count, not by waiting.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

#: Hypothesis runs up to `max_examples` examples (60-400 here) with `deadline=None`; under
#: coverage on a busy 2-core machine the largest take ~10 s, so give them room.
HYPOTHESIS_TIMEOUT_S = 60


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        test = getattr(item, "obj", None)
        if getattr(test, "is_hypothesis_test", False) and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(HYPOTHESIS_TIMEOUT_S))


@pytest.fixture(scope="session")
def _python3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("python3-bin")
    shim = directory / "python3"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -S "$@"\n')
    shim.chmod(0o755)
    return directory


@pytest.fixture
def python3_on_path(_python3_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """`python3` on PATH is this interpreter, started without `site` (-S).

    Stand-in binaries such as tests/fixtures/fake-mps-control run through
    `#!/usr/bin/env python3`, once per command. A version manager's shim (pyenv) costs
    ~150 ms a start against ~10 ms for the interpreter itself, which made the MPS tests
    take seconds. -S: the stand-ins use only the standard library, and coverage's `.pth`
    hook must not start measuring processes that run no kubegpu code.
    """
    monkeypatch.setenv("PATH", os.pathsep.join([str(_python3_dir), os.environ.get("PATH", "")]))
    return _python3_dir
