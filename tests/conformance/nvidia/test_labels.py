"""GPU Feature Discovery's own label cases, run against `kubegpu.labels` and the labeller.

Every case comes from NVIDIA's k8s-device-plugin v0.20.0 (see
`data/nvidia/labels/README.md`): the mocked devices of its label tests are rebuilt as
kubegpu `Gpu`/`MigDevice` models, and kubegpu's labels must equal GFD's expected ones.
GFD's own `tests/expected-output*.txt` are read unmodified from ../shared/peer-data.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

from kubegpu.config import Config, parse_config
from kubegpu.devices.model import Gpu, Inventory, MigDevice
from kubegpu.errors import ConfigError, InitError, KubegpuError
from kubegpu.labeller import FeatureFileSink, parse_duration, read_machine_type, run_labeller
from kubegpu.labels import (
    MIG_ATTRIBUTES,
    gpu_labels,
    sanitise,
    vendor_capability,
    vgpu_host_driver,
    vgpu_labels,
)
from tests.conformance.origin import DATA, NVIDIA_DP, peer_file
from tests.waiting import WAIT

LABELS = DATA / "nvidia" / "labels"
PRESENT = "nvidia.com/gpu.present"


def load(name: str) -> Any:
    return yaml.safe_load((LABELS / name).read_text(encoding="utf-8"))


MOCK = load("mock.yaml")
RESOURCE_SUFFIXES = (
    "product",
    "count",
    "replicas",
    "sharing-strategy",
    "memory",
    "family",
    "compute.major",
    "compute.minor",
    *MIG_ATTRIBUTES,
)


# --- the mocked node, as kubegpu models -------------------------------------------------


def mock_mig(parent: int, n: int, spec: Mapping[str, Any]) -> MigDevice:
    gi, ci, gb = spec["gi"], spec["ci"], spec["gb"]
    attributes = dict(MOCK["migDevice"]["attributes"])
    attributes |= {"memory": gb, "slices.gi": gi, "slices.ci": ci}
    attributes |= spec.get("attributes") or {}
    return MigDevice(
        uuid=f"MIG-mock-{parent}-{n}",
        parent_uuid=f"GPU-mock-{parent}",
        parent_index=parent,
        gi_id=n + 1,
        ci_id=0,
        profile=f"{gi}g.{gb}gb",  # the mock's GetName
        memory_mib=gb,
        multiprocessors=attributes["multiprocessors"],
        attributes=attributes,
    )


def mock_gpu(index: int, spec: str | Mapping[str, Any]) -> Gpu:
    """`full`, `{mig-enabled: [migs]}` or `{mig-disabled: [migs]}` (MIG off, slices listed)."""
    if spec == "full":
        kind, migs = MOCK["fullGpu"], []
    elif isinstance(spec, Mapping) and "mig-enabled" in spec:
        kind, migs = MOCK["migEnabledGpu"], spec["mig-enabled"]
    elif isinstance(spec, Mapping) and "mig-disabled" in spec:
        kind, migs = MOCK["fullGpu"], spec["mig-disabled"]
    else:
        raise ValueError(f"unknown mock device {spec!r}")
    return Gpu(
        index=index,
        uuid=f"GPU-mock-{index}",
        minor=index,
        product=kind["name"],
        memory_mib=kind["totalMemoryMiB"],
        pci_bus_id=bus_id(index),
        numa_node=None,
        compute_capability=tuple(kind["cudaComputeCapability"]),
        mig_capable=kind["migCapable"],
        mig_enabled=kind["migEnabled"],
        mig_devices=tuple(mock_mig(index, n, m) for n, m in enumerate(migs)),
    )


def bus_id(index: int) -> str:
    return f"0000:{index + 0x10:02x}:00.0"


def mock_node(devices: list[Any]) -> Inventory:
    manager = MOCK["manager"]
    return Inventory(
        gpus=tuple(mock_gpu(i, d) for i, d in enumerate(devices)),
        driver_version=manager["driverVersion"],
        cuda_driver_version=tuple(manager["cudaDriverVersion"]),
        backend="mock",
    )


def mock_classes(node: Inventory) -> dict[str, str]:
    """Every mocked GPU reports PCI class 0 (neither VGA nor 3D controller)."""
    code = MOCK["fullGpu"]["pciClass"]
    return {g.pci_bus_id: f"0x{code:06x}" for g in node.gpus}


def config(
    mig_strategy: str = "none",
    *,
    sharing: Mapping[str, Any] | None = None,
    time_slicing: list[Any] | None = None,
    extra_flags: Mapping[str, Any] | None = None,
) -> Config:
    doc: dict[str, Any] = {"version": "v1", "flags": {"migStrategy": mig_strategy}}
    doc["flags"] |= extra_flags or {}
    if sharing:
        doc["sharing"] = dict(sharing)
        if "mps" in sharing:
            # kubegpu's config needs the MPS directory with sharing.mps (NVIDIA's chart
            # always passes one); the labels do not depend on it.
            doc["flags"]["mpsRoot"] = "/run/nvidia/mps"
    if time_slicing:
        doc["sharing"] = {"timeSlicing": {"resources": time_slicing}}
    return parse_config(yaml.safe_dump(doc))


def labels_for(node: Inventory, cfg: Config) -> dict[str, str]:
    return gpu_labels(node, cfg, machine_type=None, timestamp=None, pci_classes=mock_classes(node))


def resource_labels(labels: Mapping[str, str]) -> dict[str, str]:
    """What GFD's resource labelers write: `<resource>.<suffix>` and `mig.strategy`."""
    out: dict[str, str] = {}
    for key, value in labels.items():
        if key == "nvidia.com/mig.strategy":
            out[key] = value
            continue
        if not key.startswith(("nvidia.com/gpu.", "nvidia.com/mig-")):
            continue
        if any(key.endswith(f".{suffix}") for suffix in RESOURCE_SUFFIXES):
            out[key] = value
    return out


def ids(cases: list[dict[str, Any]], path: str) -> list[Any]:
    return [pytest.param(c, id=f"{NVIDIA_DP.cite(path)} {c['id']}") for c in cases]


# --- internal/lm/mig-strategy_test.go ----------------------------------------------------


@pytest.mark.parametrize(
    "case", ids(load("mig-strategy.yaml")["cases"], "internal/lm/mig-strategy_test.go")
)
def test_mig_strategy_resource_labels(case: dict[str, Any]) -> None:
    node = mock_node(case["devices"])
    cfg = config(case["migStrategy"], time_slicing=case.get("timeSlicing"))
    assert resource_labels(labels_for(node, cfg)) == case["expected"]


# --- internal/lm/resource_test.go --------------------------------------------------------

RESOURCE = load("resource.yaml")


@pytest.mark.parametrize("case", ids(RESOURCE["gpu"], "internal/lm/resource_test.go"))
def test_gpu_resource_labels(case: dict[str, Any]) -> None:
    node = mock_node(["full"] * case["count"])
    cfg = config(sharing=case.get("sharing"))
    got = resource_labels(labels_for(node, cfg))
    assert got == case["expected"]


@pytest.mark.parametrize("case", ids(RESOURCE["mig"], "internal/lm/resource_test.go"))
def test_mig_resource_labels(case: dict[str, Any]) -> None:
    resource = case.get("resourceAs") or case["resource"]
    slices = [{"gi": 1, "ci": 2, "gb": 300}] * case["count"]
    node = mock_node([{"mig-enabled": slices}])
    strategy = "single" if resource == "nvidia.com/gpu" else "mixed"
    cfg = config(strategy, time_slicing=case.get("timeSlicing"))
    got = resource_labels(labels_for(node, cfg))
    if resource == "nvidia.com/gpu":
        # Under `single` the slice's labels replace the full GPU's under nvidia.com/gpu.
        got.pop("nvidia.com/mig.strategy")
        assert got == case["expected"]
    else:
        mig_only = {k: v for k, v in got.items() if k.startswith("nvidia.com/mig-")}
        assert mig_only == case["expected"]


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(c, id=f"{NVIDIA_DP.cite('internal/lm/resource_test.go')} {c['input']!r}")
        for c in RESOURCE["sanitise"]
    ],
)
def test_sanitise(case: dict[str, str]) -> None:
    assert sanitise(case["input"]) == case["expected"]


# --- internal/lm/nvml_test.go ------------------------------------------------------------

NVML = load("nvml.yaml")


@pytest.mark.parametrize("case", ids(NVML["migCapable"], "internal/lm/nvml_test.go"))
def test_mig_capable(case: dict[str, Any]) -> None:
    labels = labels_for(mock_node(case["devices"]), config())
    got = {k: v for k, v in labels.items() if k == "nvidia.com/mig.capable"}
    assert got == case["expected"]


@pytest.mark.parametrize("case", ids(NVML["sharing"], "internal/lm/nvml_test.go"))
def test_mps_capable(case: dict[str, Any]) -> None:
    node = mock_node(case["devices"])
    if "configError" in case:
        with pytest.raises(ConfigError, match=re.escape(case["configError"])):
            config(sharing=case.get("sharing"))
        return
    cfg = config(sharing=case.get("sharing"))
    if "error" in case:
        # GFD refuses the config; so does kubegpu, naming the fix in one line.
        with pytest.raises(ConfigError, match=r"MPS cannot share MIG-enabled GPUs") as err:
            labels_for(node, cfg)
        assert "\n" not in str(err.value)
        return
    got = {k: v for k, v in labels_for(node, cfg).items() if k == "nvidia.com/mps.capable"}
    assert got == case["expected"]


@pytest.mark.parametrize("case", ids(NVML["gpuMode"], "internal/lm/nvml_test.go"))
def test_gpu_mode(case: dict[str, Any]) -> None:
    node = mock_node(["full"] * len(case["classes"]))
    classes = {bus_id(i): f"0x{c:06x}" for i, c in enumerate(case["classes"])}
    labels = gpu_labels(node, config(), machine_type=None, timestamp=None, pci_classes=classes)
    assert {"nvidia.com/gpu.mode": labels["nvidia.com/gpu.mode"]} == case["expected"]


# --- internal/vgpu -----------------------------------------------------------------------

VGPU = load("vgpu.yaml")["devices"]


def config_space(device: Mapping[str, Any]) -> bytes:
    return bytes.fromhex("".join(device["config"].split()))


@pytest.mark.parametrize(
    "device",
    [
        pytest.param(d, id=f"{NVIDIA_DP.cite('internal/vgpu/vgpu_test.go')} {d['address']}")
        for d in VGPU
    ],
)
def test_vgpu_capability_of_mock_pci_devices(device: dict[str, Any]) -> None:
    config = config_space(device)
    assert f"0x{config[0] | config[1] << 8:04x}" == device["vendor"]
    capability = vendor_capability(config)
    assert capability is not None
    assert len(capability) == device["vendorCapabilityLength"]
    host = vgpu_host_driver(capability)
    if not device["isVgpu"]:
        assert host is None
        return
    assert capability[0] == device["vendorCapabilityId"]
    assert host == (device["hostDriverVersion"], device["hostDriverBranch"])


def test_vgpu_labels_of_the_mock_bus() -> None:
    """NVIDIA/k8s-device-plugin@v0.20.0:internal/lm/vgpu.go: present, and the host driver."""
    vgpu = next(d for d in VGPU if d["isVgpu"])
    labels = vgpu_labels([config_space(d) for d in VGPU])
    assert labels == {
        "nvidia.com/vgpu.present": "true",
        "nvidia.com/vgpu.host-driver-version": vgpu["hostDriverVersion"],
        "nvidia.com/vgpu.host-driver-branch": vgpu["hostDriverBranch"],
    }
    passthrough = [config_space(d) for d in VGPU if not d["isVgpu"]]
    assert vgpu_labels(passthrough) == {"nvidia.com/vgpu.present": "false"}


# --- cmd/gpu-feature-discovery/main_test.go and mig_test.go: whole runs -------------------

RUNS = load("gfd-runs.yaml")


def expected_output(name: str) -> Path:
    """GFD's `tests/<name>`, one label regex a line (peer-data)."""
    return peer_file("nvidia", "tests", name)


def check_result(output: str, expected_file: str, *, vgpu: bool) -> list[str]:
    """GFD's checkResult: the output lines that match no regex of the expected file.

    `nvidia.com/gpu.present` is kubegpu's own label (deliberate `gpu-present-from-pci`,
    asserted below), so it is left out of GFD's check.
    """
    text = expected_output(expected_file).read_text(encoding="utf-8")
    regexes = [re.compile(line) for line in text.rstrip("\n").split("\n")]
    unmatched = []
    for line in output.rstrip("\n").split("\n"):
        if ("vgpu" in line) != vgpu or line.startswith(f"{PRESENT}="):
            continue
        if not any(r.search(line) for r in regexes):
            unmatched.append(line)
    return unmatched


def mock_sysfs(root: Path) -> Path:
    """The mocked vGPU PCI bus of the GFD runs, as a sysfs tree."""
    for device in VGPU:
        d = root / "sys/bus/pci/devices" / device["address"]
        d.mkdir(parents=True)
        (d / "vendor").write_text(device["vendor"] + "\n")
        (d / "class").write_text("0x030000\n")
        (d / "config").write_bytes(config_space(device))
    return root


def label_map(output: str) -> dict[str, str]:
    """GFD's buildLabelMapFromOutput: one `key=value` per line, no duplicates."""
    labels: dict[str, str] = {}
    for line in output.rstrip("\n").split("\n"):
        key, sep, value = line.partition("=")
        assert sep and "=" not in value, f"unexpected format in line: {line!r}"
        assert key not in labels, f"duplicate label {key}"
        labels[key] = value
    return labels


@pytest.mark.parametrize("run", ids(RUNS["runs"], "cmd/gpu-feature-discovery/main_test.go"))
async def test_gfd_run(run: dict[str, Any], tmp_path: Path) -> None:
    machine = tmp_path / "machine-type"
    machine.write_text(RUNS["machineTypeFile"])
    out = tmp_path / "gfd"
    node = mock_node(run["devices"])
    cfg = config(run["migStrategy"])
    done = await run_labeller(
        lambda: node,
        lambda: cfg,
        FeatureFileSink(str(out)),
        interval=None,
        machine_type=lambda: read_machine_type(str(machine)),
        timestamps=not run.get("noTimestamp", False),
        sysfs_root=str(mock_sysfs(tmp_path / "host")),
    )
    assert done == 1
    output = out.read_text(encoding="utf-8")
    assert check_result(output, run["expectedOutput"], vgpu=False) == []
    if run.get("vgpu"):
        assert check_result(output, "expected-output-vgpu.txt", vgpu=True) == []
    labels = label_map(output)
    for key, value in (run.get("labels") or {}).items():
        assert labels.get(key) == value, key
    for key in run.get("absent") or []:
        assert key not in labels


class Recording:
    def __init__(self, passes: int, stop: asyncio.Event) -> None:
        self.published: list[dict[str, str]] = []
        self.passes = passes
        self.stop = stop

    async def publish(self, labels: Mapping[str, str]) -> None:
        self.published.append(dict(labels))
        if len(self.published) == self.passes:
            self.stop.set()  # what SIGTERM does in `kubegpu labels`


@pytest.mark.parametrize("loop", ids(RUNS["loops"], "cmd/gpu-feature-discovery/main_test.go"))
async def test_gfd_loop(loop: dict[str, Any], tmp_path: Path) -> None:
    node = mock_node(["full"])
    cfg = config()
    stop = asyncio.Event()
    sink = Recording(loop["passes"], stop)
    interval = parse_duration(loop["sleepInterval"])
    done = await asyncio.wait_for(
        run_labeller(
            lambda: node,
            lambda: cfg,
            sink,
            interval=interval,
            sysfs_root=str(mock_sysfs(tmp_path / "host")),
            stop=stop,
        ),
        timeout=WAIT,
    )
    assert done == loop["passes"]
    for labels in sink.published:
        assert (
            check_result(
                "".join(f"{k}={v}\n" for k, v in labels.items()), "expected-output.txt", vgpu=False
            )
            == []
        )
        for key in loop.get("present") or []:
            assert key in labels
    if loop.get("sameTimestamp"):
        stamps = {p["nvidia.com/gfd.timestamp"] for p in sink.published}
        assert len(stamps) == 1
    if math.isinf(interval):
        assert done == 1


def _fail_on_init(case: dict[str, Any]) -> Any:
    marks = []
    if case["migStrategy"] == "bogus" and not case["expectError"]:
        marks.append(pytest.mark.deliberate("mig-strategy-checked-at-start"))
    return pytest.param(
        case,
        id=f"{NVIDIA_DP.cite('cmd/gpu-feature-discovery/main_test.go')} {case['id']}",
        marks=marks,
    )


@pytest.mark.parametrize("case", [_fail_on_init(c) for c in RUNS["failOnInitError"]])
async def test_fail_on_init_error(case: dict[str, Any], tmp_path: Path) -> None:
    def discover() -> Inventory:
        if case["errorOnInit"]:
            raise InitError("manager.Init error")
        return mock_node(["full"])

    def load_config() -> Config:
        return config(case["migStrategy"], extra_flags={"failOnInitError": case["failOnInitError"]})

    run = run_labeller(discover, load_config, FeatureFileSink(str(tmp_path / "gfd")), interval=None)
    # kubegpu refuses a bad migStrategy on every node, with or without GPUs.
    expect_error = case["expectError"] or case["migStrategy"] == "bogus"
    if expect_error:
        with pytest.raises(KubegpuError):
            await run
    else:
        assert await run == 1


# --- deliberate differences --------------------------------------------------------------


@pytest.mark.deliberate("gpu-present-from-pci")
def test_gpu_present_is_kubegpus_own_label() -> None:
    """NVIDIA/k8s-device-plugin@v0.20.0:tests/expected-output.txt lists no gpu.present."""
    node = mock_node(["full"])
    labels = gpu_labels(node, config(), machine_type=None, timestamp=None, present=False)
    assert labels[PRESENT] == "true"
    line = f"{PRESENT}=true"
    regexes = expected_output("expected-output.txt").read_text(encoding="utf-8").split("\n")
    assert not any(re.search(r, line) for r in regexes if r)
    # From the PCI bus alone, with no driver to read the GPUs through:
    assert gpu_labels(
        Inventory(gpus=()), config(), machine_type=None, timestamp=None, present=True
    ) == {PRESENT: "true"}


@pytest.mark.deliberate("most-common-model")
def test_mixed_models_label_the_most_common_full_gpu_model() -> None:
    """NVIDIA/k8s-device-plugin@v0.20.0:internal/lm/mig-strategy.go merges one labeller per
    model in map order, so which model wins is not defined; full GPUs beat MIG-enabled ones."""
    node = mock_node(["full", "full", "full"])
    t4 = dataclasses.replace(node.gpus[0], product="Tesla T4")
    v100 = dataclasses.replace(node.gpus[1], product="Tesla V100")
    t4b = dataclasses.replace(node.gpus[2], product="Tesla T4")
    mixed = Inventory(gpus=(v100, t4, t4b), driver_version="400.300")
    labels = gpu_labels(mixed, config(), machine_type=None, timestamp=None)
    assert (labels["nvidia.com/gpu.product"], labels["nvidia.com/gpu.count"]) == ("Tesla-T4", "2")


@pytest.mark.deliberate("gpu-mode-from-name")
def test_gpu_mode_from_the_product_name_when_the_pci_class_is_unreadable() -> None:
    """NVIDIA/k8s-device-plugin@v0.20.0:internal/lm/nvml.go: unknown if a class is unreadable."""
    node = mock_node(["full"])
    tesla = dataclasses.replace(node.gpus[0], product="Tesla T4", brand="Tesla")
    labels = gpu_labels(Inventory(gpus=(tesla,)), config(), machine_type=None, timestamp=None)
    assert labels["nvidia.com/gpu.mode"] == "compute"


# --- internal/lm/machine-type.go: how GFD reads and sanitises the machine type ------------


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ("product-name\n", "product-name"),
        ("Standard PC (Q35 + ICH9, 2009)\n", "Standard-PC-Q35-ICH9-2009"),
        ("  PowerEdge R750xa  \n", "PowerEdge-R750xa"),
        ("", ""),
        (None, "unknown"),
    ],
    ids=lambda v: f"{NVIDIA_DP.cite('internal/lm/machine-type.go')} {v!r}",
)
def test_machine_type(content: str | None, expected: str, tmp_path: Path) -> None:
    path = tmp_path / "product_name"
    if content is not None:
        path.write_text(content)
    node = mock_node(["full"])
    labels = gpu_labels(node, config(), machine_type=read_machine_type(str(path)), timestamp=None)
    assert labels["nvidia.com/gpu.machine"] == expected


def test_full_gpus_win_over_mig_enabled_ones_of_another_model() -> None:
    """NVIDIA/k8s-device-plugin@v0.20.0:internal/lm/mig-strategy.go (newGPULabelers): the
    labellers of full GPUs are merged after those of MIG-enabled ones, so they win."""
    mig = mock_node([{"mig-enabled": []}, {"mig-enabled": []}, "full"])
    a100s = [dataclasses.replace(g, product="NVIDIA A100-SXM4-40GB") for g in mig.gpus[:2]]
    node = dataclasses.replace(mig, gpus=(*a100s, mig.gpus[2]))
    cfg = config(time_slicing=[{"name": "nvidia.com/gpu", "replicas": 2}])
    labels = resource_labels(labels_for(node, cfg))
    assert labels == {
        "nvidia.com/gpu.product": "MOCKMODEL-SHARED",
        "nvidia.com/gpu.count": "1",
        "nvidia.com/gpu.replicas": "2",
        "nvidia.com/gpu.sharing-strategy": "time-slicing",
        "nvidia.com/gpu.memory": "300",
        "nvidia.com/gpu.family": "ampere",
        "nvidia.com/gpu.compute.major": "8",
        "nvidia.com/gpu.compute.minor": "0",
    }


@pytest.mark.deliberate("rename-honoured")
def test_an_explicit_rename_keeps_the_plain_product_name() -> None:
    """NVIDIA/k8s-device-plugin@v0.20.0:cmd/gpu-feature-discovery/main.go calls
    api/config/v1/config.go DisableResourceNamingInConfig: a file's explicit `rename` is
    dropped (plugin and GFD alike), so GFD labels `-SHARED`. kubegpu's plugin advertises
    the renamed resource, and its labels say so: no suffix."""
    rename = [{"name": "nvidia.com/gpu", "rename": "nvidia.com/gpu.shared", "replicas": 2}]
    labels = labels_for(mock_node(["full"]), config(time_slicing=rename))
    assert labels["nvidia.com/gpu.product"] == "MOCKMODEL"
    assert labels["nvidia.com/gpu.replicas"] == "2"


def test_rename_by_default_drops_the_shared_suffix_as_gfd_does() -> None:
    """NVIDIA/k8s-device-plugin@v0.20.0:api/config/v1/replicas.go: renameByDefault sets each
    resource's rename to `<name>.shared`, and a renamed resource's product has no suffix."""
    sharing = {
        "timeSlicing": {
            "renameByDefault": True,
            "resources": [{"name": "nvidia.com/gpu", "replicas": 2}],
        }
    }
    labels = labels_for(mock_node(["full"]), config(sharing=sharing))
    assert labels["nvidia.com/gpu.product"] == "MOCKMODEL"
    assert labels["nvidia.com/gpu.replicas"] == "2"
    assert labels["nvidia.com/gpu.sharing-strategy"] == "time-slicing"
