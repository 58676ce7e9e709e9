"""`DRAKubelet`: the kubelet's DRA side for one node (plugin watcher + DRA manager).

It composes `watcher.PluginWatcher` (plugins_registry), `plugins.DRAPluginManager` (the
"DRAPlugin" handler: registered drivers and their connections) and `manager.DRAManager`
(claims, checkpoint, prepare/unprepare), the way `pkg/kubelet/kubelet.go` wires the DRA
manager's `GetWatcherHandler()` into the plugin manager. Run it alone, or hand it to
`KubeletEmulator(dra=...)` to serve device plugins and DRA drivers side by side.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from kubegpu.kubelet.changes import Changes
from tests.rig.dra.manager import ClaimReader, DRACall, DRAManager
from tests.rig.dra.plugins import (
    CALL_TIMEOUT,
    HEALTH_RETRY,
    WIPING_DELAY,
    DRAPlugin,
    DRAPluginManager,
    SliceWiper,
)
from tests.rig.dra.watcher import (
    DRA_PLUGIN_TYPE,
    RETRY_INITIAL,
    PluginWatcher,
    RegistrationAttempt,
)

log = logging.getLogger("tests.rig.dra")

#: The kubelet's directories under its root (`/var/lib/kubelet`).
PLUGINS_REGISTRY = "plugins_registry"
PLUGINS = "plugins"


class SliceStore(Protocol):
    """The API's ResourceSlices as `FakeKube` holds them."""

    resource_slices: dict[str, dict[str, Any]]

    def delete_resource_slice(self, name: str) -> bool: ...


def node_slice_wiper(kube: SliceStore, node: str) -> SliceWiper:
    """Deletes the node's ResourceSlices (of one driver, or all) as the kubelet does.

    The kubelet deletes by field selector `spec.nodeName=<node>[,spec.driver=<driver>]`.
    """

    def wipe(driver: str | None) -> None:
        for name, body in list(kube.resource_slices.items()):
            spec = body.get("spec") or {}
            if spec.get("nodeName") == node and driver in (None, spec.get("driver")):
                kube.delete_resource_slice(name)

    return wipe


class DRAKubelet:
    """The kubelet's DRA side, rooted at `root` (stands for /var/lib/kubelet).

    `kube` serves `get_resource_claim` (FakeKube). With `wipe` (see `node_slice_wiper`) the
    node's ResourceSlices are deleted when it starts and `wiping_delay` seconds after a
    driver lost its last connected plugin, as the kubelet does; without, slices are left.
    `retry_initial` is the first backoff of a failed registration (the kubelet's 0.5 s);
    `health_retry` the wait before a driver's health stream is opened again (5 s).
    """

    def __init__(
        self,
        root: Path,
        kube: ClaimReader,
        *,
        registry_dir: Path | None = None,
        retry_initial: float = RETRY_INITIAL,
        call_timeout: float = CALL_TIMEOUT,
        wiping_delay: float = WIPING_DELAY,
        wipe: SliceWiper | None = None,
        health_retry: float = HEALTH_RETRY,
    ) -> None:
        self.root = Path(root)
        self.registry_dir = registry_dir or self.root / PLUGINS_REGISTRY
        self.changes = Changes()
        self.plugins = DRAPluginManager(
            call_timeout=call_timeout,
            wiping_delay=wiping_delay,
            wipe=wipe,
            on_change=self._notify,
            health_retry=health_retry,
        )
        self.watcher = PluginWatcher(
            self.registry_dir,
            {DRA_PLUGIN_TYPE: self.plugins},
            retry_initial=retry_initial,
            on_change=self._notify,
        )
        self.manager = DRAManager(kube, self.plugins, self.root, on_change=self._notify)
        self._running = False

    @property
    def plugins_dir(self) -> Path:
        """Where drivers put their service sockets (`/var/lib/kubelet/plugins`)."""
        return self.root / PLUGINS

    @property
    def running(self) -> bool:
        return self._running

    async def start(self) -> None:
        """Start as the kubelet does: load the checkpoint, wipe slices, watch the registry."""
        if self._running:
            raise RuntimeError("the DRA side of the kubelet emulator is already running")
        self.root.mkdir(parents=True, exist_ok=True)
        self.manager.load()
        self.plugins.start()
        await self.watcher.start()
        self._running = True
        log.info(
            "kubelet DRA side watching %s (%d claims restored)",
            self.registry_dir,
            len(self.manager.cache),
        )
        await self._notify()

    async def stop(self) -> None:
        """Stop like a kubelet exit: connections dropped, only the checkpoint remains."""
        if not self._running:
            return
        self._running = False
        await self.watcher.stop()
        await self.plugins.stop()
        await self._notify()

    async def restart(self) -> None:
        """A kubelet restart: sockets found again, claims reloaded from the checkpoint."""
        await self.stop()
        await self.start()

    async def __aenter__(self) -> DRAKubelet:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # ------------------------------------------------------------ pods

    async def prepare(self, pod: dict[str, Any]) -> None:
        """Prepare the pod's claims; `PrepareError` as the kubelet would report it."""
        self._require_running()
        await self.manager.prepare(pod)

    def cdi_devices(self, pod: dict[str, Any], container: str) -> list[str]:
        """CDI device IDs for one container of a prepared pod."""
        return self.manager.cdi_devices(pod, container)

    async def unprepare(self, pod: dict[str, Any]) -> None:
        """Unprepare a terminated pod's claims; `UnprepareError` when it must be retried."""
        self._require_running()
        await self.manager.unprepare(pod)

    # ------------------------------------------------------------ observation

    @property
    def drivers(self) -> list[str]:
        """Drivers with at least one registered plugin."""
        return self.plugins.drivers

    def plugin(self, driver: str) -> DRAPlugin | None:
        """The plugin the manager would call for `driver` now, or None."""
        plugins = self.plugins.plugins(driver)
        return self.plugins.get(driver) if plugins else None

    @property
    def attempts(self) -> list[RegistrationAttempt]:
        """Every registration operation the watcher ran, in order."""
        return self.watcher.attempts

    @property
    def calls(self) -> list[DRACall]:
        """Every NodePrepareResources/NodeUnprepareResources call, in order."""
        return self.manager.calls

    def allocated_resources_status(self, pod: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
        """Container name -> `allocatedResourcesStatus` of its claims' devices, as the
        kubelet puts it in the pod's status from the drivers' health streams."""
        return self.manager.allocated_resources_status(pod)

    @property
    def health_errors(self) -> list[tuple[str, str]]:
        """(driver, error) of every health stream that failed, as the kubelet logs them."""
        return self.plugins.health_errors

    def prepared_claims(self) -> dict[tuple[str, str], set[str]]:
        """(namespace, claim name) -> pod UIDs, for every claim in the cache."""
        return {c.key: set(c.pod_uids) for c in self.manager.cache}

    async def wait_for(
        self,
        predicate: Callable[[], bool],
        timeout: float = 5.0,
        *,
        describe: Callable[[], str] | None = None,
    ) -> None:
        """Wait until `predicate()` holds, re-checking on every change; `TimeoutError`."""
        await self.changes.wait_for(predicate, timeout, describe)

    async def wait_for_driver(
        self, driver: str, *, registered: bool = True, timeout: float = 5.0
    ) -> None:
        """Wait until `driver` is (or, with `registered=False`, is no longer) registered."""

        def describe() -> str:
            return (
                f"expected driver {driver} registered={registered}; drivers: {self.drivers}; "
                f"attempts: {[(a.socket, a.error) for a in self.attempts]}"
            )

        await self.wait_for(
            lambda: (driver in self.drivers) == registered, timeout, describe=describe
        )

    async def _notify(self) -> None:
        await self.changes.notify()

    def _require_running(self) -> None:
        if not self._running:
            raise RuntimeError("the DRA side of the kubelet emulator is not running")
