"""Device-plugin resources a Node's status still shows after the node moved to DRA.

A node whose GPUs were served by a device plugin keeps that plugin's extended resources
in its status (`capacity` and `allocatable`, `nvidia.com/gpu: 8`) after it moves to DRA:
the kubelet no longer knows the resource, so nothing removes them. The scheduler then
takes `nvidia.com/gpu` on that node for a device-plugin resource rather than the DRA
extended resource of the `gpu.nvidia.com` DeviceClass, and an unmodified pod asking for
`nvidia.com/gpu: 2` runs there with no claim and no GPU, silently. Removing the keys from
the Node's status routes such pods through DRA at once.

`stale_resources` (pure) finds them in a Node's status, `fix_command` is the `kubectl`
line that removes them. `StaleResourceCheck` reads the Node at start, whenever the kubelet
registers the driver and periodically, and says so once per change of what it finds: a
Warning event on the Node, an error log line with the fix, the
`kubegpu_stale_node_resources` gauge and a readiness detail.

Readiness itself stays true: the driver serves its claims correctly, the scheduler does
not look at the pod's readiness, and a not-ready pod would stall a rolling update of the
DaemonSet and drop out of the metrics Service, hiding the gauge that reports the problem.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import shlex
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from kubegpu.dra.slices import AMD_DRIVER, NVIDIA_DRIVER
from kubegpu.events import NodeEvents, Reason
from kubegpu.kube import Kube, KubeError
from kubegpu.metrics import Metrics
from kubegpu.untrusted import escape

log = logging.getLogger("kubegpu.dra.stale")

#: The extended resource the chart's whole-GPU DeviceClass of each driver maps its
#: devices to (`extendedResourceName`), as NVIDIA's and ROCm's device plugins name it.
EXTENDED_RESOURCES: Final = {NVIDIA_DRIVER: "nvidia.com/gpu", AMD_DRIVER: "amd.com/gpu"}
#: Seconds between reads of the Node while it shows none (a device plugin that registers
#: later is also caught at the kubelet's next registration of the driver).
INTERVAL_S: Final = 600.0
#: Seconds between reads while it shows some: the warning clears soon after the fix.
STALE_INTERVAL_S: Final = 30.0
#: The status sections a device plugin's resources appear in.
SECTIONS: Final = ("capacity", "allocatable")
#: The longest Node name (a DNS subdomain), for escaping it in log lines.
NODE_NAME_CHARS: Final = 253


@dataclass(frozen=True)
class StaleResource:
    """One extended resource in a Node's status: its quantity in each section, if there."""

    name: str
    capacity: str | None
    allocatable: str | None

    def describe(self) -> str:
        shown = [
            f"{section} {escape(str(value))}"
            for section, value in zip(SECTIONS, (self.capacity, self.allocatable), strict=True)
            if value is not None
        ]
        return f"{self.name} ({', '.join(shown)})"


def stale_resources(status: Mapping[str, Any], names: Iterable[str]) -> tuple[StaleResource, ...]:
    """Those of `names` that `status` (a Node's, as `Kube.get_node_status` gives it) shows
    in its capacity or allocatable, whatever the quantity, by name.

    Any quantity counts: the scheduler takes a name the Node's allocatable has for a
    device-plugin resource, and one at 0 makes the pods that ask for it unschedulable there.
    """
    sections = [status.get(s) or {} for s in SECTIONS]
    found = []
    for name in sorted(set(names)):
        capacity, allocatable = (section.get(name) for section in sections)
        if capacity is not None or allocatable is not None:
            found.append(
                StaleResource(
                    name,
                    None if capacity is None else str(capacity),
                    None if allocatable is None else str(allocatable),
                )
            )
    return tuple(found)


def _pointer(*tokens: str) -> str:
    """A JSON pointer (RFC 6901): `~` and `/` in a token escaped, as in `nvidia.com~1gpu`."""
    return "".join("/" + t.replace("~", "~0").replace("/", "~1") for t in tokens)


def fix_command(node: str, stale: Iterable[StaleResource]) -> str:
    """The `kubectl patch` that removes `stale` from the Node's status: a JSON patch on the
    status subresource, one `remove` per key present (removing an absent one would fail
    the whole patch)."""
    ops = [
        {"op": "remove", "path": _pointer("status", section, s.name)}
        for s in stale
        for section, value in zip(SECTIONS, (s.capacity, s.allocatable), strict=True)
        if value is not None
    ]
    patch = json.dumps(ops, separators=(",", ":"))
    return (
        f"kubectl patch node {shlex.quote(escape(node, NODE_NAME_CHARS))} "
        "--subresource=status --type=json "
        f"-p {shlex.quote(patch)}"
    )


def warning_text(node: str, stale: tuple[StaleResource, ...]) -> str:
    """One line: what the Node shows, what it does to pods, and the fix."""
    names = ", ".join(s.name for s in stale)
    return (
        f"Node {escape(node, NODE_NAME_CHARS)} status still shows device-plugin resource(s) "
        f"{', '.join(s.describe() for s in stale)} while kubegpu serves its GPUs through "
        f"DRA: the scheduler takes {names} here for a device-plugin resource, and a pod "
        f"that asks for it runs with no claim and no GPU. If no device plugin serves it on "
        f"this node any more, remove it from the Node's status: {fix_command(node, stale)}"
    )


class StaleResourceCheck:
    """Reads the Node's status and reports the stale device-plugin resources of `names()`
    (see the module doc). `poke()` asks for a read now; `run()` reads until cancelled."""

    def __init__(
        self,
        kube: Kube,
        node: str,
        names: Callable[[], Iterable[str]],
        *,
        events: NodeEvents,
        metrics: Metrics,
        interval_s: float = INTERVAL_S,
        stale_interval_s: float = STALE_INTERVAL_S,
    ) -> None:
        self.kube = kube
        self.node = node
        self.names = names
        self.events = events
        self.metrics = metrics
        self.interval_s = interval_s
        self.stale_interval_s = stale_interval_s
        #: What the last successful read found (empty: nothing stale).
        self.found: tuple[StaleResource, ...] = ()
        #: Reads of the Node done, each reported (for tests).
        self.checks = 0
        self._failing = False
        self._poke = asyncio.Event()

    def poke(self) -> None:
        """Read the Node again now (call from the event loop)."""
        self._poke.set()

    def detail(self) -> str | None:
        """A readiness detail while something is stale, else None."""
        if not self.found:
            return None
        names = ", ".join(s.name for s in self.found)
        return f"Node status still shows device-plugin resource(s) {names}: see the log"

    async def run(self) -> None:
        while True:
            self._poke.clear()
            ok = await self.check()
            wait = self.stale_interval_s if ok and self.found else self.interval_s
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait):
                    await self._poke.wait()

    async def check(self) -> bool:
        """Read the Node once and report a change; False when it cannot be read."""
        try:
            return await self._check()
        finally:
            self.checks += 1

    async def _check(self) -> bool:
        try:
            status = await asyncio.to_thread(self.kube.get_node_status, self.node)
        except KubeError as exc:
            # Once per streak: RBAC without `get` on nodes would otherwise log every read.
            if not self._failing:
                log.warning(
                    "node %s: cannot read the Node to look for device-plugin resources its "
                    "status still shows: %s",
                    escape(self.node, NODE_NAME_CHARS),
                    exc,
                )
            self._failing = True
            return False
        self._failing = False
        found = stale_resources(status, self.names())
        before = {s.name for s in self.found}
        self.found = found
        if {s.name for s in found} == before:
            return True
        self.metrics.set_stale_resources(s.name for s in found)
        if found:
            text = warning_text(self.node, found)
            log.error("%s", text)
            self.events.warning(Reason.STALE_DEVICE_PLUGIN_RESOURCE, text)
        else:
            log.info(
                "node %s: the Node's status no longer shows device-plugin resource(s) %s",
                escape(self.node, NODE_NAME_CHARS),
                ", ".join(sorted(before)),
            )
        return True


__all__ = [
    "EXTENDED_RESOURCES",
    "INTERVAL_S",
    "STALE_INTERVAL_S",
    "StaleResource",
    "StaleResourceCheck",
    "fix_command",
    "stale_resources",
    "warning_text",
]
