"""CDI (Container Device Interface) specs for the node's GPUs.

With the `cdi-cri` / `cdi-annotations` device list strategies, `Allocate` answers with
CDI device names and the container runtime (containerd, CRI-O) applies the edits in the
spec written here: device nodes, driver libraries and tools as read-only bind mounts,
and `NVIDIA_VISIBLE_DEVICES=void` so a legacy NVIDIA hook in the same runtime does not
inject GPUs a second time. The kind is NVIDIA's `k8s.device-plugin.nvidia.com/gpu`, so
runtimes and pods configured for NVIDIA's plugin see the same names.

Two roots matter: `driver_root` is where the driver lives *on the host* (written into
`hostPath`s, which the runtime resolves), `container_driver_root` is where this process
sees that same tree (searched for files); they differ when the plugin runs in a pod that
mounts the host's driver root at, say, `/driver-root`. Symlinks are resolved inside the
tree, so `hostPath` always names a regular file even when the driver uses absolute links.

No hooks are written unless asked for: updating the container's ld cache needs
`nvidia-ctk` on the host, which this plugin can neither ship nor verify. Pass
`nvidia_ctk_path` when the host has it.

`CdiWriter` keeps the files of a running `serve` in step with the node's state: the
inventory or the config changes, the files follow.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import posixpath
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from kubegpu.allocation import (
    CDI_STRATEGIES,
    SIMULATED_DEVICE_NODE,
    ImexChannel,
    cdi_device_name,
    stands_in,
    under_root,
)
from kubegpu.config import Config
from kubegpu.devices.model import Gpu, Inventory, MigDevice
from kubegpu.errors import ConfigError

# NVIDIA's names and driver paths live in kubegpu.nvidia_paths; the aliases keep this
# module's names (KIND: Allocate names devices in it, see allocation.cdi_device_name).
from kubegpu.nvidia_paths import BINARIES as BINARIES
from kubegpu.nvidia_paths import BINARY_DIRS as BINARY_DIRS
from kubegpu.nvidia_paths import CDI_KIND as KIND
from kubegpu.nvidia_paths import CDI_VENDOR as VENDOR
from kubegpu.nvidia_paths import IPC_SOCKETS as IPC_SOCKETS
from kubegpu.nvidia_paths import LIBRARY_DIRS as LIBRARY_DIRS
from kubegpu.nvidia_paths import LIBRARY_PATTERNS as LIBRARY_PATTERNS
from kubegpu.nvidia_paths import OPTIONAL_CONTROL_DEVICES as OPTIONAL_CONTROL_NODES
from kubegpu.nvidia_paths import REQUIRED_CONTROL_DEVICES as REQUIRED_CONTROL_NODES
from kubegpu.nvidia_paths import gpu_device_node
from kubegpu.state import NodeState, NodeStore
from kubegpu.watch import Backoff

log = logging.getLogger(__name__)

#: The CDI spec version written; 0.6.0 is understood by containerd >= 1.7 and CRI-O >= 1.28.
CDI_VERSION = "0.6.0"
DEFAULT_DIRECTORY = "/var/run/cdi"
DEFAULT_NAME = "k8s.device-plugin.nvidia.com-gpu.json"
IMEX_KIND = f"{VENDOR}/imex-channel"

MOUNT_OPTIONS = ("ro", "nosuid", "nodev", "bind")


def gpu_name(gpu: Gpu, device_id_strategy: str) -> str:
    return str(gpu.index) if device_id_strategy == "index" else gpu.uuid


def mig_name(mig: MigDevice, device_id_strategy: str) -> str:
    return mig.index if device_id_strategy == "index" else mig.uuid


def generate_spec(
    inventory: Inventory,
    *,
    driver_root: str = "/",
    container_driver_root: str | None = None,
    device_id_strategy: str = "uuid",
    dev_root: str | None = None,
    nvidia_ctk_path: str | None = None,
) -> dict[str, Any]:
    """A CDI spec with one device per GPU and MIG slice, plus `all`.

    `dev_root` is the host directory whose `dev/` holds the device nodes (default: the
    driver root); optional nodes are looked for there when it is given, else under the
    local view of the driver root. Simulated GPUs' nodes are bound from `/dev/null`
    unless `dev_root` is given (`allocation.stands_in`). `nvidia_ctk_path` (host path)
    adds an `update-ldcache` createContainer hook for the mounted library directories.
    """
    if device_id_strategy not in ("uuid", "index"):
        raise ConfigError(f"device-id-strategy {device_id_strategy!r} is not one of: uuid, index")
    local_root = Path(container_driver_root or driver_root)
    host_dev_root = dev_root or driver_root
    local_dev_root = Path(dev_root) if dev_root else local_root
    # A simulated node has no /dev/nvidia*, and the runtime stats every host path.
    stand_in = stands_in(inventory.simulated, dev_root)

    def node(path: str) -> dict[str, Any]:
        entry: dict[str, Any] = {"path": path}
        if stand_in:
            entry["hostPath"] = SIMULATED_DEVICE_NODE
        elif host_dev_root not in ("", "/"):
            entry["hostPath"] = under_root(host_dev_root, path)
        return entry

    devices: list[dict[str, Any]] = []
    all_paths: dict[str, None] = {}
    for gpu in inventory.gpus:
        own = gpu.device_paths or (gpu_device_node(gpu.minor),)
        all_paths.update(dict.fromkeys(own))
        devices.append(_device(gpu_name(gpu, device_id_strategy), [node(p) for p in own]))
        for mig in gpu.mig_devices:
            paths = own + tuple(p for p in mig.device_paths if p not in own)
            all_paths.update(dict.fromkeys(paths))
            devices.append(_device(mig_name(mig, device_id_strategy), [node(p) for p in paths]))
    if devices:
        devices.append(_device("all", [node(p) for p in all_paths]))

    control = list(inventory.control_device_paths) or list(REQUIRED_CONTROL_NODES)
    control += [
        p for p in OPTIONAL_CONTROL_NODES if p not in control and _exists(local_dev_root, p)
    ]
    mounts = [
        *_mounts(find_libraries(local_root, inventory.driver_version), driver_root),
        *_mounts(find_binaries(local_root), driver_root),
        *_mounts(_find(local_root, IPC_SOCKETS), driver_root),
    ]
    edits: dict[str, Any] = {
        "env": ["NVIDIA_VISIBLE_DEVICES=void"],
        "deviceNodes": [node(p) for p in control],
        "mounts": mounts,
    }
    if nvidia_ctk_path:
        folders = sorted(
            {posixpath.dirname(m["containerPath"]) for m in mounts if ".so" in m["containerPath"]}
        )
        if folders:
            # newer toolkits ship the hooks as a separate `nvidia-cdi-hook` binary
            if posixpath.basename(nvidia_ctk_path) == "nvidia-cdi-hook":
                args = ["nvidia-cdi-hook", "update-ldcache"]
            else:
                args = ["nvidia-ctk", "hook", "update-ldcache"]
            for folder in folders:
                args += ["--folder", folder]
            edits["hooks"] = [
                {"hookName": "createContainer", "path": nvidia_ctk_path, "args": args}
            ]
    return {"cdiVersion": CDI_VERSION, "kind": KIND, "devices": devices, "containerEdits": edits}


def find_libraries(root: Path, driver_version: str = "") -> list[tuple[str, str]]:
    """Driver libraries under `root` as (path in the tree, real file it resolves to).

    Both are absolute paths as if `root` were `/`.

    Besides the fixed patterns, every `libnvidia-*.so.<driver version>` is taken, which
    catches the many small helper libraries a given driver ships without naming them.
    """
    patterns = list(LIBRARY_PATTERNS)
    if driver_version:
        patterns.append(f"libnvidia-*.so.{driver_version}")
    found: dict[str, str] = {}
    for rel_dir in LIBRARY_DIRS:
        directory = root / rel_dir
        if not directory.is_dir() or directory.is_symlink():
            continue  # `lib` -> `usr/lib` on merged-/usr systems: seen once is enough
        for pattern in patterns:
            for path in sorted(directory.glob(pattern)):
                rel = _rel(root, path)
                if rel in found:
                    continue
                real = resolve_in_root(root, path)
                if real is not None and real.is_file():
                    found[rel] = _rel(root, real)
    return sorted(found.items())


def find_binaries(root: Path) -> list[tuple[str, str]]:
    """Driver tools under `root`; mounted at `/usr/bin/<name>` whatever their host dir."""
    found: dict[str, str] = {}
    for name in BINARIES:
        for rel_dir in BINARY_DIRS:
            real = resolve_in_root(root, root / rel_dir / name)
            if real is not None and real.is_file():
                found[f"/usr/bin/{name}"] = _rel(root, real)
                break
    return sorted(found.items())


def resolve_in_root(root: Path, path: Path, _depth: int = 0) -> Path | None:
    """Follow symlinks as if `root` were `/`, so absolute links stay inside the tree."""
    if _depth > 40:
        return None  # a loop
    if not path.is_symlink():
        return path if path.exists() else None
    target = str(path.readlink())
    nxt = root / target.lstrip("/") if target.startswith("/") else path.parent / target
    return resolve_in_root(root, Path(posixpath.normpath(nxt)), _depth + 1)


def _find(root: Path, rel_paths: Iterable[str]) -> list[tuple[str, str]]:
    return [("/" + rel, "/" + rel) for rel in rel_paths if (root / rel).exists()]


def _mounts(found: Iterable[tuple[str, str]], host_root: str) -> list[dict[str, Any]]:
    return [
        {
            "hostPath": under_root(host_root, rel),
            "containerPath": container_path,
            "options": list(MOUNT_OPTIONS),
        }
        for container_path, rel in found
    ]


def _rel(root: Path, path: Path) -> str:
    return "/" + str(path.relative_to(root))


def _exists(root: Path, path: str) -> bool:
    return (root / path.lstrip("/")).exists()


def generate_imex_spec(
    channels: Sequence[ImexChannel], *, dev_root: str = "/"
) -> dict[str, Any] | None:
    """The `k8s.device-plugin.nvidia.com/imex-channel` spec: one device per channel ID.

    Allocate names `imex-channel=<id>` under the CDI strategies (as NVIDIA's plugin does),
    so this spec must sit next to the GPU one; None when no channel is selected.
    """
    if not channels:
        return None
    devices = []
    for channel in channels:
        node: dict[str, Any] = {"path": channel.path}
        if dev_root not in ("", "/"):
            node["hostPath"] = under_root(dev_root, channel.path)
        devices.append(_device(channel.id, [node]))
    return {"cdiVersion": CDI_VERSION, "kind": IMEX_KIND, "devices": devices}


#: Per mode (`flags.gdsEnabled`...): device node globs under /dev and, only when a node
#: exists, driver-root paths to mount: what NVIDIA's CDI generator writes for each mode.
MODES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "gdrcopy": (("gdrdrv",), ()),
    "gds": (("nvidia-fs*",), ("/run/udev", "/etc/cufile.json")),
    "mofed": (("infiniband/uverbs*", "infiniband/rdma_cm"), ()),
}


def spec_name(cdi_class: str) -> str:
    """The file name of our spec for a CDI class (`...-gpu.json`, `...-gds.json`)."""
    return f"{VENDOR}-{cdi_class}.json"


def generate_mode_spec(
    mode: str,
    *,
    driver_root: str = "/",
    container_driver_root: str | None = None,
    dev_root: str | None = None,
) -> dict[str, Any] | None:
    """The spec of `k8s.device-plugin.nvidia.com/<mode>` with one device, `all`.

    None when the node has none of the mode's device nodes: NVIDIA's plugin then writes
    no spec and Allocate names no such device (see `available_classes`).
    """
    globs, extra = MODES[mode]
    local_root = Path(container_driver_root or driver_root)
    local_dev = (Path(dev_root) if dev_root else local_root) / "dev"
    host_dev_root = dev_root or driver_root
    nodes = []
    for pattern in globs:
        for found in sorted(local_dev.glob(pattern)):
            path = "/dev/" + found.relative_to(local_dev).as_posix()
            entry: dict[str, Any] = {"path": path}
            if host_dev_root not in ("", "/"):
                entry["hostPath"] = under_root(host_dev_root, path)
            nodes.append(entry)
    if not nodes:
        return None
    edits: dict[str, Any] = {"deviceNodes": nodes}
    mounts = [
        {
            "hostPath": under_root(driver_root, p),
            "containerPath": p,
            "options": list(MOUNT_OPTIONS),
        }
        for p in extra
        if (local_root / p.lstrip("/")).exists()
    ]
    if mounts:
        edits["mounts"] = mounts
    return {
        "cdiVersion": CDI_VERSION,
        "kind": f"{VENDOR}/{mode}",
        "devices": [{"name": "all", "containerEdits": edits}],
    }


def available_classes(directory: str | Path) -> frozenset[str]:
    """The CDI classes of our vendor with a spec file in `directory` (what may be named)."""
    prefix = f"{VENDOR}-"
    try:
        names = [p.name for p in Path(directory).iterdir()]
    except OSError:
        return frozenset()
    return frozenset(
        n[len(prefix) : -len(ext)]
        for n in names
        for ext in (".json", ".yaml")
        if n.startswith(prefix) and n.endswith(ext)
    )


class ClassCache:
    """`available_classes(directory)`, listed again only when the directory changed.

    Allocate asks on every call; the answer changes only when a spec file is written,
    renamed in or removed, and each of those changes the directory's mtime, so one
    `stat` replaces the listing. A listing is trusted only when the directory's mtime
    was at least `settle_s` older than the listing (git's "racy clean" rule): file
    timestamps tick coarsely (a kernel jiffy, a second on some filesystems), so a change
    in the same tick as the listing could leave the mtime as it was.
    """

    def __init__(
        self,
        directory: str | Path,
        *,
        settle_s: float = 1.0,
        clock_ns: Callable[[], int] = time.time_ns,
    ) -> None:
        self.directory = Path(directory)
        self._settle_ns = int(settle_s * 1e9)
        self._clock_ns = clock_ns
        self._stamp: tuple[int, int, int] | None = None
        self._classes: frozenset[str] = frozenset()
        #: How many times the directory was listed (the cost the cache saves).
        self.listings = 0

    def get(self) -> frozenset[str]:
        try:
            st = self.directory.stat()
        except OSError:
            self._stamp = None
            return frozenset()
        stamp = (st.st_dev, st.st_ino, st.st_mtime_ns)
        if stamp == self._stamp:
            return self._classes
        now = self._clock_ns()
        self.listings += 1
        self._classes = available_classes(self.directory)
        settled = st.st_mtime_ns <= now - self._settle_ns
        self._stamp = stamp if settled else None
        return self._classes


def node_specs(
    inventory: Inventory, config: Config, *, container_driver_root: str | None = None
) -> dict[str, dict[str, Any]]:
    """Every spec file `serve` keeps in the CDI directory, by file name.

    The GPU spec, plus one per enabled mode (gds, mofed, gdrcopy) with device nodes on
    this node and one for the configured IMEX channels: Allocate names a class only when
    its file is there (`available_classes`), so these files are what turns those flags on.
    """
    flags = config.flags
    plugin = flags.plugin
    roots: dict[str, Any] = {
        "driver_root": flags.nvidia_driver_root,
        "container_driver_root": container_driver_root or plugin.container_driver_root,
        "dev_root": flags.nvidia_dev_root,
    }
    specs = {
        DEFAULT_NAME: generate_spec(
            inventory, device_id_strategy=plugin.device_id_strategy.value, **roots
        )
    }
    enabled = {"gds": flags.gds_enabled, "mofed": flags.mofed_enabled}
    enabled["gdrcopy"] = flags.gdrcopy_enabled
    for mode in (m for m, on in enabled.items() if on):
        spec = generate_mode_spec(mode, **roots)
        if spec is not None:
            specs[spec_name(mode)] = spec
    channels = [ImexChannel(str(n)) for n in config.imex.channel_ids]
    imex = generate_imex_spec(channels, dev_root=flags.dev_root)
    if imex is not None:
        specs[spec_name("imex-channel")] = imex
    return specs


def _device(name: str, nodes: list[dict[str, Any]]) -> dict[str, Any]:
    return {"name": name, "containerEdits": {"deviceNodes": nodes}}


def write_spec(
    spec: Mapping[str, Any],
    directory: str = DEFAULT_DIRECTORY,
    name: str = DEFAULT_NAME,
    *,
    format: str = "json",
) -> Path:
    """Write atomically (temp file + rename), mode 0644: a runtime never reads half a spec."""
    target_dir = Path(directory)
    target_dir.mkdir(parents=True, exist_ok=True)
    text = dump(spec, format)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{name}.", dir=target_dir)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        tmp.chmod(0o644)
        target = target_dir / name
        tmp.replace(target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return target


def update_spec(spec: Mapping[str, Any], directory: str, name: str) -> Path | None:
    """`write_spec` unless the file already holds exactly these bytes; the path if written.

    A config reload that changes nothing CDI-related then leaves the files (and the
    runtime's view of them) alone.
    """
    target = Path(directory) / name
    try:
        if target.read_bytes() == dump(spec).encode("utf-8"):
            return None
    except OSError:
        pass  # missing or unreadable: write it
    return write_spec(spec, directory, name)


def dump(spec: Mapping[str, Any], format: str = "json") -> str:
    if format == "yaml":
        return str(yaml.safe_dump(spec, sort_keys=False))
    if format == "json":
        return json.dumps(spec, indent=2) + "\n"
    raise ConfigError(f"--format {format!r} is not one of: json, yaml")


class CdiWriter:
    """Keeps the CDI spec files in `directory` up to date with the node's state.

    The files depend on the inventory and the config (strategies, modes such as
    `gdsEnabled`, IMEX channels), so only a change of either rewrites them, and a file
    whose bytes would not change is left alone. A class switched off loses its file, so
    Allocate stops naming it. A directory that cannot be written is logged, not fatal:
    the plugin keeps serving, the CDI names will not resolve.
    """

    def __init__(
        self,
        store: NodeStore,
        directory: Path | str = DEFAULT_DIRECTORY,
        *,
        backoff: Backoff | None = None,
    ) -> None:
        self.store = store
        self.directory = Path(directory)
        #: The config the spec files were last brought up to date for (None: not yet).
        self.config: Config | None = None
        self._inventory: Inventory | None = None
        #: Paces the retries of a write that failed (a full or read-only disk).
        self._backoff = backoff or Backoff(RETRY_FIRST_S, RETRY_MAX_S)

    async def follow(self, since: int) -> None:
        """Rewrite the specs for every state after version `since` whose inventory or
        config differs from those last written (a root task). A write that fails is
        retried, for the newest state, until it succeeds: start-up's own write too, so a
        spec directory that refused it (full, read-only for a while) gets the files as
        soon as it can take them, not at the next change of the node."""
        if not self._written(self.store.state):
            since = -1  # the store's current state first: what start-up could not write
        async for state in self.store.subscribe(since):
            if self._written(state):
                continue  # only health or MPS readiness moved
            while not await self.write(state):
                await self._backoff.wait()
                state = self.store.state
            self._backoff.reset()

    def _written(self, state: NodeState) -> bool:
        """Whether the files are those of `state`'s inventory and config."""
        return state.inventory is self._inventory and state.config is self.config

    async def write(self, state: NodeState) -> bool:
        """Bring the spec files up to date for `state` (off the loop: it reads the driver
        tree and writes files); False if they could not be written."""
        plugin = state.config.flags.plugin
        if CDI_STRATEGIES.isdisjoint(plugin.device_list_strategy) or not state.inventory.gpus:
            self.config, self._inventory = state.config, state.inventory
            return True
        directory = self.directory
        specs: dict[str, dict[str, Any]] = {}
        try:
            specs = await asyncio.to_thread(node_specs, state.inventory, state.config)
            for name, spec in specs.items():
                # Unchanged bytes are left alone: most reloads touch nothing CDI-related.
                path = await asyncio.to_thread(update_spec, spec, str(directory), name)
                if path is not None:
                    count = len(spec.get("devices", []))
                    log.info("wrote CDI spec %s (%d devices)", path, count)
            # A class switched off (gdsEnabled: false) must stop being named by Allocate.
            for cdi_class in available_classes(directory):
                stale = directory / spec_name(cdi_class)
                if stale.name not in specs and stale.exists():
                    stale.unlink()
                    log.info("removed CDI spec %s: no longer enabled", stale)
        except OSError as exc:
            withdrawn = await asyncio.to_thread(_withdraw_stale, directory, specs)
            log.error(
                "cannot write the CDI spec to %s (%s): %s; retrying in %.0fs "
                "(mount /var/run/cdi read-write, with room to write)",
                directory,
                exc,
                f"withdrew {', '.join(withdrawn)} so Allocate does not name devices it lacks"
                if withdrawn
                else "CDI device names will not resolve",
                self._backoff.delay,
            )
            return False
        self.config, self._inventory = state.config, state.inventory
        return True


#: First and longest wait between attempts to write the CDI specs again.
RETRY_FIRST_S = 1.0
RETRY_MAX_S = 60.0


def _withdraw_stale(directory: Path, wanted: Mapping[str, dict[str, Any]]) -> list[str]:
    """Remove the spec files that are not what `wanted` says they should be: Allocate names
    devices of a class only while its file is there, and an old file lacks new devices.
    Removing needs no free space, so it works on the full disk that stopped the write."""
    withdrawn = []
    for name, spec in wanted.items():
        path = directory / name
        try:
            if path.read_bytes() != dump(spec).encode("utf-8"):
                path.unlink()
                withdrawn.append(path.name)
        except OSError:
            continue  # absent already, or not ours to remove
    return withdrawn


__all__ = [
    "CDI_VERSION",
    "KIND",
    "CdiWriter",
    "ClassCache",
    "cdi_device_name",
    "find_binaries",
    "find_libraries",
    "generate_spec",
    "update_spec",
    "write_spec",
]
