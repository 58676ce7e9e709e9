"""GPUs shared by memory in DRA mode: the config's `sizing`, the slice's request policies,
the limits a claim's allocation result makes, and how they are recorded."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from kubegpu.config import Config, parse_config
from kubegpu.config.names import parse_quantity
from kubegpu.dra.checkpoint import Checkpoint, ClaimRecord, ClaimState, CorruptCheckpoint
from kubegpu.dra.claims import ClaimError, node_devices, plan_claim
from kubegpu.dra.resourceclaim import Claim, parse_claim
from kubegpu.dra.sizing import (
    ClaimLimits,
    ComputeLimit,
    DeviceLimit,
    MemoryLimit,
    SizingError,
    device_limit,
)
from kubegpu.dra.slices import Device
from kubegpu.dra.state import recorded_claim
from kubegpu.errors import ConfigError
from kubegpu.mps import MpsReconciler
from kubegpu.resources import build_resources
from kubegpu.state import NodeStore
from tests.builders import gpu, inventory
from tests.unit.dra.conftest import bodies, check_api_rules, slices_of
from tests.unit.mps.conftest import FAKE, commands

MPS_ROOT = "flags: {mpsRoot: /run/nvidia/mps}\n"


def sized(entry: str = "sizing: {}", strategy: str = "mps") -> Config:
    return parse_config(
        f"version: v1\n{MPS_ROOT}sharing:\n  {strategy}:\n    resources:\n"
        f"    - {{name: gpu, replicas: 4, {entry}}}\n"
    )


def error(text: str) -> str:
    with pytest.raises(ConfigError) as caught:
        parse_config(text, source="cm.yaml")
    return str(caught.value)


# -- config -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        (
            "sizing: {defaultMemory: 10Gi, memoryStep: 3Gi}",
            "sharing.mps.resources[0].sizing.defaultMemory: is not a multiple of memoryStep "
            "(3Gi) (got '10Gi'); make it one: the scheduler only hands out whole steps",
        ),
        (
            "sizing: {memoryStep: 1000}",
            "sharing.mps.resources[0].sizing.memoryStep: must be whole MiB (got '1000'); MPS "
            "takes its memory limits in MiB: use a multiple of 1Mi, like '256Mi' or '1Gi'",
        ),
        (
            "sizing: {defaultShares: 5}",
            "sharing.mps.resources[0].sizing.defaultShares: is more than the 4 replicas "
            "(shares) of each GPU (got 5); give at most 4",
        ),
        (
            "sizing: {defaultMemory: 10GB}",
            "sharing.mps.resources[0].sizing.defaultMemory: is not a Kubernetes quantity "
            "(got '10GB'); write bytes or a quantity like '10Gi' or '512Mi'",
        ),
        (
            "sizing: {defaultMemory: 0}",
            "sharing.mps.resources[0].sizing.defaultMemory: must be more than 0 bytes "
            "(got 0); write bytes or a quantity like '10Gi' or '512Mi'",
        ),
        (
            "sizing: {memorySteps: 1Gi}",
            "sharing.mps.resources[0].sizing.memorySteps: unknown key 'memorySteps'; did you "
            "mean 'memoryStep'?",
        ),
    ],
)
def test_bad_sizing_is_one_line_naming_the_key(entry: str, message: str) -> None:
    text = f"version: v1\n{MPS_ROOT}sharing:\n  mps:\n    resources:\n"
    text += f"    - {{name: gpu, replicas: 4, {entry}}}\n"
    assert error(text) == f"cm.yaml: {message}"


def test_sizing_defaults_and_both_strategies() -> None:
    for strategy in ("mps", "timeSlicing"):
        entry = sized(strategy=strategy).sharing
        resources = (entry.mps or entry.time_slicing).resources  # type: ignore[union-attr]
        assert resources[0].sizing is not None
        assert resources[0].sizing.memory_step == "1Mi"
        assert resources[0].sizing.default_shares == 1


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        (
            "sizing: {memoryStep: 41Gi}",
            "sharing.mps.resources[0].sizing.memoryStep: 41Gi is more than half of the 81559Mi "
            "of GPU 0; the smallest claim is one step and the API needs room for two: use a "
            "smaller step",
        ),
        (
            "sizing: {defaultMemory: 80Gi}",
            "sharing.mps.resources[0].sizing.defaultMemory: 80Gi does not fit in the 81559Mi "
            "of GPU 0; give at most what one GPU holds",
        ),
    ],
)
def test_sizing_that_does_not_fit_the_gpus_is_refused_once_they_are_known(
    entry: str, message: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        build_resources(inventory(gpu(0)), sized(entry))
    assert str(caught.value) == message


# -- slices ----------------------------------------------------------------------------


def check_request_policies(device: Device) -> None:
    """What the API server checks of each capacity's request policy
    (pkg/apis/resource/validation, validateRequestPolicyRange, v1.36): min within the
    capacity, default and max between min and the capacity, min + step within the
    capacity, default and max whole steps from min."""
    for name, capacity in device["capacity"].items():
        policy = capacity.get("requestPolicy")
        if policy is None:
            continue
        value = _q(capacity["value"])
        default = _q(policy["default"])
        valid = policy["validRange"]
        low = _q(valid["min"])
        assert 0 <= low <= value and low <= default, name
        if "max" in valid:
            assert low <= _q(valid["max"]) <= value and default <= _q(valid["max"]), name
        if "step" in valid:
            step = _q(valid["step"])
            assert low + step <= value, name
            assert (default - low) % step == 0, name
            if "max" in valid:
                assert (_q(valid["max"]) - low) % step == 0, name


def _q(text: str) -> int:
    return 0 if text == "0" else parse_quantity(text)


def test_a_sized_gpu_publishes_its_size_policy_and_how_limits_hold() -> None:
    [body] = bodies(inventory(gpu(0)), sized("sizing: {defaultMemory: 10Gi, memoryStep: 1Gi}"))
    assert body["allowMultipleAllocations"] is True
    assert body["capacity"] == {
        "memory": {
            "value": "81559Mi",
            "requestPolicy": {
                "default": "10Gi",
                "validRange": {"min": "1Gi", "max": "79Gi", "step": "1Gi"},
            },
        },
        "shares": {
            "value": "4",
            "requestPolicy": {"default": "1", "validRange": {"min": "1", "max": "4", "step": "1"}},
        },
    }
    assert body["attributes"]["kubegpu.io/memoryLimit"] == {"string": "mps-pinned-memory"}
    assert body["attributes"]["kubegpu.io/computeLimit"] == {"string": "mps-active-threads"}
    check_request_policies(body)
    check_api_rules(slices_of([body]))


def test_an_unsized_shared_gpu_keeps_nvidias_layout_and_names_no_limit() -> None:
    config = parse_config(
        "version: v1\nsharing: {timeSlicing: {resources: [{name: gpu, replicas: 4}]}}"
    )
    [body] = bodies(inventory(gpu(0)), config)
    assert body["capacity"]["memory"]["requestPolicy"]["default"] == "0"
    assert "kubegpu.io/memoryLimit" not in body["attributes"]


@pytest.mark.parametrize(
    ("entry", "memory", "default"),
    [
        ("sizing: {}", "81559Mi", "20389Mi"),  # total / replicas, whole MiB
        ("sizing: {memoryStep: 1Gi}", "81559Mi", "19Gi"),  # rounded down to a step
        ("sizing: {memoryStep: 32Gi}", "81559Mi", "32Gi"),  # at least one step
        ("sizing: {memoryStep: 256Mi, defaultShares: 4}", "81559Mi", "20224Mi"),
    ],
)
def test_sized_policies_pass_the_api_servers_rules(entry: str, memory: str, default: str) -> None:
    [body] = bodies(inventory(gpu(0)), sized(entry))
    assert body["capacity"]["memory"]["value"] == memory
    assert body["capacity"]["memory"]["requestPolicy"]["default"] == default
    check_request_policies(body)
    check_api_rules(slices_of([body]))


def test_sized_mig_slices_are_time_sliced_without_a_limit() -> None:
    text = (
        "version: v1\nflags: {migStrategy: mixed}\nsharing:\n  timeSlicing:\n    resources:\n"
        "    - {name: nvidia.com/mig-3g.40gb, replicas: 2, sizing: {memoryStep: 1Gi}}\n"
    )
    devices = bodies(inventory(gpu(0, migs=["3g.40gb", "3g.40gb"])), parse_config(text))
    shared = [d for d in devices if d.get("allowMultipleAllocations")]
    assert shared
    for body in shared:
        assert body["attributes"]["kubegpu.io/memoryLimit"] == {"string": "none"}
        check_request_policies(body)
    check_api_rules(slices_of(devices))


@pytest.mark.parametrize(
    ("strategy", "memory", "compute"),
    [("mps", "nvml-cgroup", "mps-active-threads"), ("timeSlicing", "nvml-cgroup", "none")],
)
def test_a_node_with_kernel_memory_limits_publishes_them(
    strategy: str, memory: str, compute: str
) -> None:
    node = dataclasses.replace(inventory(gpu(0)), memory_limits=True)
    [body] = bodies(node, sized(strategy=strategy))
    assert body["attributes"]["kubegpu.io/memoryLimit"] == {"string": memory}
    assert body["attributes"]["kubegpu.io/computeLimit"] == {"string": compute}


# -- limits ----------------------------------------------------------------------------


def sized_device(config: Config | None = None) -> Any:
    return node_devices("gpu.nvidia.com", build_resources(inventory(gpu(0)), config or sized()))[
        "gpu-0"
    ]


def test_consumed_capacity_becomes_the_limit_and_requests_on_one_device_add_up() -> None:
    device = sized_device()
    one = device_limit("gpu-0", device.resource, device.unit, [{"memory": "30Gi", "shares": "1"}])
    assert (one.memory_mib, one.thread_percentage) == (30720, 25)
    two = device_limit(
        "gpu-0",
        device.resource,
        device.unit,
        [{"memory": "10Gi", "shares": "1"}, {"memory": "20Gi", "shares": "2"}],
    )
    assert (two.memory_mib, two.shares, two.thread_percentage) == (30720, 3, 75)


def test_a_device_held_whole_is_limited_to_all_of_it() -> None:
    """An API server without DRAConsumableCapacity writes no consumedCapacity: the device
    then serves one claim, which gets all of it."""
    device = sized_device()
    whole = device_limit("gpu-0", device.resource, device.unit, [{}])
    assert (whole.memory_mib, whole.thread_percentage) == (81559, 100)


@pytest.mark.parametrize(
    ("consumed", "message"),
    [
        ({"memory": "100Gi", "shares": "1"}, "was allocated 107374182400 bytes of memory"),
        ({"memory": "10Gi", "shares": "5"}, "was allocated 5 shares; it has 1 to 4 to give"),
        ({"memory": "10Gi"}, "consumedCapacity has no shares"),
        ({"memory": "ten", "shares": "1"}, "consumedCapacity memory is not a quantity"),
    ],
)
def test_an_allocation_that_cannot_be_a_limit_is_named(
    consumed: dict[str, str], message: str
) -> None:
    device = sized_device()
    with pytest.raises(SizingError, match=message):
        device_limit("gpu-0", device.resource, device.unit, [consumed])


def claim(consumed: dict[str, str] | None, pods: list[dict[str, str]] | None = None) -> Any:
    result: dict[str, Any] = {
        "request": "gpu",
        "driver": "gpu.nvidia.com",
        "pool": "node",
        "device": "gpu-0",
    }
    if consumed is not None:
        result["consumedCapacity"] = consumed
    return {
        "metadata": {"namespace": "ns", "name": "c", "uid": "u"},
        "status": {
            "allocation": {"devices": {"results": [result]}},
            "reservedFor": pods or [],
        },
    }


def plan(claim: Any, config: Config | None = None, **kw: Any) -> Any:
    """The plan of a claim: an API body, or the typed claim a record gives."""
    config = config or sized()
    devices = node_devices("gpu.nvidia.com", build_resources(inventory(gpu(0)), config))
    typed = claim if isinstance(claim, Claim) else parse_claim(claim)
    return plan_claim(typed, "gpu.nvidia.com", "node", devices, {}, config, **kw)


def test_a_record_plans_the_spec_and_limits_its_claim_did() -> None:
    """A prepared claim's missing CDI spec is written again at start from its checkpoint
    record alone: the record's values (two requests sharing one sized device, recorded
    as their sum) plan the spec and limits the claim itself did."""
    results = [
        {"request": r, "driver": "gpu.nvidia.com", "pool": "node", "device": "gpu-0"}
        | {"consumedCapacity": {"memory": "4Gi", "shares": "1"}}
        for r in ("a", "b")
    ]
    body = {
        "metadata": {"namespace": "ns", "name": "c", "uid": "u"},
        "status": {"allocation": {"devices": {"results": results}}},
    }
    first = plan(body)
    assert first.limits is not None and first.spec is not None
    record = ClaimRecord("u", ClaimState.PREPARED, "ns", "c", first.devices, first.limits)
    restored = recorded_claim(record, "gpu.nvidia.com")
    assert restored.uid == "u" and restored.label == "ns/c"
    again = plan(restored, daemon_dir=first.limits.daemon_dir)
    assert again.spec == first.spec
    assert again.limits == first.limits
    assert again.devices == first.devices


def test_a_plan_carries_the_limits_and_only_the_pods_uids() -> None:
    pod = "0f8e8a52-5cf0-4a2b-9a4e-2f1d8b1e0c01"
    got = plan(
        claim(
            {"memory": "8Gi", "shares": "2"},
            [
                {"resource": "pods", "name": "p", "uid": pod},
                {"resource": "pods", "name": "q", "uid": "../../etc"},
                {"resource": "jobs", "apiGroup": "batch", "name": "j", "uid": pod.upper()},
            ],
        )
    )
    assert got.limits is not None
    assert got.limits.memory_mib() == {gpu(0).uuid: 8192}
    assert got.limits.thread_percentage == 50
    assert got.limits.daemon_dir == "/run/nvidia/mps/kubegpu-claims/u"
    assert got.pods == (pod,)


def test_a_bad_allocation_fails_the_claims_plan_with_one_line() -> None:
    with pytest.raises(ClaimError) as caught:
        plan(claim({"memory": "10Gi", "shares": "9"}))
    assert str(caught.value) == (
        "claim ns/c: device gpu-0 was allocated 9 shares; it has 1 to 4 to give; the "
        "scheduler wrote an allocation this node cannot limit"
    )


def test_an_unsized_shared_gpu_has_no_limits() -> None:
    config = parse_config(
        "version: v1\nsharing: {timeSlicing: {resources: [{name: gpu, replicas: 4}]}}"
    )
    assert plan(claim({"memory": "0", "shares": "1"}), config).limits is None


# -- the record ------------------------------------------------------------------------


LIMITS = ClaimLimits(
    (DeviceLimit("gpu-0", "GPU-0", 8 << 30, 1, 4),),
    MemoryLimit.NVML_CGROUP,
    ComputeLimit.MPS_THREADS,
    "/run/nvidia/mps/kubegpu-claims/u",
    ("/sys/fs/cgroup/kubepods.slice/x",),
)


def test_a_records_limits_survive_the_checkpoint(tmp_path: Path) -> None:
    checkpoint = Checkpoint(tmp_path)
    checkpoint.claims["u"] = ClaimRecord("u", ClaimState.PREPARED, "ns", "c", (), LIMITS)
    checkpoint.claims["v"] = ClaimRecord("v", ClaimState.PREPARED, "ns", "d")
    checkpoint.save()
    loaded = Checkpoint.load(tmp_path)
    assert loaded.claims == checkpoint.claims
    raw = json.loads(checkpoint.path.read_text())
    assert "limits" not in raw["claims"]["v"]  # an unsized claim's record is as before


def test_a_record_with_bad_limits_makes_the_checkpoint_corrupt(tmp_path: Path) -> None:
    checkpoint = Checkpoint(tmp_path)
    bad = dataclasses.replace(LIMITS, devices=(DeviceLimit("gpu-0", "GPU-0", 0, 1, 4),))
    checkpoint.claims["u"] = ClaimRecord("u", ClaimState.PREPARED, "ns", "c", (), bad)
    checkpoint.save()
    with pytest.raises(CorruptCheckpoint, match="device limit out of range"):
        Checkpoint.load(tmp_path)


# -- the MPS daemons of the resources ----------------------------------------------------


async def test_device_plugin_mode_keeps_nvidias_fixed_limits_for_a_sized_resource(
    tmp_path: Path, python3_on_path: Path
) -> None:
    """The device plugin cannot see a pod's size: its MPS replicas keep total/replicas."""
    config = parse_config(
        f"version: v1\nflags: {{mpsRoot: {tmp_path}}}\nsharing:\n  mps:\n    resources:\n"
        "    - {name: gpu, replicas: 4, sizing: {defaultMemory: 10Gi}}\n"
    )
    store = NodeStore()
    store.update(inventory=inventory(gpu(0)), config=config)
    plugin_mode = MpsReconciler(store, control_binary=FAKE)
    try:
        await plugin_mode.reconcile(store.state)
        [daemon] = plugin_mode.daemons.values()
        assert commands(daemon)[-2:] == [
            f"set_default_device_pinned_mem_limit {gpu(0).uuid} 20389M",
            "set_default_active_thread_percentage 25",
        ]
    finally:
        await plugin_mode.stop()


async def test_dra_mode_starts_no_resource_daemon_for_a_sized_resource(tmp_path: Path) -> None:
    from kubegpu.dra.sizing import sized as is_sized

    store = NodeStore()
    store.update(inventory=inventory(gpu(0)), config=sized())
    dra_mode = MpsReconciler(store, control_binary="/nonexistent", per_claim=is_sized)
    await dra_mode.reconcile(store.state)
    assert dra_mode.daemons == {}
    # Served at once: each claim's prepare starts the daemon it needs.
    assert store.state.mps_ready == {"nvidia.com/gpu": True}
    assert all(d.unit.health.value == "Healthy" for s in store.state.specs for d in s.devices)


def test_the_published_schema_describes_sizing() -> None:
    import jsonschema  # type: ignore[import-untyped, unused-ignore]

    from kubegpu.config.v1 import json_schema

    validator = jsonschema.Draft202012Validator(json_schema())

    def entry(sizing: Any) -> dict[str, Any]:
        return {
            "sharing": {"mps": {"resources": [{"name": "gpu", "replicas": 4, "sizing": sizing}]}}
        }

    assert validator.is_valid(entry({"defaultMemory": 1 << 30, "memoryStep": "1Gi"}))
    assert validator.is_valid(entry({"defaultMemory": None}))
    assert not validator.is_valid(entry({"defaultShares": 0}))
    assert not validator.is_valid(entry({"memorySteps": "1Gi"}))
