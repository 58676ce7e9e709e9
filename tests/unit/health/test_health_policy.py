"""The Xid policy: NVIDIA's Xid catalog as a case table, the operator's overrides on top, and
the rule that a reset-requiring Xid is not healed by the recovery timer alone."""

from __future__ import annotations

import pytest

from kubegpu.config.v1 import HealthFlags
from kubegpu.devices.model import Health, HealthEvent, HealthEventKind
from kubegpu.errors import ConfigError
from kubegpu.health import (
    XID_MEANINGS,
    HealthTracker,
    XidPolicy,
    describe_xid,
    health_flags_from_env,
    xid_overrides,
)
from kubegpu.xid_catalog import BUCKET_OUTCOMES, CATALOG, XidOutcome, catalog_outcome
from tests.unit.health.conftest import GPU, Clock, xid

IGNORE, UNHEALTHY, RESET = XidOutcome.IGNORE, XidOutcome.UNHEALTHY, XidOutcome.UNTIL_RESET


def probe(ok: bool, uuid: str = GPU) -> HealthEvent:
    if ok:
        return HealthEvent(uuid, HealthEventKind.PROBE_OK)
    return HealthEvent(uuid, HealthEventKind.PROBE_FAILED, detail="GPU is lost")


# -- the catalog as data ----------------------------------------------------------------------


def test_the_catalog_lists_every_xid_up_to_172_with_a_known_bucket() -> None:
    assert sorted(CATALOG) == list(range(1, 173))
    unknown = {e.bucket for e in CATALOG.values()} - BUCKET_OUTCOMES.keys()
    assert unknown == set(), "every bucket the table names has an outcome"


def test_every_xid_kubegpu_names_in_logs_is_in_the_catalog() -> None:
    assert set(XID_MEANINGS) <= set(CATALOG)


@pytest.mark.parametrize(
    ("number", "mnemonic", "a100", "h100", "bucket"),
    [
        (13, "ROBUST_CHANNEL_GR_EXCEPTION", True, True, "RESTART_APP"),
        (48, "ROBUST_CHANNEL_GPU_ECC_DBE", True, True, "WORKFLOW_XID_48"),
        (79, "ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS", True, True, "RESTART_BM"),
        (93, "INFOROM_ERASE_LIMIT_EXCEEDED", True, False, "IGNORE"),
        (94, "ROBUST_CHANNEL_CONTAINED_ERROR", True, True, "RESTART_APP"),
        (109, "ROBUST_CHANNEL_CTXSW_TIMEOUT_ERROR", True, True, "RESET_GPU"),
        (110, "SEC_FAULT_ERROR", False, True, "RESET_GPU"),
        (151, "ROBUST_CHANNEL_KEY_ROTATION_ERROR", False, True, "RESTART_VM"),
        (54, "SILENT_RUNNING_PWR_REDUCED_CLOCKING", True, True, "CHECK_MECHANICALS"),
        (167, "PCIE_FATAL_TIMEOUT", False, True, ""),
    ],
)
def test_catalog_rows_as_nvidia_publishes_them(
    number: int, mnemonic: str, a100: bool, h100: bool, bucket: str
) -> None:
    entry = CATALOG[number]
    assert (entry.mnemonic, entry.a100, entry.h100, entry.bucket) == (mnemonic, a100, h100, bucket)


#: Xid -> outcome with the default settings (NVIDIA's six-Xid ignore list still in place).
DEFAULT_CASES = [
    (13, IGNORE),  # RESTART_APP, and on NVIDIA's list
    (31, IGNORE),
    (43, IGNORE),  # IGNORE
    (45, IGNORE),  # WORKFLOW_XID_45: follow the other Xid
    (68, IGNORE),
    (109, IGNORE),  # RESET_GPU in the catalog, but on NVIDIA's default list: kept as NVIDIA does
    (8, IGNORE),  # RESTART_APP
    (63, IGNORE),  # row remapping event: IGNORE
    (92, IGNORE),  # high single-bit ECC rate: IGNORE
    (94, IGNORE),  # contained ECC error: RESTART_APP (NVIDIA's plugin marks it, its #1014)
    (154, IGNORE),  # XID_154: informational, follows another Xid
    (46, RESET),  # RESET_GPU
    (48, RESET),  # WORKFLOW_XID_48
    (62, RESET),
    (64, RESET),
    (74, RESET),  # WORKFLOW_NVLINK_ERR
    (79, RESET),  # RESTART_BM
    (95, RESET),
    (119, RESET),
    (120, RESET),
    (140, RESET),
    (151, RESET),  # RESTART_VM
    (54, RESET),  # CHECK_MECHANICALS
    (78, UNHEALTHY),  # UPDATE_SWFW
    (61, UNHEALTHY),  # CONTACT_SUPPORT (unused on A100/H100)
    (144, UNHEALTHY),  # WORKFLOW_NVLINK5_ERR: needs a sub-code NVML does not give
    (168, UNHEALTHY),  # no bucket
    (999, UNHEALTHY),  # not in the catalog
]


@pytest.mark.parametrize(("number", "outcome"), DEFAULT_CASES)
def test_default_policy(number: int, outcome: XidOutcome) -> None:
    assert XidPolicy.from_flags(HealthFlags()).outcome(number) is outcome


@pytest.mark.parametrize("number", [13, 31, 43, 45, 68, 109, 94, 8, 154])
def test_without_nvidias_list_the_catalog_decides(number: int) -> None:
    policy = XidPolicy.from_flags(HealthFlags(ignored_xids=()))
    assert policy.outcome(number) is catalog_outcome(number)
    assert policy.outcome(109) is RESET, "NVIDIA's #1974: 109 needs a reset"


def test_an_error_without_an_xid_marks_the_device() -> None:
    assert XidPolicy().outcome(None) is UNHEALTHY


# -- the operator's overrides ------------------------------------------------------------------


def env_policy(**env: str) -> XidPolicy:
    return XidPolicy.from_flags(health_flags_from_env(env, HealthFlags()))


def test_dp_disable_tokens_override_the_catalog() -> None:
    policy = env_policy(DP_DISABLE_HEALTHCHECKS="79,48")
    assert policy.outcome(79) is IGNORE and policy.outcome(48) is IGNORE
    assert policy.outcome(95) is RESET


def test_dp_enable_tokens_override_the_catalog_keeping_a_reset_outcome() -> None:
    policy = env_policy(DP_ENABLE_HEALTHCHECKS="94,13,109")
    assert policy.outcome(94) is UNHEALTHY, "RESTART_APP, made critical"
    assert policy.outcome(13) is UNHEALTHY, "on the ignore list, made critical"
    assert policy.outcome(109) is RESET, "critical, and the catalog wants a reset"
    assert policy.outcome(31) is IGNORE


def test_dp_enable_all_makes_every_xid_critical() -> None:
    policy = env_policy(DP_ENABLE_HEALTHCHECKS="all")
    assert policy.outcome(13) is UNHEALTHY
    assert policy.outcome(94) is UNHEALTHY
    assert policy.outcome(154) is UNHEALTHY
    assert policy.outcome(79) is RESET


def test_per_xid_overrides_beat_the_catalog_and_the_ignore_list() -> None:
    overrides = {79: UNHEALTHY, 109: RESET, 48: IGNORE, 94: UNHEALTHY}
    policy = XidPolicy.from_flags(HealthFlags(), overrides)
    assert policy.outcome(79) is UNHEALTHY
    assert policy.outcome(109) is RESET, "beats NVIDIA's default ignore list"
    assert policy.outcome(48) is IGNORE
    assert policy.outcome(94) is UNHEALTHY


def test_critical_beats_an_ignoring_override() -> None:
    policy = XidPolicy.from_flags(HealthFlags(critical_xids=(48,)), {48: IGNORE})
    assert policy.outcome(48) is RESET


def test_xid_overrides_reads_config_style_values() -> None:
    assert xid_overrides({"79": "unhealthy", 94: "Ignore", 109: "unhealthy-until-reset"}) == {
        79: UNHEALTHY,
        94: IGNORE,
        109: RESET,
    }


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"xid79": "ignore"}, "Xid override 'xid79': the key must be an Xid number, like 48"),
        (
            {79: "reboot"},
            "Xid override 79: 'reboot' is not an outcome; "
            "use one of ignore, unhealthy, unhealthy-until-reset",
        ),
    ],
)
def test_xid_overrides_refuses_bad_input_in_one_line(
    values: dict[int | str, str], message: str
) -> None:
    with pytest.raises(ConfigError) as info:
        xid_overrides(values)
    assert str(info.value) == message


# -- unhealthy until reset ---------------------------------------------------------------------


def tracker(clock: Clock, **settings: object) -> HealthTracker:
    return HealthTracker(HealthFlags(recovery_seconds=60, **settings), clock)  # type: ignore[arg-type]


def test_a_reset_requiring_xid_is_not_healed_by_passing_probes() -> None:
    clock = Clock()
    t = tracker(clock)
    assert t.observe(xid(79))
    assert t.awaiting_reset(GPU)
    for _ in range(10):
        clock.now += 600
        assert not t.observe(probe(ok=True))
    assert t.health() == {GPU: Health.UNHEALTHY}
    clock.now += 5
    assert t.due_probes() == [GPU], "still probed, to see the reset"


def test_after_the_reset_the_usual_timer_heals_it() -> None:
    clock = Clock()
    t = tracker(clock)
    t.observe(xid(48))
    clock.now += 30
    # The reset: the GPU drops out of NVML (or NVML says the reset is pending) ...
    assert not t.observe(probe(ok=False))
    assert not t.awaiting_reset(GPU)
    assert t.reason(GPU) == "Xid 48 (double-bit ECC error)", "the fault keeps its cause"
    clock.now += 59
    assert not t.observe(probe(ok=True))
    clock.now += 1  # ... then answers, for recoverySeconds after its last failure
    assert t.observe(probe(ok=True))
    assert t.health() == {}


def test_a_later_recoverable_xid_does_not_end_the_wait_for_a_reset() -> None:
    clock = Clock()
    t = tracker(clock)
    t.observe(xid(95))
    t.observe(xid(999))
    clock.now += 10**5
    assert not t.observe(probe(ok=True))
    assert t.awaiting_reset(GPU)


def test_a_reset_requiring_xid_after_a_probe_failure_needs_its_own_reset() -> None:
    clock = Clock()
    t = tracker(clock)
    t.observe(probe(ok=False))
    t.observe(xid(119))
    clock.now += 10**5
    assert not t.observe(probe(ok=True))
    assert t.reason(GPU) == "Xid 119 (GSP RPC timeout)"


def test_a_recoverable_xid_heals_by_the_timer_alone() -> None:
    clock = Clock()
    t = tracker(clock)
    t.observe(xid(78))
    assert not t.awaiting_reset(GPU)
    clock.now += 60
    assert t.observe(probe(ok=True))


def test_healed_by_the_operator_clears_a_reset_requiring_fault() -> None:
    t = tracker(Clock())
    t.observe(xid(79))
    assert t.observe(HealthEvent(GPU, HealthEventKind.HEALED))
    assert not t.awaiting_reset(GPU)


def test_describe_xid_falls_back_to_the_catalog_description() -> None:
    assert describe_xid(8) == "Xid 8 (GPU stopped processing)"
    assert describe_xid(1) == "Xid 1", "'Unused' says nothing"
    assert describe_xid(79) == "Xid 79 (GPU has fallen off the bus)"
