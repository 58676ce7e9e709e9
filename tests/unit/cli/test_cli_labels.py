"""`kubegpu labels`: GFD's flags and env vars, the sink they pick, the named config."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import click
import pytest

import kubegpu.devices
from kubegpu.cli import kubegpu as kubegpu_command
from kubegpu.cli.labels import labels, labels_main
from kubegpu.devices.model import HealthEvent, Inventory, StopFlag
from kubegpu.kube import KubeError
from kubegpu.kube.client import default_client
from tests.builders import NODE
from tests.rig.kube import FakeKube

FIXTURES = Path(__file__).parents[2] / "fixtures"


# --- CLI -----------------------------------------------------------------------------


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
    # `kubegpu labels` is the command `labels_main` runs.
    assert kubegpu_command.get_command(click.Context(kubegpu_command), "labels") is labels
    return labels_main(argv, environ=dict(env or {}), **kw)


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


def test_cli_oneshot_refuses_to_replace_a_system_file_unless_forced(
    tmp_path: Path, fake_backend: list[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    account = tmp_path / "etc" / "passwd"
    account.parent.mkdir()
    account.write_text("root:x:0:0:root:/root:/bin/bash\n")
    relative = tmp_path / "features.d" / ".." / "etc" / "passwd"
    argv = ["--oneshot", "-o", str(relative), "--sysfs-root", str(tmp_path)]
    assert run_cli(argv) != 0
    assert account.read_text() == "root:x:0:0:root:/root:/bin/bash\n"
    err = capsys.readouterr().err
    assert "refusing to replace" in err and "Traceback" not in err
    assert run_cli(argv, {"KUBEGPU_FORCE_OUTPUT": "true"}) == 0
    assert "nvidia.com/gpu.count=1" in account.read_text().splitlines()


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
    api = FakeKube()
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
    api = FakeKube()
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
    api = FakeKube()
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
    api = FakeKube()
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


def test_cli_node_feature_unreadable_pod_is_the_adapters_error_and_labels_unowned(
    tmp_path: Path, fake_backend: list[dict[str, Any]], caplog: pytest.LogCaptureFixture
) -> None:
    """A refused Pod read (RBAC) is a `KubeError`: logged once, and labelling goes on."""
    api = FakeKube()
    api.fail_next("get pod/", KubeError("get Pod gpu/gfd-1: HTTP 403 Forbidden", status=403))
    env = {
        "NODE_NAME": "gpu-1",
        "GFD_USE_NODE_FEATURE_API": "true",
        "POD_NAMESPACE": "gpu",
        "POD_NAME": "gfd-1",
    }
    rc = run_cli(["--oneshot", "--sysfs-root", str(tmp_path)], env, api_factory=lambda: api)
    assert rc == 0
    assert "HTTP 403 Forbidden" in caplog.text
    meta = api.node_features[("gpu", "nvidia-features-for-gpu-1")]["metadata"]
    assert "ownerReferences" not in meta


@pytest.fixture
def no_credentials(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Neither in a pod nor a kubeconfig, and no client configured by an earlier test."""
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "no-kubeconfig"))
    default_client.cache_clear()
    yield
    default_client.cache_clear()


@pytest.mark.usefixtures("no_credentials")
@pytest.mark.parametrize("mode", ["--node-patch", "--use-node-feature-api"])
def test_cli_api_modes_without_credentials_fail_at_start_in_one_line(
    mode: str,
    tmp_path: Path,
    fake_backend: list[dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
) -> None:
    rc = run_cli(
        ["--oneshot", mode, "--sysfs-root", str(tmp_path)],
        {"NODE_NAME": "gpu-1", "POD_NAMESPACE": "gpu"},
    )
    assert rc == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "no Kubernetes credentials" in err
    assert "KUBECONFIG" in err  # what to do
    assert fake_backend == []  # failed before any GPU was read


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
    assert run_cli(argv, env, api_factory=FakeKube) == 2
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


# --- the named config: the labeller picks what `serve` picks ------------------------------

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


# --- no GPU: GFD's --fail-on-init-error ----------------------------------------------------


def test_without_a_gpu_it_exits_1_as_gfd_and_names_the_flag_that_labels_anyway(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    no_driver = tmp_path / "no-driver"
    no_driver.mkdir()
    argv = ["--oneshot", "-o", "-", "--backend", "nvml", "--nvidia-driver-root", str(no_driver)]
    argv += ["--sysfs-root", str(tmp_path)]
    assert run_cli(argv) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    (line,) = captured.err.splitlines()
    assert "NVML" in line and "--fail-on-init-error=false" in line

    assert run_cli([*argv, "--fail-on-init-error=false"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert any(label.startswith("nvidia.com/gfd.timestamp=") for label in printed), printed
    assert not any(label.startswith("nvidia.com/gpu.product=") for label in printed)
