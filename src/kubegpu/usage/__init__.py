"""Which pod uses what on each GPU: processes attributed to the containers kubegpu gave
devices to, for the per-container metrics and `kubegpu top`.

The rooms: `cgroup` (a process's pod, from `/proc/<pid>/cgroup`), `kubelet` (what the
kubelet says each container holds: PodResources `List`, its device checkpoint), `attribution`
(pure: allocations, limits, processes to rows) and `collector` (`UsageCollector`, one
snapshot per scrape, off the event loop).

It sits below the device plugin and DRA packages: what it reads of the DRA driver comes
through a `DraView` (`kubegpu.dra.usage.dra_view`), and the daemon wires it to
`Metrics.follow_usage` (and `UsageCollector.devices`, the GPUs' health, to
`Metrics.follow_devices`).
"""

from kubegpu.usage.attribution import Allocation, Holder, memory_limit
from kubegpu.usage.collector import DEFAULT_MAX_ROWS, DraView, UsageCollector, UsageSettings

__all__ = [
    "DEFAULT_MAX_ROWS",
    "Allocation",
    "DraView",
    "Holder",
    "UsageCollector",
    "UsageSettings",
    "memory_limit",
]
