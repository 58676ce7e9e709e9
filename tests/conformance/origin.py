"""Where the conformance cases come from.

Every case in ``tests/conformance`` is a fact taken from a peer project's own tests, test
data, expected outputs or chart values, pinned to the commit it was read at, so a reader
can check the case against its source. The code of those projects is not copied: the
tests here are our own.

Two kinds of data feed them. ``data/`` holds the project's own case tables (YAML facts,
each citing its origin). The peers' files themselves (NVIDIA's chart ``values.yaml``, GFD's
``expected-output*.txt``, the config files of NVIDIA's README, ROCm's ``testdata/``
trees) are not kept in this repository: they are read, unmodified, from ``peer-data``
beside it (``../shared/peer-data``, whose README gives each file's origin), and the tests
that need them skip where it is absent.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

HERE = Path(__file__).parent
DATA = HERE / "data"
REPO_ROOT = HERE.parents[1]
PEER_DATA = REPO_ROOT.parent / "shared" / "peer-data"
PEER_DATA_ABSENT = (
    "needs the peers' own data files in ../shared/peer-data (NVIDIA's and ROCm's files,"
    " kept beside the repository, not in it); not found at " + str(PEER_DATA)
)


def peer_file(*parts: str) -> Path:
    """A file or folder of peer-data; skips the calling test where peer-data is absent.

    Present but without this path is an error, not a skip: the checkout is out of date.
    """
    if not PEER_DATA.is_dir():
        pytest.skip(PEER_DATA_ABSENT)
    path = PEER_DATA.joinpath(*parts)
    if not path.exists():
        raise FileNotFoundError(
            f"{path} is missing from peer-data; update ../shared/peer-data (see its README.md)"
        )
    return path


#: For tests parametrized over a peer file's contents: their cases are known only where it is.
needs_peer_data = pytest.mark.skipif(not PEER_DATA.is_dir(), reason=PEER_DATA_ABSENT)


@dataclass(frozen=True)
class Origin:
    """A peer repository at a pinned commit."""

    repo: str
    ref: str
    commit: str

    def cite(self, path: str) -> str:
        """A reference a reader can follow: ``repo@ref:path (commit)``."""
        return f"{self.repo}@{self.ref}:{path} ({self.commit[:12]})"


NVIDIA_DP = Origin(
    repo="NVIDIA/k8s-device-plugin",
    ref="v0.20.0",
    commit="1b826acc6af3079d8923bac395c3124b8861a9a6",
)
ROCM_DP = Origin(
    repo="ROCm/k8s-device-plugin",
    ref="master",
    commit="ed7646843003e8f0b6a0630346f01bb4d1ecff2e",
)
