"""NVIDIA's resource-manager cases (internal/rm, cmd/mps-control-daemon/mps) against kubegpu.

Each case is data under ``data/nvidia/rm/`` read from NVIDIA's own tests; the tests here
build an equivalent node (tests.builders) and ask kubegpu's pure functions: `build_resources`
(replica IDs, names), `validate_request`, `preferred_allocation` and the health policy.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import yaml

from kubegpu.allocation import validate_request
from kubegpu.config import AllocationPolicy, Config, parse_config
from kubegpu.config.v1 import HealthFlags
from kubegpu.devices.model import Health, HealthEvent, HealthEventKind
from kubegpu.errors import AllocationError, ConfigError, KubegpuError
from kubegpu.health import HealthTracker, health_flags_from_env
from kubegpu.placement import preferred_allocation
from kubegpu.resources import ResourceSpec, build_resources, mig_resource_name
from tests import builders
from tests.conformance.origin import DATA, NVIDIA_DP

RM = DATA / "nvidia" / "rm"


def load(name: str, key: str = "cases") -> list[dict[str, Any]]:
    data: dict[str, list[dict[str, Any]]] = yaml.safe_load((RM / name).read_text())
    return data[key]


def config_with(sections: dict[str, Any]) -> Config:
    if "mps" in sections.get("sharing", {}):
        # kubegpu needs the MPS root named (NVIDIA's chart sets it); not part of the cases.
        sections = {**sections, "flags": {"mpsRoot": "/run/nvidia/mps"}}
    return parse_config(yaml.safe_dump({"version": "v1", **sections}))


def gpu_spec(gpus: int, sharing: dict[str, Any] | None = None) -> ResourceSpec:
    inv = builders.inventory(*(builders.gpu(i) for i in range(gpus)))
    config = config_with({"sharing": sharing} if sharing else {})
    return next(s for s in build_resources(inv, config) if s.name == "nvidia.com/gpu")


def real_id(symbolic: str, prefix: str) -> str:
    """`device1::0` -> `<UUID of GPU 1>::0`."""
    name, _, replica = symbolic.partition("::")
    uuid = builders.gpu(int(name.removeprefix(prefix))).uuid
    return f"{uuid}::{replica}" if replica else uuid


# -- internal/rm/rm_test.go TestValidateRequest ---------------------------------------------

VALIDATE = load("validate_request.yaml")


@pytest.mark.parametrize(
    "case",
    VALIDATE,
    ids=[f"{c['id']}@{NVIDIA_DP.cite('internal/rm/rm_test.go')}" for c in VALIDATE],
)
def test_validate_request(case: dict[str, Any]) -> None:
    spec = gpu_spec(2, case.get("sharing"))
    ids = [real_id(i, "device") for i in case["request"]]
    if case["valid"]:
        got = validate_request(spec, ids)
        assert [d.id for d in got] == ids
    else:
        with pytest.raises(AllocationError):
            validate_request(spec, ids)


# -- internal/rm/devices.go NewAnnotatedID: replica IDs --------------------------------------


def test_replica_ids_are_uuid_double_colon_n() -> None:
    """Replica r of a GPU is `<UUID>::<r>` (NVIDIA_DP internal/rm/devices.go NewAnnotatedID)."""
    spec = gpu_spec(2, {"timeSlicing": {"resources": [{"name": "nvidia.com/gpu", "replicas": 3}]}})
    uuids = [builders.gpu(i).uuid for i in range(2)]
    assert sorted(d.id for d in spec.devices) == sorted(
        f"{u}::{r}" for u in uuids for r in range(3)
    )


# -- internal/rm/rm.go AddDefaultResourcesToConfig: MIG resource names -----------------------

MIG_NAMES = [
    ("1g.10gb", "nvidia.com/mig-1g.10gb"),
    ("3g.40gb", "nvidia.com/mig-3g.40gb"),
    ("7g.80gb", "nvidia.com/mig-7g.80gb"),
    # "mig-"+profile with every "+" replaced by ".".
    ("1g.10gb+me", "nvidia.com/mig-1g.10gb.me"),
    ("1g.12gb+me.all", "nvidia.com/mig-1g.12gb.me.all"),
]


@pytest.mark.parametrize(
    ("profile", "name"),
    MIG_NAMES,
    ids=[f"{p}@{NVIDIA_DP.cite('internal/rm/rm.go')}" for p, _ in MIG_NAMES],
)
def test_mig_mixed_resource_names(profile: str, name: str) -> None:
    assert mig_resource_name(profile) == name
    inv = builders.inventory(builders.gpu(0, migs=[profile, profile]))
    specs = build_resources(inv, config_with({"flags": {"migStrategy": "mixed"}}))
    assert [(s.name, len(s.devices)) for s in specs] == [(name, 2)]


def test_mig_single_advertises_slices_as_gpu() -> None:
    """`single` adds the MIG rule `* -> gpu` (NVIDIA_DP internal/rm/rm.go)."""
    inv = builders.inventory(builders.gpu(0, migs=["1g.10gb"] * 3))
    specs = build_resources(inv, config_with({"flags": {"migStrategy": "single"}}))
    assert [(s.name, len(s.devices)) for s in specs] == [("nvidia.com/gpu", 3)]
    assert all(d.id.startswith("MIG-") for d in specs[0].devices)


@pytest.mark.deliberate("mig-compute-instance-profiles-advertised")
@pytest.mark.parametrize("origin", [NVIDIA_DP.cite("internal/rm/rm.go")])
def test_mig_mixed_compute_instance_profiles_are_advertised(origin: str) -> None:
    """AddDefaultResourcesToConfig adds mixed-strategy rules only for profiles whose compute
    and GPU slice counts match, so a `1c.3g.20gb` slice matches no rule and NVIDIA's device
    map fails ("does not match any resource patterns"). kubegpu advertises it under its own
    name beside the full-size slices instead of refusing the node."""
    inv = builders.inventory(builders.gpu(0, migs=["1c.3g.20gb", "3g.20gb", "1g.5gb"]))
    specs = build_resources(inv, config_with({"flags": {"migStrategy": "mixed"}}))
    assert sorted((s.name, len(s.devices)) for s in specs) == [
        ("nvidia.com/mig-1c.3g.20gb", 1),
        ("nvidia.com/mig-1g.5gb", 1),
        ("nvidia.com/mig-3g.20gb", 1),
    ]


# -- internal/rm/allocate_test.go: distributed / packed replicas ------------------------------

SHARED = load("shared_allocation.yaml")


@pytest.mark.parametrize(
    "case",
    SHARED,
    ids=[f"{c['id']}@{NVIDIA_DP.cite('internal/rm/allocate_test.go')}" for c in SHARED],
)
def test_shared_allocation_policy(case: dict[str, Any]) -> None:
    ts: dict[str, Any] = {"resources": [{"name": "nvidia.com/gpu", "replicas": case["replicas"]}]}
    spec = gpu_spec(case["gpus"], {"timeSlicing": ts})
    available = (
        [real_id(i, "gpu") for i in case["available"]]
        if "available" in case
        else [d.id for d in spec.devices]
    )
    policy = AllocationPolicy(case["policy"]) if case["policy"] else AllocationPolicy.DISTRIBUTED
    if case.get("error"):
        with pytest.raises(AllocationError):
            preferred_allocation(spec, available, [], case["size"], policy)
        return
    got = preferred_allocation(spec, available, [], case["size"], policy)
    assert len(got) == len(set(got)) == case["size"] and set(got) <= set(available)
    counts = Counter(spec.by_id[i].unit.gpu.index for i in got)
    if "per_gpu" in case:
        assert counts == {int(g.removeprefix("gpu")): n for g, n in case["per_gpu"].items()}
    else:
        assert sorted(counts.values()) == case["sorted_counts"]


def test_default_config_policy_is_distributed() -> None:
    """No sharedDevicesAllocationPolicy means distributed (NVIDIA_DP allocate_test.go)."""
    assert Config().flags.plugin.shared_devices_allocation_policy is AllocationPolicy.DISTRIBUTED


# -- internal/rm/health_test.go: Xids from the environment -----------------------------------

HEALTH_ENV = load("health_xids.yaml", "env_cases")
HEALTH_LIST = load("health_xids.yaml", "list_cases")
HEALTH_JUNK = load("health_xids.yaml", "junk_cases")
DEFAULT_IGNORED = set(HealthFlags().ignored_xids)


def marks_unhealthy(flags: HealthFlags, xid: int) -> bool:
    tracker = HealthTracker(flags, lambda: 0.0)
    return tracker.observe(HealthEvent("GPU-0", HealthEventKind.XID, xid=xid))


@pytest.mark.parametrize(
    "case",
    HEALTH_ENV,
    ids=[f"{c['id']}@{NVIDIA_DP.cite('internal/rm/health_test.go')}" for c in HEALTH_ENV],
)
def test_health_env(case: dict[str, Any]) -> None:
    env = {"DP_DISABLE_HEALTHCHECKS": case["disable"], "DP_ENABLE_HEALTHCHECKS": case["enable"]}
    flags = health_flags_from_env(env, HealthFlags())
    got = {xid: not marks_unhealthy(flags, xid) for xid in case["ignored"]}
    assert got == case["ignored"]


@pytest.mark.parametrize(
    "case",
    HEALTH_LIST,
    ids=[f"{c['id']}@{NVIDIA_DP.cite('internal/rm/health_test.go')}" for c in HEALTH_LIST],
)
def test_health_xid_list_syntax(case: dict[str, Any]) -> None:
    flags = health_flags_from_env({"DP_DISABLE_HEALTHCHECKS": case["input"]}, HealthFlags())
    assert set(flags.ignored_xids) == DEFAULT_IGNORED | set(case["added"])
    for xid in case["added"]:
        assert not marks_unhealthy(flags, xid)


@pytest.mark.deliberate("xid-token-typos-rejected")
@pytest.mark.parametrize(
    "case",
    HEALTH_JUNK,
    ids=[f"{c['id']}@{NVIDIA_DP.cite('internal/rm/health_test.go')}" for c in HEALTH_JUNK],
)
def test_health_xid_junk_is_refused(case: dict[str, Any]) -> None:
    """NVIDIA skips a token that is not an Xid; kubegpu names it and refuses to start."""
    with pytest.raises(ConfigError, match=r"DP_DISABLE_HEALTHCHECKS.*not an Xid number"):
        health_flags_from_env({"DP_DISABLE_HEALTHCHECKS": case["input"]}, HealthFlags())


# -- cmd/mps-control-daemon/mps/device_test.go: MPS client limits ----------------------------

MPS = load("mps_replicas.yaml")


@pytest.mark.parametrize(
    "case",
    MPS,
    ids=[f"{c['id']}@{NVIDIA_DP.cite('cmd/mps-control-daemon/mps/device_test.go')}" for c in MPS],
)
def test_mps_replica_limits(case: dict[str, Any]) -> None:
    major, minor = (int(x) for x in case["cc"].split("."))
    inv = builders.inventory(builders.gpu(0, cc=(major, minor)))
    sharing = {"mps": {"resources": [{"name": "nvidia.com/gpu", "replicas": case["replicas"]}]}}
    if case["valid"]:
        specs = build_resources(inv, config_with({"sharing": sharing}))
        assert len(specs[0].devices) == case["replicas"]
    else:
        with pytest.raises(KubegpuError, match="replicas"):
            build_resources(inv, config_with({"sharing": sharing}))


@pytest.mark.parametrize(
    ("policy", "valid"),
    [("distributed", True), ("packed", True), ("no-such-policy", False)],
    ids=[f"{p}@{NVIDIA_DP.cite('cmd/nvidia-device-plugin/main.go')}" for p in ("d", "p", "bad")],
)
def test_allocation_policy_values(policy: str, valid: bool) -> None:
    """NVIDIA accepts `distributed` and `packed` and refuses any other value at start-up."""
    sections = {"flags": {"plugin": {"sharedDevicesAllocationPolicy": policy}}}
    if valid:
        assert config_with(sections).flags.plugin.shared_devices_allocation_policy == policy
    else:
        with pytest.raises(ConfigError, match="sharedDevicesAllocationPolicy"):
            config_with(sections)


def test_full_gpu_node_ignores_allocation_policy() -> None:
    """Whole, unshared GPUs are placed by topology whatever the policy says, so one DaemonSet
    serves full-GPU and shared nodes alike (NVIDIA_DP internal/rm/allocate_test.go
    TestFullGPUNodeIgnoresAllocationPolicy)."""
    inv = builders.nvlinked(8, numa_split=4)
    spec = build_resources(inv, Config())[0]
    ids = [d.id for d in spec.devices]
    answers = {
        p: preferred_allocation(spec, ids, [], 3, p)
        for p in (AllocationPolicy.DISTRIBUTED, AllocationPolicy.PACKED)
    }
    assert answers[AllocationPolicy.DISTRIBUTED] == answers[AllocationPolicy.PACKED]


# -- internal/rm/health.go: a critical Xid marks the device; only kubegpu brings it back ------


@pytest.mark.deliberate("health-recovers")
@pytest.mark.parametrize("origin", [NVIDIA_DP.cite("internal/rm/health.go")])
def test_a_critical_xid_marks_the_gpu_and_kubegpu_heals_it_after_passing_probes(
    origin: str,
) -> None:
    """NVIDIA internal/rm/health.go: checkHealth sends a device on the `unhealthy` channel for
    a critical Xid (79 here), and nothing in NVIDIA's plugin ever reports it Healthy again.
    kubegpu marks it the same way; as the Xid catalog resolves 79 with a restart, passing
    probes heal it only after the GPU was seen to reset (a probe failed, the GPU dropped out
    of NVML), then it reports it Healthy once its probes pass for recoverySeconds."""
    now = [1000.0]
    tracker = HealthTracker(HealthFlags(recovery_seconds=60), lambda: now[0])
    uuid = "GPU-4cf8db2d-06c0-7d70-1a51-e59b25b2c16c"
    assert tracker.observe(HealthEvent(uuid, HealthEventKind.XID, xid=79))
    assert tracker.health() == {uuid: Health.UNHEALTHY}  # as NVIDIA
    now[0] += 600
    assert not tracker.observe(HealthEvent(uuid, HealthEventKind.PROBE_OK))  # no reset yet
    tracker.observe(HealthEvent(uuid, HealthEventKind.PROBE_FAILED, detail="GPU is lost"))
    now[0] += 59
    assert not tracker.observe(HealthEvent(uuid, HealthEventKind.PROBE_OK))
    assert tracker.health() == {uuid: Health.UNHEALTHY}  # not before the recovery period
    now[0] += 1
    assert tracker.observe(HealthEvent(uuid, HealthEventKind.PROBE_OK))
    assert tracker.health() == {}  # healthy again: NVIDIA would still say Unhealthy
