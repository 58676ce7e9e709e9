"""The ROCm case files (`data/rocm/cases/*.yaml`), loaded once."""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any, TypeVar

import yaml

from tests.conformance.origin import DATA, ROCM_DP

F = TypeVar("F", bound=Callable[..., Any])

CASES = DATA / "rocm" / "cases"


@cache
def load(name: str) -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((CASES / name).read_text(encoding="utf-8"))
    return data


def cites(path: str) -> Callable[[F], F]:
    """Prefix a test's docstring with the ROCm file its case comes from."""

    def mark(test: F) -> F:
        test.__doc__ = f"{ROCM_DP.cite(path)}: {test.__doc__ or ''}"
        return test

    return mark
