"""What the per-container GPU metrics read of the DRA driver: its prepared claims and devices.

The claims come from the driver's checkpoint file, not from the running driver's memory:
the file is written atomically, so a scrape (in its own thread) reads one whole version,
never one the event loop is changing. A claim record names the claim, not the pods that
use it: the metrics attribute to the containers the kubelet's PodResources API says use a
claim device, and to the claim itself (its namespace and name) where the kubelet does not.
"""

from __future__ import annotations

from pathlib import Path

from kubegpu.dra.checkpoint import Checkpoint, CorruptCheckpoint
from kubegpu.dra.claims import node_devices
from kubegpu.resources import ResourceSpec, Unit
from kubegpu.untrusted import is_dns_label, is_dns_subdomain
from kubegpu.usage.attribution import ClaimDevices
from kubegpu.usage.collector import DraView
from kubegpu.usage.kubelet import SourceError


def prepared_claims(data_dir: Path, pool: str = "") -> tuple[ClaimDevices, ...]:
    """The driver's prepared claims with their devices in `pool`; `SourceError` when the
    checkpoint cannot be read."""
    try:
        checkpoint = Checkpoint.load(data_dir)
    except CorruptCheckpoint as err:
        raise SourceError(f"DRA checkpoint in {data_dir}: {err}") from err
    claims = []
    for record in checkpoint.claims.values():
        if not (is_dns_label(record.namespace) and is_dns_subdomain(record.name)):
            continue  # an adopted claim (no names kept) or names Kubernetes would not allow
        devices = tuple(d.device for d in record.devices if not pool or d.pool == pool)
        sized = (
            {}
            if record.limits is None
            else {d.device: d.memory_bytes for d in record.limits.devices}
        )
        claims.append(ClaimDevices(record.namespace, record.name, devices, sized, record.pods))
    return tuple(claims)


def dra_view(driver: str, data_dir: Path, pool: str = "") -> DraView:
    """The `DraView` of a driver serving from `data_dir` for this node's `pool`."""

    def devices(specs: tuple[ResourceSpec, ...]) -> dict[str, tuple[Unit, ResourceSpec]]:
        return {name: (d.unit, d.resource) for name, d in node_devices(driver, specs).items()}

    return DraView(driver, pool, lambda: prepared_claims(data_dir, pool), devices)


__all__ = ["dra_view", "prepared_claims"]
