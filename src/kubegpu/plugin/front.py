"""`serve`'s device plugin front (the default mode) over the daemon's shared core.

The daemon starts the core (store, health, config, CDI, MPS, events, metrics) and then this
front: the plugin directory's role (`PluginDirectory`: owner, or with `--handover` a
successor on its own socket slot), the servers and their registrations
(`PluginManager`), the kubelet-restart watch and the handover between two `serve`s.
"""

from __future__ import annotations

import logging
from collections.abc import Coroutine, Sequence
from typing import Any

from kubegpu.allocation import select_imex_channels
from kubegpu.config import Config
from kubegpu.errors import InitError, StartupError
from kubegpu.files import unusable_dir
from kubegpu.front import Core, DaemonSettings
from kubegpu.plugin.directory import PluginDirectory, Role
from kubegpu.plugin.handover import follow as follow_handover
from kubegpu.plugin.manager import PluginManager
from kubegpu.resources import ResourceSpec
from kubegpu.rpc import socket_path_too_long
from kubegpu.state import NodeState

log = logging.getLogger("kubegpu.plugin")


class PluginFront:
    """Device plugin mode: one server and registration per resource name."""

    def __init__(self, settings: DaemonSettings, core: Core) -> None:
        self.store = core.store
        self.plugin_dir = settings.plugin_dir
        #: This process's role in the plugin directory and the socket slot it serves.
        self.directory = PluginDirectory(settings.plugin_dir, handover=settings.handover)
        self.manager = PluginManager(
            settings.plugin_dir,
            metrics=core.metrics,
            on_registered=core.on_registered,
            cdi_dir=settings.cdi_dir,
            socket_name=self.directory.socket_name,
        )

    # -- the front's protocol (kubegpu.front.Front) ----------------------------------------

    def open(self) -> None:
        """Take this process's role in the plugin directory (instant, before anything that
        may wait, so a second `serve` is refused at once)."""
        why = unusable_dir(
            self.plugin_dir,
            "device-plugin directory",
            "the kubelet's device-plugins directory",
            "--device-plugin-path",
        )
        if why is not None:
            raise InitError(why)
        if self.directory.acquire() is Role.SUCCESSOR:
            log.info(
                "another kubegpu serve owns %s: starting beside it on socket slot %d, to take over",
                self.plugin_dir,
                self.directory.slot,
            )

    def check(self, config: Config) -> None:
        """`PreconditionError` when `config` requires IMEX channels this node lacks: every
        Allocate would be refused while the GPUs stay advertised, so, as NVIDIA's plugin,
        such a config is not served."""
        select_imex_channels(config)

    def per_claim(self, spec: ResourceSpec) -> bool:
        """The device plugin has no claims: one MPS control daemon per resource."""
        return False

    def claims_view(self) -> None:
        """The per-container metrics read the kubelet's own checkpoint in this mode."""
        return

    async def start(self, state: NodeState) -> None:
        """Serve and register the first state's resources."""
        self._check_socket_paths(state.planned)
        await self.manager.apply(state.specs, state.config)

    def root_tasks(self, since: int) -> Sequence[tuple[str, Coroutine[Any, Any, None]]]:
        """The servers following the store, the kubelet-restart watch, the handover."""
        return [
            ("plugins", self.manager.follow(self.store, since)),
            ("kubelet watcher", self.manager.run()),
            ("handover", follow_handover(self.directory, self.manager)),
        ]

    def ready(self) -> tuple[bool, str]:
        return self.manager.ready()

    async def stop(self) -> None:
        """Withdraw the plugins and answer the calls on their way (`PluginManager.stop`)."""
        await self.manager.stop()

    def close(self) -> None:
        self.directory.release()

    def _check_socket_paths(self, specs: tuple[ResourceSpec, ...]) -> None:
        """A socket path over the unix limit can never be served: say so and stop, rather
        than retry forever (the CLI only knows the kubelet's socket name, not ours)."""
        for spec in specs:
            name = self.directory.socket_name(spec.socket_name)
            too_long = socket_path_too_long(self.plugin_dir / name)
            if too_long is not None:
                raise StartupError(f"{spec.name}: {too_long}")


__all__ = ["PluginFront"]
