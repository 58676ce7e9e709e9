"""The suite's hang guard (pytest-timeout's `timeout` in pyproject.toml) against its waits."""

from __future__ import annotations

import pytest

from tests.waiting import WAIT


def test_a_wait_that_never_holds_fails_with_its_own_message_before_the_guard(
    pytestconfig: pytest.Config,
) -> None:
    """A condition that never holds ends in `eventually`'s TimeoutError, naming the wait,
    only if the guard leaves it room: WAIT, then the test's own work and teardown."""
    guard = float(pytestconfig.getini("timeout"))
    assert guard >= 2 * WAIT, f"timeout = {guard:g} s leaves a {WAIT:g} s wait no room"
