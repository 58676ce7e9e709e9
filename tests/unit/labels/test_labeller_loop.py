"""The labelling loop: label, publish, sleep, retry; the live named config; vendors."""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Mapping
from pathlib import Path

import pytest

from kubegpu.config import Config, parse_config
from kubegpu.devices.model import Health, Inventory
from kubegpu.errors import ConfigError, InitError
from kubegpu.labeller import (
    PublishError,
    config_loader,
    follow_store,
    parse_duration,
    run_labeller,
)
from kubegpu.state import NodeStore
from kubegpu.supervisor import Supervisor
from tests.builders import NODE, RecordingSink, config
from tests.waiting import WAIT

FIXTURES = Path(__file__).parents[2] / "fixtures"


async def test_oneshot_publishes_once_with_present_and_mode_from_sysfs() -> None:
    sink = RecordingSink()
    done = await run_labeller(
        lambda: NODE,
        config,
        sink,
        interval=None,
        machine_type=lambda: "g4dn.xlarge",
        clock=lambda: 42.7,
        sysfs_root=str(FIXTURES / "pci-nvidia"),
    )
    assert done == 1
    (labels,) = sink.published
    assert labels["nvidia.com/gpu.product"] == "Tesla-T4"
    assert labels["nvidia.com/gpu.present"] == "true"
    assert labels["nvidia.com/gpu.mode"] == "compute"  # class 0x030200 at 0000:00:1e.0
    assert labels["nvidia.com/gpu.machine"] == "g4dn.xlarge"
    assert labels["nvidia.com/gfd.timestamp"] == "42"


async def test_loop_relabels_until_stopped_and_picks_up_changes() -> None:
    stop = asyncio.Event()
    inventories = iter([NODE, Inventory(gpus=())])

    def on_publish(n: int) -> None:
        if n == 2:
            stop.set()

    sink = RecordingSink(on_publish)
    done = await run_labeller(
        lambda: next(inventories),
        config,
        sink,
        interval=0.01,
        timestamps=False,
        sysfs_root=str(FIXTURES / "pci-none"),
        stop=stop,
    )
    assert done == 2
    assert sink.published[0]["nvidia.com/gpu.count"] == "1"
    # GPUs gone: only what the PCI bus says (no NVIDIA function, so no vGPU either).
    assert sink.published[1] == {"nvidia.com/vgpu.present": "false"}


async def test_infinite_interval_labels_once_then_waits_for_stop() -> None:
    stop = asyncio.Event()
    sink = RecordingSink(lambda n: stop.set())
    done = await asyncio.wait_for(
        run_labeller(lambda: NODE, config, sink, interval=math.inf, sysfs_root=None, stop=stop),
        WAIT,
    )
    assert done == 1


async def test_first_failure_propagates_later_ones_are_retried() -> None:
    class Flaky:
        def __init__(self) -> None:
            self.attempts = 0

        async def publish(self, labels: Mapping[str, str]) -> None:
            self.attempts += 1
            if self.attempts == 2:
                raise PublishError("API down")
            if self.attempts == 3:
                stop.set()

    with pytest.raises(PublishError):
        await run_labeller(
            lambda: NODE,
            config,
            FakeFailingSink(),
            interval=0.01,
            sysfs_root=None,
        )
    stop = asyncio.Event()
    flaky = Flaky()
    assert await run_labeller(
        lambda: NODE, config, flaky, interval=0.01, sysfs_root=None, stop=stop
    )
    assert flaky.attempts == 3


class FakeFailingSink:
    async def publish(self, labels: Mapping[str, str]) -> None:
        raise PublishError("nope")


async def test_init_error_is_fatal_unless_fail_on_init_error_is_false() -> None:
    def broken() -> Inventory:
        raise InitError("no NVML")

    with pytest.raises(InitError):
        await run_labeller(broken, config, RecordingSink(), interval=None, sysfs_root=None)

    lenient = parse_config("version: v1\nflags:\n  failOnInitError: false\n")
    sink = RecordingSink()
    await run_labeller(
        broken,
        lambda: lenient,
        sink,
        interval=None,
        timestamps=False,
        sysfs_root=str(FIXTURES / "pci-nvidia"),
    )
    assert sink.published == [{"nvidia.com/gpu.present": "true"}]


# --- helpers -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("60s", 60.0),
        ("1m30s", 90.0),
        ("500ms", 0.5),
        ("1h", 3600.0),
        ("infinite", math.inf),
        ("0s", 0.0),
    ],
)
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "60", "abc", "5x", "s60"])
def test_bad_durations(text: str) -> None:
    with pytest.raises(ValueError, match="duration"):
        parse_duration(text)


SHARE_4 = """version: v1
sharing:
  timeSlicing:
    resources:
      - name: nvidia.com/gpu
        replicas: 4
"""


def named_dir(tmp_path: Path) -> Path:
    configs = tmp_path / "available-configs"
    configs.mkdir()
    (configs / "shared").write_text(SHARE_4)
    (configs / "plain").write_text("version: v1\n")
    return configs


async def test_live_config_follows_a_node_label_change(tmp_path: Path) -> None:
    from kubegpu.config.source import ConfigSource, FakeNodeLabels, NamedConfigs
    from kubegpu.labeller import LiveConfig

    node_labels = FakeNodeLabels("shared")
    named = NamedConfigs(directory=named_dir(tmp_path), node_name="gpu-node-1", labels=node_labels)
    live = LiveConfig(ConfigSource(config_file=None, overrides={}, named=named))
    first = await live.start()
    try:
        assert first.sharing.time_slicing is not None
        assert live() is first
        waiting = asyncio.ensure_future(live.changed())
        await asyncio.sleep(0)  # let it start waiting before the label moves
        node_labels.set("plain")
        now = await asyncio.wait_for(waiting, WAIT)
        assert now.sharing.time_slicing is None
        assert live() is now
    finally:
        await live.close()


async def test_other_vendors_label_functions_run_on_the_same_snapshot() -> None:
    seen: list[Inventory] = []

    def amd(inventory: Inventory, cfg: Config) -> dict[str, str]:
        seen.append(inventory)
        return {"amd.com/gpu.count": "0"}

    sink = RecordingSink()
    await run_labeller(
        lambda: NODE,
        config,
        sink,
        interval=None,
        timestamps=False,
        sysfs_root=None,
        vendor_labels=(amd,),
    )
    assert seen == [NODE]
    assert sink.published[0]["amd.com/gpu.count"] == "0"
    assert sink.published[0]["nvidia.com/gpu.count"] == "1"


def test_the_config_file_and_the_flags_are_validated_together(tmp_path: Path) -> None:
    """As `serve` reads them: a flag may set right what the file gets wrong; a file that
    turns bad later keeps the last good config; one bad from the start is an error."""
    path = tmp_path / "config.yaml"
    path.write_text("version: v1\nflags:\n  migStrategy: bogus\n")
    load = config_loader(str(path), {"flags.migStrategy": "single"})
    assert load().flags.mig_strategy == "single"
    with pytest.raises(ConfigError, match="migStrategy"):
        config_loader(str(path), {})()
    good = config_loader(str(path), {})
    path.write_text("version: v1\nflags:\n  migStrategy: mixed\n")
    assert good().flags.mig_strategy == "mixed"
    path.write_text("version: v1\nflags:\n  migStrategy: [\n")
    assert good().flags.mig_strategy == "mixed"
    assert config_loader(None, {"flags.migStrategy": "single"})().flags.mig_strategy == "single"


# -- follow_store: `serve --with-labels`, labels of the daemon's own NodeStore --------------

GFD_FLAGS = "flags:\n  gfd: {sleepInterval: 1h, noTimestamp: true, machineTypeFile: /nonexistent}\n"


def store_config(replicas: int | None = None) -> Config:
    resource = f"{{name: nvidia.com/gpu, replicas: {replicas}}}"
    sharing = f"sharing:\n  timeSlicing:\n    resources:\n    - {resource}\n" if replicas else ""
    return parse_config("version: v1\n" + GFD_FLAGS + sharing)


async def test_follow_store_labels_the_stores_view_again_on_every_change() -> None:
    """A new config or a health change is labelled at once, not after the sleep interval
    (an hour here)."""
    published: asyncio.Queue[int] = asyncio.Queue()
    sink = RecordingSink(published.put_nowait)
    store = NodeStore()
    store.update(inventory=NODE, config=store_config())
    async with Supervisor("test") as tasks:
        tasks.start("labeller", follow_store(store, sink))
        assert await asyncio.wait_for(published.get(), 5) == 1
        assert sink.published[0]["nvidia.com/gpu.count"] == "1"
        assert sink.published[0]["nvidia.com/gpu.replicas"] == "1"
        assert "nvidia.com/gfd.timestamp" not in sink.published[0]
        store.update(config=store_config(replicas=3))
        assert await asyncio.wait_for(published.get(), 5) == 2
        assert sink.published[1]["nvidia.com/gpu.replicas"] == "3"
        store.update(health={NODE.gpus[0].uuid: Health.UNHEALTHY})
        assert await asyncio.wait_for(published.get(), 5) == 3


class FailingOnceSink(RecordingSink):
    """Refuses the first publish (a full disk, say), then records; `attempts` sees each try."""

    def __init__(self) -> None:
        super().__init__()
        self.tries = 0
        self.attempts: asyncio.Queue[int] = asyncio.Queue()

    async def publish(self, labels: Mapping[str, str]) -> None:
        self.tries += 1
        self.attempts.put_nowait(self.tries)
        if self.tries == 1:
            raise PublishError("features.d is full")
        await super().publish(labels)


async def test_follow_store_logs_a_failure_and_labels_again_on_the_next_change(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Unlike `kubegpu labels`, a failed first pass does not end `serve`."""
    sink = FailingOnceSink()
    store = NodeStore()
    store.update(inventory=NODE, config=store_config())
    async with Supervisor("test") as tasks:
        with caplog.at_level(logging.ERROR, "kubegpu.labeller"):
            task = tasks.start("labeller", follow_store(store, sink))
            await asyncio.wait_for(sink.attempts.get(), 5)
            store.update(config=store_config(replicas=2))
            await asyncio.wait_for(sink.attempts.get(), 5)
        assert not task.done()
    assert [labels["nvidia.com/gpu.replicas"] for labels in sink.published] == ["2"]
    assert any("labelling failed" in r.getMessage() for r in caplog.records)
