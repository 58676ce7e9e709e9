"""Where the conformance cases come from.

Every case in ``tests/conformance`` is a fact taken from a peer project's own tests, test
data, expected outputs or chart values, pinned to the commit it was read at, so a reader
can check the case against its source. The code of those projects is not copied: the
tests here are our own; only their data (YAML, fixture trees, expected labels) is.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).parent
DATA = HERE / "data"


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
