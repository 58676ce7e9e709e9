"""Label delivery (file, NodeFeature, Node patch), the loop, and `kubegpu labels` flags."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest

import kubegpu.devices
from kubegpu.config import Config, parse_config
from kubegpu.devices.model import Gpu, HealthEvent, Inventory, StopFlag
from kubegpu.errors import InitError
from kubegpu.labeller import (
    MANAGED_ANNOTATION,
    FakeKubeApi,
    FeatureFileSink,
    NodeFeatureSink,
    NodePatchSink,
    PublishError,
    format_features,
    labels_main,
    parse_duration,
    read_machine_type,
    register_cli,
    run_labeller,
)

FIXTURES = Path(__file__).parent.parent / "fixtures"
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
    return Config()


class RecordingSink:
    def __init__(self, on_publish: Callable[[int], None] = lambda n: None) -> None:
        self.published: list[dict[str, str]] = []
        self.on_publish = on_publish

    async def publish(self, labels: Mapping[str, str]) -> None:
        self.published.append(dict(labels))
        self.on_publish(len(self.published))


# --- sinks ---------------------------------------------------------------------------


def test_features_file_format_is_sorted_key_value_lines() -> None:
    assert format_features({"b": "2", "a": "1"}) == "a=1\nb=2\n"


async def test_feature_file_sink_replaces_file_atomically(tmp_path: Path) -> None:
    target = tmp_path / "features.d" / "gfd"
    sink = FeatureFileSink(str(target))
    await sink.publish({"nvidia.com/gpu.count": "1"})
    await sink.publish({"nvidia.com/gpu.count": "2", "nvidia.com/gpu.present": "true"})
    assert target.read_text() == "nvidia.com/gpu.count=2\nnvidia.com/gpu.present=true\n"
    assert sorted(p.name for p in target.parent.iterdir()) == ["gfd"]  # no temp files left
    assert target.stat().st_mode & 0o777 == 0o644


async def test_feature_file_sink_unwritable_dir_says_what_to_fix(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(PublishError, match=r"features\.d"):
        await FeatureFileSink(str(blocker / "gfd")).publish({"a": "b"})


async def test_node_patch_sets_and_later_removes_only_its_own_labels() -> None:
    api = FakeKubeApi()
    api.add_node("n1", {"kubernetes.io/hostname": "n1", "nvidia.com/custom": "mine"})
    sink = NodePatchSink(api, "n1")
    await sink.publish({"nvidia.com/gpu.count": "2", "nvidia.com/gpu.product": "Tesla-T4"})
    labels = api.nodes["n1"]["labels"]
    assert labels["nvidia.com/gpu.count"] == "2"
    assert json.loads(api.nodes["n1"]["annotations"][MANAGED_ANNOTATION]) == [
        "nvidia.com/gpu.count",
        "nvidia.com/gpu.product",
    ]

    await sink.publish({"nvidia.com/gpu.count": "1"})
    labels = api.nodes["n1"]["labels"]
    assert "nvidia.com/gpu.product" not in labels  # ours, gone from the set: removed
    assert labels["nvidia.com/custom"] == "mine"  # never ours: untouched
    assert labels["kubernetes.io/hostname"] == "n1"
    assert labels["nvidia.com/gpu.count"] == "1"


async def test_node_patch_skips_the_write_when_nothing_changed() -> None:
    api = FakeKubeApi()
    api.add_node("n1")
    sink = NodePatchSink(api, "n1")
    await sink.publish({"a.io/x": "1"})
    await sink.publish({"a.io/x": "1"})
    assert api.calls == ["get node/n1", "patch node/n1", "get node/n1"]


def test_node_patch_is_a_minimal_merge_patch() -> None:
    sink = NodePatchSink(FakeKubeApi(), "n1")
    meta = {
        "labels": {"a.io/keep": "1", "a.io/old": "x", "a.io/foreign": "y"},
        "annotations": {MANAGED_ANNOTATION: '["a.io/keep","a.io/old"]'},
    }
    patch = sink.patch_for(meta, {"a.io/keep": "1", "a.io/new": "2"})
    assert patch["metadata"]["labels"] == {"a.io/new": "2", "a.io/old": None}
    assert patch["metadata"]["annotations"] == {MANAGED_ANNOTATION: '["a.io/keep","a.io/new"]'}


async def test_node_feature_object_created_then_updated_keeping_features() -> None:
    api = FakeKubeApi()
    sink = NodeFeatureSink(api, "gpu-1", "kube-system")
    await sink.publish({"nvidia.com/gpu.count": "1"})
    obj = api.node_features[("kube-system", "nvidia-features-for-gpu-1")]
    assert obj["apiVersion"] == "nfd.k8s-sigs.io/v1alpha1"
    assert obj["kind"] == "NodeFeature"
    assert obj["metadata"]["labels"] == {"nfd.node.kubernetes.io/node-name": "gpu-1"}
    assert obj["spec"] == {"labels": {"nvidia.com/gpu.count": "1"}}

    obj["spec"]["features"] = {"flags": {}}  # NFD's part must survive our updates
    await sink.publish({"nvidia.com/gpu.count": "2"})
    obj = api.node_features[("kube-system", "nvidia-features-for-gpu-1")]
    assert obj["spec"] == {"labels": {"nvidia.com/gpu.count": "2"}, "features": {"flags": {}}}

    api.calls.clear()
    await sink.publish({"nvidia.com/gpu.count": "2"})
    assert api.calls == ["get nodefeature/kube-system/nvidia-features-for-gpu-1"]


# --- loop ----------------------------------------------------------------------------


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
        5,
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


def test_machine_type_file(tmp_path: Path) -> None:
    f = tmp_path / "product_name"
    f.write_text("Standard PC (Q35 + ICH9, 2009)\n")
    assert read_machine_type(str(f)) == "Standard PC (Q35 + ICH9, 2009)"
    assert read_machine_type(str(tmp_path / "missing")) == "unknown"


# --- CLI -----------------------------------------------------------------------------


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kubegpu")
    register_cli(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["labels", *argv])


class FakeBackend:
    name = "fake"

    def discover(self) -> Inventory:
        return NODE

    def probe(self, uuid: str) -> str | None:
        return None

    def watch(self, stop: StopFlag, emit: Callable[[HealthEvent], None]) -> None:
        pass

    def close(self) -> None:
        pass


@pytest.fixture
def fake_backend(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    opened: list[dict[str, Any]] = []

    def open_backend(kind: str = "auto", **kwargs: Any) -> FakeBackend:
        opened.append({"kind": kind, **kwargs})
        return FakeBackend()

    monkeypatch.setattr(kubegpu.devices, "open_backend", open_backend)
    return opened


def run_cli(argv: list[str], env: Mapping[str, str] | None = None, **kw: Any) -> int:
    args = parse(*argv)
    func: Callable[..., int] = args.func
    assert func is labels_main
    return func(args, environ=dict(env or {}), **kw)


def test_cli_oneshot_writes_features_file(
    tmp_path: Path, fake_backend: list[dict[str, Any]]
) -> None:
    out = tmp_path / "gfd"
    rc = run_cli(
        ["--oneshot", "-o", str(out), "--no-timestamp", "--sysfs-root", str(FIXTURES / "pci-none")],
        {"GFD_MACHINE_TYPE_FILE": str(tmp_path / "none"), "MIG_STRATEGY": "single"},
    )
    assert rc == 0
    lines = out.read_text().splitlines()
    assert "nvidia.com/gpu.product=Tesla-T4" in lines
    assert "nvidia.com/gpu.machine=unknown" in lines
    assert "nvidia.com/mig.strategy=single" in lines  # from the env var
    assert not any(line.startswith("nvidia.com/gfd.timestamp=") for line in lines)
    assert fake_backend[0]["kind"] == "auto"
    assert run_cli(["--oneshot", "-o", str(out), "--backend", "nvml"]) == 0
    assert fake_backend[1]["kind"] == "nvml"


def test_cli_flag_beats_env_and_env_beats_config_file(
    tmp_path: Path, fake_backend: list[dict[str, Any]]
) -> None:
    cfg = tmp_path / "config.yaml"
    cfg.write_text("version: v1\nflags:\n  migStrategy: mixed\n  gfd:\n    oneshot: true\n")
    out = tmp_path / "gfd"
    common = ["--config-file", str(cfg), "-o", str(out), "--sysfs-root", str(tmp_path)]
    assert run_cli(common) == 0
    assert "nvidia.com/mig.strategy=mixed" in out.read_text()
    assert run_cli(common, {"MIG_STRATEGY": "single"}) == 0
    assert "nvidia.com/mig.strategy=single" in out.read_text()
    assert run_cli([*common, "--mig-strategy", "none"], {"MIG_STRATEGY": "single"}) == 0
    assert "nvidia.com/mig.strategy" not in out.read_text()


def test_cli_node_patch_uses_the_api(tmp_path: Path, fake_backend: list[dict[str, Any]]) -> None:
    api = FakeKubeApi()
    api.add_node("gpu-1")
    rc = run_cli(
        ["--oneshot", "--node-patch", "--sysfs-root", str(tmp_path)],
        {"NODE_NAME": "gpu-1"},
        api_factory=lambda: api,
    )
    assert rc == 0
    assert api.nodes["gpu-1"]["labels"]["nvidia.com/gpu.count"] == "1"


def test_cli_node_feature_api_needs_a_namespace_env(
    tmp_path: Path, fake_backend: list[dict[str, Any]]
) -> None:
    api = FakeKubeApi()
    rc = run_cli(
        ["--oneshot", "--sysfs-root", str(tmp_path)],
        {"NODE_NAME": "gpu-1", "GFD_USE_NODE_FEATURE_API": "true", "POD_NAMESPACE": "gpu"},
        api_factory=lambda: api,
    )
    assert rc == 0
    assert ("gpu", "nvidia-features-for-gpu-1") in api.node_features


def test_cli_node_feature_takes_gfds_namespace_and_pod_name_env(
    tmp_path: Path, fake_backend: list[dict[str, Any]]
) -> None:
    api = FakeKubeApi()
    owner = {"apiVersion": "apps/v1", "kind": "DaemonSet", "name": "gfd", "uid": "ds-1"}
    api.pods[("gpu-operator", "gfd-abcde")] = {
        "name": "gfd-abcde",
        "uid": "pod-1",
        "ownerReferences": [owner],
    }
    env = {
        "NODE_NAME": "gpu-1",
        "GFD_USE_NODE_FEATURE_API": "true",
        "NAMESPACE": "gpu-operator",  # GFD's env var; wins over the pod's own namespace
        "POD_NAMESPACE": "elsewhere",
        "POD_NAME": "gfd-abcde",
    }
    rc = run_cli(["--oneshot", "--sysfs-root", str(tmp_path)], env, api_factory=lambda: api)
    assert rc == 0
    obj = api.node_features[("gpu-operator", "nvidia-features-for-gpu-1")]
    owners = obj["metadata"]["ownerReferences"]
    assert [(o["kind"], o["uid"]) for o in owners] == [("DaemonSet", "ds-1"), ("Pod", "pod-1")]


def test_cli_node_feature_without_a_readable_pod_labels_unowned(
    tmp_path: Path, fake_backend: list[dict[str, Any]]
) -> None:
    api = FakeKubeApi()
    env = {
        "NODE_NAME": "gpu-1",
        "GFD_USE_NODE_FEATURE_API": "true",
        "POD_NAMESPACE": "gpu",
        "POD_NAME": "gone",
    }
    rc = run_cli(["--oneshot", "--sysfs-root", str(tmp_path)], env, api_factory=lambda: api)
    assert rc == 0
    assert (
        "ownerReferences" not in api.node_features[("gpu", "nvidia-features-for-gpu-1")]["metadata"]
    )


@pytest.mark.parametrize(
    ("argv", "env", "named"),
    [
        (["--sleep-interval", "soon"], {}, "--sleep-interval"),
        ([], {"GFD_SLEEP_INTERVAL": "10parsecs"}, "GFD_SLEEP_INTERVAL"),
        (["--mig-strategy", "half"], {}, "--mig-strategy"),
        ([], {"MIG_STRATEGY": "half"}, "MIG_STRATEGY"),
        (["--oneshot=maybe"], {}, "--oneshot"),
        ([], {"FAIL_ON_INIT_ERROR": "sometimes"}, "FAIL_ON_INIT_ERROR"),
        (["--node-patch"], {}, "--node-name"),
        (["--use-node-feature-api"], {"NODE_NAME": "n"}, "--use-node-feature-api"),
        (["--node-patch", "--use-node-feature-api"], {"NODE_NAME": "n"}, "--node-patch"),
    ],
)
def test_cli_bad_values_exit_2_with_one_line_naming_the_flag(
    argv: list[str],
    env: dict[str, str],
    named: str,
    capsys: pytest.CaptureFixture[str],
    fake_backend: list[dict[str, Any]],
) -> None:
    # The namespace fallback reads the service-account file; none exists in tests.
    assert run_cli(argv, env, api_factory=FakeKubeApi) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert named in err


def test_cli_bad_config_file_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("version: v1\nflags:\n  migStrategy: sideways\n")
    assert run_cli(["--config-file", str(cfg)]) == 2
    assert "migStrategy" in capsys.readouterr().err


def test_cli_simulate_t4_preset(tmp_path: Path) -> None:
    out = tmp_path / "gfd"
    rc = run_cli(["--oneshot", "--simulate", "t4-1", "-o", str(out), "--sysfs-root", str(tmp_path)])
    assert rc == 0
    labels = dict(line.split("=", 1) for line in out.read_text().splitlines())
    assert labels["nvidia.com/gpu.count"] == "1"
    assert labels["nvidia.com/gpu.product"].endswith("T4")
    assert labels["nvidia.com/gpu.family"] == "turing"


# --- the named config (issue 8): the labeller picks what `serve` picks -------------------

SHARE_4 = """version: v1
sharing:
  timeSlicing:
    resources:
      - name: nvidia.com/gpu
        replicas: 4
"""
PLAIN = "version: v1\n"


def named_dir(tmp_path: Path) -> Path:
    configs = tmp_path / "available-configs"
    configs.mkdir()
    (configs / "shared").write_text(SHARE_4)
    (configs / "plain").write_text(PLAIN)
    return configs


def test_cli_uses_the_named_config_the_node_label_picks(
    tmp_path: Path, fake_backend: list[dict[str, Any]]
) -> None:
    from kubegpu.config.source import FakeNodeLabels

    out = tmp_path / "gfd"
    node_labels = FakeNodeLabels("shared")
    env = {
        "CONFIG_FILE_SRCDIR": str(named_dir(tmp_path)),
        "DEFAULT_CONFIG": "plain",
        "NODE_NAME": "gpu-node-1",
    }
    argv = ["--oneshot", "-o", str(out), "--no-timestamp", "--sysfs-root", str(tmp_path)]
    assert run_cli(argv, env, node_labels=node_labels) == 0
    labels = dict(line.split("=", 1) for line in out.read_text().splitlines())
    assert labels["nvidia.com/gpu.replicas"] == "4"
    assert labels["nvidia.com/gpu.product"] == "Tesla-T4-SHARED"
    assert labels["nvidia.com/gpu.sharing-strategy"] == "time-slicing"
    assert node_labels.watched == [("gpu-node-1", "nvidia.com/device-plugin.config")]


def test_cli_named_config_falls_back_to_the_default_without_a_label(
    tmp_path: Path, fake_backend: list[dict[str, Any]]
) -> None:
    from kubegpu.config.source import FakeNodeLabels

    out = tmp_path / "gfd"
    env = {
        "CONFIG_FILE_SRCDIR": str(named_dir(tmp_path)),
        "DEFAULT_CONFIG": "plain",
        "NODE_NAME": "gpu-node-1",
    }
    argv = ["--oneshot", "-o", str(out), "--no-timestamp", "--sysfs-root", str(tmp_path)]
    assert run_cli(argv, env, node_labels=FakeNodeLabels(None)) == 0
    labels = dict(line.split("=", 1) for line in out.read_text().splitlines())
    assert labels["nvidia.com/gpu.replicas"] == "1"
    assert labels["nvidia.com/gpu.product"] == "Tesla-T4"


def test_cli_named_config_that_does_not_exist_is_one_line_exit_2(
    tmp_path: Path, fake_backend: list[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    from kubegpu.config.source import FakeNodeLabels

    env = {"CONFIG_FILE_SRCDIR": str(named_dir(tmp_path)), "NODE_NAME": "gpu-node-1"}
    argv = ["--oneshot", "-o", str(tmp_path / "gfd"), "--sysfs-root", str(tmp_path)]
    assert run_cli(argv, env, node_labels=FakeNodeLabels("typo")) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "'typo'" in err and "plain, shared" in err


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
        now = await asyncio.wait_for(waiting, timeout=10)
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
