"""Small hand-built inventories for unit tests of the pure layers, and the labeller's
one-GPU node with a recording sink."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from kubegpu.config import Config
from kubegpu.devices import Gpu, Inventory, Link, LinkKind, MigDevice


def gpu(
    index: int,
    *,
    product: str = "NVIDIA H100 80GB HBM3",
    numa: int | None = 0,
    cc: tuple[int, int] = (9, 0),
    migs: Sequence[str] = (),
    links: Sequence[Link] = (),
) -> Gpu:
    uuid = f"GPU-{index:08d}-0000-0000-0000-000000000000"
    mig_devices = tuple(
        MigDevice(
            uuid=f"MIG-{index:04d}{n:04d}-0000-0000-0000-000000000000",
            parent_uuid=uuid,
            parent_index=index,
            gi_id=n + 1,
            ci_id=0,
            profile=profile,
            memory_mib=10240,
            device_paths=(f"/dev/nvidia-caps/nvidia-cap{100 + n}",),
        )
        for n, profile in enumerate(migs)
    )
    return Gpu(
        index=index,
        uuid=uuid,
        minor=index,
        product=product,
        memory_mib=81559,
        pci_bus_id=f"0000:{index + 0x10:02x}:00.0",
        numa_node=numa,
        compute_capability=cc,
        device_paths=(f"/dev/nvidia{index}",),
        mig_capable=True,
        mig_enabled=bool(migs),
        mig_devices=mig_devices,
        links=tuple(links),
    )


def inventory(*gpus: Gpu) -> Inventory:
    return Inventory(
        gpus=tuple(gpus),
        driver_version="550.54.15",
        cuda_driver_version=(12, 4),
        control_device_paths=("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"),
        backend="test",
    )


def nvlinked(count: int, *, numa_split: int | None = None) -> Inventory:
    """`count` GPUs in a full NVLink mesh; NUMA 0 below `numa_split`, else 1."""
    uuids = [gpu(i).uuid for i in range(count)]
    gpus = []
    for i in range(count):
        links = [Link(peer_uuid=u, kind=LinkKind.NVLINK, count=18) for u in uuids if u != uuids[i]]
        numa = 0 if numa_split is None or i < numa_split else 1
        gpus.append(gpu(i, numa=numa, links=links))
    return inventory(*gpus)


# -- the labeller's one-GPU node and a sink that records what it was given --------------

T4 = Gpu(
    index=0,
    uuid="GPU-t4",
    minor=0,
    product="Tesla T4",
    memory_mib=15360,
    pci_bus_id="0000:00:1e.0",
    numa_node=0,
    compute_capability=(7, 5),
    brand="Tesla",
)
NODE = Inventory(gpus=(T4,), driver_version="550.54.15", cuda_driver_version=(12, 4))


def config() -> Config:
    """The default config, as a `load_config` callable for the labeller."""
    return Config()


class RecordingSink:
    """A `LabelSink` that keeps every label set; `on_publish` sees the running count."""

    def __init__(self, on_publish: Callable[[int], None] = lambda n: None) -> None:
        self.published: list[dict[str, str]] = []
        self.on_publish = on_publish

    async def publish(self, labels: Mapping[str, str]) -> None:
        self.published.append(dict(labels))
        self.on_publish(len(self.published))
