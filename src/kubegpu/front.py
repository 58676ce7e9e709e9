"""What a mode's front is given and what it must do: the contract between the daemon and
`kubegpu.plugin.front.PluginFront` or `kubegpu.dra.front.DraFront`.

The daemon (`kubegpu.daemon`) builds the shared core and then one front, by calling the
front's class with what `serve` was asked to do (`DaemonSettings`) and the core (`Core`):
every front's constructor is a `FrontFactory`. It lives here, below both fronts and the
daemon, so that a front needs nothing of the daemon and the daemon nothing of a front: the
daemon names each front's class in a table and loads only the one its mode chooses.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeAlias, runtime_checkable

from kubegpu.cdi import DEFAULT_DIRECTORY as DEFAULT_CDI_DIRECTORY
from kubegpu.config import Config
from kubegpu.config.source import POLL_INTERVAL, NamedConfigs
from kubegpu.devices import DeviceBackend
from kubegpu.events import NodeEvents
from kubegpu.kube import Kube
from kubegpu.kubelet_paths import (
    DEVICE_PLUGIN_PATH,
    PLUGINS_DIRECTORY,
    POD_RESOURCES_SOCKET,
    REGISTRAR_DIRECTORY,
)
from kubegpu.metrics import Metrics
from kubegpu.mode import Mode
from kubegpu.nvidia_paths import MPS_CONTROL_BINARY
from kubegpu.resources import ResourceSpec
from kubegpu.state import NodeState, NodeStore
from kubegpu.usage import DEFAULT_MAX_ROWS
from kubegpu.usage.collector import DraView


@dataclass(frozen=True)
class DaemonSettings:
    """What `serve` was asked to do; built from flags and env vars by the CLI."""

    plugin_dir: Path = Path(DEVICE_PLUGIN_PATH)
    #: The device plugin API (the default) or a DRA kubelet plugin.
    mode: Mode = Mode.PLUGIN
    #: DRA: where the kubelet's plugin watcher looks for registration sockets.
    registrar_dir: Path = Path(REGISTRAR_DIRECTORY)
    #: DRA: the kubelet's plugins directory; ours is `<it>/<driver>` (dra.sock, checkpoint).
    kubelet_plugins_dir: Path = Path(PLUGINS_DIRECTORY)
    #: This node's name: the DRA pool the scheduler allocates from.
    node_name: str = ""
    backend: str = "auto"
    simulate: str | None = None
    config_file: Path | None = None
    #: Flag and env values as dotted config paths; they beat the config file.
    overrides: Mapping[str, Any] = field(default_factory=dict)
    named: NamedConfigs | None = None
    #: NVIDIA's DP_DISABLE_HEALTHCHECKS / DP_ENABLE_HEALTHCHECKS, as read at the edge.
    health_env: Mapping[str, str] = field(default_factory=dict)
    metrics_address: str = "127.0.0.1"
    metrics_port: int = 0
    health_address: str = "0.0.0.0"
    health_port: int = 0
    config_poll_interval: float = POLL_INTERVAL
    #: Where CDI specs go when a CDI device-list strategy is on.
    cdi_dir: Path = Path(DEFAULT_CDI_DIRECTORY)
    mps_control_binary: str = MPS_CONTROL_BINARY
    #: Also write GPU Feature Discovery labels (NFD features.d file), as `kubegpu labels`.
    with_labels: bool = False
    #: Start beside a `serve` already on the plugin directory and take over from it.
    handover: bool = False
    #: The host's /proc (process cgroups) and the kubelet's PodResources socket, to tell
    #: which container uses what on the GPUs; the cap on per-container rows per scrape.
    proc_root: Path = Path("/proc")
    pod_resources_socket: Path | None = Path(POD_RESOURCES_SOCKET)
    usage_max_rows: int = DEFAULT_MAX_ROWS


@dataclass(frozen=True)
class Core:
    """The shared core a front is built over: what it follows, writes to, reports through."""

    store: NodeStore
    kube: Kube
    metrics: Metrics
    events: NodeEvents
    #: The GPU backend, once start-up has opened it.
    backend: Callable[[], DeviceBackend]
    #: Device plugin mode: told each resource registered, and how long it took.
    on_registered: Callable[[str, float], None] | None


@runtime_checkable
class Front(Protocol):
    """What the daemon asks of the mode's front, over the shared core it started.

    In order: `open` (instant, first: the front's place on the node, its directories),
    `start` with the first state (after the CDI specs and the MPS daemons), the
    `root_tasks` the supervisor runs, and at shutdown `stop` (withdraw from the kubelet,
    answer the calls on their way) and, last of all, `close` (let the directories go).
    `check` refuses a config the front cannot serve; `per_claim` and `claims_view` are
    what the MPS daemons and the per-container metrics need to know of it.
    """

    def open(self) -> None: ...

    async def start(self, state: NodeState) -> None: ...

    def root_tasks(self, since: int) -> Sequence[tuple[str, Coroutine[Any, Any, None]]]: ...

    def ready(self) -> tuple[bool, str]: ...

    async def stop(self) -> None: ...

    def close(self) -> None: ...

    def check(self, config: Config) -> None: ...

    def per_claim(self, spec: ResourceSpec) -> bool: ...

    def claims_view(self) -> Callable[[], DraView | None] | None:
        """Where the per-container metrics read which claim holds what: the DRA driver's
        prepared claims, or None where the kubelet's own device checkpoint says which
        pod holds which device (the device plugin)."""
        ...


#: A front's class: built with the settings and the core, all it is given.
FrontFactory: TypeAlias = Callable[[DaemonSettings, Core], Front]

__all__ = ["Core", "DaemonSettings", "Front", "FrontFactory"]
