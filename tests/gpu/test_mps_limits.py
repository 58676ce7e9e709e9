"""A sized claim's MPS memory limit holds on a real GPU, and its neighbour's use is untouched.

Two claims share one GPU the way kubegpu prepares sized claims (docs/sharing.md, "Sized
claims"): `kubegpu.dra.limits.ClaimLimiter` starts one real `nvidia-cuda-mps-control -d` per
claim, in `<root>/kubegpu-claims/<claim UID>/{pipe,log}`, and sets its defaults
(`set_default_device_pinned_mem_limit <UUID> <MiB>M`, `set_default_active_thread_percentage`).
Claim A holds 2 GiB of the GPU, claim B 4 GiB.

One client process per claim, with the environment kubegpu gives the claim's containers
(`mps.claim_edits`: `CUDA_MPS_PIPE_DIRECTORY`, `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`) as a
process outside a container sees it (the pipe directory at its host path, the claim's GPU as
`CUDA_VISIBLE_DEVICES`, the daemon's `CUDA_MPS_LOG_DIRECTORY`), allocates device memory
through the CUDA driver API (`libcuda.so.1` over ctypes, no framework). Each daemon lists its
own claim's client among those its MPS servers serve, and not the other's.
While B holds more memory than A's whole limit, A's allocation past its limit fails with
`CUDA_ERROR_OUT_OF_MEMORY` (with the GPU's free memory far above the request, so only the
limit can refuse it) and A fills up to at most its limit; B keeps running, allocates more
within its limit, writes all it holds, and is in turn stopped at its own, larger, limit. In
the `client-raises-its-limit` case A's client also sets `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`
above its claim's size in its own environment, as a process in a container could: the
daemon's limit must still hold.

"The metrics show both": the processes are read with `NvmlBackend.processes()`, the real
driver's process table as kubegpu's per-container metrics read it, and turned into
`kubegpu_container_gpu_memory_used_bytes` / `_limit_bytes` series by kubegpu's attribution
(`usage_rows`) and exposition (`Metrics.render`). The clients run outside pods, so what the
attribution is given stands in for the kubelet: each client's `/proc/<pid>/cgroup` (a fake
proc tree naming its pod, read by kubegpu's cgroup reader) and each claim's allocation with
its limit (the memory the claim consumed). What the hardware answers is whether the driver
lists each MPS client with the memory it holds.

Skipped, with the reason, where NVML sees no GPU, `libcuda.so.1` does not load,
`nvidia-cuda-mps-control` is not on PATH, the test is not root (kubegpu runs its MPS control
daemons as root), no GPU can host MPS limits (MIG off, compute capability 7.0 or later), the
GPU is not in the Default compute mode or has too little free memory.
docs/gpu-validation.md ("MPS limits") says how to run it.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import shutil
import sys
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pynvml
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kubegpu import mps
from kubegpu.devices import Gpu, GpuProcess
from kubegpu.devices.nvml import NvmlBackend
from kubegpu.dra.limits import ClaimLimiter
from kubegpu.dra.sizing import ClaimLimits, ComputeLimit, DeviceLimit, MemoryLimit
from kubegpu.metrics import Metrics, UsageSnapshot
from kubegpu.nvidia_paths import MPS_CONTROL_BINARY
from kubegpu.resources import Unit
from kubegpu.usage.attribution import Allocation, Holder, usage_rows
from kubegpu.usage.cgroup import read_cgroup
from tests.usage_fixtures import ProcTree, cgroup_line, container_id, pod_uid
from tests.waiting import WAIT, eventually

MIB = 1 << 20
#: The CUDA driver's CUDA_ERROR_OUT_OF_MEMORY.
OUT_OF_MEMORY = 2
#: What each claim consumed of the GPU (its pinned-memory limit), and its shares of 4.
LIMIT_A_MIB, SHARES_A = 2048, 1
LIMIT_B_MIB, SHARES_B = 4096, 2
TOTAL_SHARES = 4
#: B holds more than A's whole limit while A hits its own: the limits are per claim.
B_FIRST_MIB = 2560
B_MORE_MIB = 512
#: A's single allocation past its limit.
A_OVER_MIB = LIMIT_A_MIB + 1024
FILL_CHUNK_MIB = 256
#: Free memory the GPU needs at the start: both claims' limits, A's refused request, the
#: MPS servers' and contexts' own memory, with room to spare.
NEEDED_FREE_MIB = 12 * 1024
#: The form NVIDIA's MPS documentation gives (`<device ordinal>=<size>`); the client sees
#: its one GPU as device 0.
RAISED_CLIENT_LIMIT = "0=8G"
NAMESPACE = "gpu-test"

# A claim's workload, reduced to what the limit is about: the CUDA driver API over ctypes
# (libcuda.so.1 ships with the driver; no framework needed). One command per stdin line,
# one JSON answer per stdout line:
#   alloc <MiB>          one allocation, kept on success       {"rc", "held_mib"}
#   fill <chunk> <max>   allocations of <chunk> MiB until one fails or <max> MiB are held
#   touch                write every byte held and synchronise (the context still works)
#   quit                 free everything and exit
CLIENT = r"""
import ctypes, json, sys

MIB = 1 << 20
cuda = ctypes.CDLL("libcuda.so.1")
ptr_t = ctypes.c_uint64  # CUdeviceptr on 64-bit
cuda.cuMemAlloc_v2.argtypes = [ctypes.POINTER(ptr_t), ctypes.c_size_t]
cuda.cuMemFree_v2.argtypes = [ptr_t]
cuda.cuMemsetD8_v2.argtypes = [ptr_t, ctypes.c_ubyte, ctypes.c_size_t]
held = []


def say(**fields):
    print(json.dumps(fields), flush=True)


def held_mib():
    return sum(mib for _, mib in held)


def alloc(mib):
    ptr = ptr_t()
    rc = cuda.cuMemAlloc_v2(ctypes.byref(ptr), mib * MIB)
    if rc == 0:
        held.append((ptr, mib))
    return rc


def start():
    rc = cuda.cuInit(0)
    if rc:
        return rc, "cuInit"
    dev = ctypes.c_int()
    rc = cuda.cuDeviceGet(ctypes.byref(dev), 0)
    if rc:
        return rc, "cuDeviceGet"
    ctx = ctypes.c_void_p()
    rc = cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)
    if rc:
        return rc, "cuDevicePrimaryCtxRetain"
    return cuda.cuCtxSetCurrent(ctx), "cuCtxSetCurrent"


rc, step = start()
say(rc=rc, step=step)
if rc:
    sys.exit(1)
for line in sys.stdin:
    verb, *args = line.split()
    if verb == "alloc":
        say(rc=alloc(int(args[0])), held_mib=held_mib())
    elif verb == "fill":
        chunk, most = int(args[0]), int(args[1])
        rc = 0
        while rc == 0 and held_mib() + chunk <= most:
            rc = alloc(chunk)
        say(rc=rc, held_mib=held_mib())
    elif verb == "touch":
        rc = 0
        for ptr, mib in held:
            rc = rc or cuda.cuMemsetD8_v2(ptr, 0x5A, mib * MIB)
        say(rc=rc or cuda.cuCtxSynchronize(), held_mib=held_mib())
    elif verb == "quit":
        break
for ptr, _ in held:
    cuda.cuMemFree_v2(ptr)
"""


def _libcuda_loads() -> str | None:
    """None when the CUDA driver library loads, else why not."""
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        return str(exc)
    return None


def _free_mib(gpu: Gpu) -> int:
    """The GPU's free memory now, as NVML reports it."""
    pynvml.nvmlInit()  # counted: the backend's session stays open
    try:
        handle = pynvml.nvmlDeviceGetHandleByUUID(gpu.uuid)
        return int(pynvml.nvmlDeviceGetMemoryInfo(handle).free) // MIB
    finally:
        pynvml.nvmlShutdown()


def _compute_mode(gpu: Gpu) -> int:
    """The GPU's compute mode (`NVML_COMPUTEMODE_*`)."""
    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByUUID(gpu.uuid)
        return int(pynvml.nvmlDeviceGetComputeMode(handle))
    finally:
        pynvml.nvmlShutdown()


@pytest.fixture
def mps_gpu(nvml_backend: NvmlBackend) -> Gpu:
    """The first GPU that can host MPS memory limits; skips with the reason otherwise."""
    problem = _libcuda_loads()
    if problem is not None:
        pytest.skip(f"the CUDA driver library libcuda.so.1 does not load: {problem}")
    if shutil.which(MPS_CONTROL_BINARY) is None:
        pytest.skip(f"{MPS_CONTROL_BINARY} is not on PATH (it ships with the NVIDIA driver)")
    if os.geteuid() != 0:
        pytest.skip("not root: kubegpu runs its MPS control daemons as root; run as root")
    gpus = nvml_backend.discover().gpus
    usable = [g for g in gpus if not g.mig_enabled and g.compute_capability >= (7, 0)]
    if not usable:
        pytest.skip(
            "no GPU with MIG off and compute capability 7.0 or later "
            "(MPS memory limits need Volta or newer)"
        )
    gpu = usable[0]
    if _compute_mode(gpu) != pynvml.NVML_COMPUTEMODE_DEFAULT:
        # Exclusive-process mode allows one context, so one MPS server: kubegpu leaves the
        # mode at Default for several claims' servers (docs/sharing.md).
        pytest.skip(
            f"GPU {gpu.index} is not in the Default compute mode; two claims' MPS servers "
            f"need it (nvidia-smi -i {gpu.index} -c DEFAULT)"
        )
    free = _free_mib(gpu)
    if free < NEEDED_FREE_MIB:
        pytest.skip(f"GPU {gpu.index} has {free} MiB free; the test needs {NEEDED_FREE_MIB} MiB")
    return gpu


@dataclass
class Claim:
    """One claim's limits as applied, its pod and its client process."""

    name: str
    pod: int
    limits: ClaimLimits
    #: Its MPS control daemon, as `ClaimLimiter` supervises it.
    daemon: mps.MpsDaemon
    client: Client | None = None

    @property
    def uid(self) -> str:
        return Path(self.limits.daemon_dir).name

    @property
    def limit_mib(self) -> int:
        return self.limits.devices[0].memory_mib

    def env(self, extra: Mapping[str, str]) -> dict[str, str]:
        """What kubegpu gives the claim's containers, with the pipe directory at its host
        path (a container has it mounted at /tmp/nvidia-mps) and the claim's GPU as the
        only visible one (a container is given only that GPU). Inherited MPS variables are
        dropped: only the claim's own count."""
        base = {k: v for k, v in os.environ.items() if not k.startswith("CUDA_MPS_")}
        directory = Path(self.limits.daemon_dir)
        return {
            **base,
            **mps.claim_edits(directory, self.limits.thread_percentage).envs,
            "CUDA_MPS_PIPE_DIRECTORY": str(directory / "pipe"),
            "CUDA_MPS_LOG_DIRECTORY": str(directory / "log"),
            "CUDA_VISIBLE_DEVICES": self.limits.devices[0].gpu_uuid,
            **extra,
        }

    async def mps_clients(self) -> set[int]:
        """The PIDs its daemon's MPS servers serve (`get_server_list`, `get_client_list`)."""
        found: set[int] = set()
        for server in (await self.daemon.command("get_server_list")).split():
            listed = await self.daemon.command(f"get_client_list {server}")
            found.update(int(pid) for pid in listed.split() if pid.isdigit())
        return found

    def logs(self) -> str:
        """The tail of its MPS daemon's and servers' logs, for a failure's message."""
        tails = []
        for path in sorted(Path(self.limits.daemon_dir, "log").glob("*")):
            with contextlib.suppress(OSError):
                tail = path.read_text(errors="replace").splitlines()[-15:]
                tails.append(f"--- {path.name}\n" + "\n".join(tail))
        return "\n".join(tails) or "(no MPS logs)"


class Client:
    """A client process of one claim, driven one command at a time."""

    def __init__(self, claim: Claim, proc: asyncio.subprocess.Process, stderr: Path) -> None:
        self.claim = claim
        self.proc = proc
        self.stderr = stderr

    @classmethod
    async def start(
        cls, claim: Claim, root: Path, extra: Mapping[str, str] | None = None
    ) -> Client:
        stderr = root / f"client-{claim.name}.stderr"
        with stderr.open("wb") as err:
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-I",
                "-c",
                CLIENT,
                env=claim.env(extra or {}),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=err,
            )
        client = cls(claim, proc, stderr)
        claim.client = client
        ready = await client._answer()
        assert ready["rc"] == 0, client.describe(f"CUDA did not start: {ready}")
        return client

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def running(self) -> bool:
        return self.proc.returncode is None

    async def ask(self, command: str) -> dict[str, Any]:
        stdin = self.proc.stdin
        assert stdin is not None
        stdin.write(f"{command}\n".encode())
        await stdin.drain()
        return await self._answer()

    async def _answer(self) -> dict[str, Any]:
        stdout = self.proc.stdout
        assert stdout is not None
        line = await asyncio.wait_for(stdout.readline(), WAIT)
        assert line, self.describe("the client ended without answering")
        answer: dict[str, Any] = json.loads(line)
        return answer

    async def stop(self) -> None:
        """Ask it to free what it holds and exit; kill it if it does not."""
        if self.running:
            stdin = self.proc.stdin
            if stdin is not None and not stdin.is_closing():
                with contextlib.suppress(ConnectionError):
                    stdin.write(b"quit\n")
                    stdin.close()
            try:
                await asyncio.wait_for(self.proc.wait(), WAIT)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()

    def describe(self, what: str) -> str:
        try:
            err = self.stderr.read_text(errors="replace")[-2000:]
        except OSError:
            err = ""
        return f"claim {self.claim.name}: {what}\nclient stderr: {err}\n{self.claim.logs()}"


def _limits(root: Path, gpu: Gpu, limit_mib: int, shares: int) -> ClaimLimits:
    """A sized claim's limits on one GPU, its daemon where kubegpu puts it."""
    device = DeviceLimit("gpu-0", gpu.uuid, limit_mib * MIB, shares, TOTAL_SHARES)
    return ClaimLimits(
        (device,),
        MemoryLimit.MPS_PINNED,
        ComputeLimit.MPS_THREADS,
        daemon_dir=str(mps.claim_dir(root, str(uuid.uuid4()))),
    )


@pytest.fixture
async def claims(mps_gpu: Gpu, socket_dir: Path) -> AsyncIterator[tuple[Claim, Claim]]:
    """Claims A (2 GiB, 1 share) and B (4 GiB, 2 shares) on one GPU, each with its own MPS
    control daemon started and configured by `ClaimLimiter`; released afterwards."""
    limiter = ClaimLimiter(daemon_options={"ready_timeout": WAIT, "command_timeout": WAIT})
    root = socket_dir / "mps"  # short: the MPS pipe directory holds unix sockets
    by_uuid = {mps_gpu.uuid: mps_gpu}
    made: list[Claim] = []
    try:
        for name, pod, limit, shares in (
            ("a", 1, LIMIT_A_MIB, SHARES_A),
            ("b", 2, LIMIT_B_MIB, SHARES_B),
        ):
            wanted = _limits(root, mps_gpu, limit, shares)
            uid = Path(wanted.daemon_dir).name
            applied = await limiter.apply(uid, wanted, by_uuid.__getitem__)
            daemon = limiter.daemons[uid]
            assert daemon.ready
            made.append(Claim(name, pod, applied, daemon))
        yield made[0], made[1]
    finally:
        for claim in made:
            if claim.client is not None:
                await claim.client.stop()
        for claim in made:
            await limiter.release(claim.uid, claim.limits)
        await limiter.close()
    for claim in made:
        assert not Path(claim.limits.daemon_dir).exists(), "release left the daemon directory"


def _by_pid(nvml_backend: NvmlBackend, gpu: Gpu) -> dict[int, GpuProcess]:
    return {p.pid: p for p in nvml_backend.processes().processes if p.uuid == gpu.uuid}


def _series(text: str, family: str) -> dict[str, float]:
    """pod -> value of one per-container family, on the scraped text."""
    return {
        s.labels.get("pod", ""): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == family
    }


def _scrape(nvml_backend: NvmlBackend, gpu: Gpu, proc: ProcTree, a: Claim, b: Claim) -> str:
    """/metrics' per-container series for the GPU now: the real process table, attributed
    through the clients' cgroups to the two claims' allocations."""
    table = nvml_backend.processes()
    inventory = nvml_backend.discover()
    unit = Unit(gpu.uuid, str(gpu.index), gpu)
    allocations = [
        Allocation(
            Holder(NAMESPACE, f"pod-{c.name}", "main", f"claim-{c.name}", pod_uid(c.pod)),
            unit,
            c.limit_mib * MIB,
        )
        for c in (a, b)
    ]
    owners = {p.pid: read_cgroup(proc.root, p.pid) for p in table.processes}
    rows = usage_rows(table, owners, allocations, inventory)
    metrics = Metrics()
    metrics.follow_usage(lambda: UsageSnapshot(rows=tuple(rows), sources={"processes": True}))
    return metrics.render().decode()


@pytest.mark.parametrize(
    "a_env",
    [{}, {"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": RAISED_CLIENT_LIMIT}],
    ids=["plain", "client-raises-its-limit"],
)
async def test_a_claim_past_its_memory_gets_out_of_memory_while_its_neighbour_runs(
    nvml_backend: NvmlBackend,
    mps_gpu: Gpu,
    claims: tuple[Claim, Claim],
    socket_dir: Path,
    a_env: dict[str, str],
) -> None:
    a, b = claims
    gpu = mps_gpu

    # B holds more than A's whole limit before A starts.
    client_b = await Client.start(b, socket_dir)
    got = await client_b.ask(f"alloc {B_FIRST_MIB}")
    assert got["rc"] == 0, client_b.describe(f"B could not allocate within its limit: {got}")

    client_a = await Client.start(a, socket_dir, a_env)
    free = await asyncio.to_thread(_free_mib, gpu)
    assert free > A_OVER_MIB + 1024, f"only {free} MiB free: an out-of-memory would prove nothing"
    # Each client runs under its own claim's MPS daemon (not without MPS, which no limit
    # would hold, nor under its neighbour's).
    served = {c.name: await c.mps_clients() for c in (a, b)}
    assert client_a.pid in served["a"] and client_a.pid not in served["b"], served
    assert client_b.pid in served["b"] and client_b.pid not in served["a"], served

    over = await client_a.ask(f"alloc {A_OVER_MIB}")
    assert over["rc"] == OUT_OF_MEMORY, client_a.describe(
        f"one allocation of {A_OVER_MIB} MiB against a {LIMIT_A_MIB} MiB limit, with {free} MiB "
        f"free on the GPU: {over}"
    )
    filled = await client_a.ask(f"fill {FILL_CHUNK_MIB} {2 * LIMIT_A_MIB}")
    assert filled["rc"] == OUT_OF_MEMORY, client_a.describe(f"filling did not stop: {filled}")
    held_a = int(filled["held_mib"])
    # Up to its limit and not past it (the context's own memory may count against it).
    assert LIMIT_A_MIB // 2 <= held_a <= LIMIT_A_MIB, client_a.describe(f"A filled {filled}")

    # B was not disturbed: still running, still allocating within its limit, its memory
    # writable.
    assert client_b.running, client_b.describe("B ended while A ran out of memory")
    more = await client_b.ask(f"alloc {B_MORE_MIB}")
    assert more["rc"] == 0, client_b.describe(f"B could not allocate more after A's OOM: {more}")
    touched = await client_b.ask("touch")
    assert touched["rc"] == 0, client_b.describe(f"B's memory is not usable: {touched}")
    held_b = int(touched["held_mib"])
    assert held_b == B_FIRST_MIB + B_MORE_MIB

    # The metrics show both: each client with what it holds, beside its claim's limit.
    proc = ProcTree(socket_dir / "proc")
    for claim, client in ((a, client_a), (b, client_b)):
        proc.put(client.pid, cgroup_line(pod_uid(claim.pod), container_id(claim.pod)))

    def both_listed() -> bool:
        seen = _by_pid(nvml_backend, gpu)
        return all(
            (p := seen.get(c.pid)) is not None and (p.used_memory_bytes or 0) >= held * MIB
            for c, held in ((client_a, held_a), (client_b, held_b))
        )

    with contextlib.suppress(TimeoutError):
        await eventually(both_listed)
    assert both_listed(), (
        f"NVML does not list both clients (pids {client_a.pid}, {client_b.pid}) with the "
        f"memory they hold ({held_a}, {held_b} MiB): {_by_pid(nvml_backend, gpu)}; if the "
        "pids differ, the test runs in a PID namespace other than the driver's"
    )
    text = await asyncio.to_thread(_scrape, nvml_backend, gpu, proc, a, b)
    used = _series(text, "kubegpu_container_gpu_memory_used_bytes")
    limit = _series(text, "kubegpu_container_gpu_memory_limit_bytes")
    assert used["pod-a"] >= held_a * MIB and used["pod-b"] >= held_b * MIB, text
    assert limit["pod-a"] == LIMIT_A_MIB * MIB and limit["pod-b"] == LIMIT_B_MIB * MIB, text

    # B's own, larger, limit holds as well.
    last = await client_b.ask(f"fill {FILL_CHUNK_MIB} {2 * LIMIT_B_MIB}")
    assert last["rc"] == OUT_OF_MEMORY, client_b.describe(f"B's filling did not stop: {last}")
    assert LIMIT_A_MIB < int(last["held_mib"]) <= LIMIT_B_MIB, client_b.describe(f"B: {last}")
    assert client_a.running, client_a.describe("A ended after its out-of-memory")
