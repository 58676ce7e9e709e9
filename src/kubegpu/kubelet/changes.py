"""How tests and `demo` follow the emulator: a change history, subscribers and waits.

The kubelet has no such thing; it is the emulator's window. Every state change records the
resource's (capacity, allocatable) when it moved, calls the subscribers and wakes every
`wait_for`, so callers wait on conditions instead of polling or sleeping.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

log = logging.getLogger("kubegpu.kubelet")


class Changes:
    """The (capacity, allocatable) history per resource, subscribers and the wake-up condition."""

    def __init__(self) -> None:
        self._history: dict[str, list[tuple[int, int]]] = {}
        self._subscribers: list[Callable[[str], None]] = []
        self._cond = asyncio.Condition()

    def history(self, resource: str) -> list[tuple[int, int]]:
        """(capacity, allocatable) after each change, starting from an implicit (0, 0)."""
        return list(self._history.get(resource, []))

    def subscribe(self, callback: Callable[[str], None]) -> Callable[[], None]:
        """Call `callback(resource)` after every state change; returns an unsubscribe."""
        self._subscribers.append(callback)
        return lambda: self._subscribers.remove(callback)

    async def changed(self, resource: str, point: tuple[int, int]) -> None:
        """A resource's state changed; `point` is its (capacity, allocatable) now."""
        history = self._history.setdefault(resource, [])
        if (history[-1] if history else (0, 0)) != point:
            history.append(point)
        for callback in list(self._subscribers):
            try:
                callback(resource)
            except Exception:
                log.exception("on_change subscriber failed")
        await self.notify()

    async def notify(self) -> None:
        """Wake every waiter to re-check its predicate (records changed, nothing else)."""
        async with self._cond:
            self._cond.notify_all()

    async def wait_for(
        self,
        predicate: Callable[[], bool],
        timeout: float,
        describe: Callable[[], str] | None = None,
    ) -> None:
        """Wait until `predicate()` holds, re-checking on every change.

        On timeout raise `TimeoutError` with `describe()` (the expected vs actual state).
        """
        try:
            async with asyncio.timeout(timeout):
                async with self._cond:
                    await self._cond.wait_for(predicate)
        except TimeoutError:
            what = (
                describe()
                if describe is not None
                else (f"{getattr(predicate, '__qualname__', predicate)!s} still false")
            )
            raise TimeoutError(f"timed out after {timeout}s: {what}") from None
