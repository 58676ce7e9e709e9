"""Shared pieces of the benchmarks: `serve` subprocesses, the kubelet emulator, statistics,
/proc reads.

Everything waits on conditions (a "ready" line, the kubelet emulator's state), never on
fixed sleeps, and every subprocess and temp dir is cleaned up by the context managers here.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from kubegpu.kubelet import KubeletEmulator

T = TypeVar("T")

RESOURCE = "nvidia.com/gpu"

#: Seconds any wait of the benchmarks may last before its section gives up. Every wait
#: returns as soon as its condition holds, so this only bounds a wait that will never end;
#: it is generous on purpose: on a loaded 2-core machine the first `serve` (which compiles
#: the bytecode cache) has taken more than 30 s to register.
DEADLINE_S = 300.0


def timeslicing_config(replicas: int) -> str:
    """A v1 config that time-slices every GPU of `RESOURCE` into `replicas` replicas."""
    return (
        "version: v1\n"
        "sharing:\n"
        "  timeSlicing:\n"
        "    resources:\n"
        f"    - name: {RESOURCE}\n"
        f"      replicas: {replicas}\n"
    )


_REGISTERED = re.compile(r"registered \S+ with the kubelet \(socket \S+\) in ([0-9.]+) s")


def use_bytecode_cache() -> Path:
    """Let every subprocess from here on write and read compiled bytecode, in a private
    directory (`PYTHONPYCACHEPREFIX`) so that nothing is written into the source tree.

    On a node the image's `pip install` compiled every module; a dev shell often sets
    PYTHONDONTWRITEBYTECODE, and then each `serve` started here would compile kubegpu's
    own sources again, ~30-40 ms that no node pays. The first process to import a module
    compiles it (the benchmark's uncounted warm-up start); later ones read the cache.
    """
    prefix = Path(tempfile.mkdtemp(prefix="kgb-pyc-", dir="/tmp"))
    os.environ["PYTHONPYCACHEPREFIX"] = str(prefix)
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    return prefix


def kubegpu_command() -> list[str]:
    """The `kubegpu` console script of this interpreter's environment (what a node runs)."""
    script = Path(sys.executable).with_name("kubegpu")
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "kubegpu.cli"]


@contextlib.contextmanager
def temp_dir(prefix: str) -> Iterator[Path]:
    # Short paths under /tmp: unix socket paths are limited to 107 bytes.
    path = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@dataclass
class Child:
    """A subprocess whose output goes to a log file (shown when something fails)."""

    proc: asyncio.subprocess.Process
    log: Path
    spawned: float  # time.perf_counter() just before the spawn

    @property
    def pid(self) -> int:
        return self.proc.pid

    def registrations_s(self) -> list[float]:
        """The "registered ... in X s" figures `serve` logged: since the plugin server was
        up (first time) or since it noticed the kubelet restart (later ones)."""
        text = self.log.read_text(errors="replace")
        return [float(m) for m in _REGISTERED.findall(text)]

    def tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


async def _terminate(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        proc.terminate()
    try:
        await asyncio.wait_for(proc.wait(), 10)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()


@contextlib.asynccontextmanager
async def child(
    args: Sequence[str],
    log: Path,
    *,
    stdin_pipe: bool = False,
    env: Mapping[str, str] | None = None,
) -> AsyncIterator[Child]:
    """Run `args` until the block ends (SIGTERM, then SIGKILL after 10 s)."""
    with log.open("wb") as out:
        spawned = time.perf_counter()
        proc = await asyncio.create_subprocess_exec(
            *args,
            stdin=asyncio.subprocess.PIPE if stdin_pipe else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE if stdin_pipe else out,
            stderr=out,
            env=None if env is None else dict(env),
        )
    try:
        yield Child(proc, log, spawned)
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        await _terminate(proc)


@contextlib.asynccontextmanager
async def serve(
    plugin_dir: Path,
    log: Path,
    *extra: str,
    simulate: str = "h100-8",
    env: Mapping[str, str] | None = None,
) -> AsyncIterator[Child]:
    """`kubegpu serve --simulate <preset or node file> --device-plugin-path <dir>`."""
    args = [
        *kubegpu_command(),
        "serve",
        "--simulate",
        simulate,
        "--device-plugin-path",
        str(plugin_dir),
        *extra,
    ]
    async with child(args, log, env=env) as proc:
        yield proc


@contextlib.asynccontextmanager
async def module_server(module: str, sock: Path, log: Path, *extra: str) -> AsyncIterator[Child]:
    """`python -m <module> <socket> [extra...]` (the reply servers that
    benchmarks/placement.py compares with), once it has printed "ready"."""
    args = [sys.executable, "-m", module, str(sock), *extra]
    async with child(args, log, stdin_pipe=True) as proc:
        assert proc.proc.stdout is not None
        line = await asyncio.wait_for(proc.proc.stdout.readline(), DEADLINE_S)
        if line.strip() != b"ready":
            raise RuntimeError(f"{module} did not start: {line!r}\n{proc.tail()}")
        yield proc


@contextlib.asynccontextmanager
async def emulator(
    plugin_dir: Path, *, topology_manager: bool = False
) -> AsyncIterator[KubeletEmulator]:
    kubelet = KubeletEmulator(plugin_dir, topology_manager=topology_manager)
    await kubelet.start()
    try:
        yield kubelet
    finally:
        await kubelet.stop()


async def timed_calls(call: Callable[[], Awaitable[object]], count: int) -> list[int]:
    """Latency in ns of `count` sequential awaits of `call()`."""
    out: list[int] = []
    clock = time.perf_counter_ns
    for _ in range(count):
        start = clock()
        await call()
        out.append(clock() - start)
    return out


def percentile(samples_ns: Sequence[int], q: float) -> float:
    """Nearest-rank percentile, in milliseconds."""
    ordered = sorted(samples_ns)
    rank = max(1, min(len(ordered), round(q / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1] / 1e6


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def proc_status(pid: int) -> dict[str, float]:
    """VmRSS and VmHWM of a process, in MiB (the kernel counts kB)."""
    out: dict[str, float] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) / 1024
    return out


def cpu_ticks(pid: int) -> int:
    """utime + stime of a process (fields 14 and 15 of /proc/<pid>/stat), in clock ticks."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def machine() -> dict[str, str | int]:
    """What the figures were measured on: CPUs, their model, Python."""
    model = "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.partition(":")[2].strip()
                break
    return {
        "nproc": len(os.sched_getaffinity(0)),
        "cpu_model": model,
        "python": sys.version.split()[0],
    }


class Stamp:
    """The perf_counter at which the emulator's state first holds a full, healthy list of
    `RESOURCE` (`capacity` devices; None: any non-empty list). Stamped by an `on_change`
    subscriber, which runs inside the state change, as the kubelet's device manager has
    the devices in memory: not when a waiting task next gets the loop. A context manager,
    entered before the change being timed starts."""

    def __init__(self, kubelet: KubeletEmulator, capacity: int | None = None) -> None:
        self._kubelet = kubelet
        self._capacity = capacity
        self.at: float | None = None
        self._unsubscribe: Callable[[], None] | None = None

    def holds(self) -> bool:
        have = self._kubelet.capacity(RESOURCE)
        wanted = have > 0 if self._capacity is None else have == self._capacity
        return wanted and self._kubelet.allocatable(RESOURCE) == have

    def _check(self, resource: str) -> None:
        if self.at is None and resource == RESOURCE and self.holds():
            self.at = time.perf_counter()

    def __enter__(self) -> Stamp:
        self._unsubscribe = self._kubelet.on_change(self._check)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._unsubscribe is not None:
            self._unsubscribe()

    def ms_since(self, start: float) -> float:
        if self.at is None:
            raise RuntimeError(f"the emulator never changed to {self._capacity} devices")
        return (self.at - start) * 1000


async def unless_exited(waiting: Awaitable[T], child: Child, what: str) -> T:
    """`waiting`'s result, or a RuntimeError with the log's tail as soon as `serve`
    exits first (a `serve` that dies at start-up fails the wait at once, not at its
    deadline)."""
    task = asyncio.ensure_future(waiting)
    exited = asyncio.ensure_future(child.proc.wait())
    try:
        await asyncio.wait({task, exited}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        exited.cancel()
    if not task.done():
        task.cancel()
        raise RuntimeError(
            f"kubegpu serve exited ({child.proc.returncode}) before {what}:\n{child.tail()}"
        )
    return task.result()


async def wait_registered(
    kubelet: KubeletEmulator, capacity: int | None, child: Child, timeout: float = DEADLINE_S
) -> None:
    """Until the kubelet reads `capacity` healthy devices (None: its first non-empty list,
    all healthy); fails fast, with the log's tail, if `serve` exits or times out."""
    registered = kubelet.wait_for(Stamp(kubelet, capacity).holds, timeout=timeout)
    try:
        await unless_exited(registered, child, "registering")
    except TimeoutError:
        raise RuntimeError(
            f"the kubelet emulator did not hold {capacity or 'a list of'} healthy {RESOURCE}"
            f" within {timeout:g} s"
            f" (capacity {kubelet.capacity(RESOURCE)}, allocatable "
            f"{kubelet.allocatable(RESOURCE)})\n--- kubegpu serve log:\n{child.tail()}"
        ) from None
