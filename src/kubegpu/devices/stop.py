"""The stop flag a backend's watch thread runs under (`StopFlag` in `devices.model`).

Apart from the model, which stays pure data: this one is a threading primitive.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable


class Stop(threading.Event):
    """A `threading.Event` that also wakes whoever asked with `on_set`."""

    def __init__(self) -> None:
        super().__init__()
        self._wakes: list[Callable[[], None]] = []
        self._wakes_lock = threading.Lock()

    def set(self) -> None:
        super().set()
        with self._wakes_lock:
            wakes = list(self._wakes)
        for wake in wakes:
            wake()

    def on_set(self, wake: Callable[[], None]) -> Callable[[], None]:
        with self._wakes_lock:
            self._wakes.append(wake)
        # Set before the hook went in: `set` may or may not have seen it; a wake is idempotent.
        if self.is_set():
            wake()

        def undo() -> None:
            with self._wakes_lock, contextlib.suppress(ValueError):
                self._wakes.remove(wake)

        return undo


__all__ = ["Stop"]
