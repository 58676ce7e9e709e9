"""ConfigSource: initial load, reloads on change, ConfigMap symlink swaps, named configs."""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from kubegpu.config import MigStrategy, parse_config
from kubegpu.config.loader import read_bytes
from kubegpu.config.names import DEFAULT_NODE_LABEL
from kubegpu.config.source import (
    SETTLE_READS,
    ConfigSource,
    ConfigUpdate,
    FakeNodeLabels,
    KubernetesNodeLabels,
    NamedConfigs,
    named_configs,
)
from kubegpu.errors import ConfigError
from tests.rig.kube import FakeKube
from tests.waiting import WAIT, eventually

FAST = 0.05


def mig(strategy: str) -> str:
    return f"version: v1\nflags:\n  migStrategy: {strategy}\n"


Updates = asyncio.Queue[ConfigUpdate]


@contextlib.asynccontextmanager
async def running(source: ConfigSource) -> AsyncIterator[Updates]:
    """The source's updates, drained by a task into a queue the test reads with timeouts."""
    queue: Updates = asyncio.Queue()

    async def drain() -> None:
        async for update in source.updates():
            queue.put_nowait(update)

    task = asyncio.create_task(drain())
    try:
        yield queue
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def next_update(queue: Updates) -> ConfigUpdate:
    return await asyncio.wait_for(queue.get(), WAIT)


async def assert_quiet(queue: Updates, seconds: float = 0.3) -> None:
    """No update within several poll intervals (only used to assert an absence)."""
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(queue.get(), seconds)


def strategy(update: ConfigUpdate) -> MigStrategy:
    assert update.config is not None, update.error
    return update.config.flags.mig_strategy


# -- a plain file ----------------------------------------------------------------------------


async def test_initial_load_and_reload_on_change(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(mig("single"))
    async with running(ConfigSource(config_file=path, overrides={}, poll_interval=FAST)) as s:
        first = await next_update(s)
        assert strategy(first) is MigStrategy.SINGLE
        assert first.origin == f"file {path}"
        path.write_text(mig("mixed"))
        assert strategy(await next_update(s)) is MigStrategy.MIXED


async def test_touch_without_a_change_yields_nothing(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(mig("single"))
    async with running(ConfigSource(config_file=path, overrides={}, poll_interval=FAST)) as s:
        await next_update(s)
        path.write_text(mig("single") + "# a comment\n")
        await assert_quiet(s)


async def test_invalid_change_then_fix(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(mig("single"))
    async with running(ConfigSource(config_file=path, overrides={}, poll_interval=FAST)) as s:
        await next_update(s)
        path.write_text("flags: {migStrategi: mixed}\n")
        bad = await next_update(s)
        assert bad.config is None and isinstance(bad.error, ConfigError)
        assert "did you mean 'migStrategy'?" in str(bad.error)
        path.write_text(mig("mixed"))
        assert strategy(await next_update(s)) is MigStrategy.MIXED


async def test_fix_back_to_the_last_good_config_still_clears_the_error(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(mig("single"))
    async with running(ConfigSource(config_file=path, overrides={}, poll_interval=FAST)) as s:
        await next_update(s)
        path.write_text("flags: [")
        assert (await next_update(s)).error is not None
        path.write_text(mig("single"))
        assert strategy(await next_update(s)) is MigStrategy.SINGLE


async def test_overrides_win_over_every_reloaded_file(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(mig("single") + "  failOnInitError: true\n")
    overrides = {"flags.migStrategy": "none"}
    async with running(
        ConfigSource(config_file=path, overrides=overrides, poll_interval=FAST)
    ) as s:
        first = await next_update(s)
        assert strategy(first) is MigStrategy.NONE
        path.write_text(mig("mixed") + "  failOnInitError: false\n")
        second = await next_update(s)
        assert strategy(second) is MigStrategy.NONE
        assert second.config is not None and second.config.flags.fail_on_init_error is False


async def test_no_file_means_defaults_and_overrides() -> None:
    source = ConfigSource(config_file=None, overrides={"flags.migStrategy": "mixed"})
    async with running(source) as s:
        update = await next_update(s)
        assert strategy(update) is MigStrategy.MIXED
        assert update.origin == "defaults (no config file)"


async def test_configmap_symlink_swap(tmp_path: Path) -> None:
    """A ConfigMap volume: config.yaml -> ..data/config.yaml, ..data -> ..<timestamp>/."""
    mount = tmp_path / "mount"
    mount.mkdir()

    def publish(version: str, text: str) -> None:
        target = mount / f"..{version}"
        target.mkdir()
        (target / "config.yaml").write_text(text)
        tmp_link = mount / "..data_tmp"
        tmp_link.symlink_to(target.name)
        tmp_link.replace(mount / "..data")  # atomic, as the kubelet does

    publish("2024_01", mig("single"))
    (mount / "config.yaml").symlink_to("..data/config.yaml")
    path = mount / "config.yaml"
    async with running(ConfigSource(config_file=path, overrides={}, poll_interval=FAST)) as s:
        assert strategy(await next_update(s)) is MigStrategy.SINGLE
        publish("2024_02", mig("mixed"))
        assert strategy(await next_update(s)) is MigStrategy.MIXED


async def test_poke_rereads_now(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(mig("single"))
    source = ConfigSource(config_file=path, overrides={}, poll_interval=3600)
    async with running(source) as s:
        await next_update(s)
        path.write_text(mig("mixed"))
        source.poke()
        assert strategy(await next_update(s)) is MigStrategy.MIXED


async def test_poke_from_another_thread(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(mig("single"))
    source = ConfigSource(config_file=path, overrides={}, poll_interval=3600)
    async with running(source) as s:
        await next_update(s)
        path.write_text(mig("mixed"))
        await asyncio.to_thread(source.poke)
        assert strategy(await next_update(s)) is MigStrategy.MIXED


async def test_missing_file_is_an_error_update(tmp_path: Path) -> None:
    path = tmp_path / "absent.yaml"
    async with running(ConfigSource(config_file=path, overrides={}, poll_interval=FAST)) as s:
        update = await next_update(s)
        assert update.config is None
        assert "cannot read the config file" in str(update.error)
        path.write_text(mig("mixed"))
        assert strategy(await next_update(s)) is MigStrategy.MIXED


# -- named configs ---------------------------------------------------------------------------


@pytest.fixture
def configs(tmp_path: Path) -> Path:
    directory = tmp_path / "configs"
    directory.mkdir()
    (directory / "a100.yaml").write_text(mig("mixed"))
    (directory / "t4").write_text(mig("single"))
    (directory / "..data").mkdir()  # ConfigMap internals are not configs
    return directory


def named_source(directory: Path, **kwargs: Any) -> ConfigSource:
    named = NamedConfigs(directory=directory, node_name="node-1", **kwargs)
    return ConfigSource(config_file=None, overrides={}, named=named, poll_interval=FAST)


async def test_label_picks_and_switches_config(configs: Path) -> None:
    labels = FakeNodeLabels("a100")
    async with running(named_source(configs, labels=labels)) as s:
        first = await next_update(s)
        assert strategy(first) is MigStrategy.MIXED
        assert first.origin == "named config 'a100' (node label nvidia.com/device-plugin.config)"
        assert labels.watched == [("node-1", "nvidia.com/device-plugin.config")]
        labels.set("t4")
        assert strategy(await next_update(s)) is MigStrategy.SINGLE


async def test_label_naming_a_missing_config_is_an_error(configs: Path) -> None:
    labels = FakeNodeLabels("a100")
    async with running(named_source(configs, labels=labels)) as s:
        await next_update(s)
        labels.set("h100")
        bad = await next_update(s)
        assert bad.config is None
        assert str(bad.error) == (
            f"node label nvidia.com/device-plugin.config: no config of that name in {configs} "
            "(got 'h100'); use one of: a100, t4, or add it to the ConfigMap"
        )
        (configs / "h100.yml").write_text(mig("none"))  # the ConfigMap catches up
        assert strategy(await next_update(s)) is MigStrategy.NONE


async def test_fallback_named_uses_default(configs: Path) -> None:
    source = named_source(configs, labels=FakeNodeLabels(None), default="t4")
    async with running(source) as s:
        update = await next_update(s)
        assert strategy(update) is MigStrategy.SINGLE
        assert update.origin == "named config 't4' (default; node label unset)"


async def test_fallback_single_uses_the_only_config(configs: Path) -> None:
    (configs / "t4").unlink()
    source = named_source(configs, fallback_strategies=("named", "single"))
    async with running(source) as s:
        assert strategy(await next_update(s)) is MigStrategy.MIXED


async def test_fallback_empty_uses_defaults(configs: Path) -> None:
    source = named_source(configs, fallback_strategies=("named", "single", "empty"))
    async with running(source) as s:
        update = await next_update(s)
        assert update.config is not None and strategy(update) is MigStrategy.NONE
        assert update.origin.startswith("defaults (fallback 'empty'")


async def test_no_fallback_applies_is_an_error(configs: Path) -> None:
    async with running(named_source(configs, default="missing")) as s:
        update = await next_update(s)
        assert update.config is None
        assert "not set and fallbacks named,single chose nothing" in str(update.error)


async def test_unsetting_the_label_falls_back(configs: Path) -> None:
    labels = FakeNodeLabels("a100")
    async with running(named_source(configs, labels=labels, default="t4")) as s:
        assert strategy(await next_update(s)) is MigStrategy.MIXED
        labels.set("")
        assert strategy(await next_update(s)) is MigStrategy.SINGLE


class _BrokenLabels:
    async def watch(self, node: str, label: str) -> AsyncIterator[str | None]:
        raise RuntimeError("no API")
        yield None  # an async generator, like real watchers


async def test_broken_label_watch_falls_back_without_waiting(configs: Path) -> None:
    source = named_source(configs, labels=_BrokenLabels(), default="t4", label_timeout=3600)
    async with running(source) as s:
        assert strategy(await next_update(s)) is MigStrategy.SINGLE


def test_unknown_fallback_strategy(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"--fallback-strategies: unknown strategy \(got 'x'\)"):
        NamedConfigs(directory=tmp_path, fallback_strategies=("x",))


# -- the Kubernetes watcher (kubegpu.kube; its retries are tested in test_kube.py) ----------


async def test_kubernetes_labels_follow_the_node_through_the_kube_adapter() -> None:
    label = "nvidia.com/device-plugin.config"
    kube = FakeKube()
    kube.add_node("node-1", {label: "a100"})
    stream = KubernetesNodeLabels(kube).watch("node-1", label)
    try:
        assert await asyncio.wait_for(anext(stream), WAIT) == "a100"
        kube.set_node_label("node-1", label, "t4")
        assert await asyncio.wait_for(anext(stream), WAIT) == "t4"
        kube.set_node_label("node-1", label, None)
        assert await asyncio.wait_for(anext(stream), WAIT) is None
    finally:
        await stream.aclose()  # type: ignore[attr-defined]
    assert kube.watched == [("node-1", label)]


async def test_named_configs_switch_when_the_kube_adapter_sees_the_label_change(
    configs: Path,
) -> None:
    kube = FakeKube()
    kube.add_node("node-1", {"nvidia.com/device-plugin.config": "a100"})
    async with running(named_source(configs, labels=KubernetesNodeLabels(kube))) as s:
        assert strategy(await next_update(s)) is MigStrategy.MIXED
        kube.set_node_label("node-1", "nvidia.com/device-plugin.config", "t4")
        assert strategy(await next_update(s)) is MigStrategy.SINGLE
    assert kube.calls == ["watch node/node-1"]


def test_symlinked_config_file_fingerprint_follows_target(tmp_path: Path) -> None:
    """The fingerprint resolves links, so pointing a link elsewhere counts as a change."""
    from kubegpu.config.source import _Selection, _stat

    (tmp_path / "a").write_text("x")
    (tmp_path / "b").write_text("x")
    link = tmp_path / "link"
    link.symlink_to("a")
    before = _stat(_Selection(link, ""))
    link.unlink()
    link.symlink_to("b")
    assert _stat(_Selection(link, "")) != before


# -- reload safety: empty files, half-written files, off-loop loading -------------------------


@pytest.mark.parametrize("empty", ["", "  \n\t\n"])
async def test_empty_file_on_reload_keeps_the_last_good_config(tmp_path: Path, empty: str) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(mig("mixed"))
    async with running(ConfigSource(config_file=path, overrides={}, poll_interval=FAST)) as s:
        assert strategy(await next_update(s)) is MigStrategy.MIXED
        path.write_text(empty)
        update = await next_update(s)
        assert update.config is None
        assert "the file is empty; keeping the last good config" in str(update.error)
        path.write_text(mig("single"))
        assert strategy(await next_update(s)) is MigStrategy.SINGLE


async def test_empty_file_at_start_is_the_defaults(tmp_path: Path) -> None:
    # As NVIDIA's plugin reads it: no keys, version defaulted. Only a *reload* refuses it.
    path = tmp_path / "config.yaml"
    path.write_text("")
    async with running(ConfigSource(config_file=path, overrides={}, poll_interval=FAST)) as s:
        assert strategy(await next_update(s)) is MigStrategy.NONE


class ScriptedReader:
    """A file whose successive reads return the scripted contents (the last one repeats)."""

    def __init__(self, *contents: str) -> None:
        self.contents = [c.encode() for c in contents]
        self.reads = 0

    def __call__(self, path: Path) -> bytes:
        self.reads += 1
        return self.contents.pop(0) if len(self.contents) > 1 else self.contents[0]


async def test_a_file_is_applied_only_once_it_reads_the_same_twice(tmp_path: Path) -> None:
    half = mig("mixed")[:18]  # "version: v1\nflags:" cut mid-way: valid YAML, wrong config
    seen: list[bytes | None] = []

    def loader(data: bytes | None, overrides: Any, source: str) -> Any:
        seen.append(data)
        from kubegpu.config.loader import load_config_bytes

        return load_config_bytes(data, overrides, source=source)

    reader = ScriptedReader(half, mig("mixed"))
    source = ConfigSource(
        config_file=tmp_path / "config.yaml",
        overrides={},
        poll_interval=3600,
        settle_interval=0.0,
        loader=loader,
        reader=reader,
    )
    async with running(source) as s:
        assert strategy(await next_update(s)) is MigStrategy.MIXED
    assert seen == [mig("mixed").encode()]  # the half-written read never reached the loader
    assert reader.reads >= 3


class CountingReader:
    """`read_bytes`, keeping every content it returned (`reads` counts them)."""

    def __init__(self) -> None:
        self.seen: list[bytes] = []

    @property
    def reads(self) -> int:
        return len(self.seen)

    def __call__(self, path: Path) -> bytes:
        data = read_bytes(path)
        self.seen.append(data)
        return data


def _counted_source(tmp_path: Path) -> tuple[Path, CountingReader, ConfigSource]:
    """A config file (MIG strategy mixed) and its source, whose reads are counted."""
    path = tmp_path / "config.yaml"
    path.write_text(mig("mixed"))
    reader = CountingReader()
    source = ConfigSource(config_file=path, overrides={}, poll_interval=3600, reader=reader)
    return path, reader, source


async def test_a_reload_renamed_into_place_is_read_once(tmp_path: Path) -> None:
    # The rename is atomic and inotify saw it: no second read a settle interval later.
    path, reader, source = _counted_source(tmp_path)
    async with running(source) as s:
        assert strategy(await next_update(s)) is MigStrategy.MIXED
        assert reader.reads == 2, "the first load settles: two reads that agree"
        staged = tmp_path / ".config.yaml.tmp"
        staged.write_text(mig("single"))
        staged.replace(path)
        assert strategy(await next_update(s)) is MigStrategy.SINGLE
        assert reader.reads == 3


async def test_a_file_still_open_for_writing_is_applied_only_once_closed(tmp_path: Path) -> None:
    """A writer that pauses mid-file, holding it open, once had its valid prefix applied
    (the kubelet briefly saw the half-written sharing config); inotify says the write is
    still open, so the source waits for the close, however long the pause."""
    path, _, source = _counted_source(tmp_path)
    async with running(source) as s:
        assert strategy(await next_update(s)) is MigStrategy.MIXED
        with path.open("w") as writer:
            writer.write(mig("single"))  # a valid config on its own: the first half
            writer.flush()
            await assert_quiet(s)  # many settle intervals: the open write is not applied
            writer.write("  gfd:\n    oneshot: true\n")
        update = await next_update(s)
        assert strategy(update) is MigStrategy.SINGLE
        assert update.config is not None and update.config.flags.gfd.oneshot


class EndlessReader:
    """A file that reads differently every time (a writer that never stops)."""

    def __init__(self) -> None:
        self.reads = 0

    def __call__(self, path: Path) -> bytes:
        self.reads += 1
        return f"version: v1\n# {self.reads}\n".encode()


async def test_a_file_that_never_stops_changing_is_refused_not_waited_on(tmp_path: Path) -> None:
    reader = EndlessReader()
    source = ConfigSource(
        config_file=tmp_path / "config.yaml",
        overrides={},
        poll_interval=3600,
        settle_interval=0.0,
        reader=reader,
    )
    async with running(source) as s:
        update = await next_update(s)
    assert update.config is None
    assert "kept changing" in str(update.error) and "last good config" in str(update.error)
    assert reader.reads == SETTLE_READS + 1


async def test_loading_runs_off_the_event_loop(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(mig("mixed"))
    entered, release = threading.Event(), threading.Event()

    def slow_loader(data: bytes | None, overrides: Any, source: str) -> Any:
        from kubegpu.config.loader import load_config_bytes

        entered.set()
        assert release.wait(WAIT), "the test never released the loader"
        return load_config_bytes(data, overrides, source=source)

    source = ConfigSource(
        config_file=path, overrides={}, poll_interval=FAST, settle_interval=0.0, loader=slow_loader
    )
    async with running(source) as s:
        assert await asyncio.to_thread(entered.wait, WAIT)
        # While the load is stuck, other coroutines (gRPC, /healthz, SIGTERM) still run.
        ticked = asyncio.Event()
        asyncio.get_running_loop().call_soon(ticked.set)
        await asyncio.wait_for(ticked.wait(), WAIT)
        assert s.empty()
        release.set()
        assert strategy(await next_update(s)) is MigStrategy.MIXED


async def test_a_loader_crash_is_an_error_update_not_the_end(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(mig("mixed"))
    crash = True

    def loader(data: bytes | None, overrides: Any, source: str) -> Any:
        from kubegpu.config.loader import load_config_bytes

        if crash:
            raise RuntimeError("boom")
        return load_config_bytes(data, overrides, source=source)

    source = ConfigSource(config_file=path, overrides={}, poll_interval=FAST, loader=loader)
    async with running(source) as s:
        update = await next_update(s)
        assert update.config is None and "RuntimeError('boom')" in str(update.error)
        crash = False
        source.poke()
        assert strategy(await next_update(s)) is MigStrategy.MIXED


@pytest.mark.parametrize(
    "text",
    [
        "version: {2001-01-01: 1}\n",
        "flags: &f {plugin: *f}\n",
        "flags: " + "[" * 3000 + "]" * 3000 + "\n",
        "version: v1\nversion: v1\n",
    ],
    ids=["date-key", "self-alias", "deep", "duplicate"],
)
async def test_bad_files_on_reload_keep_the_last_good(tmp_path: Path, text: str) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(mig("mixed"))
    async with running(ConfigSource(config_file=path, overrides={}, poll_interval=FAST)) as s:
        assert strategy(await next_update(s)) is MigStrategy.MIXED
        path.write_text(text)
        update = await next_update(s)
        assert update.config is None and isinstance(update.error, ConfigError)
        assert "\n" not in str(update.error)
        path.write_text(mig("single"))
        assert strategy(await next_update(s)) is MigStrategy.SINGLE


# -- watched, not polled: every kind of change wakes the source through inotify -----------

NEVER = 3600.0  # a fallback poll period no test outlives: only inotify can wake the source


def _swap(mount: Path, version: str, text: str) -> None:
    target = mount / f"..{version}"
    target.mkdir()
    (target / "config.yaml").write_text(text)
    staged = mount / "..data_tmp"
    staged.symlink_to(target.name)
    staged.replace(mount / "..data")


def _edit_in_place(path: Path, text: str) -> None:
    path.write_text(text)


def _replace_by_rename(path: Path, text: str) -> None:
    staged = path.with_name(".config.yaml.tmp")
    staged.write_text(text)
    staged.replace(path)


@pytest.mark.parametrize("change", [_edit_in_place, _replace_by_rename], ids=["write", "rename"])
async def test_a_file_change_is_seen_without_polling(tmp_path: Path, change: Any) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(mig("single"))
    async with running(ConfigSource(config_file=path, overrides={}, poll_interval=NEVER)) as s:
        assert strategy(await next_update(s)) is MigStrategy.SINGLE
        change(path, mig("mixed"))
        assert strategy(await next_update(s)) is MigStrategy.MIXED
        change(path, mig("none"))
        assert strategy(await next_update(s)) is MigStrategy.NONE


async def test_a_file_held_open_for_writing_beside_the_config_does_not_hold_its_reloads(
    tmp_path: Path,
) -> None:
    """`serve`'s own log beside its config (or an editor's swap file) once made every reload
    fail with "kept changing, or stayed open for writing": the directory's writes were all
    taken for the config's. Only the config's own file counts, on a change as on SIGHUP."""
    path = tmp_path / "config.yaml"
    path.write_text(mig("single"))
    source = ConfigSource(config_file=path, overrides={}, poll_interval=NEVER)
    with (tmp_path / "serve.log").open("a") as log:

        def log_line() -> None:
            log.write("a line\n")
            log.flush()

        async with running(source) as s:
            assert strategy(await next_update(s)) is MigStrategy.SINGLE
            log_line()
            _replace_by_rename(path, mig("mixed"))
            assert strategy(await next_update(s)) is MigStrategy.MIXED
            log_line()
            _edit_in_place(path, mig("none"))
            assert strategy(await next_update(s)) is MigStrategy.NONE
            # SIGHUP: the poke is taken before the source wakes, so this reload is a
            # forced one (two reads that agree), which the open log once failed as well.
            log_line()
            source.poke()
            _replace_by_rename(path, mig("single"))
            assert strategy(await next_update(s)) is MigStrategy.SINGLE


async def test_configmap_swaps_are_seen_without_polling(tmp_path: Path) -> None:
    mount = tmp_path / "mount"
    mount.mkdir()
    _swap(mount, "2026_11_23_04_00_00.1", mig("single"))
    (mount / "config.yaml").symlink_to("..data/config.yaml")
    path = mount / "config.yaml"
    async with running(ConfigSource(config_file=path, overrides={}, poll_interval=NEVER)) as s:
        assert strategy(await next_update(s)) is MigStrategy.SINGLE
        _swap(mount, "2026_11_23_04_00_01.2", mig("mixed"))
        assert strategy(await next_update(s)) is MigStrategy.MIXED
        _swap(mount, "2026_11_23_04_00_02.3", mig("none"))
        assert strategy(await next_update(s)) is MigStrategy.NONE


async def test_a_config_file_created_later_is_seen_without_polling(tmp_path: Path) -> None:
    path = tmp_path / "etc" / "kubegpu" / "config.yaml"
    async with running(ConfigSource(config_file=path, overrides={}, poll_interval=NEVER)) as s:
        assert (await next_update(s)).error is not None
        path.parent.mkdir(parents=True)
        path.write_text(mig("mixed"))
        assert strategy(await next_update(s)) is MigStrategy.MIXED


async def test_named_configs_are_watched_without_polling(tmp_path: Path) -> None:
    configs = tmp_path / "configs"
    configs.mkdir()
    (configs / "a.yaml").write_text(mig("single"))
    labels = FakeNodeLabels("b")
    named = NamedConfigs(configs, node_name="n", labels=labels, label_timeout=WAIT)
    source = ConfigSource(config_file=None, overrides={}, named=named, poll_interval=NEVER)
    async with running(source) as s:
        assert (await next_update(s)).error is not None  # no config named b yet
        (configs / "b.yaml").write_text(mig("mixed"))
        assert strategy(await next_update(s)) is MigStrategy.MIXED
        labels.set("a")
        assert strategy(await next_update(s)) is MigStrategy.SINGLE
        (configs / "a.yaml").write_text(mig("none"))  # the newly selected file is watched
        assert strategy(await next_update(s)) is MigStrategy.NONE


# -- one named-config selection for serve and labels -------------------------------------


@pytest.mark.parametrize("fallbacks", [None, [], ["named", "single"]])
def test_serve_and_labels_choose_named_configs_from_the_same_settings(
    fallbacks: list[str] | None,
) -> None:
    """Both commands call `named_configs`; no strategies given means NVIDIA's chart
    default (named, then single), whether the value is missing or an empty list."""
    from kubegpu.cli.labels import labels
    from kubegpu.cli.options import parse
    from kubegpu.cli.serve import serve
    from kubegpu.labeller import named_configs as labeller_named_configs

    assert labeller_named_configs is named_configs
    values = {"config_dir": "/configs", "fallback_strategies": fallbacks}
    named = named_configs(values)
    assert named is not None
    assert named.fallback_strategies == ("named", "single")
    assert named.label == DEFAULT_NODE_LABEL and named.labels is None
    assert named_configs({"config_dir": ""}) is None
    # A node name turns on the label watch through the Kubernetes adapter.
    watched = named_configs({**values, "node_name": "node-a"})
    assert watched is not None and isinstance(watched.labels, KubernetesNodeLabels)
    # What each command parses from the same flag gives the same selection.
    chosen = [named_configs(parse(c, ["--config-dir=/configs"], {})) for c in (serve, labels)]
    assert chosen[0] == chosen[1] == named


def _mutations(seed: int, count: int) -> list[bytes]:
    """What an attacker or a broken tool writes over a config: junk bytes, a valid config
    cut anywhere, or one with a byte flipped (deterministic: the seed names the corpus)."""
    rng = random.Random(seed)
    valid = (mig("mixed") + "sharing:\n  timeSlicing:\n    resources:\n").encode()
    valid += b"      - name: nvidia.com/gpu\n        replicas: 4\n"
    out: list[bytes] = []
    for _ in range(count):
        kind = rng.randrange(3)
        if kind == 0:
            out.append(rng.randbytes(rng.randrange(1, 200)))
        elif kind == 1:
            out.append(valid[: rng.randrange(1, len(valid))])
        else:
            flipped = bytearray(valid)
            flipped[rng.randrange(len(flipped))] = rng.randrange(256)
            out.append(bytes(flipped))
    return out


async def test_fuzzed_reloads_each_give_a_config_or_one_line_and_good_ones_still_land(
    tmp_path: Path,
) -> None:
    """300 hostile files renamed over a watched config, each followed by a good one: the
    source reads every hostile file, makes each a config or a one-line error (never its
    end), and always applies the good file after it."""
    path = tmp_path / "config.yaml"
    path.write_text(mig("mixed"))
    reader = CountingReader()
    source = ConfigSource(config_file=path, overrides={}, poll_interval=3600, reader=reader)
    staged = tmp_path / ".staged"
    async with running(source) as s:
        assert strategy(await next_update(s)) is MigStrategy.MIXED
        for n, data in enumerate(_mutations(seed=18, count=300)):
            staged.write_bytes(data)
            staged.replace(path)
            await eventually(lambda data=data: data in reader.seen)  # type: ignore[misc]
            # Two configs no mutation of a `mixed` file can turn into: each is news.
            wanted = mig("single") + ("  gfd:\n    oneshot: true\n" if n % 2 else "")
            staged.write_text(wanted)
            staged.replace(path)
            while True:  # every update on the way is a config or one line
                update = await next_update(s)
                if update.config is None:
                    assert str(update.error) and "\n" not in str(update.error)
                elif update.config == parse_config(wanted):
                    break
