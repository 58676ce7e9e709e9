"""CDI specs: valid per the CDI schema, NVIDIA's names, files found under the driver root."""

from __future__ import annotations

import errno
import json
import logging
import os
import stat
from pathlib import Path
from typing import Any

import click
import jsonschema  # type: ignore[import-untyped, unused-ignore]
import pytest
import yaml

from kubegpu import allocation, cdi
from kubegpu.cli import cdi as cdi_cli
from kubegpu.cli import options as cli_options
from kubegpu.config import Config, parse_config
from kubegpu.devices.model import Gpu, Inventory, MigDevice
from kubegpu.devices.simulated import SimulatedBackend
from kubegpu.errors import ConfigError
from kubegpu.resources import build_resources
from kubegpu.state import NodeStore
from kubegpu.supervisor import Supervisor
from kubegpu.watch import Backoff
from tests.unit.cdi.conftest import runtime_device_nodes
from tests.waiting import eventually

FIXTURES = Path(__file__).parents[2] / "fixtures"
DEBIAN = FIXTURES / "driver-root-debian"
RHEL = FIXTURES / "driver-root-rhel"
SCHEMA = json.loads((FIXTURES / "cdi-schema.json").read_text())
VERSION = "550.54.15"
LIBDIR = "/usr/lib/x86_64-linux-gnu"


def gpu(index: int, **kw: Any) -> Gpu:
    return Gpu(
        index=index,
        uuid=f"GPU-0000000{index}-aaaa-bbbb-cccc-dddddddddddd",
        minor=index,
        product="NVIDIA A100-SXM4-40GB",
        memory_mib=40960,
        pci_bus_id=f"0000:0{index}:00.0",
        numa_node=0,
        compute_capability=(8, 0),
        **kw,
    )


def mig(parent: int, gi: int, caps: tuple[int, int]) -> MigDevice:
    return MigDevice(
        uuid=f"MIG-{parent}{gi}000000-1111-2222-3333-444444444444",
        parent_uuid=f"GPU-0000000{parent}-aaaa-bbbb-cccc-dddddddddddd",
        parent_index=parent,
        gi_id=gi,
        ci_id=0,
        profile="3g.20gb",
        memory_mib=20096,
        device_paths=tuple(f"/dev/nvidia-caps/nvidia-cap{c}" for c in caps),
    )


PLAIN = Inventory(gpus=(gpu(0), gpu(1)), driver_version=VERSION)
MIXED = Inventory(
    gpus=(
        gpu(0, device_paths=("/dev/nvidia0",)),
        gpu(
            1,
            device_paths=("/dev/nvidia1",),
            mig_enabled=True,
            mig_capable=True,
            mig_devices=(mig(1, 1, (21, 22)), mig(1, 2, (30, 31))),
        ),
    ),
    driver_version=VERSION,
    control_device_paths=("/dev/nvidiactl", "/dev/nvidia-uvm"),
)


def devices(spec: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    return {d["name"]: d["containerEdits"]["deviceNodes"] for d in spec["devices"]}


def mounts(spec: dict[str, Any]) -> dict[str, str]:
    return {m["containerPath"]: m["hostPath"] for m in spec["containerEdits"]["mounts"]}


@pytest.mark.parametrize("inventory", [PLAIN, MIXED], ids=["plain", "mig"])
@pytest.mark.parametrize("strategy", ["uuid", "index"])
@pytest.mark.parametrize("root", [DEBIAN, RHEL], ids=["debian", "rhel"])
@pytest.mark.parametrize("ctk", [None, "/usr/bin/nvidia-ctk"])
def test_specs_validate_against_the_cdi_schema(
    inventory: Inventory, strategy: str, root: Path, ctk: str | None
) -> None:
    spec = cdi.generate_spec(
        inventory,
        driver_root="/run/nvidia/driver",
        container_driver_root=str(root),
        device_id_strategy=strategy,
        nvidia_ctk_path=ctk,
    )
    jsonschema.validate(spec, SCHEMA)
    assert spec["kind"] == "k8s.device-plugin.nvidia.com/gpu"
    major, minor, _ = (int(x) for x in spec["cdiVersion"].split("."))
    assert (major, minor) >= (0, 6)
    assert len({d["name"] for d in spec["devices"]}) == len(spec["devices"])


def test_schema_rejects_what_the_spec_forbids() -> None:
    good = cdi.generate_spec(PLAIN, container_driver_root=str(DEBIAN))
    bad_name = {**good, "devices": [{"name": "-gpu", "containerEdits": {}}]}
    bad_kind = {**good, "kind": "nvidia.com/gpu/extra"}
    bad_node = {**good, "containerEdits": {"deviceNodes": [{"hostPath": "/dev/x"}]}}
    for bad in (bad_name, bad_kind, bad_node, {**good, "devices": []}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, SCHEMA)


def test_uuid_names_and_device_nodes() -> None:
    spec = cdi.generate_spec(MIXED, container_driver_root=str(DEBIAN))
    nodes = devices(spec)
    g0, g1 = MIXED.gpus
    m1, m2 = g1.mig_devices
    assert list(nodes) == [g0.uuid, g1.uuid, m1.uuid, m2.uuid, "all"]
    assert nodes[g0.uuid] == [{"path": "/dev/nvidia0"}]
    paths = [n["path"] for n in nodes[m1.uuid]]
    assert paths == [
        "/dev/nvidia1",
        "/dev/nvidia-caps/nvidia-cap21",
        "/dev/nvidia-caps/nvidia-cap22",
    ]
    all_paths = [n["path"] for n in nodes["all"]]
    assert all_paths[:2] == ["/dev/nvidia0", "/dev/nvidia1"]
    assert set(all_paths) == {
        "/dev/nvidia0",
        "/dev/nvidia1",
        *(f"/dev/nvidia-caps/nvidia-cap{c}" for c in (21, 22, 30, 31)),
    }
    assert len(all_paths) == len(set(all_paths))


def test_index_names_follow_nvidia_notation() -> None:
    spec = cdi.generate_spec(MIXED, device_id_strategy="index", container_driver_root=str(DEBIAN))
    assert list(devices(spec)) == ["0", "1", "1:1", "1:2", "all"]


def test_gpu_without_device_paths_uses_its_minor() -> None:
    spec = cdi.generate_spec(Inventory(gpus=(gpu(3),)), container_driver_root=str(DEBIAN))
    assert devices(spec)[gpu(3).uuid] == [{"path": "/dev/nvidia3"}]


def test_host_paths_under_driver_and_dev_roots() -> None:
    spec = cdi.generate_spec(
        PLAIN, driver_root="/run/nvidia/driver", container_driver_root=str(DEBIAN)
    )
    assert devices(spec)[PLAIN.gpus[0].uuid] == [
        {"path": "/dev/nvidia0", "hostPath": "/run/nvidia/driver/dev/nvidia0"}
    ]
    spec = cdi.generate_spec(PLAIN, driver_root="/run/nvidia/driver", dev_root="/")
    assert devices(spec)[PLAIN.gpus[0].uuid] == [{"path": "/dev/nvidia0"}]


def test_control_nodes_and_env() -> None:
    spec = cdi.generate_spec(PLAIN, container_driver_root=str(DEBIAN))
    edits = spec["containerEdits"]
    assert [n["path"] for n in edits["deviceNodes"]] == [
        "/dev/nvidiactl",
        "/dev/nvidia-uvm",
        "/dev/nvidia-uvm-tools",
        "/dev/nvidia-modeset",  # present in this tree
    ]
    assert edits["env"] == ["NVIDIA_VISIBLE_DEVICES=void"]
    assert "hooks" not in edits
    # the RHEL tree has no modeset node; the inventory's own control list wins
    spec = cdi.generate_spec(MIXED, container_driver_root=str(RHEL))
    assert [n["path"] for n in spec["containerEdits"]["deviceNodes"]] == [
        "/dev/nvidiactl",
        "/dev/nvidia-uvm",
    ]


def test_libraries_and_binaries_debian_tree() -> None:
    spec = cdi.generate_spec(PLAIN, driver_root="/host", container_driver_root=str(DEBIAN))
    got = mounts(spec)
    real = f"/host{LIBDIR}/libcuda.so.{VERSION}"
    # every name of libcuda maps to the real file, so links never dangle in the container
    assert got[f"{LIBDIR}/libcuda.so.1"] == real
    assert got[f"{LIBDIR}/libcuda.so"] == real
    assert got[f"{LIBDIR}/libcuda.so.{VERSION}"] == real
    assert got[f"{LIBDIR}/libnvidia-ml.so.1"] == f"/host{LIBDIR}/libnvidia-ml.so.{VERSION}"
    assert f"{LIBDIR}/libnvidia-ptxjitcompiler.so.1" in got
    assert f"{LIBDIR}/libnvidia-glcore.so.{VERSION}" in got  # by driver version
    assert f"{LIBDIR}/libnvidia-glcore.so.535.104.05" not in got  # stale driver
    assert f"{LIBDIR}/libfoo.so.1" not in got
    for name in cdi.BINARIES:
        assert got[f"/usr/bin/{name}"] == f"/host/usr/bin/{name}"
    assert got["/run/nvidia-persistenced/socket"] == "/host/run/nvidia-persistenced/socket"
    for m in spec["containerEdits"]["mounts"]:
        assert m["options"] == ["ro", "nosuid", "nodev", "bind"]


def test_libraries_rhel_tree_with_absolute_and_dangling_links() -> None:
    got = mounts(cdi.generate_spec(PLAIN, container_driver_root=str(RHEL)))
    assert got["/usr/lib64/libcuda.so.1"] == f"/usr/lib64/libcuda.so.{VERSION}"
    assert got["/usr/lib64/libnvidia-ml.so.1"] == f"/usr/lib64/libnvidia-ml.so.{VERSION}"
    assert "/usr/lib64/libnvidia-ptxjitcompiler.so.1" not in got  # dangling
    assert not any(p.startswith("/lib64/") for p in got)  # lib64 -> usr/lib64 seen once
    assert got["/usr/bin/nvidia-smi"] == "/usr/sbin/nvidia-smi"
    assert "/usr/bin/nvidia-cuda-mps-control" not in got


def test_missing_driver_root_gives_devices_only(tmp_path: Path) -> None:
    spec = cdi.generate_spec(PLAIN, container_driver_root=str(tmp_path / "nothing"))
    jsonschema.validate(spec, SCHEMA)
    assert spec["containerEdits"]["mounts"] == []


def test_ldcache_hook_only_when_asked() -> None:
    spec = cdi.generate_spec(
        PLAIN, container_driver_root=str(DEBIAN), nvidia_ctk_path="/usr/local/bin/nvidia-ctk"
    )
    (hook,) = spec["containerEdits"]["hooks"]
    assert hook["hookName"] == "createContainer"
    assert hook["path"] == "/usr/local/bin/nvidia-ctk"
    assert hook["args"] == ["nvidia-ctk", "hook", "update-ldcache", "--folder", LIBDIR]
    spec = cdi.generate_spec(
        PLAIN, container_driver_root=str(DEBIAN), nvidia_ctk_path="/usr/bin/nvidia-cdi-hook"
    )
    (hook,) = spec["containerEdits"]["hooks"]
    assert hook["args"] == ["nvidia-cdi-hook", "update-ldcache", "--folder", LIBDIR]


def test_device_id_strategy_checked() -> None:
    with pytest.raises(ConfigError, match="device-id-strategy 'serial'"):
        cdi.generate_spec(PLAIN, device_id_strategy="serial")


def test_cdi_device_name_format() -> None:
    uuid = PLAIN.gpus[0].uuid
    assert cdi.cdi_device_name(uuid) == f"k8s.device-plugin.nvidia.com/gpu={uuid}"
    assert cdi.cdi_device_name("1:2") == "k8s.device-plugin.nvidia.com/gpu=1:2"
    # what Allocate hands the runtime must name a device of the written spec
    spec = cdi.generate_spec(MIXED, container_driver_root=str(DEBIAN))
    names = {cdi.cdi_device_name(d["name"]) for d in spec["devices"]}
    for g in MIXED.gpus:
        assert allocation.cdi_device_name(g.uuid) in names
    for m in MIXED.mig_devices():
        assert allocation.cdi_device_name(m.uuid) in names


def test_write_spec_atomic_0644(tmp_path: Path) -> None:
    spec = cdi.generate_spec(PLAIN, container_driver_root=str(DEBIAN))
    target = cdi.write_spec(spec, str(tmp_path / "cdi"))
    assert target == tmp_path / "cdi" / "k8s.device-plugin.nvidia.com-gpu.json"
    assert stat.S_IMODE(target.stat().st_mode) == 0o644
    assert json.loads(target.read_text()) == spec
    smaller = {**spec, "devices": spec["devices"][:1]}
    cdi.write_spec(smaller, str(tmp_path / "cdi"))
    assert json.loads(target.read_text()) == smaller
    assert [p.name for p in (tmp_path / "cdi").iterdir()] == [target.name]  # no temp left


def test_write_spec_yaml(tmp_path: Path) -> None:
    spec = cdi.generate_spec(MIXED, container_driver_root=str(DEBIAN))
    target = cdi.write_spec(spec, str(tmp_path), "gpu.yaml", format="yaml")
    assert yaml.safe_load(target.read_text()) == spec
    with pytest.raises(ConfigError, match="--format 'toml'"):
        cdi.write_spec(spec, str(tmp_path), "gpu.toml", format="toml")


def parse(argv: list[str]) -> dict[str, Any]:
    """`kubegpu cdi generate ARGV`'s values, in this process's environment."""
    assert argv[:2] == ["cdi", "generate"]
    return cli_options.parse(cdi_cli.generate, argv[2:], os.environ)


def test_cli_defaults_come_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NVIDIA_DRIVER_ROOT", "/run/nvidia/driver")
    monkeypatch.setenv("DEVICE_ID_STRATEGY", "index")
    monkeypatch.setenv("SIMULATE", "t4-1")
    args = parse(["cdi", "generate"])
    assert (args["driver_root"], args["device_id_strategy"], args["simulate"]) == (
        "/run/nvidia/driver",
        "index",
        "t4-1",
    )
    assert (args["output"], args["format"]) == ("-", "json")
    assert cdi_cli.cdi.get_command(click.Context(cdi_cli.cdi), "generate") is cdi_cli.generate
    args = parse(["cdi", "generate", "--driver-root", "/", "--device-id-strategy", "uuid"])
    assert (args["driver_root"], args["device_id_strategy"]) == ("/", "uuid")


def test_cli_without_subcommand_is_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    from kubegpu.cli import main

    assert main(["cdi"]) == 2
    assert "usage:" in capsys.readouterr().err


def test_cli_backend_failure_is_exit_1(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from kubegpu.cli import main

    monkeypatch.delenv("SIMULATE", raising=False)
    assert main(["cdi", "generate", "--device-discovery-strategy", "bogus"]) == 1
    assert "unknown backend 'bogus'" in capsys.readouterr().err


@pytest.mark.parametrize("preset", ["h100-8", "a100-40gb-mig"])
def test_cli_generate_simulated(
    preset: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "gpu.json"
    args = parse(
        [
            "cdi",
            "generate",
            "--simulate",
            preset,
            "--container-driver-root",
            str(DEBIAN),
            "--output",
            str(out),
        ]
    )
    assert cdi_cli.run_generate(args) == 0, capsys.readouterr().err
    spec = json.loads(out.read_text())
    jsonschema.validate(spec, SCHEMA)
    assert spec["devices"][-1]["name"] == "all"
    args = parse(["cdi", "generate", "--simulate", preset, "--format", "yaml"])
    assert cdi_cli.run_generate(args) == 0
    assert yaml.safe_load(capsys.readouterr().out)["kind"] == cdi.KIND


def simulated_config(**flags: Any) -> Config:
    flags = {"plugin": {"deviceListStrategy": ["cdi-cri"], "passDeviceSpecs": True}, **flags}
    return parse_config(json.dumps({"version": "v1", "flags": flags}))


@pytest.mark.parametrize("preset", ["h100-8", "a100-40gb-mig"])
def test_a_simulated_node_spec_names_host_devices_every_node_has(preset: str) -> None:
    """A node without GPUs has no /dev/nvidia*: the runtime refused every container of a
    simulated node (`failed to stat CDI host device "/dev/nvidiactl"`). Each node is
    bound from /dev/null; the container keeps the GPU's usual paths."""
    inventory = SimulatedBackend.load(preset).discover()
    specs = cdi.node_specs(inventory, simulated_config())
    nodes = runtime_device_nodes(specs[cdi.DEFAULT_NAME])
    assert {host for _, host in nodes} == {allocation.SIMULATED_DEVICE_NODE}
    wanted = {*inventory.control_device_paths}
    for g in inventory.gpus:
        wanted.update(g.device_paths)
        wanted.update(p for m in g.mig_devices for p in m.device_paths)
    assert {path for path, _ in nodes} == wanted
    assert "/dev/nvidia0" in wanted and "/dev/nvidiactl" in wanted


def test_a_simulated_node_with_a_dev_root_uses_the_nodes_made_there(tmp_path: Path) -> None:
    """`nvidiaDevRoot` names a tree of nodes made for the simulated GPUs: those are bound."""
    inventory = SimulatedBackend.load("t4-1").discover()
    specs = cdi.node_specs(inventory, simulated_config(nvidiaDevRoot=str(tmp_path)))
    edits = specs[cdi.DEFAULT_NAME]["containerEdits"]
    assert edits["deviceNodes"][0] == {
        "path": "/dev/nvidiactl",
        "hostPath": f"{tmp_path}/dev/nvidiactl",
    }


def test_a_simulated_gpus_device_specs_name_host_devices_every_node_has() -> None:
    """The device plugin's own device nodes (`passDeviceSpecs`) are stat'ed by the
    runtime just the same."""
    inventory = SimulatedBackend.load("a10g-4").discover()
    config = simulated_config(plugin={"deviceListStrategy": ["envvar"], "passDeviceSpecs": True})
    [spec] = build_resources(inventory, config)
    edits = allocation.build_response(spec, spec.devices[1:3], config, response_id="r")
    nodes = [(d.container_path, d.host_path) for d in edits.device_specs]
    assert [path for path, _ in nodes] == [
        *inventory.control_device_paths,
        "/dev/nvidia1",
        "/dev/nvidia2",
    ]
    for _, host in nodes:
        assert stat.S_ISCHR(os.lstat(host).st_mode), host


def test_imex_channel_spec_matches_the_names_allocate_uses() -> None:
    from kubegpu.allocation import ImexChannel, cdi_device_name

    spec = cdi.generate_imex_spec(
        [ImexChannel("0"), ImexChannel("3")], dev_root="/run/nvidia/driver"
    )
    assert spec is not None
    jsonschema.validate(spec, SCHEMA)
    names = [f"{spec['kind']}={d['name']}" for d in spec["devices"]]
    assert names == [cdi_device_name(c, "imex-channel") for c in ("0", "3")]
    assert spec["devices"][1]["containerEdits"]["deviceNodes"] == [
        {
            "path": "/dev/nvidia-caps-imex-channels/channel3",
            "hostPath": "/run/nvidia/driver/dev/nvidia-caps-imex-channels/channel3",
        }
    ]
    assert cdi.generate_imex_spec([]) is None


def test_mode_specs_name_the_nodes_present_and_nothing_when_absent(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "dev/infiniband").mkdir(parents=True)
    for name in ("dev/nvidia-fs0", "dev/nvidia-fs1", "dev/infiniband/uverbs0", "etc/cufile.json"):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).touch()
    gds = cdi.generate_mode_spec("gds", driver_root="/host", container_driver_root=str(root))
    assert gds is not None
    jsonschema.validate(gds, SCHEMA)
    assert gds["kind"] == "k8s.device-plugin.nvidia.com/gds"
    edits = gds["devices"][0]["containerEdits"]
    assert gds["devices"][0]["name"] == "all"
    assert edits["deviceNodes"] == [
        {"path": "/dev/nvidia-fs0", "hostPath": "/host/dev/nvidia-fs0"},
        {"path": "/dev/nvidia-fs1", "hostPath": "/host/dev/nvidia-fs1"},
    ]
    assert [m["containerPath"] for m in edits["mounts"]] == ["/etc/cufile.json"]
    mofed = cdi.generate_mode_spec("mofed", container_driver_root=str(root))
    assert mofed is not None
    assert mofed["devices"][0]["containerEdits"]["deviceNodes"] == [
        {"path": "/dev/infiniband/uverbs0"}
    ]
    assert cdi.generate_mode_spec("gdrcopy", container_driver_root=str(root)) is None


def test_available_classes_lists_our_spec_files(tmp_path: Path) -> None:
    for name in (cdi.spec_name("gpu"), cdi.spec_name("gds"), "other-vendor-gpu.json", "x.txt"):
        (tmp_path / name).write_text("{}")
    assert cdi.available_classes(tmp_path) == {"gpu", "gds"}
    assert cdi.available_classes(tmp_path / "missing") == frozenset()


# -- the class cache Allocate reads, and writes only on change ------------------------------

OLD_NS = 1_000_000_000_000_000_000  # a directory mtime far in the past of the fake clock


def _age(directory: Path, mtime_ns: int = OLD_NS) -> None:
    os.utime(directory, ns=(mtime_ns, mtime_ns))


def test_class_cache_answers_as_the_listing_and_lists_only_after_a_change(
    tmp_path: Path,
) -> None:
    (tmp_path / cdi.spec_name("gpu")).write_text("{}")
    _age(tmp_path)
    cache = cdi.ClassCache(tmp_path, clock_ns=lambda: OLD_NS + 10**10)  # 10 s later
    assert cache.get() == cdi.available_classes(tmp_path) == {"gpu"}
    assert [cache.get() for _ in range(3)] == [{"gpu"}] * 3
    assert cache.listings == 1  # the directory did not change: one stat, no listing
    (tmp_path / cdi.spec_name("gds")).write_text("{}")  # the mtime moves to now
    assert cache.get() == {"gpu", "gds"}
    (tmp_path / cdi.spec_name("gds")).unlink()
    assert cache.get() == {"gpu"}  # a switched-off class is not named again


def test_class_cache_does_not_trust_a_listing_in_the_directory_s_last_tick(
    tmp_path: Path,
) -> None:
    """A change in the same timestamp tick as the listing keeps the mtime: list again."""
    _age(tmp_path)
    cache = cdi.ClassCache(tmp_path, clock_ns=lambda: OLD_NS + 10**6)  # 1 ms later
    assert cache.get() == frozenset()
    (tmp_path / cdi.spec_name("gpu")).write_text("{}")
    _age(tmp_path)  # the same mtime as at the listing, as a coarse clock would leave it
    assert cache.get() == {"gpu"}
    assert cache.listings == 2


def test_class_cache_of_a_missing_directory_is_empty_until_it_appears(tmp_path: Path) -> None:
    cache = cdi.ClassCache(tmp_path / "cdi")
    assert cache.get() == frozenset()
    cdi.write_spec({"kind": cdi.KIND}, str(tmp_path / "cdi"), cdi.spec_name("gpu"))
    assert cache.get() == {"gpu"}


def test_update_spec_writes_only_changed_bytes_and_atomically(tmp_path: Path) -> None:
    directory, name = str(tmp_path / "cdi"), cdi.DEFAULT_NAME
    spec = {"cdiVersion": cdi.CDI_VERSION, "kind": cdi.KIND, "devices": []}
    written = cdi.update_spec(spec, directory, name)
    assert written == tmp_path / "cdi" / name
    first = written.stat()
    assert cdi.update_spec(dict(spec), directory, name) is None  # same bytes: untouched
    again = written.stat()
    assert (again.st_ino, again.st_mtime_ns) == (first.st_ino, first.st_mtime_ns)
    changed = {**spec, "devices": [{"name": "0", "containerEdits": {}}]}
    assert cdi.update_spec(changed, directory, name) == written
    assert written.stat().st_ino != first.st_ino  # replaced by rename, never rewritten
    assert json.loads(written.read_text()) == changed
    assert stat.S_IMODE(written.stat().st_mode) == 0o644


# -- CdiWriter: the spec files of a running `serve` follow the store -----------------------


def writer_config(dev_root: Path, *, gdrcopy: bool, strategy: str = "cdi-cri") -> Config:
    flags = {
        "nvidiaDevRoot": str(dev_root),
        "gdrcopyEnabled": gdrcopy,
        "plugin": {"deviceListStrategy": [strategy]},
    }
    return parse_config(json.dumps({"version": "v1", "flags": flags}))


@pytest.fixture
def dev_root(tmp_path: Path) -> Path:
    """A host /dev with a GDRCopy node, so `gdrcopyEnabled` has a spec to write."""
    root = tmp_path / "host"
    (root / "dev").mkdir(parents=True)
    (root / "dev" / "gdrdrv").touch()
    return root


async def test_the_writer_keeps_the_spec_files_as_the_state_says(
    tmp_path: Path, dev_root: Path
) -> None:
    store = NodeStore()
    directory = tmp_path / "cdi"
    writer = cdi.CdiWriter(store, directory)
    gpu_spec, gdrcopy_spec = directory / cdi.DEFAULT_NAME, directory / cdi.spec_name("gdrcopy")
    state = store.update(inventory=PLAIN, config=writer_config(dev_root, gdrcopy=True))
    await writer.write(state)
    assert writer.config is state.config
    assert sorted(p.name for p in directory.iterdir()) == sorted([gpu_spec.name, gdrcopy_spec.name])
    assert len(json.loads(gpu_spec.read_text())["devices"]) == 3  # two GPUs and `all`
    before = gpu_spec.stat()

    # The same bytes again: the file (and the runtime's view of it) is left alone.
    await writer.write(store.update(config=writer_config(dev_root, gdrcopy=True)))
    after = gpu_spec.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)

    # A class switched off loses its file, so Allocate stops naming it.
    await writer.write(store.update(config=writer_config(dev_root, gdrcopy=False)))
    assert [p.name for p in directory.iterdir()] == [gpu_spec.name]

    # Without a CDI strategy nothing is written; the config is still the one handled.
    plain = store.update(config=writer_config(dev_root, gdrcopy=True, strategy="envvar"))
    await writer.write(plain)
    assert writer.config is plain.config and not gdrcopy_spec.exists()


async def test_a_cdi_directory_that_cannot_be_written_is_logged_not_raised(
    tmp_path: Path, dev_root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The plugin keeps serving; only the CDI names will not resolve."""
    blocker = tmp_path / "not-a-directory"
    blocker.touch()
    store = NodeStore()
    writer = cdi.CdiWriter(store, blocker / "cdi")
    state = store.update(inventory=PLAIN, config=writer_config(dev_root, gdrcopy=False))
    with caplog.at_level(logging.ERROR, "kubegpu.cdi"):
        assert not await writer.write(state)
    assert writer.config is None  # not written: `follow` tries this state again
    (record,) = caplog.records
    assert "cannot write the CDI spec" in record.getMessage()


async def test_a_failed_write_withdraws_the_stale_spec_and_is_retried_until_it_lands(
    tmp_path: Path, dev_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full disk once stopped the writer for good, and Allocate went on naming CDI devices
    of the old file that a new inventory had and the file lacked."""
    store = NodeStore()
    directory = tmp_path / "cdi"
    writer = cdi.CdiWriter(store, directory, backoff=Backoff(0.01, 0.01))
    one = Inventory(gpus=(gpu(0),), driver_version=VERSION)
    old = store.update(inventory=one, config=writer_config(dev_root, gdrcopy=False))
    assert await writer.write(old)
    gpu_spec = directory / cdi.DEFAULT_NAME
    assert cdi.available_classes(directory) == {"gpu"}

    full = OSError(errno.ENOSPC, "No space left on device")
    attempts: list[str] = []

    def no_space(spec: dict[str, Any], directory: str, name: str) -> Path:
        attempts.append(name)
        if len(attempts) < 3:
            raise full
        return real_write(spec, directory, name)

    real_write = cdi.write_spec
    monkeypatch.setattr(cdi, "write_spec", no_space)
    grown = store.update(inventory=PLAIN)
    async with Supervisor("test") as tasks:
        tasks.start("cdi writer", writer.follow(old.version), root=True)
        # Withdrawn at the first failure: Allocate names no device of a file that lacks one.
        await eventually(lambda: len(attempts) >= 1 and not gpu_spec.exists())
        await eventually(lambda: gpu_spec.exists())
    assert len(attempts) == 3 and writer.config is grown.config
    assert cdi.available_classes(directory) == {"gpu"}
    assert len(json.loads(gpu_spec.read_text())["devices"]) == 3  # both GPUs and `all`


async def test_a_start_up_write_that_failed_is_retried_until_it_lands(
    tmp_path: Path, dev_root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`serve` writes the specs once before the writer's loop starts; a directory that
    refused that write (not yet mounted, full) once stayed without them until the node
    changed, while Allocate named CDI devices that did not resolve."""
    blocker = tmp_path / "cdi-parent"
    blocker.touch()  # a file where the spec directory's parent belongs: every write fails
    directory = blocker / "cdi"
    store = NodeStore()
    writer = cdi.CdiWriter(store, directory, backoff=Backoff(0.01, 0.01))
    state = store.update(inventory=PLAIN, config=writer_config(dev_root, gdrcopy=False))

    def failures() -> int:
        return sum("cannot write the CDI spec" in r.getMessage() for r in caplog.records)

    with caplog.at_level(logging.ERROR, "kubegpu.cdi"):
        assert not await writer.write(state)  # start-up's write
        async with Supervisor("test") as tasks:
            tasks.start("cdi writer", writer.follow(state.version), root=True)
            await eventually(lambda: failures() >= 2)  # the loop tried again, and failed
            blocker.unlink()  # the directory can be written now
            await eventually(lambda: (directory / cdi.DEFAULT_NAME).exists())
    assert writer.config is state.config
    assert len(json.loads((directory / cdi.DEFAULT_NAME).read_text())["devices"]) == 3


async def test_the_writer_follows_the_inventory_and_the_config(
    tmp_path: Path, dev_root: Path
) -> None:
    store = NodeStore()
    directory = tmp_path / "cdi"
    writer = cdi.CdiWriter(store, directory)
    state = store.update(inventory=PLAIN, config=writer_config(dev_root, gdrcopy=True))
    await writer.write(state)
    async with Supervisor("test") as tasks:
        tasks.start("cdi writer", writer.follow(state.version), root=True)
        switched = store.update(config=writer_config(dev_root, gdrcopy=False))
        await eventually(lambda: writer.config is switched.config)
        assert not (directory / cdi.spec_name("gdrcopy")).exists()
        store.update(inventory=Inventory(gpus=(gpu(0),), driver_version=VERSION))
        spec = directory / cdi.DEFAULT_NAME
        await eventually(lambda: len(json.loads(spec.read_text())["devices"]) == 2)


@pytest.mark.parametrize("kind", ["fifo", "link-to-device", "directory"])
def test_cli_generate_never_replaces_a_special_file(
    kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`-o /dev/null` as root once replaced the node's /dev/null with the spec: the write
    renames a file over its target. A device, FIFO or directory is refused and left as is."""
    from kubegpu.cli import main

    out = tmp_path / "out"
    if kind == "fifo":
        os.mkfifo(out)
    elif kind == "directory":
        out.mkdir()
    else:
        out.symlink_to("/dev/null")
    before = out.lstat()
    assert main(["cdi", "generate", "--simulate", "t4-1", "-o", str(out)]) == 1
    err = capsys.readouterr().err
    assert f"cannot write {out}: it is not a regular file" in err
    assert len(err.strip().splitlines()) == 1
    after = out.lstat()
    assert (after.st_mode, after.st_ino) == (before.st_mode, before.st_ino)
