"""The watch adapter: inotify-backed path watches (create, rename over, symlink swap,
directory removed and re-created), the polling fallback, and the backoff helper."""

from __future__ import annotations

import ast
import asyncio
import errno
import logging
import re
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from asyncinotify import Inotify

import kubegpu
from kubegpu.watch import Backoff, BlockingPathWatch, PathWatch, fingerprint, watched_dirs
from tests.waiting import WAIT


class Wakes:
    """Counts `on_change` calls and lets a test wait for the next one."""

    def __init__(self) -> None:
        self.count = 0
        self.event = asyncio.Event()

    def __call__(self) -> None:
        self.count += 1
        self.event.set()

    async def next(self) -> None:
        await asyncio.wait_for(self.event.wait(), WAIT)
        self.event.clear()

    async def after(self, check: Callable[[], bool]) -> None:
        """Wait for wakes caused from now on until `check()` holds.

        Call it right after a synchronous change: the loop has not run since, so no wake
        from the change can have been consumed already, and a wake left over from an
        earlier step was cleared by that step's own `after`.
        """
        self.event.clear()
        async with asyncio.timeout(WAIT):
            while True:
                await self.event.wait()
                self.event.clear()
                if check():
                    return


def _ino(path: Path) -> int | None:
    try:
        return path.stat().st_ino
    except OSError:
        return None


# -- which directories cover a path ------------------------------------------------------


def test_a_file_is_covered_by_its_directory_and_the_directory_by_its_parent(
    tmp_path: Path,
) -> None:
    # The parent only for the directory's own name: a sibling's churn wakes nobody.
    assert watched_dirs([tmp_path / "kubelet.sock"]) == {
        tmp_path: None,
        tmp_path.parent: frozenset({tmp_path.name}),
    }


def test_a_missing_directory_is_covered_by_its_nearest_ancestor(tmp_path: Path) -> None:
    assert watched_dirs([tmp_path / "a" / "b" / "kubelet.sock"]) == {
        tmp_path: frozenset({"a"}),
    }


def test_a_symlink_is_covered_also_through_its_target(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "config.yaml").write_text("x")
    (tmp_path / "mount").mkdir()
    (tmp_path / "mount" / "config.yaml").symlink_to(tmp_path / "real" / "config.yaml")
    assert watched_dirs([tmp_path / "mount" / "config.yaml"]) == {
        tmp_path / "mount": None,
        tmp_path / "real": None,
        tmp_path: frozenset({"mount", "real"}),
    }


def test_a_directory_is_covered_by_itself_and_its_parent(tmp_path: Path) -> None:
    (tmp_path / "configs").mkdir()
    assert watched_dirs([tmp_path / "configs"]) == {
        tmp_path / "configs": None,
        tmp_path: None,
        tmp_path.parent: frozenset({tmp_path.name}),
    }


def test_names_only_covers_a_path_by_its_own_name(tmp_path: Path) -> None:
    assert watched_dirs([tmp_path / "dra.sock"], names_only=True) == {
        tmp_path: frozenset({"dra.sock"}),
        tmp_path.parent: frozenset({tmp_path.name}),
    }


# -- the event-loop watch -----------------------------------------------------------------


async def test_creating_a_file_wakes_the_owner(tmp_path: Path) -> None:
    wakes = Wakes()
    target = tmp_path / "kubelet.sock"
    with PathWatch(lambda: [target], wakes, poll_interval=3600, name="t") as watch:
        assert watch.polling is None
        target.write_text("")
        await wakes.next()


async def test_replacing_a_file_by_rename_wakes_the_owner(tmp_path: Path) -> None:
    wakes = Wakes()
    target = tmp_path / "config.yaml"
    target.write_text("a")
    before = _ino(target)
    with PathWatch(lambda: [target], wakes, poll_interval=3600, name="t"):
        staged = tmp_path / ".config.yaml.tmp"
        staged.write_text("b")
        staged.rename(target)
        await wakes.after(lambda: _ino(target) != before)
    assert target.read_text() == "b"


async def test_writing_a_file_in_place_wakes_the_owner(tmp_path: Path) -> None:
    wakes = Wakes()
    target = tmp_path / "node.yaml"
    target.write_text("a")
    with PathWatch(lambda: [target], wakes, poll_interval=3600, name="t"):
        target.write_text("bb")
        await wakes.after(lambda: target.read_text() == "bb")


def _configmap_swap(mount: Path, version: str, text: str) -> None:
    """The kubelet's atomic writer: a new timestamped dir, `..data` renamed over to it."""
    data = mount / f"..{version}"
    data.mkdir()
    (data / "config.yaml").write_text(text)
    staged = mount / "..data_tmp"
    staged.symlink_to(data.name)
    staged.rename(mount / "..data")


def _configmap_mount(mount: Path, version: str, text: str) -> Path:
    """A ConfigMap volume as the kubelet lays it out: `config.yaml` → `..data/config.yaml`,
    `..data` → `..<version>`; the file's path."""
    mount.mkdir()
    _configmap_swap(mount, version, text)
    (mount / "config.yaml").symlink_to("..data/config.yaml")
    return mount / "config.yaml"


async def test_a_configmap_symlink_swap_wakes_the_owner(tmp_path: Path) -> None:
    mount = tmp_path / "mount"
    target = _configmap_mount(mount, "2026_11_23_04_00_00.1", "one")
    wakes = Wakes()
    with PathWatch(lambda: [target], wakes, poll_interval=3600, name="t"):
        _configmap_swap(mount, "2026_11_23_04_00_01.2", "two")
        await wakes.after(lambda: target.read_text() == "two")
        # The watch moved to the new target's directory: a second swap is seen too.
        _configmap_swap(mount, "2026_11_23_04_00_02.3", "three")
        await wakes.after(lambda: target.read_text() == "three")


async def test_a_names_only_watch_is_not_woken_by_its_siblings(tmp_path: Path) -> None:
    """A socket beside a file replaced on every call (the DRA driver's checkpoint): the
    replacements wake nobody, the socket's own creation and removal do."""
    target = tmp_path / "dra.sock"
    wakes = Wakes()
    with PathWatch(lambda: [target], wakes, poll_interval=3600, name="t", names_only=True) as watch:
        for i in range(3):
            staged = tmp_path / "checkpoint.json.tmp"
            staged.write_text(str(i))
            staged.rename(tmp_path / "checkpoint.json")
        (tmp_path / "checkpoint.json").write_text("in place")
        watch.writing()  # reads what is queued, and hands on what matters
        assert wakes.count == 0
        target.write_text("")
        await wakes.after(target.exists)
        target.unlink()
        await wakes.after(lambda: not target.exists())


def test_a_names_only_fingerprint_ignores_the_siblings(tmp_path: Path) -> None:
    target = tmp_path / "dra.sock"
    before = fingerprint([target], names_only=True)
    (tmp_path / "checkpoint.json").write_text("x")
    assert fingerprint([target], names_only=True) == before
    target.write_text("")
    assert fingerprint([target], names_only=True) != before


# -- whether a write is complete (quiet) ----------------------------------------------------


async def test_a_file_renamed_into_place_is_quiet(tmp_path: Path) -> None:
    target = tmp_path / "config.yaml"
    target.write_text("a")
    before = _ino(target)
    wakes = Wakes()
    with PathWatch(lambda: [target], wakes, poll_interval=3600, name="t") as watch:
        staged = tmp_path / ".config.yaml.tmp"
        staged.write_text("b")  # modified, then closed, then renamed: whole
        staged.rename(target)
        await wakes.after(lambda: _ino(target) != before)
        assert watch.quiet()


async def test_a_configmap_swap_is_quiet(tmp_path: Path) -> None:
    mount = tmp_path / "mount"
    target = _configmap_mount(mount, "2026_11_23_04_00_00.1", "one")
    wakes = Wakes()
    with PathWatch(lambda: [target], wakes, poll_interval=3600, name="t") as watch:
        _configmap_swap(mount, "2026_11_23_04_00_01.2", "two")
        await wakes.after(lambda: target.read_text() == "two")
        assert watch.quiet()


async def test_a_file_modified_and_still_open_is_not_quiet_until_closed(tmp_path: Path) -> None:
    target = tmp_path / "config.yaml"
    target.write_text("a")
    wakes = Wakes()
    with PathWatch(lambda: [target], wakes, poll_interval=3600, name="t") as watch:
        with target.open("a") as writer:
            writer.write("half")
            writer.flush()
            await wakes.after(lambda: target.read_text() == "ahalf")
            assert not watch.quiet(), "modified and not closed: the writer may not be done"
        await wakes.after(watch.quiet)  # IN_CLOSE_WRITE: the write is complete


async def test_another_file_held_open_for_writing_beside_it_is_not_a_write_of_it(
    tmp_path: Path,
) -> None:
    """A log held open in the watched file's directory once left the watch never quiet and
    always writing, so every reload of the file waited for the log to close."""
    target = tmp_path / "config.yaml"
    target.write_text("a")
    wakes = Wakes()
    with (
        PathWatch(lambda: [target], wakes, poll_interval=3600, name="t") as watch,
        (tmp_path / "serve.log").open("a") as log,
    ):
        log.write("a line\n")
        log.flush()
        await wakes.after(lambda: True)  # the log's write reached the watch
        assert not watch.writing()
        assert watch.quiet()
        with target.open("a") as writer:  # the watched file itself still counts
            writer.write("half")
            writer.flush()
            await wakes.after(lambda: target.read_text() == "ahalf")
            assert watch.writing() and not watch.quiet()
        await wakes.after(watch.quiet)


async def test_a_configmap_target_open_for_writing_counts_and_its_siblings_do_not(
    tmp_path: Path,
) -> None:
    """Through `config.yaml -> ..data/config.yaml`, the file written is the target in the
    timestamped directory: that one counts, another key of the same ConfigMap does not."""
    mount = tmp_path / "mount"
    target = _configmap_mount(mount, "2026_11_23_04_00_00.1", "one")
    wakes = Wakes()
    with (
        PathWatch(lambda: [target], wakes, poll_interval=3600, name="t") as watch,
        (mount / "..data" / "other.yaml").open("w") as sibling,
    ):
        sibling.write("x")
        sibling.flush()
        await wakes.after(lambda: True)
        assert not watch.writing() and watch.quiet()
        with target.open("a") as writer:
            writer.write("+")
            writer.flush()
            await wakes.after(lambda: target.read_text() == "one+")
            assert watch.writing() and not watch.quiet()
        await wakes.after(watch.quiet)


async def test_a_write_queued_after_the_wake_is_not_quiet_and_wakes_the_owner(
    tmp_path: Path,
) -> None:
    target = tmp_path / "config.yaml"
    wakes = Wakes()
    with PathWatch(lambda: [target], wakes, poll_interval=3600, name="t") as watch:
        target.write_text("one")
        await wakes.after(target.exists)
        before = wakes.count
        target.write_text("two")  # events queued, not yet read by the loop
        assert not watch.quiet(), "queued events mean the owner must look again"
        assert wakes.count == before + 1, "the queued events reached the owner"


async def test_a_polling_watch_is_never_quiet(tmp_path: Path) -> None:
    target = tmp_path / "config.yaml"
    target.write_text("a")
    with PathWatch(
        lambda: [target], Wakes(), poll_interval=3600, name="t", inotify=_no_inotify
    ) as watch:
        assert watch.polling is not None
        assert not watch.quiet(), "without events nothing says a write has ended"


async def test_a_directory_removed_and_re_created_is_watched_again(tmp_path: Path) -> None:
    plugins = tmp_path / "device-plugins"
    plugins.mkdir()
    socket_path = plugins / "kubelet.sock"
    wakes = Wakes()
    with PathWatch(lambda: [socket_path], wakes, poll_interval=3600, name="t"):
        for _ in range(3):  # as every kubelet restart does
            plugins.rmdir()
            await wakes.after(lambda: not plugins.exists())
            plugins.mkdir()
            await wakes.after(plugins.is_dir)
            # The new directory's inode is watched: a socket created in it wakes the owner.
            socket_path.write_text("")
            await wakes.after(socket_path.exists)
            socket_path.unlink()
            await wakes.after(lambda: not socket_path.exists())


async def test_a_directory_removed_while_a_socket_pins_it_is_seen(tmp_path: Path) -> None:
    """A socket still bound inside a removed directory delays the directory's own
    DELETE_SELF until the socket closes (the old plugin server's, closed only once the
    restart is seen): the parent's events must be enough."""
    plugins = tmp_path / "dp"
    plugins.mkdir()
    kubelet = plugins / "kubelet.sock"
    wakes = Wakes()
    pin = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    pinned = plugins / "plugin.sock"
    pin.bind(str(pinned))
    try:
        with PathWatch(lambda: [kubelet], wakes, poll_interval=3600, name="t"):
            pinned.unlink()  # the kubelet wipes the sockets; the server still holds its own
            await wakes.after(lambda: not pinned.exists())
            plugins.rmdir()
            plugins.mkdir()
            await wakes.after(plugins.is_dir)
            kubelet.write_text("")
            await wakes.after(kubelet.exists)
    finally:
        pin.close()


async def test_a_directory_created_later_is_seen(tmp_path: Path) -> None:
    sock_path = tmp_path / "kubelet" / "device-plugins" / "kubelet.sock"
    wakes = Wakes()
    with PathWatch(lambda: [sock_path], wakes, poll_interval=3600, name="t"):
        sock_path.parent.mkdir(parents=True)
        await wakes.after(lambda: sock_path.parent.is_dir())
        sock_path.write_text("")
        await wakes.after(sock_path.exists)


async def test_rearm_follows_a_changed_path_set(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    current = [tmp_path / "a" / "x"]
    wakes = Wakes()
    with PathWatch(lambda: current, wakes, poll_interval=3600, name="t") as watch:
        current[:] = [tmp_path / "b" / "x"]
        watch.rearm()
        (tmp_path / "b" / "x").write_text("")
        await wakes.next()


# -- the fallback --------------------------------------------------------------------------


def _no_inotify() -> Any:
    raise OSError(errno.EMFILE, "Too many open files")


class _WatchLimit(Inotify):
    """An inotify instance whose watch limit is reached (ENOSPC on add_watch)."""

    def add_watch(self, path: Any, mask: Any) -> Any:
        raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("factory", [_no_inotify, _WatchLimit], ids=["no-instance", "no-watch"])
async def test_without_inotify_the_watch_polls_and_says_so_once(
    tmp_path: Path, factory: Callable[[], Any], caplog: pytest.LogCaptureFixture
) -> None:
    target = tmp_path / "config.yaml"
    wakes = Wakes()
    with (
        caplog.at_level(logging.WARNING, logger="kubegpu.watch"),
        PathWatch(
            lambda: [target], wakes, poll_interval=0.01, name="config file", inotify=factory
        ) as watch,
    ):
        assert watch.polling is not None
        target.write_text("one")
        await wakes.after(target.exists)
        target.write_text("two!")
        await wakes.after(lambda: target.read_text() == "two!")
    warnings = [r.getMessage() for r in caplog.records if r.name == "kubegpu.watch"]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith("config file: inotify unavailable")
    assert "max_user" in warnings[0]


def test_the_fallback_fingerprint_sees_a_symlink_swap(tmp_path: Path) -> None:
    mount = tmp_path / "mount"
    _configmap_mount(mount, "1", "same")
    before = fingerprint([mount / "config.yaml"])
    _configmap_swap(mount, "2", "same")
    assert fingerprint([mount / "config.yaml"]) != before


# -- the thread flavour --------------------------------------------------------------------


@pytest.fixture
def blocking(tmp_path: Path) -> Iterator[tuple[BlockingPathWatch, Path]]:
    target = tmp_path / "node.yaml"
    target.write_text("a")
    watch = BlockingPathWatch(lambda: [target], poll_interval=3600, name="node file")
    try:
        yield watch, target
    finally:
        watch.close()


def _in_thread(fn: Callable[[], bool]) -> tuple[threading.Thread, list[bool]]:
    results: list[bool] = []
    thread = threading.Thread(target=lambda: results.append(fn()))
    thread.start()
    return thread, results


def test_blocking_watch_returns_true_on_a_change(
    blocking: tuple[BlockingPathWatch, Path],
) -> None:
    watch, target = blocking
    thread, results = _in_thread(watch.wait)
    target.write_text("b")
    thread.join(WAIT)
    assert results == [True]


def test_blocking_watch_returns_false_when_interrupted(
    blocking: tuple[BlockingPathWatch, Path],
) -> None:
    watch, _ = blocking
    thread, results = _in_thread(watch.wait)
    watch.interrupt()
    thread.join(WAIT)
    assert results == [False]


def test_blocking_watch_leaves_its_watches_alone_for_unrelated_churn(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The parent of the watched file's directory is covered for that directory's name
    only: another entry coming and going there neither wakes nor re-arms the watch."""
    target = tmp_path / "node" / "node.yaml"
    target.parent.mkdir()
    target.write_text("a")
    watch = BlockingPathWatch(lambda: [target], poll_interval=3600, name="node file")
    rearms: list[int] = []
    rearm = watch._core.rearm

    def counted() -> None:
        rearms.append(1)
        rearm()

    monkeypatch.setattr(watch._core, "rearm", counted)
    try:
        (tmp_path / "other").write_text("x")  # queued before the wait
        watch.interrupt()
        assert watch.wait() is False
        assert rearms == []
        # A change to the watched file still wakes, and re-arms.
        target.write_text("b")
        assert watch.wait() is True
        assert rearms == [1]
    finally:
        watch.close()


def test_interrupt_after_close_is_harmless(tmp_path: Path) -> None:
    watch = BlockingPathWatch(lambda: [tmp_path / "x"], poll_interval=3600, name="t")
    watch.close()
    watch.interrupt()
    watch.close()


def test_blocking_watch_polls_without_inotify(tmp_path: Path) -> None:
    target = tmp_path / "node.yaml"
    watch = BlockingPathWatch(
        lambda: [target], poll_interval=0.01, name="node file", inotify=_no_inotify
    )
    try:
        assert watch.polling is not None
        thread, results = _in_thread(watch.wait)
        target.write_text("b")
        thread.join(WAIT)
        assert results == [True]
    finally:
        watch.close()


# -- backoff -------------------------------------------------------------------------------


class FakeSleep:
    def __init__(self) -> None:
        self.slept: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.slept.append(seconds)


async def test_backoff_doubles_up_to_its_cap_and_resets() -> None:
    sleep = FakeSleep()
    backoff = Backoff(0.05, 0.3, sleep=sleep)
    for _ in range(5):
        await backoff.wait()
    assert sleep.slept == [0.05, 0.1, 0.2, 0.3, 0.3]
    backoff.reset()
    assert backoff.advance() == 0.05
    assert backoff.delay == 0.1


async def test_backoff_wait_is_cut_short_by_a_wake() -> None:
    never = asyncio.Event()

    async def forever(seconds: float) -> None:
        await never.wait()

    backoff = Backoff(1.0, 2.0, sleep=forever)
    wake = asyncio.Event()
    waiting = asyncio.ensure_future(backoff.wait(wake))
    await asyncio.sleep(0)
    wake.set()
    assert await asyncio.wait_for(waiting, WAIT) is True
    assert backoff.delay == 2.0


async def test_backoff_wait_without_wake_reports_a_full_sleep() -> None:
    sleep = FakeSleep()
    assert await Backoff(1.0, 2.0, sleep=sleep).wait(asyncio.Event()) is False
    assert sleep.slept == [1.0]


def test_backoff_resets_only_after_a_stable_run() -> None:
    now = [100.0]
    backoff = Backoff(1.0, 60.0, clock=lambda: now[0])
    for _ in range(4):
        backoff.advance()
    backoff.mark()
    now[0] += 5
    assert not backoff.reset_if_stable(600)
    assert backoff.delay == 16.0
    now[0] += 600
    assert backoff.reset_if_stable(600)
    assert backoff.delay == 1.0


class RecordingStop(threading.Event):
    """A stop flag whose timed waits return at once, recorded (a thread's fake clock)."""

    def __init__(self) -> None:
        super().__init__()
        self.waits: list[float | None] = []

    def wait(self, timeout: float | None = None) -> bool:
        self.waits.append(timeout)
        return self.is_set()


def test_backoff_blocks_a_thread_on_its_stop_flag() -> None:
    stop = RecordingStop()
    backoff = Backoff(1.0, 4.0)
    assert [backoff.block(stop) for _ in range(4)] == [False] * 4
    assert stop.waits == [1.0, 2.0, 4.0, 4.0]
    stop.set()
    assert backoff.block(stop) is True  # stopped: the retry loop ends


def test_backoff_block_wakes_when_the_flag_is_set_from_another_thread() -> None:
    stop = threading.Event()
    backoff = Backoff(3600.0, 3600.0)  # far beyond the test's timeout unless woken
    result: list[bool] = []
    thread = threading.Thread(target=lambda: result.append(backoff.block(stop)))
    thread.start()
    stop.set()
    thread.join(WAIT)
    assert result == [True]


@pytest.mark.parametrize(("start", "cap", "factor"), [(0, 1, 2), (2, 1, 2), (1, 2, 0.5)])
def test_backoff_refuses_nonsense(start: float, cap: float, factor: float) -> None:
    with pytest.raises(ValueError, match="need 0 < start <= cap and factor >= 1"):
        Backoff(start, cap, factor=factor)


def test_inotify_instances_are_closed_with_the_watch(tmp_path: Path) -> None:
    before = sum(1 for _ in Path("/proc/self/fd").iterdir())
    for _ in range(20):
        BlockingPathWatch(lambda: [tmp_path / "x"], poll_interval=3600, name="t").close()
    assert sum(1 for _ in Path("/proc/self/fd").iterdir()) <= before


# -- one backoff helper (structural) -------------------------------------------------------

SRC = Path(kubegpu.__file__).parent
#: Words that name a retry delay; a multiplied one is a hand-written exponential backoff.
DELAY_WORDS = re.compile(r"delay|backoff|sleep|retry|interval|wait", re.IGNORECASE)


def _delay_named(node: ast.AST) -> bool:
    if isinstance(node, ast.Subscript):
        return _delay_named(node.value)
    name = node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", None)
    return bool(name and DELAY_WORDS.search(name))


def _grows_a_delay(expr: ast.AST) -> bool:
    return (
        isinstance(expr, ast.BinOp)
        and isinstance(expr.op, ast.Mult | ast.Pow)
        and (_delay_named(expr.left) or _delay_named(expr.right))
    )


def _hand_written_backoffs(source: str, where: str) -> list[str]:
    """`min(delay * 2, cap)`, `delay *= 2` and `delay = delay * 2` (any delay-like name)."""
    found = []
    for node in ast.walk(ast.parse(source, where)):
        hit = (
            (
                isinstance(node, ast.Call)
                and getattr(node.func, "id", None) == "min"
                and any(_grows_a_delay(arg) for arg in node.args)
            )
            or (
                isinstance(node, ast.AugAssign)
                and isinstance(node.op, ast.Mult | ast.Pow)
                and _delay_named(node.target)
            )
            or (
                isinstance(node, ast.Assign)
                and any(_delay_named(t) for t in node.targets)
                and _grows_a_delay(node.value)
            )
        )
        if hit:
            found.append(f"{where}:{getattr(node, 'lineno', '?')}")
    return found


def test_no_module_but_watch_backoff_writes_its_own_backoff() -> None:
    allowed = SRC / "watch" / "backoff.py"
    offenders = [
        hit
        for path in sorted(SRC.rglob("*.py"))
        if path != allowed
        for hit in _hand_written_backoffs(path.read_text(), str(path.relative_to(SRC.parent)))
    ]
    assert offenders == [], "pace retries with kubegpu.watch.Backoff (block() in threads)"


@pytest.mark.parametrize(
    "source",
    [
        "backoff = min(backoff * 2, MAX_BACKOFF_S)",  # the NVML health thread's, before
        "delay, self._delay = self._delay, min(self._delay * 2, self._cap)",  # kube's, before
        "delay = min(delay * 2, self.backoff[1])",  # the MPS supervisor's, before
        "retry_wait *= 2",
        "self.sleep_s = self.sleep_s * 1.5",
    ],
)
def test_the_backoff_scan_finds_hand_written_doubling(source: str) -> None:
    assert _hand_written_backoffs(source, "example")


def test_the_backoff_scan_sees_the_helper_itself_and_spares_other_products() -> None:
    assert _hand_written_backoffs((SRC / "watch" / "backoff.py").read_text(), "backoff.py")
    clean = "amount *= scale\ndeadline = time.monotonic() + 10 * self.backoff[1]\n"
    assert _hand_written_backoffs(clean, "clean") == []
