"""Processes to containers, and each allocation's limit: the pure part of the GPU usage view."""

from __future__ import annotations

import pytest

from kubegpu.config import parse_config
from kubegpu.devices import GpuProcess, Inventory, ProcessTable
from kubegpu.devices.simulated import SimulatedBackend, parse_node
from kubegpu.metrics import UNATTRIBUTED, UsageRow
from kubegpu.resources import ResourceSpec, build_resources
from kubegpu.usage.attribution import (
    Allocation,
    ClaimDevices,
    Holder,
    attribute,
    capped,
    dra_allocations,
    memory_limit,
    plugin_allocations,
    usage_rows,
)
from kubegpu.usage.cgroup import PodCgroup
from kubegpu.usage.kubelet import ContainerClaimDevice, ContainerDevices

MIB = 1024 * 1024
GPU = "nvidia.com/gpu"
UID_A, UID_B, UID_C = (f"{n}" * 8 + "-0000-4000-8000-" + "0" * 12 for n in "abc")


def node(*gpus: dict[str, object]) -> Inventory:
    return SimulatedBackend(parse_node({"gpus": list(gpus)}, "n", "n")).discover()


def specs(inventory: Inventory, config: str = "version: v1") -> tuple[ResourceSpec, ...]:
    return build_resources(inventory, parse_config(config))


TIME_SLICED = (
    "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n"
    "      replicas: 4\n"
)
MPS = (
    "version: v1\nflags: {mpsRoot: /run/nvidia/mps}\nsharing:\n  mps:\n    resources:\n"
    "    - name: nvidia.com/gpu\n      replicas: 4\n"
)


def test_limits_whole_gpu_mig_slice_time_sliced_and_mps_replica() -> None:
    inventory = node(
        {"memory_mib": 81559}, {"mig_capable": True, "mig": ["3g.40gb"], "memory_mib": 81559}
    )
    whole_gpu = inventory.gpus[0]
    (plain,) = [s for s in specs(inventory) if s.name == GPU]
    unit = plain.devices[0].unit
    assert memory_limit(unit, plain) == 81559 * MIB
    mixed = specs(inventory, "version: v1\nflags: {migStrategy: mixed}")
    mig = next(d.unit for s in mixed for d in s.devices if d.unit.mig is not None)
    assert mig.mig is not None
    assert memory_limit(mig, plain) == mig.mig.memory_mib * MIB
    (sliced,) = specs(node({}), TIME_SLICED)
    # Time-slicing shares the memory: each replica may use the whole device.
    assert memory_limit(sliced.devices[0].unit, sliced) == whole_gpu.memory_mib * MIB
    (mps,) = specs(node({}), MPS)
    # NVIDIA's fixed MPS limit: an equal share, what the control daemon sets per client.
    assert memory_limit(mps.devices[0].unit, mps) == (81559 // 4) * MIB
    (sized,) = specs(node({}), MPS.replace("replicas: 4", "replicas: 4\n      memoryLimit: 10Gi"))
    assert memory_limit(sized.devices[0].unit, sized) == 10 * 1024 * MIB


def test_plugin_allocations_fold_replicas_and_skip_other_plugins() -> None:
    inventory = node({}, {})
    (spec,) = specs(inventory, TIME_SLICED)
    g0, g1 = (g.uuid for g in inventory.gpus)
    held = [
        ContainerDevices("ml", "train-0", "main", GPU, (f"{g0}::0", f"{g0}::1", f"{g1}::3")),
        ContainerDevices("ml", "other", "x", "example.com/fpga", ("fpga-0",)),
    ]
    uids = {("main", GPU, frozenset(held[0].device_ids)): UID_A}
    found = plugin_allocations(held, [spec], uids)
    holder = Holder("ml", "train-0", "main", pod_uid=UID_A)
    assert {(a.holder, a.unit.uuid) for a in found} == {(holder, g0), (holder, g1)}


def test_dra_allocations_by_container_else_by_claim() -> None:
    inventory = node({}, {})
    (spec,) = specs(inventory)
    devices = {f"gpu-{d.unit.gpu.index}": (d.unit, spec) for d in spec.devices}
    claims = [
        ClaimDevices("ml", "train", ("gpu-0",)),
        ClaimDevices("ml", "infer", ("gpu-1",)),
    ]
    used = [
        ContainerClaimDevice("ml", "train-0", "main", "train", "gpu.nvidia.com", "node-a", "gpu-0"),
        # another driver's device of the same name is not ours
        ContainerClaimDevice("ml", "x", "y", "infer", "other.example.com", "node-a", "gpu-1"),
    ]
    found = dra_allocations(claims, used, devices, driver="gpu.nvidia.com", pool="node-a")
    assert {(a.holder, a.unit.gpu.index) for a in found} == {
        (Holder("ml", "train-0", "main", "train"), 0),
        (Holder("ml", claim="infer"), 1),  # the kubelet does not say: the claim itself
    }


def test_a_claim_sized_in_memory_is_held_to_what_it_consumed() -> None:
    """Two claims of 30 GiB on one shared 80 GiB GPU: each one's limit is its 30 GiB, not the
    GPU's memory over its replicas, so "close to its limit" reads against what it asked."""
    inventory = node({"memory_mib": 80 * 1024})
    (spec,) = specs(inventory, TIME_SLICED)
    unit = spec.devices[0].unit
    devices = {"gpu-0": (unit, spec)}
    claims = [
        ClaimDevices("ml", "a", ("gpu-0",), {"gpu-0": 30 * 1024 * MIB}),
        ClaimDevices("ml", "b", ("gpu-0",), {"gpu-0": 30 * 1024 * MIB}),
        ClaimDevices("ml", "whole", ("gpu-0",)),
    ]
    found = {
        a.holder.claim: a.limit_bytes
        for a in dra_allocations(claims, [], devices, driver="gpu.nvidia.com")
    }
    assert found == {
        "a": 30 * 1024 * MIB,
        "b": 30 * 1024 * MIB,
        "whole": memory_limit(unit, spec),
    }


def allocation(holder: Holder, inventory: Inventory, index: int = 0) -> Allocation:
    (spec,) = specs(inventory)
    unit = spec.devices[index].unit
    return Allocation(holder, unit, memory_limit(unit, spec))


def test_attribute_by_pod_uid_among_holders_of_a_shared_gpu() -> None:
    inventory = node({})
    a = allocation(Holder("ml", "a", "main", pod_uid=UID_A), inventory)
    b = allocation(Holder("ml", "b", "main", pod_uid=UID_B), inventory)
    assert attribute(PodCgroup(UID_B), [a, b]) == (b.holder, b.limit_bytes)
    # A pod holding nothing on this GPU (a privileged pod seeing every GPU) is not a holder.
    assert attribute(PodCgroup(UID_C), [a, b]) is None
    # Outside every pod: the MPS server, a host process.
    assert attribute(None, [a, b]) is None
    assert attribute(PodCgroup(UID_A), []) is None


def test_attribute_without_uids_only_where_one_holder_has_the_device() -> None:
    inventory = node({})
    claim = allocation(Holder("ml", claim="train"), inventory)
    assert attribute(PodCgroup(UID_A), [claim]) == (claim.holder, claim.limit_bytes)
    other = allocation(Holder("ml", claim="infer"), inventory)
    assert attribute(PodCgroup(UID_A), [claim, other]) is None
    # Two containers of one claim: the claim is known, the container is not.
    one = allocation(Holder("ml", "p", "c1", "train"), inventory)
    two = allocation(Holder("ml", "p", "c2", "train"), inventory)
    assert attribute(PodCgroup(UID_A), [one, two]) == (
        Holder("ml", claim="train"),
        one.limit_bytes,
    )


def test_two_containers_of_one_pod_on_one_gpu_count_for_the_pod() -> None:
    inventory = node({})
    one = allocation(Holder("ml", "p", "c1", pod_uid=UID_A), inventory)
    two = allocation(Holder("ml", "p", "c2", pod_uid=UID_A), inventory)
    holder, limit = attribute(PodCgroup(UID_A), [one, two]) or (None, None)
    assert holder == Holder("ml", "p", "", pod_uid=UID_A) and limit == one.limit_bytes


def test_rows_sum_per_holder_and_fold_the_rest_per_device() -> None:
    inventory = node({}, {"mig_capable": True, "mig": ["3g.40gb"]})
    g0 = inventory.gpus[0]
    mig = inventory.gpus[1].mig_devices[0]
    (plain, *_) = specs(inventory)
    a = allocation(Holder("ml", "a", "main", pod_uid=UID_A), inventory)
    idle = allocation(Holder("ml", "idle", "main", pod_uid=UID_C), inventory)
    table = ProcessTable(
        (
            GpuProcess(1, g0.uuid, used_memory_bytes=100 * MIB, sm_percent=70),
            GpuProcess(2, g0.uuid, used_memory_bytes=50 * MIB, sm_percent=60),
            GpuProcess(3, g0.uuid, used_memory_bytes=7 * MIB, sm_percent=5),
            GpuProcess(4, mig.uuid, used_memory_bytes=9 * MIB, gpu_instance_id=mig.gi_id),
            GpuProcess(5, "GPU-not-discovered-yet", used_memory_bytes=None),
        )
    )
    owners = {1: PodCgroup(UID_A), 2: PodCgroup(UID_A), 3: None, 4: PodCgroup(UID_B)}
    rows = {
        (r.uuid, r.gi_id, r.namespace, r.pod): r
        for r in usage_rows(table, owners, [a, idle], inventory, "node-a")
    }
    mine = rows[(g0.uuid, "", "ml", "a")]
    assert (mine.used_bytes, mine.limit_bytes, mine.processes) == (150 * MIB, 81559 * MIB, 2)
    assert mine.sm_percent == 100  # summed, at most 100
    assert (mine.gpu, mine.device, mine.model, mine.hostname) == (
        "0",
        "nvidia0",
        g0.product,
        "node-a",
    )
    # An allocation without processes: its limit beside a use of 0.
    quiet = rows[(g0.uuid, "", "ml", "idle")]
    assert (quiet.used_bytes, quiet.limit_bytes, quiet.sm_percent) == (0, 81559 * MIB, 0)
    rest = rows[(g0.uuid, "", "", UNATTRIBUTED)]
    assert (rest.used_bytes, rest.limit_bytes, rest.processes) == (7 * MIB, None, 1)
    on_slice = rows[(inventory.gpus[1].uuid, str(mig.gi_id), "", UNATTRIBUTED)]
    assert on_slice.gi_profile == mig.profile and on_slice.sm_percent is None
    assert rows[("GPU-not-discovered-yet", "", "", UNATTRIBUTED)].gpu == ""
    assert plain.name == GPU


def test_the_cap_keeps_the_rows_holding_most_memory_in_display_order() -> None:
    rows = [
        UsageRow(gpu=str(i % 3), uuid=f"GPU-{i % 3}", pod=f"p{i}", used_bytes=i) for i in range(10)
    ]
    kept, dropped = capped(rows, 4)
    assert dropped == 6
    assert sorted(r.used_bytes for r in kept) == [6, 7, 8, 9]
    assert [r.gpu for r in kept] == sorted(r.gpu for r in kept)
    assert capped(rows, 100) == (tuple(capped(rows, 100)[0]), 0)


@pytest.mark.parametrize("bad", ["../x", "A", "a" * 64, "a_b", "x\n", ""])
def test_names_kubernetes_refuses_are_not_names(bad: str) -> None:
    from kubegpu.usage.kubelet import valid_names

    assert not valid_names(bad, "pod", "c")
    assert valid_names("ml", "train-0.a", "main")
