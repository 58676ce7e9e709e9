"""One supervisor of named tasks: the only place in kubegpu that creates an asyncio task.

Modelled on kopf's: every task (the daemon's roots, registrars, MPS supervisors, watches,
the health thread bridge) is started with a name through `Supervisor.start`; a task that
fails is logged once with that name and its traceback; a *root* task that fails stops the
whole daemon (`Supervisor.wait` raises its error), while a failed helper only logs.

Code that runs inside a daemon but is not handed a supervisor (the config source's label
watch, the labeller's config follower) calls the module-level `spawn`: it uses the
supervisor of the running daemon (a context variable set by `Supervisor.__aenter__`), or a
standalone one when there is none (a test, the `labels` command).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

log = logging.getLogger("kubegpu.supervisor")

T = TypeVar("T")

_current: contextvars.ContextVar[Supervisor | None] = contextvars.ContextVar(
    "kubegpu_supervisor", default=None
)


class Supervisor:
    """Named tasks, their failures logged, the first root failure remembered."""

    def __init__(self, name: str = "kubegpu") -> None:
        self.name = name
        self._tasks: dict[asyncio.Task[Any], bool] = {}
        #: Set when a root task fails (or ends while it was meant to run for ever).
        self._root_down = asyncio.Event()
        self._failure: BaseException | None = None
        self._token: contextvars.Token[Supervisor | None] | None = None

    def start(
        self, name: str, coro: Coroutine[Any, Any, T], *, root: bool = False
    ) -> asyncio.Task[T]:
        """Run `coro` as a task called `name`; a failing `root` stops the daemon."""
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks[task] = root
        task.add_done_callback(self._done)
        return task

    @property
    def tasks(self) -> dict[str, bool]:
        """Running task names -> whether each is a root (for tests and debugging)."""
        return {t.get_name(): root for t, root in self._tasks.items()}

    def _done(self, task: asyncio.Task[Any]) -> None:
        root = self._tasks.pop(task, False)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is None:
            if root:
                log.info("root task %r ended", task.get_name())
            return
        log.error("task %r failed: %s", task.get_name(), exc, exc_info=exc)
        if root and self._failure is None:
            self._failure = exc
            self._root_down.set()

    async def wait(self, stop: asyncio.Event) -> None:
        """Until `stop` is set or a root task fails; then raise that root's error."""
        stopped = asyncio.get_running_loop().create_task(stop.wait(), name="stop signal")
        down = asyncio.get_running_loop().create_task(self._root_down.wait(), name="root down")
        try:
            await asyncio.wait({stopped, down}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in (stopped, down):
                waiter.cancel()
            # Reaped, so no pending task is left for the loop to complain about.
            await asyncio.gather(stopped, down, return_exceptions=True)
        if self._failure is not None:
            raise self._failure

    async def stop(self) -> None:
        """Cancel every task (roots and helpers) and wait until they have ended."""
        while self._tasks:
            tasks = list(self._tasks)
            for task in tasks:
                task.cancel()
            # A cancelled task may still start another while unwinding: loop until none.
            await asyncio.gather(*tasks, return_exceptions=True)

    async def __aenter__(self) -> Supervisor:
        self._token = _current.set(self)
        return self

    async def __aexit__(self, *exc: object) -> None:
        try:
            await self.stop()
        finally:
            if self._token is not None:
                with contextlib.suppress(ValueError):  # exited in another context
                    _current.reset(self._token)
                self._token = None


async def until_stopped(name: str, work: Coroutine[Any, Any, None], stop: asyncio.Event) -> bool:
    """Run `work` (as task `name`) until it ends (True) or `stop` is set first (False,
    `work` cancelled); `work`'s own error is raised."""
    loop = asyncio.get_running_loop()
    task = loop.create_task(work, name=name)
    stopped = loop.create_task(stop.wait(), name=f"{name}: stop signal")
    try:
        await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
        await asyncio.gather(stopped, return_exceptions=True)
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        return False
    task.result()  # start-up's own error, if any
    return True


#: Serves `spawn` outside any daemon; its tasks end with their event loop.
_standalone: dict[asyncio.AbstractEventLoop, Supervisor] = {}


def current() -> Supervisor:
    """The running daemon's supervisor, else one per event loop for standalone use."""
    supervisor = _current.get()
    if supervisor is not None:
        return supervisor
    loop = asyncio.get_running_loop()
    standalone = _standalone.get(loop)
    if standalone is None:
        # One per loop; a closed loop's entry is dropped on the next lookup.
        for stale in [k for k in _standalone if k.is_closed()]:
            del _standalone[stale]
        standalone = _standalone[loop] = Supervisor("standalone")
    return standalone


def spawn(name: str, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
    """Start a named helper task under the current supervisor (logged if it fails)."""
    return current().start(name, coro)


__all__ = ["Supervisor", "current", "spawn", "until_stopped"]
