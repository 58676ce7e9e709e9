"""Where the live config comes from: a file or a node-selected named config, reloaded.

The daemon consumes `ConfigSource.updates()`: the first item is the config to start with,
later items arrive only when the effective config changes (or a reload fails). Files are
watched with inotify (`kubegpu.watch.PathWatch`) on the DIRECTORY that holds them, and the
path is resolved again on every event, so a ConfigMap volume renaming its `..data` symlink
over a new `..2026_...` directory is seen as it happens; without inotify the watch polls
`stat` every `POLL_INTERVAL`.

Every read runs in a worker thread (`asyncio.to_thread`), so a slow disk or a large file
never stalls gRPC, `/healthz` or SIGTERM. A file is applied only once it is known whole:
on a reload woken by inotify whose events show every write finished (closed, or renamed
into place as a ConfigMap swap does) one read is enough; otherwise (the first load, a
SIGHUP, polling, a file modified and still open) it must read the same twice,
`SETTLE_INTERVAL` apart, so a file rewritten in place is never applied half-written.
Only writes to the config's own file count (the path and, through a ConfigMap's symlinks,
the file it resolves to): a log or an editor's swap file held open beside it does not.
On a reload an empty or whitespace-only file is refused, keeping the last good config
(a ConfigMap being replaced can show up empty for a moment; taking it as "all defaults"
would silently turn sharing off).

Named configs follow NVIDIA's config-manager: a directory holds one file per config, the
node label `nvidia.com/device-plugin.config` picks one, and fallback strategies decide
when the label is unset. Changing the label switches the config live.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Protocol

from kubegpu.config.loader import load_config_bytes, read_bytes
from kubegpu.config.names import DEFAULT_NODE_LABEL
from kubegpu.config.v1 import Config
from kubegpu.errors import ConfigError
from kubegpu.kube import Kube, default_client
from kubegpu.supervisor import spawn
from kubegpu.watch import PathWatch

log = logging.getLogger(__name__)

#: `named`: the `default` config; `single`: the only config; `empty`: no config at all.
FALLBACK_STRATEGIES: Final = ("named", "single", "empty")
_SUFFIXES: Final = (".yaml", ".yml")


@dataclass(frozen=True)
class ConfigUpdate:
    """One item of `ConfigSource.updates()`: a new config, or why a reload failed."""

    #: The new effective config; `None` when this update reports an error.
    config: Config | None
    #: Why the (re)load failed; the daemon keeps running with its last good config.
    error: ConfigError | None
    #: Where it came from, for logs: "file /etc/kubegpu/config.yaml", "named config 'a100'...".
    origin: str


class NodeLabels(Protocol):
    """The value of one label on one node, now and on every change.

    Implementations are async generators: `async def watch(...)` with `yield`.
    """

    def watch(self, node: str, label: str) -> AsyncIterator[str | None]: ...


@dataclass(frozen=True)
class NamedConfigs:
    """A directory of named configs and how one is chosen for this node."""

    #: One file per config; the file name (less `.yaml`/`.yml`) is the config's name.
    directory: Path
    #: The config the `named` fallback picks when the node has no label.
    default: str | None = None
    #: Tried in order when the node label is unset: `named`, `single`, `empty`.
    fallback_strategies: tuple[str, ...] = ("named", "single")
    #: This node, to read its label; without it (or `labels`) only fallbacks apply.
    node_name: str | None = None
    label: str = DEFAULT_NODE_LABEL
    labels: NodeLabels | None = None
    #: How long the first load waits for the label before using the fallbacks.
    label_timeout: float = 30.0

    def __post_init__(self) -> None:
        for strategy in self.fallback_strategies:
            if strategy not in FALLBACK_STRATEGIES:
                raise ConfigError(
                    f"--fallback-strategies: unknown strategy (got {strategy!r}); "
                    f"use some of: {', '.join(FALLBACK_STRATEGIES)}"
                )


@dataclass(frozen=True)
class _Selection:
    path: Path | None
    origin: str
    error: ConfigError | None = None


#: A file's identity and version: inode and device, size, mtime, and the resolved path.
_Fingerprint = tuple[str, int, int, int, int] | None

#: Builds the effective config from a file's bytes (`None`: no file); runs in a thread.
Loader = Callable[[bytes | None, Mapping[str, Any], str], Config]


def _default_loader(data: bytes | None, overrides: Mapping[str, Any], source: str) -> Config:
    return load_config_bytes(data, overrides, source=source)


#: How often the config file and the named-config directory are checked where inotify is
#: unavailable (the fallback); with inotify nothing is polled.
POLL_INTERVAL = 0.2
#: A file is applied once two reads this far apart agree, unless inotify showed its write
#: finished. Short: a writer that is still writing after it sends inotify another event,
#: and the re-read that follows applies the finished file (docs/performance.md).
SETTLE_INTERVAL = 0.01
#: Reads, a settle interval apart, before a file that never stops changing is refused.
SETTLE_READS = 200


class ConfigSource:
    """The live config: the initial load, then one update per effective change."""

    def __init__(
        self,
        *,
        config_file: Path | None,
        overrides: Mapping[str, Any],
        named: NamedConfigs | None = None,
        poll_interval: float = POLL_INTERVAL,
        loader: Loader = _default_loader,
        settle_interval: float | None = None,
        reader: Callable[[Path], bytes] = read_bytes,
    ) -> None:
        self._config_file = config_file
        self._loader = loader
        self._reader = reader
        #: The gap between the two reads that must agree; a fallback poll at most.
        self._settle = (
            min(poll_interval, SETTLE_INTERVAL) if settle_interval is None else settle_interval
        )
        self._overrides = dict(overrides)
        self._named = named
        self._poll_interval = poll_interval
        self._wake = asyncio.Event()
        self._poked = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._label_value: str | None = None
        self._label_seen = asyncio.Event()

    def poke(self) -> None:
        """Re-read now even if nothing looks changed (SIGHUP). Safe from any thread."""
        loop = self._loop
        if loop is None or loop.is_closed():
            self._poked = True
            return
        try:
            running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            self._poke_now()
        else:
            loop.call_soon_threadsafe(self._poke_now)

    def _poke_now(self) -> None:
        self._poked = True
        self._wake.set()

    async def updates(self) -> AsyncIterator[ConfigUpdate]:
        """The initial config (or error), then an update per change; runs until closed."""
        self._loop = asyncio.get_running_loop()
        label_task = await self._start_label_watch()
        watched: list[Path] = []
        try:
            with PathWatch(
                lambda: watched,
                self._wake.set,
                poll_interval=self._poll_interval,
                name=self._watch_name(),
            ) as watch:
                async for update in self._follow(watch, watched):
                    yield update
        finally:
            if label_task is not None:
                label_task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await label_task

    async def _follow(self, watch: PathWatch, watched: list[Path]) -> AsyncIterator[ConfigUpdate]:
        """Check on every wake (file event, poke, label change); yield what is news."""
        last_key: object = None
        last: ConfigUpdate | None = None
        last_good: Config | None = None
        while True:
            forced, self._poked = self._poked, False
            selection = self._select()
            wanted = self._watched_paths(selection)
            if wanted != watched:
                # The label picked another file: cover it before reading it, so an edit
                # made while it loads still wakes us.
                watched[:] = wanted
                watch.rearm()
            key = (selection.path, selection.origin, str(selection.error), _stat(selection))
            if key != last_key or forced or last is None:
                last_key = key
                # Only a reload woken by the watch itself may trust its events.
                whole = watch.quiet if last is not None and not forced else None
                update = await self._load(
                    selection, reload=last is not None, whole=whole, writing=watch.writing
                )
                if _is_news(update, last, last_good):
                    last = update
                    if update.config is not None:
                        last_good = update.config
                    yield update
            await self._wait()

    async def _wait(self) -> None:
        """Until a watched path changes, a poke or a label change; no timer."""
        await self._wake.wait()
        self._wake.clear()

    def _watch_name(self) -> str:
        if self._named is not None:
            return f"named configs in {self._named.directory}"
        return f"config file {self._config_file}"

    def _watched_paths(self, selection: _Selection) -> list[Path]:
        """The named-config directory (entries come and go) and the selected file."""
        paths = [] if self._named is None else [self._named.directory]
        if selection.path is not None:
            paths.append(selection.path)
        return paths

    # -- choosing the file ---------------------------------------------------------------

    def _select(self) -> _Selection:
        if self._named is None:
            if self._config_file is None:
                return _Selection(None, "defaults (no config file)")
            return _Selection(self._config_file, f"file {self._config_file}")
        return select_named(self._named, self._label_value)

    async def _load(
        self,
        selection: _Selection,
        *,
        reload: bool,
        whole: Callable[[], bool] | None = None,
        writing: Callable[[], bool] = lambda: False,
    ) -> ConfigUpdate:
        """Read (settled), parse and validate off the loop; every failure is an update."""
        if selection.error is not None:
            return ConfigUpdate(None, selection.error, selection.origin)
        try:
            data = await self._read_settled(selection.path, whole, writing)
            if reload and data is not None and not data.strip():
                raise ConfigError(
                    f"{selection.path}: the file is empty; keeping the last good config "
                    "(write 'version: v1' for an all-defaults config)"
                )
            source = str(selection.path or "<defaults>")
            config = await asyncio.to_thread(self._loader, data, self._overrides, source)
        except ConfigError as exc:
            return ConfigUpdate(None, exc, selection.origin)
        except Exception as exc:  # a custom loader's bug must not end the daemon either
            error = ConfigError(f"{selection.origin}: cannot load the config ({exc!r:.200})")
            return ConfigUpdate(None, error, selection.origin)
        return ConfigUpdate(config, None, selection.origin)

    async def _read_settled(
        self,
        path: Path | None,
        whole: Callable[[], bool] | None = None,
        writing: Callable[[], bool] = lambda: False,
    ) -> bytes | None:
        """The file's bytes once known whole: `whole()` says so right after the read (no
        write open, nothing new queued), or two reads a settle interval apart agree while
        no write is known open (`writing()`: a writer that pauses mid-file, holding it open,
        must not get its valid prefix applied)."""
        if path is None:
            return None
        data = await asyncio.to_thread(self._reader, path)
        if whole is not None and whole():
            return data
        for attempt in range(SETTLE_READS):
            await asyncio.sleep(self._settle)
            again = await asyncio.to_thread(self._reader, path)
            if again == data and not writing():
                return data
            if attempt == 0:
                log.info("config file %s changed while being read; waiting for it to settle", path)
            data = again
        # A file rewritten without pause (a runaway writer) must not hold start-up or the
        # reload loop for ever: refuse it like any bad config; its next change is read again.
        raise ConfigError(
            f"{path}: the config file kept changing, or stayed open for writing, over "
            f"{SETTLE_READS} reads; keeping the last good config: write it once and close it "
            "(or rename a finished file over it)"
        )

    # -- the node label ------------------------------------------------------------------

    async def _start_label_watch(self) -> asyncio.Task[None] | None:
        named = self._named
        if named is None or named.labels is None:
            return None
        if named.node_name is None:
            log.warning("named configs: no node name (--node-name/NODE_NAME); label ignored")
            return None
        task = spawn(
            f"config-label-{named.node_name}",
            self._follow_label(named.labels, named.node_name, named.label),
        )
        try:
            async with asyncio.timeout(named.label_timeout):
                await self._label_seen.wait()
        except TimeoutError:
            log.warning(
                "node %s: label %s not read within %.0fs; using fallbacks until it is",
                named.node_name,
                named.label,
                named.label_timeout,
            )
        return task

    async def _follow_label(self, labels: NodeLabels, node: str, label: str) -> None:
        try:
            async for value in labels.watch(node, label):
                value = value or None  # an empty label value means "not set"
                if not self._label_seen.is_set() or value != self._label_value:
                    log.info("node %s: label %s=%s", node, label, value)
                    self._label_value = value
                    self._label_seen.set()
                    self._wake.set()
        except Exception as exc:  # the watch is advisory: keep the last value
            log.error("node %s: label watch stopped (%s); keeping %r", node, exc, self._label_value)
        finally:
            self._label_seen.set()  # never hold the first load waiting for a dead watch


def select_named(named: NamedConfigs, label_value: str | None) -> _Selection:
    """The named config for a label value (or the fallbacks when unset), as a selection."""
    try:
        available = available_configs(named.directory)
    except ConfigError as exc:
        return _Selection(None, f"named configs in {named.directory}", exc)
    names = ", ".join(sorted(available)) or "none"
    if label_value is not None:
        origin = f"named config {label_value!r} (node label {named.label})"
        if label_value in available:
            return _Selection(available[label_value], origin)
        return _Selection(
            None,
            origin,
            ConfigError(
                f"node label {named.label}: no config of that name in {named.directory} "
                f"(got {label_value!r}); use one of: {names}, or add it to the ConfigMap"
            ),
        )
    for strategy in named.fallback_strategies:
        if strategy == "named" and named.default is not None and named.default in available:
            origin = f"named config {named.default!r} (default; node label unset)"
            return _Selection(available[named.default], origin)
        if strategy == "single" and len(available) == 1:
            (only,) = available
            return _Selection(available[only], f"named config {only!r} (the only one)")
        if strategy == "empty":
            return _Selection(None, "defaults (fallback 'empty'; node label unset)")
    return _Selection(
        None,
        f"named configs in {named.directory}",
        ConfigError(
            f"node label {named.label}: not set and fallbacks "
            f"{','.join(named.fallback_strategies) or 'none'} chose nothing (got configs: {names}; "
            f"default {named.default!r}); label the node, set --default-config, "
            "or add 'empty' to --fallback-strategies"
        ),
    )


def available_configs(directory: Path) -> dict[str, Path]:
    """Config name -> file; hidden entries (a ConfigMap's `..data`) are skipped."""
    try:
        entries = sorted(directory.iterdir())
    except OSError as exc:
        raise ConfigError(
            f"{directory}: cannot list the named configs ({exc.strerror}); "
            "check --config-dir and the ConfigMap mount"
        ) from exc
    found: dict[str, Path] = {}
    for entry in entries:
        if entry.name.startswith(".") or not entry.is_file():
            continue
        name = entry.stem if entry.suffix in _SUFFIXES else entry.name
        # An exact file name wins over a suffixed one: `a` beats `a.yaml`.
        if name not in found or entry.name == name:
            found[name] = entry
    return found


def _stat(selection: _Selection) -> _Fingerprint:
    """What changes when the file does, including a ConfigMap swapping `..data`."""
    if selection.path is None:
        return None
    try:
        st = selection.path.stat()  # follows symlinks: the target's identity
        real = os.path.realpath(selection.path)
    except OSError:
        return None
    return (real, st.st_ino, st.st_dev, st.st_size, st.st_mtime_ns)


def _is_news(update: ConfigUpdate, last: ConfigUpdate | None, last_good: Config | None) -> bool:
    """Whether the consumer needs this update: a different config, a new error or a fix."""
    if last is None:
        return True
    if update.config is not None:
        return last.config is None or update.config != last_good
    return last.error is None or str(last.error) != str(update.error)


# -- node label watchers -----------------------------------------------------------------------


class FakeNodeLabels:
    """A `NodeLabels` for tests: `set(value)` is seen by every watcher at once.

    Call `set` from the event loop's thread.
    """

    def __init__(self, value: str | None = None) -> None:
        self.value = value
        #: (node, label) of every `watch` call, to assert what was watched.
        self.watched: list[tuple[str, str]] = []
        self._queues: list[asyncio.Queue[str | None]] = []

    def set(self, value: str | None) -> None:
        self.value = value
        for queue in self._queues:
            queue.put_nowait(value)

    async def watch(self, node: str, label: str) -> AsyncIterator[str | None]:
        self.watched.append((node, label))
        queue: asyncio.Queue[str | None] = asyncio.Queue()
        self._queues.append(queue)
        try:
            yield self.value
            while True:
                yield await queue.get()
        finally:
            self._queues.remove(queue)


class KubernetesNodeLabels:
    """Node labels from the Kubernetes API, through the `kubegpu.kube` adapter.

    The adapter reads the Node, then watches it by name off the event loop; failures (API
    errors, dropped connections, no credentials yet) are logged on one line and retried
    with backoff, they never end the watch. Default: the process's one client.
    """

    def __init__(self, kube: Kube | None = None) -> None:
        self._kube = kube

    def watch(self, node: str, label: str) -> AsyncIterator[str | None]:
        kube = self._kube if self._kube is not None else default_client()
        return kube.watch_node_label(node, label)


def named_configs(
    values: Mapping[str, Any], node_labels: NodeLabels | None = None
) -> NamedConfigs | None:
    """The named-config selection of `serve` and `labels`, from the settings both take
    (`config_dir`, `node_name`, `default_config`, `fallback_strategies`, `node_label`);
    None without a config directory. The node's label is read from the Kubernetes API
    unless `node_labels` says otherwise, and only when a node name is given."""
    directory = values.get("config_dir")
    if not directory:
        return None
    node = values.get("node_name")
    if node_labels is None and node:
        node_labels = KubernetesNodeLabels()
    # No strategies given (the CLI's empty list is None too): NVIDIA's chart default.
    fallbacks = values.get("fallback_strategies") or ("named", "single")
    return NamedConfigs(
        directory=Path(directory),
        default=values.get("default_config"),
        fallback_strategies=tuple(fallbacks),
        node_name=node,
        label=values.get("node_label") or DEFAULT_NODE_LABEL,
        labels=node_labels if node else None,
    )
