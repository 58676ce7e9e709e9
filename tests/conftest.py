"""Suite-wide rules: a fast `python3` for fake binaries, a short directory for sockets.

Time: each test is bounded only by the hang guard (`timeout` in pyproject.toml), the same
for every test, and each of its waits by `tests.waiting.WAIT`; no test carries a shorter
budget of its own, since a loaded machine would make it fire.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest


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


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    """A short, private directory under /tmp for unix sockets.

    pytest's tmp_path can exceed the ~107-byte limit of a unix socket path.
    """
    path = Path(tempfile.mkdtemp(prefix="kg-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
