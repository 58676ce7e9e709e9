"""devices + config -> advertised resources: MIG strategies, renaming, sharing."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kubegpu.config import parse_config
from kubegpu.devices import Health, Vendor
from kubegpu.errors import ConfigError
from kubegpu.resources import SharingKind, build_resources, socket_name
from tests.builders import gpu, inventory


def names(specs: tuple) -> list[str]:  # type: ignore[type-arg]
    return [s.name for s in specs]


def test_plain_gpus_are_nvidia_gpu_with_uuid_ids() -> None:
    inv = inventory(gpu(0), gpu(1, numa=1))
    (spec,) = build_resources(inv, parse_config("version: v1"))
    assert spec.name == "nvidia.com/gpu"
    assert [d.id for d in spec.devices] == [g.uuid for g in inv.gpus]
    assert [d.numa_node for d in spec.devices] == [0, 1]
    assert spec.sharing is SharingKind.NONE
    assert spec.control_device_paths == inv.control_device_paths


def test_socket_name_replaces_the_slash_and_doubles_dashes() -> None:
    assert socket_name("nvidia.com/mig-1g.10gb") == "kubegpu-nvidia.com-mig--1g.10gb.sock"


def test_health_follows_inventory() -> None:
    inv = inventory(gpu(0), gpu(1))
    inv = inv.with_health({inv.gpus[1].uuid: Health.UNHEALTHY})
    (spec,) = build_resources(inv, parse_config("version: v1"))
    assert [d.health for d in spec.devices] == [Health.HEALTHY, Health.UNHEALTHY]
    assert spec.healthy_count == 1


def test_amd_gpus_are_amd_gpu() -> None:
    g = gpu(0)
    amd = type(g)(**{**g.__dict__, "vendor": Vendor.AMD, "uuid": "AMD-1"})
    (spec,) = build_resources(inventory(amd), parse_config("version: v1"))
    assert spec.name == "amd.com/gpu"


def test_resources_patterns_rename_by_product() -> None:
    inv = inventory(gpu(0, product="NVIDIA A100-SXM4-40GB"), gpu(1, product="Tesla T4"))
    config = parse_config(
        """
version: v1
resources:
  gpus:
  - pattern: "*A100*"
    name: a100
"""
    )
    specs = build_resources(inv, config)
    assert names(specs) == ["nvidia.com/a100", "nvidia.com/gpu"]
    assert specs[0].devices[0].unit.gpu.index == 0


def test_mig_none_advertises_whole_gpus() -> None:
    inv = inventory(gpu(0, migs=["1g.10gb", "1g.10gb"]))
    (spec,) = build_resources(inv, parse_config("version: v1"))
    assert [d.id for d in spec.devices] == [inv.gpus[0].uuid]


def test_mig_single_advertises_slices_as_gpu() -> None:
    inv = inventory(gpu(0, migs=["1g.10gb"] * 3), gpu(1, migs=["1g.10gb"] * 2))
    (spec,) = build_resources(inv, parse_config("version: v1\nflags: {migStrategy: single}"))
    assert spec.name == "nvidia.com/gpu"
    assert len(spec.devices) == 5
    assert all(d.id.startswith("MIG-") for d in spec.devices)
    assert spec.devices[0].unit.index == "0:1"
    assert "/dev/nvidia-caps/nvidia-cap100" in spec.devices[0].unit.device_paths


def test_mig_single_refuses_mixed_profiles() -> None:
    inv = inventory(gpu(0, migs=["1g.10gb", "2g.20gb"]))
    with pytest.raises(ConfigError, match="one MIG profile"):
        build_resources(inv, parse_config("version: v1\nflags: {migStrategy: single}"))


def test_mig_single_refuses_mig_disabled_gpu() -> None:
    inv = inventory(gpu(0, migs=["1g.10gb"]), gpu(1))
    with pytest.raises(ConfigError, match=r"GPU\(s\) 1 have it off"):
        build_resources(inv, parse_config("version: v1\nflags: {migStrategy: single}"))


def test_mig_mixed_one_resource_per_profile() -> None:
    inv = inventory(gpu(0, migs=["1g.10gb", "1g.10gb", "2g.20gb+me"]), gpu(1))
    specs = build_resources(inv, parse_config("version: v1\nflags: {migStrategy: mixed}"))
    assert names(specs) == ["nvidia.com/gpu", "nvidia.com/mig-1g.10gb", "nvidia.com/mig-2g.20gb.me"]
    assert len(specs[1].devices) == 2


def test_time_slicing_replicas_and_ids() -> None:
    inv = inventory(gpu(0), gpu(1))
    config = parse_config(
        """
version: v1
sharing:
  timeSlicing:
    resources:
    - name: nvidia.com/gpu
      replicas: 4
"""
    )
    (spec,) = build_resources(inv, config)
    assert spec.name == "nvidia.com/gpu"
    assert spec.sharing is SharingKind.TIME_SLICING
    assert len(spec.devices) == 8
    assert spec.devices[0].id == f"{inv.gpus[0].uuid}::0"
    assert {d.unit.uuid for d in spec.devices} == {g.uuid for g in inv.gpus}


def test_rename_by_default_and_devices_subset_side_by_side() -> None:
    inv = inventory(gpu(0), gpu(1), gpu(2))
    config = parse_config(
        """
version: v1
sharing:
  timeSlicing:
    renameByDefault: true
    resources:
    - name: nvidia.com/gpu
      replicas: 2
      devices: [1]
"""
    )
    plain, shared = build_resources(inv, config)
    assert plain.name == "nvidia.com/gpu" and shared.name == "nvidia.com/gpu.shared"
    assert [d.unit.gpu.index for d in plain.devices] == [0, 2]
    assert [d.id for d in shared.devices] == [f"{inv.gpus[1].uuid}::0", f"{inv.gpus[1].uuid}::1"]


def test_devices_count_takes_first_gpus_and_explicit_rename() -> None:
    inv = inventory(gpu(0), gpu(1), gpu(2))
    config = parse_config(
        """
version: v1
sharing:
  timeSlicing:
    resources:
    - name: nvidia.com/gpu
      rename: nvidia.com/gpu-slice
      replicas: 3
      devices: 2
"""
    )
    plain, shared = build_resources(inv, config)
    assert shared.name == "nvidia.com/gpu-slice"
    assert {d.unit.gpu.index for d in shared.devices} == {0, 1}
    assert [d.unit.gpu.index for d in plain.devices] == [2]


def test_subset_without_rename_is_refused() -> None:
    inv = inventory(gpu(0), gpu(1))
    config = parse_config(
        """
version: v1
sharing:
  timeSlicing:
    resources:
    - name: nvidia.com/gpu
      replicas: 2
      devices: [0]
"""
    )
    with pytest.raises(ConfigError, match="set 'rename' or 'renameByDefault"):
        build_resources(inv, config)


def test_devices_entry_that_matches_nothing_names_it() -> None:
    inv = inventory(gpu(0))
    config = parse_config(
        """
version: v1
sharing:
  timeSlicing:
    renameByDefault: true
    resources:
    - name: nvidia.com/gpu
      replicas: 2
      devices: [5]
"""
    )
    with pytest.raises(ConfigError, match=r"devices: '5' matches no"):
        build_resources(inv, config)


def test_mig_slices_shared_by_index() -> None:
    inv = inventory(gpu(0, migs=["1g.10gb", "1g.10gb"]))
    config = parse_config(
        """
version: v1
flags: {migStrategy: mixed}
sharing:
  timeSlicing:
    resources:
    - name: nvidia.com/mig-1g.10gb
      replicas: 2
"""
    )
    (spec,) = build_resources(inv, config)
    assert len(spec.devices) == 4
    assert spec.devices[0].id.startswith("MIG-") and "::" in spec.devices[0].id


MPS = """
version: v1
flags: {{mpsRoot: /run/nvidia/mps}}
sharing:
  mps:
    resources:
    - name: nvidia.com/gpu
      replicas: {replicas}
"""


def test_mps_replica_limit_depends_on_compute_capability() -> None:
    old = inventory(gpu(0, cc=(7, 0)))
    with pytest.raises(ConfigError, match="limit of 16"):
        build_resources(old, parse_config(MPS.format(replicas=20)))
    (spec,) = build_resources(inventory(gpu(0, cc=(8, 0))), parse_config(MPS.format(replicas=20)))
    assert spec.sharing is SharingKind.MPS and len(spec.devices) == 20


def test_unhealthy_gpu_marks_all_its_replicas() -> None:
    inv = inventory(gpu(0), gpu(1))
    inv = inv.with_health({inv.gpus[0].uuid: Health.UNHEALTHY})
    (spec,) = build_resources(inv, parse_config(MPS.format(replicas=3)))
    bad = [d for d in spec.devices if d.health is Health.UNHEALTHY]
    assert len(bad) == 3 and {d.unit.uuid for d in bad} == {inv.gpus[0].uuid}


def test_parent_xid_takes_down_every_mig_slice() -> None:
    inv = inventory(gpu(0, migs=["1g.10gb", "1g.10gb"]))
    inv = inv.with_health({inv.gpus[0].uuid: Health.UNHEALTHY})
    (spec,) = build_resources(inv, parse_config("version: v1\nflags: {migStrategy: mixed}"))
    assert all(d.health is Health.UNHEALTHY for d in spec.devices)


def test_sharing_a_resource_the_node_lacks_advertises_nothing_extra() -> None:
    inv = inventory(gpu(0, product="NVIDIA A100-SXM4-40GB"))
    config = parse_config(
        """
version: v1
resources:
  gpus: [{pattern: "*A100*", name: a100}]
sharing:
  timeSlicing:
    resources:
    - name: nvidia.com/gpu
      replicas: 4
"""
    )
    assert names(build_resources(inv, config)) == ["nvidia.com/a100"]


def test_socket_names_are_distinct_for_names_that_differ_only_in_dash_and_slash() -> None:
    label = st.from_regex(r"[a-z0-9]([-a-z0-9]{0,6}[a-z0-9])?", fullmatch=True)
    domain = st.lists(label, min_size=1, max_size=3).map(".".join)
    short = st.from_regex(r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,8}[A-Za-z0-9])?", fullmatch=True)
    name = st.builds(lambda d, n: f"{d}/{n}", domain, short)

    @given(name, name)
    def distinct(a: str, b: str) -> None:
        assert (socket_name(a) == socket_name(b)) == (a == b)

    distinct()
    assert socket_name("x.io-a/b") != socket_name("x.io/a-b")
    assert socket_name("nvidia.com/gpu") == "kubegpu-nvidia.com-gpu.sock"
