"""MPS (CUDA Multi-Process Service) control daemons for `sharing.mps` resources.

An MPS-shared resource is only usable when a control daemon for its GPUs is running and
its clients find its pipe directory, so the plugin supervises one
`nvidia-cuda-mps-control -d` per resource and advertises the resource only once the
daemon answers. Limits (pinned device memory per GPU, active thread percentage) are set
as daemon defaults, so every client a pod starts is held to its share without the pod
doing anything.

The control binary is driven the way its manual describes: `-d` starts the daemon,
every other interaction is one command line on the stdin of a client invocation that
shares the daemon's `CUDA_MPS_PIPE_DIRECTORY`. The real binary forks and its parent
exits; when the process we started is still running we wait on it, otherwise liveness
is checked by querying the daemon every `health_interval` seconds.

`MpsReconciler` keeps the set of daemons in step with the node's state: one per
MPS-shared resource of the newest `NodeState`, restarted when its GPUs or limits change,
its readiness written back to the store.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from kubegpu.allocation import ContainerEdits, MountSpec
from kubegpu.config import Config
from kubegpu.config.names import parse_quantity
from kubegpu.devices.model import Gpu
from kubegpu.errors import ConfigError, DeviceError
from kubegpu.nvidia_paths import MPS_CONTAINER_PIPE_DIR as CONTAINER_PIPE_DIR
from kubegpu.nvidia_paths import MPS_CONTROL_BINARY
from kubegpu.resources import ResourceSpec, SharingKind
from kubegpu.state import NodeState, NodeStore
from kubegpu.supervisor import spawn
from kubegpu.watch.backoff import Backoff

log = logging.getLogger(__name__)

#: The query used as readiness/liveness probe: cheap, read-only, answered by the daemon.
PROBE = "get_default_active_thread_percentage"


class MpsError(DeviceError):
    """The MPS control daemon could not be started, configured or reached."""


def resource_dir_name(resource: str) -> str:
    """`nvidia.com/gpu` -> `nvidia.com_gpu`: one directory per resource under the root."""
    return resource.replace("/", "_")


def pipe_dir(root: Path | str, resource: str) -> Path:
    """Where the control daemon of `resource` keeps its pipes, under the MPS root."""
    return Path(root) / resource_dir_name(resource) / "pipe"


def container_edits(
    resource: str, host_root: Path | str, shm_dir: Path | str = "/dev/shm"
) -> ContainerEdits:
    """What a container of an MPS-shared `resource` needs to reach its daemon.

    It follows from the config alone (`flags.mpsRoot` and the resource name), so Allocate
    computes it; whether the daemon answers is the store's `mps_ready`, which keeps the
    devices unhealthy (not allocatable) until it does.
    """
    return ContainerEdits(
        envs={"CUDA_MPS_PIPE_DIRECTORY": CONTAINER_PIPE_DIR},
        mounts=(
            MountSpec(
                container_path=CONTAINER_PIPE_DIR, host_path=str(pipe_dir(host_root, resource))
            ),
            MountSpec(container_path="/dev/shm", host_path=str(shm_dir)),
        ),
    )


def resource_edits(spec: ResourceSpec, config: Config) -> ContainerEdits | None:
    """The MPS pipe and shm mounts of an MPS-shared resource, from the config alone (None
    for any other resource): what both the device plugin and the DRA plugin add."""
    if spec.sharing is not SharingKind.MPS:
        return None  # the common case, first: Allocate's hot path
    root = config.flags.mps_root
    return None if root is None else container_edits(spec.name, root)


#: Under the MPS root, the directory of the per-claim daemons (DRA mode, memory-sized
#: GPUs): `<root>/kubegpu-claims/<claim UID>/{pipe,log}`. Not a resource's directory: a
#: resource name always holds a `/`, which `resource_dir_name` turns into `_`.
CLAIMS_DIR = "kubegpu-claims"


def claim_dir(root: Path | str, claim_uid: str) -> Path:
    """Where the MPS control daemon of one claim keeps its pipes and logs."""
    return Path(root) / CLAIMS_DIR / claim_uid


def claim_edits(directory: Path | str, thread_percentage: int) -> ContainerEdits:
    """What a container of a claim with its own MPS daemon (in `directory`, under the MPS
    root) gets: that daemon's pipe directory, the shared memory directory of the MPS
    servers (`<root>/shm`, the daemons' `/dev/shm` in the chart), and the claim's active
    thread percentage in the environment. The daemon's default is what holds (a client's
    own value can only lower it); the variable tells the container its share."""
    directory = Path(directory)
    return ContainerEdits(
        envs={
            "CUDA_MPS_PIPE_DIRECTORY": CONTAINER_PIPE_DIR,
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(thread_percentage),
        },
        mounts=(
            MountSpec(container_path=CONTAINER_PIPE_DIR, host_path=str(directory / "pipe")),
            MountSpec(container_path="/dev/shm", host_path=str(directory.parent.parent / "shm")),
        ),
    )


class MpsDaemon:
    """One supervised MPS control daemon serving `replicas` clients per GPU of a resource.

    `root` is the MPS root as this process sees it; `host_root` (default the same) is
    the host path that containers mount (`container_edits` gives their mounts).
    """

    def __init__(
        self,
        resource: str,
        root: Path,
        gpus: Sequence[Gpu],
        replicas: int,
        *,
        memory_limit_mib: int | None = None,
        active_thread_percentage: int | None = None,
        control_binary: str = MPS_CONTROL_BINARY,
        env: Mapping[str, str] | None = None,
        host_root: Path | None = None,
        ready_timeout: float = 30.0,
        command_timeout: float = 10.0,
        probe_interval: float = 0.1,
        health_interval: float = 5.0,
        backoff: tuple[float, float] = (1.0, 60.0),
        on_change: Callable[[bool], None] | None = None,
        directory: Path | None = None,
        memory_limits_mib: Mapping[str, int] | None = None,
    ) -> None:
        if not gpus and directory is None:  # a claim's daemon may be a handle to stop
            raise ConfigError(f"sharing.mps: resource {resource} has no GPUs to share")
        if replicas < 1:
            raise ConfigError(f"sharing.mps: {resource} replicas must be >= 1, got {replicas}")
        if active_thread_percentage is not None and not 1 <= active_thread_percentage <= 100:
            raise ConfigError(
                f"sharing.mps: {resource} activeThreadPercentage must be 1..100, "
                f"got {active_thread_percentage}"
            )
        if memory_limit_mib is not None and memory_limit_mib < 1:
            raise ConfigError(f"sharing.mps: {resource} memoryLimit must be positive")
        self.resource = resource
        self.gpus = tuple(gpus)
        self.replicas = replicas
        self.memory_limit_mib = memory_limit_mib
        self.active_thread_percentage = active_thread_percentage or max(1, 100 // replicas)
        self.control_binary = control_binary
        #: Its own directory (a claim's daemon), else the resource's under the root.
        self.dir = (
            Path(directory) if directory is not None else Path(root) / resource_dir_name(resource)
        )
        self.pipe_dir = self.dir / "pipe"
        self.log_dir = self.dir / "log"
        self.host_root = Path(host_root or root)
        self.host_pipe_dir = self.host_root / self.dir.relative_to(root) / "pipe"
        #: Pinned memory per GPU UUID, when not one value for all (a claim's own sizes).
        self._memory_limits_mib = dict(memory_limits_mib) if memory_limits_mib else None
        self.ready_timeout = ready_timeout
        self.command_timeout = command_timeout
        self.probe_interval = probe_interval
        self.health_interval = health_interval
        self.backoff = backoff
        self.on_change = on_change
        self.env = {
            **os.environ,
            **(env or {}),
            "CUDA_VISIBLE_DEVICES": ",".join(g.uuid for g in self.gpus),
            "CUDA_MPS_PIPE_DIRECTORY": str(self.pipe_dir),
            "CUDA_MPS_LOG_DIRECTORY": str(self.log_dir),
        }
        #: Daemon (re)starts after the first, for metrics and tests.
        self.restarts = 0
        self._ready = False
        self._proc: asyncio.subprocess.Process | None = None
        self._stopping = False

    @property
    def ready(self) -> bool:
        """True once the daemon answers and its limits are set; gate advertising on it."""
        return self._ready

    def memory_limits(self) -> dict[str, int]:
        """Pinned device memory per client, MiB per GPU UUID (default: an equal share)."""
        if self._memory_limits_mib is not None:
            return dict(self._memory_limits_mib)
        return {
            g.uuid: self.memory_limit_mib or max(1, g.memory_mib // self.replicas)
            for g in self.gpus
        }

    # --- lifecycle -----------------------------------------------------------------

    async def start(self) -> None:
        """Start the daemon, wait until it answers, set its limits. Raises `MpsError`."""
        self._stopping = False
        await self._start()

    async def _start(self) -> None:
        binary = self._resolve_binary()
        for d in (self.pipe_dir, self.log_dir):
            d.mkdir(parents=True, exist_ok=True)
        # stderr to a file, not a pipe: the forked daemon inherits it and would block
        # on a pipe nobody reads.
        with self.stderr_path.open("ab") as stderr:
            try:
                self._proc = await asyncio.create_subprocess_exec(
                    binary,
                    "-d",
                    env=self.env,
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=asyncio.subprocess.DEVNULL,
                    stderr=stderr,
                )
            except OSError as e:
                raise MpsError(f"{self.resource}: cannot run {binary} -d: {e}") from e
        try:
            await self._wait_ready()
            await self._configure()
        except BaseException:
            await self._shutdown()
            raise
        if self._stopping:  # stop() was called while we were starting
            await self._shutdown()
            return
        self._set_ready(True)
        log.info(
            "MPS daemon for %s ready (%d GPUs, %d replicas, %d%% threads)",
            self.resource,
            len(self.gpus),
            self.replicas,
            self.active_thread_percentage,
        )

    async def resume(self) -> None:
        """Take over a daemon an earlier process started in this directory (its limits set
        again: they are defaults, idempotent), or start one. Raises `MpsError`."""
        self._stopping = False
        if not await self._probe():
            await self._start()
            return
        try:
            await self._configure()
        except BaseException:
            await self._shutdown()
            raise
        self._set_ready(True)

    async def stop(self) -> None:
        """Ask the daemon to quit (ending its servers) and stop supervising it."""
        self._stopping = True
        self._set_ready(False)
        await self._shutdown()

    async def supervise(self) -> None:
        """Restart the daemon whenever it dies, with exponential backoff, until `stop`.

        Call after a successful `start`; run it as a task.
        """
        backoff = Backoff(*self.backoff)
        while not self._stopping:
            backoff.mark()
            reason = await self._wait_dead()
            if self._stopping:
                return
            self._set_ready(False)
            log.warning("MPS daemon for %s died (%s); restarting", self.resource, reason)
            # One that had been healthy for long starts over; one that keeps dying waits longer.
            backoff.reset_if_stable(10 * self.backoff[1])
            while not self._stopping:
                await backoff.wait()
                if self._stopping:
                    return
                try:
                    await self._start()
                except MpsError as e:
                    log.warning("restarting the MPS daemon for %s failed: %s", self.resource, e)
                    continue
                self.restarts += 1
                break

    async def command(self, line: str) -> str:
        """Send one command through a control client; its stdout, or `MpsError`."""
        try:
            proc = await asyncio.create_subprocess_exec(
                self._resolve_binary(),
                env=self.env,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
        except OSError as e:
            raise MpsError(f"{self.resource}: cannot run {self.control_binary}: {e}") from e
        try:
            out, err = await asyncio.wait_for(
                proc.communicate((line + "\n").encode()), self.command_timeout
            )
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            raise MpsError(
                f"{self.resource}: MPS control did not answer {line!r} "
                f"within {self.command_timeout}s"
            ) from None
        if proc.returncode != 0:
            detail = (err or out).decode(errors="replace").strip() or f"exit {proc.returncode}"
            raise MpsError(f"{self.resource}: MPS control refused {line!r}: {detail}")
        return out.decode(errors="replace").strip()

    # --- internals -----------------------------------------------------------------

    def _resolve_binary(self) -> str:
        found = shutil.which(self.control_binary, path=self.env.get("PATH"))
        if found is None:
            raise MpsError(
                f"{self.resource}: MPS control binary {self.control_binary!r} not found or "
                "not executable; it ships with the NVIDIA driver (check the driver root "
                "mount and PATH)"
            )
        return found

    async def _probe(self) -> bool:
        try:
            answer = await self.command(PROBE)
        except MpsError:
            return False
        try:
            float(answer)
        except ValueError:
            return False
        return True

    async def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout
        daemonised = False
        while True:
            proc = self._proc
            if proc is not None and proc.returncode is not None and not daemonised:
                if proc.returncode != 0:
                    raise MpsError(
                        f"{self.resource}: {self.control_binary} -d exited with "
                        f"{proc.returncode}: {self._stderr_tail()}; "
                        f"see {self.log_dir}/control.log"
                    )
                daemonised = True  # the real binary forks: its parent exits 0
            if await self._probe():
                return
            if time.monotonic() >= deadline:
                raise MpsError(
                    f"{self.resource}: MPS control daemon not answering after "
                    f"{self.ready_timeout}s; see {self.log_dir}/control.log"
                )
            await asyncio.sleep(self.probe_interval)

    async def _configure(self) -> None:
        for uuid, mib in self.memory_limits().items():
            await self.command(f"set_default_device_pinned_mem_limit {uuid} {mib}M")
        await self.command(f"set_default_active_thread_percentage {self.active_thread_percentage}")

    async def _wait_dead(self) -> str:
        proc = self._proc
        if proc is not None and proc.returncode is None:
            rc = await proc.wait()
            return f"exit status {rc}"
        # Daemonised: nothing to wait on, so ask it regularly; two misses in a row count.
        misses = 0
        while misses < 2:
            await asyncio.sleep(self.health_interval)
            if self._stopping:
                return "stopping"
            misses = 0 if await self._probe() else misses + 1
        return "it stopped answering"

    async def _shutdown(self) -> None:
        with contextlib.suppress(MpsError):
            await self.command("quit")
        proc, self._proc = self._proc, None
        if proc is None or proc.returncode is not None:
            return
        try:
            await asyncio.wait_for(proc.wait(), self.command_timeout)
        except TimeoutError:
            log.warning("MPS daemon for %s ignored quit; killing it", self.resource)
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()

    @property
    def stderr_path(self) -> Path:
        return self.log_dir / "daemon.stderr"

    def _stderr_tail(self) -> str:
        try:
            text = self.stderr_path.read_text(errors="replace")
        except OSError:
            return "no output"
        lines = text.strip().splitlines()
        return lines[-1] if lines else "no output"

    def _set_ready(self, ready: bool) -> None:
        if ready != self._ready:
            self._ready = ready
            if self.on_change is not None:
                self.on_change(ready)


class MpsReconciler:
    """Keeps one supervised `MpsDaemon` per MPS-shared resource of the store's state.

    A daemon is restarted when its resource's GPUs or limits change, stopped when the
    resource is no longer MPS-shared. Readiness goes to the store (`mps_ready`), which
    keeps the resource's devices unhealthy until its daemon answers.
    """

    def __init__(
        self,
        store: NodeStore,
        *,
        control_binary: str = MPS_CONTROL_BINARY,
        per_claim: Callable[[ResourceSpec], bool] = lambda spec: False,
    ) -> None:
        self.store = store
        self.control_binary = control_binary
        #: Resources whose claims each get a daemon of their own (DRA mode, memory-sized):
        #: no daemon for the resource, and nothing to wait for before serving it.
        self.per_claim = per_claim
        #: The running daemons by resource name.
        self.daemons: dict[str, MpsDaemon] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._keys: dict[str, tuple[object, ...]] = {}

    def waiting(self) -> list[str]:
        """Resources whose daemon does not answer yet (not ready to serve)."""
        ready = self.store.state.mps_ready
        return [name for name in self.daemons if not ready.get(name, False)]

    async def follow(self, since: int) -> None:
        """Reconcile with every newer state of the store, for ever (a root task)."""
        async for state in self.store.subscribe(since):
            await self.reconcile(state)

    async def reconcile(self, state: NodeState) -> None:
        """Start a daemon for each MPS resource of `state`, stop those no longer wanted."""
        mps = [s for s in state.planned if s.sharing is SharingKind.MPS]
        own = {s.name for s in mps if self.per_claim(s)}
        wanted: dict[str, ResourceSpec] = {s.name: s for s in mps if s.name not in own}
        for name in list(self.daemons):
            spec = wanted.get(name)
            if spec is None or _key(spec) != self._keys.get(name):
                await self._stop(name)
        # Ready as far as the resource goes: each claim's prepare starts its own daemon.
        # A resource that stops being one waits for its new daemon like any other.
        ready = self.store.state.mps_ready
        marks: dict[str, bool] = {
            **{k: v for k, v in ready.items() if k in own or k in self.daemons},
            **dict.fromkeys(own, True),
        }
        if marks != ready:
            self.store.update(mps_ready=marks)
        for name, spec in wanted.items():
            if name not in self.daemons:
                await self._start(spec, state.config)

    async def stop(self) -> None:
        """Stop every daemon (shutdown)."""
        for name in list(self.daemons):
            await self._stop(name)

    def _changed(self, name: str, ready: bool) -> None:
        self.store.update(mps_ready={**self.store.state.mps_ready, name: ready})

    async def _start(self, spec: ResourceSpec, config: Config) -> None:
        root = config.flags.mps_root
        if root is None:  # validation requires it; be explicit anyway
            raise ConfigError("sharing.mps needs flags.mpsRoot (--mps-root); set it")
        entry = spec.shared_by
        memory = entry.memory_limit if entry else None
        gpus = {d.unit.gpu.uuid: d.unit.gpu for d in spec.devices}
        daemon = MpsDaemon(
            spec.name,
            Path(root),
            list(gpus.values()),
            spec.replicas,
            memory_limit_mib=parse_quantity(memory) // (1 << 20) if memory else None,
            active_thread_percentage=entry.active_thread_percentage if entry else None,
            control_binary=self.control_binary,
            on_change=functools.partial(self._changed, spec.name),
        )
        self._keys[spec.name] = _key(spec)
        self.daemons[spec.name] = daemon
        try:
            await daemon.start()
        except MpsError as exc:
            log.error("%s: advertised as unhealthy until it starts", exc)
        self._tasks[spec.name] = spawn(f"mps {spec.name}", daemon.supervise())
        log.info("MPS control daemon for %s: ready=%s", spec.name, daemon.ready)

    async def _stop(self, name: str) -> None:
        task = self._tasks.pop(name, None)
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        daemon = self.daemons.pop(name)
        self._keys.pop(name, None)
        with contextlib.suppress(MpsError):
            await daemon.stop()
        # A resource no longer MPS-shared has no readiness to wait for.
        self.store.update(
            mps_ready={k: v for k, v in self.store.state.mps_ready.items() if k != name}
        )


def _key(spec: ResourceSpec) -> tuple[object, ...]:
    """What a running daemon was started for: a change restarts it."""
    entry = spec.shared_by
    gpus = tuple(sorted({d.unit.gpu.uuid for d in spec.devices}))
    limits = (entry.memory_limit, entry.active_thread_percentage) if entry else (None, None)
    return (gpus, spec.replicas, *limits)
