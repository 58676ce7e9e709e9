"""`serve --mode dra`'s front: the DRA kubelet plugin over the daemon's shared core.

The daemon starts the core (store, health, config, CDI, MPS, events, metrics) and then this
front, which assembles the rest of DRA mode: the driver for the node's vendor (`DraDriver`:
the claim preparer with its per-claim limiter, the health stream, both sockets), the
node's ResourceSlices (`SlicePublisher`), the check for device-plugin resources the Node's
status still shows (`StaleResourceCheck`) and the lock on the driver's own directory.
Everything is built with what it needs, so nothing is wired after construction: a
registration the kubelet confirms compares the slices with the API and checks the Node
again, as a starting kubelet has just deleted the node's slices.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any

from kubegpu.config import Config
from kubegpu.devices import Inventory, Vendor, pci
from kubegpu.devices.nvml import NvmlBackend
from kubegpu.dirlock import HANDOVER_DIR, DirectoryLock
from kubegpu.dra.claims import AMD_DRIVER, NVIDIA_DRIVER
from kubegpu.dra.driver import DraDriver
from kubegpu.dra.health import HealthServicer
from kubegpu.dra.limits import ClaimLimiter
from kubegpu.dra.publisher import SlicePublisher
from kubegpu.dra.service import ClaimPreparer
from kubegpu.dra.sizing import sized
from kubegpu.dra.stale import EXTENDED_RESOURCES, StaleResourceCheck
from kubegpu.dra.state import DeviceState
from kubegpu.dra.usage import dra_view
from kubegpu.errors import InitError, StartupError
from kubegpu.files import unusable_dir
from kubegpu.front import Core, DaemonSettings
from kubegpu.resources import ResourceSpec
from kubegpu.rpc import socket_path_too_long
from kubegpu.state import NodeState
from kubegpu.supervisor import spawn
from kubegpu.usage.collector import DraView

log = logging.getLogger("kubegpu.dra")

#: The flag that moves the driver's directory, named by the errors about it.
PLUGINS_FLAG = "--kubelet-plugins-directory-path"
REGISTRAR_FLAG = "--kubelet-registrar-directory-path"


class DraFront:
    """DRA mode: one `DraDriver` for the node's vendor, its slices and its checks."""

    def __init__(self, settings: DaemonSettings, core: Core) -> None:
        self.store = core.store
        self.kube = core.kube
        self._backend = core.backend
        self._events = core.events
        self._metrics = core.metrics
        self.node_name = settings.node_name
        self.registrar_dir = settings.registrar_dir
        self.plugins_dir = settings.kubelet_plugins_dir
        self.cdi_dir = settings.cdi_dir
        self.mps_control_binary = settings.mps_control_binary
        self.simulated = settings.simulate is not None
        #: The driver, once start-up knows the node's vendor.
        self.driver: DraDriver | None = None
        #: Device-plugin resources the Node's status still shows (once started).
        self.stale: StaleResourceCheck | None = None
        self.publisher: SlicePublisher | None = None
        self._directory: DirectoryLock | None = None

    # -- the front's protocol (kubegpu.front.Front) ----------------------------------------

    def open(self) -> None:
        """The registrar directory must be usable; the driver's own directory is taken
        once start-up knows the driver."""
        _usable(self.registrar_dir, "kubelet directory", "the kubelet's directory", REGISTRAR_FLAG)

    def check(self, config: Config) -> None:
        """Every config the core accepts serves DRA (it injects no IMEX channels)."""

    def per_claim(self, spec: ResourceSpec) -> bool:
        """A memory-sized resource's claims each get an MPS control daemon of their own."""
        return sized(spec)

    def claims_view(self) -> Callable[[], DraView | None]:
        """The per-container metrics read the driver's prepared claims."""
        return self._claims_view

    def _claims_view(self) -> DraView | None:
        """What the per-container metrics read of the driver (None until it is built)."""
        driver = self.driver
        return None if driver is None else dra_view(driver.driver, driver.data_dir, self.node_name)

    async def start(self, state: NodeState) -> None:
        """Build the driver for the node's vendor, take its directory, serve it."""
        driver = self._build(state.inventory)
        self._take_driver_dir(driver)
        self.driver = driver
        for path, flag in (
            (driver.service.path, PLUGINS_FLAG),
            (driver.registrar.path, REGISTRAR_FLAG),
        ):
            too_long = socket_path_too_long(path, flag)
            if too_long is not None:
                raise StartupError(f"DRA driver {driver.driver}: {too_long}")
        self.publisher = self._publisher(driver.driver)
        self.stale = self._stale_check(driver.driver)
        await driver.start()

    def root_tasks(self, since: int) -> Sequence[tuple[str, Coroutine[Any, Any, None]]]:
        """The sockets served again when deleted, the health stream, the slices."""
        assert self.driver is not None and self.publisher is not None, "front not started"
        assert self.stale is not None
        # The stale check's failure is logged and leaves the daemon up: a helper, not a root.
        spawn("stale node resources", self.stale.run())
        tasks = [("dra sockets", self.driver.run())]
        if self.driver.health is not None:
            tasks.append(("dra health", self.driver.health.follow()))
        tasks.append(("resource slices", self.publisher.run()))
        return tasks

    def ready(self) -> tuple[bool, str]:
        if self.driver is None:
            return False, "DRA driver starting"
        ok, reason = self.driver.ready()
        detail = self.stale.detail() if self.stale is not None else None
        # Still ready: see kubegpu.dra.stale for why a stale Node status is not a reason to
        # take the pod out of service.
        return (ok, f"{reason}; {detail}") if ok and detail else (ok, reason)

    async def stop(self) -> None:
        if self.driver is not None:
            await self.driver.stop()

    def close(self) -> None:
        if self._directory is not None:
            self._directory.release()
            self._directory = None

    # -- assembly ---------------------------------------------------------------------------

    def _build(self, inventory: Inventory) -> DraDriver:
        """The DRA plugin for this node's vendor (`gpu.nvidia.com`, or AMD's name)."""
        if not self.node_name:
            raise StartupError(
                "DRA mode needs this node's name (--node-name, NODE_NAME): its ResourceSlices "
                "and pool are named after it"
            )
        amd = bool(inventory.gpus) and all(g.vendor is Vendor.AMD for g in inventory.gpus)
        name = AMD_DRIVER if amd else NVIDIA_DRIVER
        backend = self._backend()
        state = DeviceState(
            self.store,
            data_dir=self.plugins_dir / name,
            cdi_dir=self.cdi_dir,
            driver=name,
            pool=self.node_name,
            limiter=ClaimLimiter(
                control_binary=self.mps_control_binary,
                memory=backend.memory_limiter() if isinstance(backend, NvmlBackend) else None,
            ),
        )
        preparer = ClaimPreparer(state, self.kube)
        return DraDriver(
            preparer,
            driver=name,
            registrar_dir=self.registrar_dir,
            plugins_dir=self.plugins_dir,
            health=HealthServicer(self.store, driver=name, pool=self.node_name),
            on_registered=self._registered,
        )

    def _registered(self) -> None:
        """The kubelet (re)registered the driver: a starting kubelet has just deleted the
        node's slices (and one that lost us a while ours), so compare with the API now
        rather than at the publisher's next periodic comparison; the Node's status too."""
        if self.publisher is not None:
            self.publisher.resync()
        if self.stale is not None:
            self.stale.poke()

    def _publisher(self, driver: str) -> SlicePublisher:
        """The node's ResourceSlices for `driver`, following the store; an unhealthy
        device's taint names the Xid the health monitor saw (`NodeState.faults`)."""
        return SlicePublisher(
            self.kube,
            self.store,
            self.node_name,
            drivers=(driver,),
            # A simulated node's bus IDs are not this host's: no pcieRoot rather than a
            # wrong one.
            pcie_roots=None if self.simulated else (lambda buses: pci.pcie_roots("/", buses)),
        )

    def _stale_check(self, driver: str) -> StaleResourceCheck:
        """Device-plugin resources left in the Node's status: the extended resource of the
        driver's whole-GPU DeviceClass, and whatever the config makes the device plugin
        mode advertise (MIG, shared and renamed resources)."""

        def names() -> set[str]:
            own = EXTENDED_RESOURCES.get(driver)
            return {spec.name for spec in self.store.state.specs} | ({own} if own else set())

        return StaleResourceCheck(
            self.kube, self.node_name, names, events=self._events, metrics=self._metrics
        )

    def _take_driver_dir(self, driver: DraDriver) -> None:
        """Own the driver's directory under the kubelet's plugins directory (its sockets
        and checkpoint): created if missing, locked against a second `serve`. Nothing is
        written beside it, so a deployment may mount that one directory alone."""
        what = "DRA driver directory"
        _usable(driver.data_dir, what, f"{driver.data_dir} from the host", PLUGINS_FLAG)
        directory = DirectoryLock(driver.data_dir, what=what, flag=PLUGINS_FLAG)
        directory.acquire()
        self._directory = directory
        # An earlier kubegpu locked it as a device-plugin directory, which made this one.
        with contextlib.suppress(OSError):
            (driver.data_dir / HANDOVER_DIR).rmdir()


def _usable(path: Path, what: str, mount: str, flag: str) -> None:
    why = unusable_dir(path, what, mount, flag)
    if why is not None:
        raise InitError(why)


__all__ = ["DraFront"]
