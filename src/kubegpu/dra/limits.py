"""Applying a sized claim's limits: its own MPS control daemon, its pods' kernel memory limit.

`ClaimLimiter` holds, for each prepared claim on memory-sized devices
(`kubegpu.dra.sizing`), what keeps its limits where a process in its containers cannot lift
them by changing its own environment:

- **a per-claim MPS control daemon** (`kubegpu.mps.MpsDaemon`, in
  `<mpsRoot>/kubegpu-claims/<claim UID>/{pipe,log}`) whose defaults are the claim's pinned
  device memory on each of its GPUs and its active thread percentage: every MPS server it
  starts, and so every client of the claim's containers, gets them. A client's
  `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` can only lower the daemon's value (NVIDIA's MPS
  documentation). The daemon is supervised and restarted with its limits;
- **the kernel path** where the node has it (`kubegpu.devices.nvml.memlimits`): a hard
  memory limit on each GPU for the cgroup of each pod the claim is reserved for.

Its claim's prepare waits for both, and fails with one line when either cannot be set: a
container must never start on a sized device without its limits. Unprepare stops the daemon
(`quit`), removes its directory and clears the cgroup limits. At start, the daemons of the
claims the checkpoint records are taken over (or started again) with their recorded limits,
and a daemon directory no record accounts for (a stop between starting a daemon and
recording it, or between dropping a record and stopping its daemon) is stopped and removed.

A stop of the plugin leaves the daemons running: they serve running containers. (In a
container, they end with the plugin's own container; the next start brings them back.)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from kubegpu import mps
from kubegpu.devices import Gpu
from kubegpu.dra.sizing import ClaimLimits, MemoryLimit
from kubegpu.errors import DeviceError, PreconditionError
from kubegpu.nvidia_paths import MPS_CONTROL_BINARY
from kubegpu.supervisor import spawn
from kubegpu.untrusted import escape, is_uid

log = logging.getLogger("kubegpu.dra")


class MemoryLimiter(Protocol):
    """Per-cgroup device memory limits (`kubegpu.devices.nvml.memlimits.NvmlMemoryLimits`);
    blocking calls, run in a thread."""

    def set_limit(self, uuid: str, cgroup: str, limit_bytes: int) -> None: ...

    def clear(self, uuid: str, cgroup: str) -> None: ...

    def pod_cgroup(self, pod_uid: str) -> str | None: ...


class LimitError(PreconditionError):
    """A claim's limits cannot be applied; the message is the claim's one line."""


class ClaimLimiter:
    """The per-claim MPS daemons and kernel limits of this node's sized claims."""

    def __init__(
        self,
        *,
        control_binary: str = MPS_CONTROL_BINARY,
        memory: MemoryLimiter | None = None,
        daemon_options: Mapping[str, Any] | None = None,
    ) -> None:
        self.control_binary = control_binary
        #: The kernel path, where the node has it.
        self.memory = memory
        #: Passed to every `MpsDaemon` (timeouts, intervals: tests make them short). A
        #: claim's prepare waits for its daemon: it is asked every 20 ms until it answers.
        self.daemon_options = {"probe_interval": 0.02, **(daemon_options or {})}
        self._warned_shm = False
        #: The supervised daemons by claim UID.
        self.daemons: dict[str, mps.MpsDaemon] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}

    # -- prepare ----------------------------------------------------------------------

    async def apply(
        self,
        uid: str,
        limits: ClaimLimits,
        gpus: Callable[[str], Gpu],
        pods: Sequence[str] = (),
    ) -> ClaimLimits:
        """Hold the claim to `limits`; the limits as applied (its cgroups), to record.
        `gpus` finds a GPU by UUID. Raises `LimitError`, having undone what it set."""
        cgroups: list[str] = []
        try:
            if limits.memory is MemoryLimit.NVML_CGROUP:
                cgroups = await self._kernel(limits, pods)
            if limits.mps:
                await self._start(uid, limits, gpus)
        except LimitError:
            await self._clear(limits.with_applied(cgroups=cgroups))
            raise
        return limits.with_applied(daemon_dir=limits.daemon_dir, cgroups=cgroups)

    async def _kernel(self, limits: ClaimLimits, pods: Sequence[str]) -> list[str]:
        memory = self.memory
        if memory is None:
            raise LimitError(
                "this node publishes kernel memory limits but the plugin cannot set them "
                "(NVML without the memory-limit calls); restart the plugin"
            )
        if not pods:
            raise LimitError(
                "it is reserved for no pod, so no cgroup can get its memory limit; the "
                "scheduler reserves a claim for its pod before the kubelet prepares it"
            )
        cgroups: list[str] = []
        try:
            for pod in pods:
                cgroup = await asyncio.to_thread(memory.pod_cgroup, pod)
                if cgroup is None:
                    raise LimitError(
                        f"the cgroup of pod {pod} is not under /sys/fs/cgroup/kubepods "
                        f"(cgroup v2, the kubelet's cgroupfs or systemd driver); its memory "
                        f"limit cannot be set"
                    )
                cgroups.append(cgroup)
                for device in limits.devices:
                    await asyncio.to_thread(
                        memory.set_limit, device.gpu_uuid, cgroup, device.memory_bytes
                    )
        except (DeviceError, LimitError) as exc:
            await self._clear(limits.with_applied(cgroups=cgroups))
            if isinstance(exc, LimitError):
                raise
            raise LimitError(str(exc)) from exc
        return cgroups

    def _daemon(self, uid: str, limits: ClaimLimits, gpus: Callable[[str], Gpu]) -> mps.MpsDaemon:
        directory = Path(limits.daemon_dir)
        try:
            found = [gpus(d.gpu_uuid) for d in limits.devices]
        except KeyError as exc:
            raise LimitError(f"its GPU {exc.args[0]} is not on this node any more") from None
        return mps.MpsDaemon(
            f"claim {uid}",
            directory.parent,
            found,
            1,
            memory_limits_mib=limits.memory_mib(),
            active_thread_percentage=limits.thread_percentage,
            control_binary=self.control_binary,
            directory=directory,
            **self.daemon_options,
        )

    async def _start(self, uid: str, limits: ClaimLimits, gpus: Callable[[str], Gpu]) -> None:
        await self._forget(uid)
        daemon = self._daemon(uid, limits, gpus)
        await asyncio.to_thread(self._check_shared_memory, daemon.dir.parent.parent)
        try:
            if daemon.dir.exists():
                # An earlier attempt's daemon may answer there: taken over, limits set again.
                await daemon.resume()
            else:
                await daemon.start()
        except mps.MpsError as exc:
            with contextlib.suppress(mps.MpsError):
                await daemon.stop()
            _remove(daemon.dir)
            raise LimitError(f"its MPS control daemon did not start: {exc}") from exc
        self._supervise(uid, daemon)

    def _check_shared_memory(self, mps_root: Path) -> None:
        """The claim's containers get `<mps root>/shm` as their /dev/shm (`mps.claim_edits`),
        which the MPS servers must share: create it (a runtime refuses a missing mount source)
        and say once if this process's /dev/shm is not it, as when `serve` runs outside the
        chart, which mounts it there."""
        shm = mps_root / "shm"
        try:
            shm.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise LimitError(f"cannot make the MPS shared memory directory {shm}: {exc}") from exc
        try:
            same = shm.samefile("/dev/shm")
        except OSError:  # no /dev/shm here at all
            same = False
        if not same and not self._warned_shm:
            self._warned_shm = True
            log.warning(
                "this process's /dev/shm is not %s, which the claims' containers get as theirs: "
                "their MPS clients cannot reach the servers on a GPU; mount %s at /dev/shm "
                "(the chart does)",
                shm,
                shm,
            )

    def _supervise(self, uid: str, daemon: mps.MpsDaemon) -> None:
        self.daemons[uid] = daemon
        self._tasks[uid] = spawn(f"mps claim {uid}", daemon.supervise())

    # -- unprepare --------------------------------------------------------------------

    async def release(self, uid: str, limits: ClaimLimits) -> None:
        """Stop the claim's daemon, remove its directory, clear its cgroups' limits. Never
        raises: what cannot be undone is logged (a cgroup's limits go with the cgroup)."""
        daemon = self.daemons.get(uid)
        await self._forget(uid)
        if limits.daemon_dir:
            if daemon is None:
                daemon = self._bare(uid, Path(limits.daemon_dir))
            with contextlib.suppress(mps.MpsError):
                await daemon.stop()
            _remove(Path(limits.daemon_dir))
        await self._clear(limits)

    async def _clear(self, limits: ClaimLimits) -> None:
        memory = self.memory
        if memory is None:
            return
        for cgroup in limits.cgroups:
            for device in limits.devices:
                try:
                    await asyncio.to_thread(memory.clear, device.gpu_uuid, cgroup)
                except DeviceError as exc:
                    log.warning(
                        "cannot clear a claim's memory limit (%s); it goes with the pod's cgroup",
                        exc,
                    )

    async def _forget(self, uid: str) -> None:
        """Stop supervising the claim's daemon (which keeps running)."""
        self.daemons.pop(uid, None)
        task = self._tasks.pop(uid, None)
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def _bare(self, uid: str, directory: Path) -> mps.MpsDaemon:
        """A handle on a daemon of an earlier process, enough to send it `quit`."""
        return mps.MpsDaemon(
            f"claim {uid}",
            directory.parent,
            [],
            1,
            control_binary=self.control_binary,
            directory=directory,
            **self.daemon_options,
        )

    # -- start and stop ---------------------------------------------------------------

    async def resume(
        self,
        records: Mapping[str, ClaimLimits],
        gpus: Callable[[str], Gpu],
        mps_root: str | None,
    ) -> None:
        """At start: take over (or start again) the daemon of every recorded claim, with its
        recorded limits; stop and remove every claim daemon directory under `mps_root`
        that no record accounts for."""
        wanted = {Path(limits.daemon_dir) for limits in records.values() if limits.mps}
        if mps_root is not None:
            for directory in _entries(Path(mps_root) / mps.CLAIMS_DIR):
                if directory not in wanted and is_uid(directory.name):
                    log.warning(
                        "stopping the MPS daemon of claim %s: no prepared claim records it "
                        "(the plugin stopped while preparing or unpreparing it)",
                        escape(directory.name),
                    )
                    with contextlib.suppress(mps.MpsError):
                        await self._bare(directory.name, directory).stop()
                    _remove(directory)
        for uid, limits in sorted(records.items()):
            if not limits.mps:
                continue
            try:
                daemon = self._daemon(uid, limits, gpus)
            except LimitError as exc:
                log.error("claim %s: cannot restart its MPS daemon: %s", escape(uid), exc)
                continue
            try:
                await daemon.resume()
            except mps.MpsError as exc:
                # Supervision keeps trying, with backoff, as for a daemon that died.
                log.error("claim %s: its MPS daemon is not answering yet: %s", escape(uid), exc)
            self._supervise(uid, daemon)

    async def close(self) -> None:
        """Stop supervising (the daemons keep serving their containers)."""
        for uid in list(self._tasks):
            await self._forget(uid)


def _entries(directory: Path) -> list[Path]:
    try:
        return sorted(p for p in directory.iterdir() if p.is_dir() and not p.is_symlink())
    except OSError:
        return []


def _remove(directory: Path) -> None:
    """Remove a claim daemon's directory (pipes, logs); only ever one named by a UID under
    the claims directory, never through a link."""
    if directory.parent.name != mps.CLAIMS_DIR or not is_uid(directory.name):
        log.error("not removing %s: not a claim daemon's directory", escape(str(directory), 300))
        return
    if directory.is_symlink():
        directory.unlink(missing_ok=True)
        return
    shutil.rmtree(directory, ignore_errors=True)


__all__ = ["ClaimLimiter", "LimitError", "MemoryLimiter"]
