"""The labelling loop: compute the node's labels, publish them, repeat.

`run_labeller` labels now and then every interval (GFD's `--sleep-interval`) until
stopped, with the config read on each pass: a plain file re-read (`config_loader`), or
the named config the node label picks, followed live (`LiveConfig`, as `kubegpu serve`
follows it). The backend is opened and closed on each pass (`discoverer`), as GFD does.
`follow_store` is `serve --with-labels`: the same pass over the daemon's own view (its
`NodeStore`), again whenever that view changes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import signal
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any

from kubegpu import devices
from kubegpu.config import Config, load_config
from kubegpu.config.names import INFINITE_NS, parse_go_duration
from kubegpu.config.source import (
    ConfigSource,
    ConfigUpdate,
)
from kubegpu.devices.host import read_machine_type
from kubegpu.devices.model import Inventory
from kubegpu.devices.pci import read_bus
from kubegpu.errors import ConfigError, InitError, KubegpuError
from kubegpu.labeller.sinks import FeatureFileSink, LabelSink
from kubegpu.labels import gpu_labels
from kubegpu.labels_amd import amd_labels
from kubegpu.state import NodeState, NodeStore
from kubegpu.supervisor import spawn

log = logging.getLogger("kubegpu.labeller")

#: Labels of one vendor's GPUs from the same snapshot and config (pure, no I/O).
VendorLabels = Callable[[Inventory, Config], Mapping[str, str]]
#: Vendors labelled besides NVIDIA (GFD's labels are built in, since they need the
#: labeller's sysfs reads). Another vendor's label module adds its function here.
VENDOR_LABELS: tuple[VendorLabels, ...] = (
    # AMD GPUs get ROCm's node labeller labels (none without AMD GPUs).
    lambda inventory, _config: amd_labels(inventory),
)


async def run_labeller(
    discover: Callable[[], Inventory],
    config: Callable[[], Config],
    sink: LabelSink,
    *,
    interval: float | None,
    machine_type: Callable[[], str | None] = lambda: None,
    timestamps: bool = True,
    sysfs_root: str | None = "/",
    clock: Callable[[], float] = time.time,
    stop: asyncio.Event | None = None,
    vendor_labels: Sequence[VendorLabels] = VENDOR_LABELS,
) -> int:
    """Label now, then every `interval` seconds until `stop` is set; returns publishes done.

    `interval` None labels once and returns (`--oneshot`); `math.inf` labels once and
    then waits for `stop` (`--sleep-interval=infinite`). A failure on the first pass
    propagates (the pod restarts and says why); later failures are logged and retried
    on the next pass, so an API server blip does not kill a healthy labeller.
    `sysfs_root` None skips the PCI scan (no `gpu.present` from the bus, no PCI class).
    """
    stop = stop or asyncio.Event()
    published = 0
    # GFD stamps the time its labelling loop started, not each pass: the label changes
    # only on a restart, so NFD does not rewrite the Node every interval.
    started = int(clock()) if timestamps else None
    while True:
        try:
            labels = await asyncio.to_thread(
                _compute, discover, config, machine_type, started, sysfs_root, vendor_labels
            )
            await sink.publish(labels)
            published += 1
            log.info("published %d labels", len(labels))
        except KubegpuError as exc:
            if published == 0 or interval is None:
                raise
            log.error("labelling failed, retrying in %ss: %s", interval, exc)
        if interval is None:
            return published
        timeout = None if math.isinf(interval) else interval
        try:
            await asyncio.wait_for(stop.wait(), timeout)
        except TimeoutError:
            continue
        return published


async def follow_store(store: NodeStore, sink: LabelSink | None = None) -> None:
    """`serve --with-labels`: publish the labels of the store's state (to `sink`, by
    default the config's `flags.gfd.outputFile`), again as soon as the inventory, health
    or config changes, else every sleep interval; a failure is logged and retried, never
    stops serving."""
    gfd = store.state.config.flags.gfd
    interval = parse_duration(gfd.sleep_interval)
    sink = sink or FeatureFileSink(gfd.output_file)
    # GFD stamps the time its loop started, not each pass, so NFD rewrites nothing.
    started = time.time()
    while True:
        state = store.state
        wait = interval
        try:
            await _label_state(state, sink, started)
        except KubegpuError as exc:
            wait = min(interval, 60)
            log.error("labelling failed, retrying in %.0f s: %s", wait, exc)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(_labels_stale(store, state), None if math.isinf(wait) else wait)


async def _label_state(state: NodeState, sink: LabelSink, started: float) -> None:
    """One labelling pass over `state` (a snapshot: the store may move meanwhile)."""
    gfd = state.config.flags.gfd
    await run_labeller(
        lambda: state.inventory.with_health(state.health),
        lambda: state.config,
        sink,
        interval=None,
        machine_type=lambda: read_machine_type(gfd.machine_type_file),
        timestamps=not gfd.no_timestamp,
        clock=lambda: started,
    )


async def _labels_stale(store: NodeStore, labelled: NodeState) -> None:
    """Until a state the labels depend on differs from `labelled` (MPS readiness and
    versions alone do not count)."""
    async for state in store.subscribe(labelled.version):
        if (state.inventory, state.config, state.health) != (
            labelled.inventory,
            labelled.config,
            labelled.health,
        ):
            return


def _compute(
    discover: Callable[[], Inventory],
    config: Callable[[], Config],
    machine_type: Callable[[], str | None],
    timestamp: int | None,
    sysfs_root: str | None,
    vendor_labels: Sequence[VendorLabels] = (),
) -> dict[str, str]:
    cfg = config()
    try:
        inventory = discover()
    except InitError as exc:
        if cfg.flags.fail_on_init_error:
            raise
        # GFD's behaviour with --fail-on-init-error=false: keep running, label what we know.
        log.warning("no GPUs could be read (%s); labelling without them", exc)
        inventory = Inventory(gpus=())
    bus = read_bus(sysfs_root) if sysfs_root is not None else None
    labels = gpu_labels(
        inventory,
        cfg,
        machine_type=machine_type(),
        timestamp=timestamp,
        present=None if bus is None else bus.present,
        pci_classes=None if bus is None else bus.classes,
        pci_configs=None if bus is None else bus.configs,
    )
    for vendor in vendor_labels:
        labels.update(vendor(inventory, cfg))
    return labels


def parse_duration(text: str) -> float:
    """Go-style duration (`60s`, `1m30s`, `500ms`) or `infinite`, in seconds: the config's
    own reader (`config.names.parse_go_duration`), as GFD's `--sleep-interval` is a Go
    duration."""
    try:
        ns = parse_go_duration(text)
    except ValueError:
        raise ValueError(
            f"invalid duration {text!r}; use e.g. 60s, 5m, 1h30m or infinite"
        ) from None
    return math.inf if ns >= INFINITE_NS else max(ns, 0) / 1e9


def config_loader(path: str | None, overrides: Mapping[str, Any]) -> Callable[[], Config]:
    """Re-read the config file on every pass (ConfigMap updates), keeping the last good one.

    The file and the flag/env overrides are validated together, as `serve` reads them: a
    value the file gets wrong and a flag sets right is no error."""
    last: list[Config] = []

    def load() -> Config:
        try:
            cfg = load_config(path or None, overrides)
        except ConfigError:
            if not last:
                raise
            log.exception("config became invalid; keeping the previous one")
            return last[0]
        last[:] = [cfg]
        return cfg

    return load


class LiveConfig:
    """The config a `ConfigSource` says is in force now; a callable for `run_labeller`.

    Reloads and label changes arrive in the background; a reload that fails keeps the
    last good config (and logs why), as the device plugin does.
    """

    def __init__(self, source: ConfigSource) -> None:
        self._source = source
        self._updates: AsyncIterator[ConfigUpdate] | None = None
        self._task: asyncio.Task[None] | None = None
        self._current: Config | None = None
        self._changed = asyncio.Event()

    async def start(self) -> Config:
        """The first config; raises its `ConfigError` when there is none to start with."""
        self._updates = aiter(self._source.updates())
        first = await anext(self._updates)
        if first.config is None:
            await self.close()
            raise first.error or ConfigError(f"{first.origin}: no config")
        log.info("config: %s", first.origin)
        self._current = first.config
        self._task = spawn("labeller-config", self._follow(self._updates))
        return first.config

    async def _follow(self, updates: AsyncIterator[ConfigUpdate]) -> None:
        async for update in updates:
            if update.config is None:
                log.error("config reload failed, keeping the previous one: %s", update.error)
                continue
            log.info("config: %s", update.origin)
            self._current = update.config
            self._changed.set()

    async def changed(self) -> Config:
        """Wait for the next config change (a reload or the node label); the new config."""
        self._changed.clear()
        await self._changed.wait()
        return self()

    def __call__(self) -> Config:
        if self._current is None:
            raise ConfigError("labeller config read before it was loaded")
        return self._current

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        closer = getattr(self._updates, "aclose", None)
        if closer is not None:
            await closer()


def discoverer(
    kind: str, *, simulate: str | None, driver_root: str, sysfs_root: str
) -> Callable[[], Inventory]:
    """Open the backend on each pass and close it again, as GFD does: no NVML handle is
    held between passes, so driver upgrades and MIG reconfigurations are picked up."""

    def discover() -> Inventory:
        # Looked up on each call, so a test's stand-in for `devices.open_backend` is used.
        backend = devices.open_backend(
            kind, simulate=simulate, driver_root=driver_root, sysfs_root=sysfs_root
        )
        try:
            return backend.discover()
        finally:
            backend.close()

    return discover


async def run_until_signalled(
    discover: Callable[[], Inventory],
    config: Callable[[], Config],
    sink: LabelSink,
    **kwargs: Any,
) -> int:
    """`run_labeller` with SIGTERM/SIGINT setting the stop flag (handlers only set it)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):  # not the main thread
            loop.add_signal_handler(sig, stop.set)
    return await run_labeller(discover, config, sink, stop=stop, **kwargs)
