"""NVIDIA's Xid catalog as data: what each Xid means and what it takes to recover from it.

Source: "Analyzing Xid Errors with the Xid Catalog",
https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html, the revision that lists
Xids 1 to 172 (its newest driver annotations are "CUDA 12.9; GPU driver R575"), read in
November 2026. Each row keeps the catalog's code, mnemonic, description, the "Applies to
A100" / "Applies to H100" columns and the "Resolution Bucket (Immediate Action)" column
verbatim ("" where the catalog leaves it blank; a few descriptions are shortened to fit).
The B100/GB200 columns, the investigatory bucket and the Xid 144-150 sub-code decode are
left out: NVML hands kubegpu the Xid number only, and the decode needs the message's
registers.

`BUCKET_OUTCOMES` is kubegpu's reading of each bucket for a device plugin, which only decides
whether new pods may land on a GPU:

- the application is at fault or nothing needs doing (`RESTART_APP`, `IGNORE`, `XID_154`
  "follow the other Xid", `WORKFLOW_XID_45` "not solo: follow the other Xid"): `ignore`;
- the GPU is unusable until it is reset or the machine restarted (`RESET_GPU`,
  `RESTART_BM`, `RESTART_VM`, `WORKFLOW_XID_48` "solo: RESET_GPU", `WORKFLOW_NVLINK_ERR`
  "a GPU reset or node reboot is needed to clear this error", `CHECK_MECHANICALS`, which no
  passing probe can fix): `unhealthy-until-reset`;
- everything else (`CONTACT_SUPPORT`, `UPDATE_SWFW`, `CHECK_UVM`, `WORKFLOW_NVLINK5_ERR`,
  whose action depends on a sub-code NVML does not give, a blank bucket, and any Xid the
  catalog does not list): `unhealthy`, healed once probes pass for `recoverySeconds`.

A table here rather than a file read at start-up: it is part of the program's behaviour,
reviewed and versioned with it, and a unit test checks every row against `BUCKET_OUTCOMES`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

SOURCE_URL = "https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html"
#: Which revision of the catalog the table transcribes (the page carries no version number).
SOURCE_REVISION = "Xids 1-172, newest annotation CUDA 12.9 / driver R575, read 2026-11"


class XidOutcome(StrEnum):
    """What an Xid does to the health of the device it names."""

    #: Nothing: an application error, or informational.
    IGNORE = "ignore"
    #: Unhealthy; healthy again once probes pass for `recoverySeconds`.
    UNHEALTHY = "unhealthy"
    #: Unhealthy; the recovery timer starts only after a reset is observed (see `health`).
    UNTIL_RESET = "unhealthy-until-reset"


@dataclass(frozen=True)
class XidEntry:
    """One row of the catalog."""

    xid: int
    mnemonic: str
    description: str
    a100: bool
    h100: bool
    #: "Resolution Bucket (Immediate Action)", as the catalog spells it.
    bucket: str

    @property
    def outcome(self) -> XidOutcome:
        return BUCKET_OUTCOMES.get(self.bucket, XidOutcome.UNHEALTHY)


BUCKET_OUTCOMES: Mapping[str, XidOutcome] = {
    "RESTART_APP": XidOutcome.IGNORE,
    "IGNORE": XidOutcome.IGNORE,
    "XID_154": XidOutcome.IGNORE,
    "WORKFLOW_XID_45": XidOutcome.IGNORE,
    "RESET_GPU": XidOutcome.UNTIL_RESET,
    "RESTART_BM": XidOutcome.UNTIL_RESET,
    "RESTART_VM": XidOutcome.UNTIL_RESET,
    "WORKFLOW_XID_48": XidOutcome.UNTIL_RESET,
    "WORKFLOW_NVLINK_ERR": XidOutcome.UNTIL_RESET,
    "CHECK_MECHANICALS": XidOutcome.UNTIL_RESET,
    "CONTACT_SUPPORT": XidOutcome.UNHEALTHY,
    "UPDATE_SWFW": XidOutcome.UNHEALTHY,
    "CHECK_UVM": XidOutcome.UNHEALTHY,
    "WORKFLOW_NVLINK5_ERR": XidOutcome.UNHEALTHY,
    "": XidOutcome.UNHEALTHY,
}

# code|mnemonic|A100|H100|immediate-action bucket|description
# A run of unused codes sharing a bucket is written once as "first-last".
_TABLE = """
1-7|ROBUST_CHANNEL_FIFO_ERROR_*|N|N|CONTACT_SUPPORT|Unused
8|ROBUST_CHANNEL_FIFO_ERROR_IDLE_TIMEOUT|Y|Y|RESTART_APP|GPU stopped processing
9-10|ROBUST_CHANNEL_GR_ERROR_*|N|N|CONTACT_SUPPORT|Unused
11|ROBUST_CHANNEL_GR_ERROR_MISSING_HW|Y|Y|RESTART_APP|Invalid or corrupted push buffer stream
12|ROBUST_CHANNEL_GR_ERROR_SW_METHOD|N|N|CONTACT_SUPPORT|Unused
13|ROBUST_CHANNEL_GR_EXCEPTION|Y|Y|RESTART_APP|Graphics Engine Exception
14|ROBUST_CHANNEL_FAKE_ERROR|Y|Y|IGNORE|Unused
15-24|ROBUST_CHANNEL_*|N|N|CONTACT_SUPPORT|Unused
25|ROBUST_CHANNEL_GR_ILLEGAL_NOTIFY|Y|Y|RESTART_APP|Invalid or illegal push buffer stream
26-30|ROBUST_CHANNEL_*|N|N|CONTACT_SUPPORT|Unused
31|ROBUST_CHANNEL_FIFO_ERROR_MMU_ERR_FLT|Y|Y|RESTART_APP|GPU memory page fault
32|ROBUST_CHANNEL_PBDMA_ERROR|Y|Y|RESTART_APP|Invalid or corrupted push buffer stream
33-36|ROBUST_CHANNEL_*|N|N|CONTACT_SUPPORT|Unused
37|ROBUST_CHANNEL_FECS_ERR_UNIMP_FIRMWARE_METHOD|Y|Y|IGNORE|Driver firmware error
38|ROBUST_CHANNEL_FECS_ERR_WATCHDOG_TIMEOUT|Y|Y|IGNORE|Driver firmware error
39|ROBUST_CHANNEL_CE0_ERROR|Y|Y|RESTART_APP|Copy Engine Exception
40|ROBUST_CHANNEL_CE1_ERROR|Y|Y|RESTART_APP|Copy Engine Exception
41|ROBUST_CHANNEL_CE2_ERROR|Y|Y|RESTART_APP|Copy Engine Exception
42|ROBUST_CHANNEL_VIC_ERROR|N|N|CONTACT_SUPPORT|Unused
43|ROBUST_CHANNEL_RESETCHANNEL_VERIF_ERROR|Y|Y|IGNORE|GPU stopped processing
44|ROBUST_CHANNEL_GR_FAULT_DURING_CTXSW|Y|Y|IGNORE|Graphics Engine fault during context switch
45|ROBUST_CHANNEL_PREEMPTIVE_REMOVAL|Y|Y|WORKFLOW_XID_45|Preemptive cleanup, due to previous errors
46|ROBUST_CHANNEL_GPU_TIMEOUT_ERROR|Y|Y|RESET_GPU|GPU stopped processing
47|ROBUST_CHANNEL_NVENC0_ERROR|N|N|CONTACT_SUPPORT|Unused
48|ROBUST_CHANNEL_GPU_ECC_DBE|Y|Y|WORKFLOW_XID_48|Double Bit ECC Error
49-53|SILENT_RUNNING_*|N|N|CONTACT_SUPPORT|Unused
54|SILENT_RUNNING_PWR_REDUCED_CLOCKING|Y|Y|CHECK_MECHANICALS|Auxiliary power is not connected
55-59|SILENT_RUNNING_TEMPERATURE_READ_ERROR..PMU_ERROR|N|N|CONTACT_SUPPORT|Unused
60|ROBUST_CHANNEL_SEC2_ERROR|Y|Y|RESTART_APP|Video processor exception
61|PMU_BREAKPOINT|N|N|CONTACT_SUPPORT|Unused
62|PMU_HALT_ERROR|Y|Y|RESET_GPU|Internal micro-controller halt
63|INFOROM_DRAM_RETIREMENT_EVENT|Y|Y|IGNORE|GPU memory remapping event
64|INFOROM_DRAM_RETIREMENT_FAILURE|Y|Y|RESET_GPU|GPU memory remapping failure
65|ROBUST_CHANNEL_NVENC1_ERROR|N|N|CONTACT_SUPPORT|Unused
66|ROBUST_CHANNEL_FECS_ERR_REG_ACCESS_VIOLATION|Y|Y|IGNORE|Illegal access by driver
67|ROBUST_CHANNEL_FECS_ERR_VERIF_VIOLATION|Y|Y|IGNORE|Illegal access by driver
68|ROBUST_CHANNEL_NVDEC0_ERROR|Y|Y|RESTART_APP|NVDEC0 Exception
69|ROBUST_CHANNEL_GR_CLASS_ERROR|Y|Y|RESTART_APP|Graphics Engine class error
70|ROBUST_CHANNEL_CE3_ERROR|Y|Y|RESTART_APP|CE3: Unknown Error
71|ROBUST_CHANNEL_CE4_ERROR|Y|Y|RESTART_APP|CE4: Unknown Error
72|ROBUST_CHANNEL_CE5_ERROR|Y|Y|RESTART_APP|CE5: Unknown Error
73|ROBUST_CHANNEL_NVENC2_ERROR|N|N|CONTACT_SUPPORT|Unused
74|NVLINK_ERROR|Y|Y|WORKFLOW_NVLINK_ERR|NVLINK Error
75|ROBUST_CHANNEL_CE6_ERROR|Y|Y|RESTART_APP|CE6: Unknown Error
76|ROBUST_CHANNEL_CE7_ERROR|Y|Y|RESTART_APP|CE7: Unknown Error
77|ROBUST_CHANNEL_CE8_ERROR|Y|Y|RESTART_APP|CE8: Unknown Error
78|VGPU_START_ERROR|Y|Y|UPDATE_SWFW|vGPU Start Error
79|ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS|Y|Y|RESTART_BM|GPU has fallen off the bus
80|PBDMA_PUSHBUFFER_CRC_MISMATCH|Y|Y|RESTART_APP|Corrupted data sent to GPU
81|ROBUST_CHANNEL_VGA_SUBSYSTEM_ERROR|N|N|CONTACT_SUPPORT|Unused
82|ROBUST_CHANNEL_NVJPG0_ERROR|Y|Y|RESTART_APP|NVJPG0 Error
83|ROBUST_CHANNEL_NVDEC1_ERROR|Y|Y|RESTART_APP|NVDEC1 Error
84|ROBUST_CHANNEL_NVDEC2_ERROR|Y|Y|RESTART_APP|NVDEC2 Error
85|ROBUST_CHANNEL_CE9_ERROR|Y|Y|RESTART_APP|CE9: Unknown Error
86|ROBUST_CHANNEL_OFA0_ERROR|Y|Y|RESTART_APP|OFA Exception
87|NVTELEMETRY_DRIVER_REPORT|N|N|CONTACT_SUPPORT|Unused
88|ROBUST_CHANNEL_NVDEC3_ERROR|Y|Y|RESTART_APP|NVDEC3 Error
89|ROBUST_CHANNEL_NVDEC4_ERROR|Y|Y|RESTART_APP|NVDEC4 Error
90|LTC_ERROR|N|N|CONTACT_SUPPORT|Unused
91|RESERVED_XID|N|N|CONTACT_SUPPORT|Unused
92|EXCESSIVE_SBE_INTERRUPTS|Y|Y|IGNORE|High single-bit ECC error rate
93|INFOROM_ERASE_LIMIT_EXCEEDED|Y|N|IGNORE|Non-fatal violation of provisioned InfoROM wear limit
94|ROBUST_CHANNEL_CONTAINED_ERROR|Y|Y|RESTART_APP|Contained memory error
95|ROBUST_CHANNEL_UNCONTAINED_ERROR|Y|Y|RESET_GPU|Uncontained memory error
96|ROBUST_CHANNEL_NVDEC5_ERROR|N|Y|RESTART_APP|NVDEC5 Error
97|ROBUST_CHANNEL_NVDEC6_ERROR|N|Y|RESTART_APP|NVDEC6 Error
98|ROBUST_CHANNEL_NVDEC7_ERROR|N|Y|RESTART_APP|NVDEC7 Error
99|ROBUST_CHANNEL_NVJPG1_ERROR|N|Y|RESTART_APP|NVJPG1 Error
100|ROBUST_CHANNEL_NVJPG2_ERROR|N|Y|RESTART_APP|NVJPG2 Error
101|ROBUST_CHANNEL_NVJPG3_ERROR|N|Y|RESTART_APP|NVJPG3 Error
102|ROBUST_CHANNEL_NVJPG4_ERROR|N|Y|RESTART_APP|NVJPG4 Error
103|ROBUST_CHANNEL_NVJPG5_ERROR|N|Y|RESTART_APP|NVJPG5 Error
104|ROBUST_CHANNEL_NVJPG6_ERROR|N|Y|RESTART_APP|NVJPG6 Error
105|ROBUST_CHANNEL_NVJPG7_ERROR|N|Y|RESTART_APP|NVJPG7 Error
106|SMBPBI_TEST_MESSAGE|Y|Y|IGNORE|SMBPBI Test Message
107|SMBPBI_TEST_MESSAGE_SILENT|Y|Y|IGNORE|SMBPBI Test Message Silent
108|NVLINK_REMOTE_TRANSLATION_ERROR|Y|Y|IGNORE|Unused
109|ROBUST_CHANNEL_CTXSW_TIMEOUT_ERROR|Y|Y|RESET_GPU|Context Switch Timeout Error
110|SEC_FAULT_ERROR|N|Y|RESET_GPU|Security Fault Error
111-118|BUNDLE_ERROR_EVENT..HEAD_REGS|N|N|CONTACT_SUPPORT|Unused
119|GSP_RPC_TIMEOUT|Y|Y|RESET_GPU|GSP RPC Timeout
120|GSP_ERROR|Y|Y|RESET_GPU|GSP Error
121|C2C_ERROR|N|N|IGNORE|C2C Error
122-125|SPI_PMU_RPC_*..INFOROM_FS_ERROR|N|N|CONTACT_SUPPORT|Unused
126-135|ROBUST_CHANNEL_CE10_ERROR..CE19_ERROR|N|N|RESTART_APP|Copy Engine: Unknown Error
136|ALI_TRAINING_FAIL|N|Y|RESET_GPU|Link Training Failed
137|NVLINK_PRIV_ERR|Y|Y|IGNORE|NVLink Privilege Error
138|ROBUST_CHANNEL_DLA_ERROR|N|N|CONTACT_SUPPORT|Unused
139|ROBUST_CHANNEL_OFA1_ERROR|N|N|RESTART_APP|OFA1 Error
140|UNRECOVERABLE_ECC_ERROR_ESCAPE|Y|Y|RESET_GPU|ECC Unrecovered Error
141|ROBUST_CHANNEL_FAST_PATH_ERROR|N|Y|IGNORE|CUDA Fast Path Error
142|ROBUST_CHANNEL_NVENC3_ERROR|N|N|CONTACT_SUPPORT|NVENC3 Error
143|GPU_INIT_ERROR|N|Y|RESET_GPU|GPU Initialization Error
144-150|NVLINK_SAW_ERROR..NVLINK_MSE_ERROR|N|N|WORKFLOW_NVLINK5_ERR|NVLINK Error
151|ROBUST_CHANNEL_KEY_ROTATION_ERROR|N|Y|RESTART_VM|Key rotation Error
152|ROBUST_CHANNEL_DLA_SMMU_ERROR|N|N|IGNORE|DLA SMMU Error
153|ROBUST_CHANNEL_DLA_TIMEOUT|N|N|IGNORE|DLA timeout Error
154|GPU_RECOVERY_ACTION_CHANGED|Y|Y|XID_154|GPU Recovery Action Changed
155|NVLINK_SW_DEFINED_ERROR|N|N|RESET_GPU|NVLINK: SW Defined Error
156|RESOURCE_RETIREMENT_EVENT|N|Y|RESET_GPU|Resource Retirement Event
157|RESOURCE_RETIREMENT_FAILURE|N|Y|IGNORE|Resource Retirement Failure
158|GPU_FATAL_TIMEOUT|Y|Y|RESET_GPU|GPU Fatal Timeout
159|ROBUST_CHANNEL_CHI_NON_DATA_ERROR|N|N|CHECK_UVM|CHI Non-Data Error
160|CHANNEL_RETIREMENT_EVENT|N|N|IGNORE|Channel Retirement Event
161|CHANNEL_RETIREMENT_FAILURE|N|N|IGNORE|Channel Retirement Failure
162|PSHC_REENGAGED|N|N||Power Smoothing HW Circuitry capability reengaged
163|PSHC_DISENGAGED|N|N||Power Smoothing HW Circuitry capability disengaged
164|PSHC_LOW_LIFETIME|N|N||Power Smoothing HW Circuitry low lifetime reached
165|PSHC_ZERO_LIFETIME|N|N||Power Smoothing HW Circuitry lifetime exhausted
166|NVLINK_SECURE_CRYPTO_ERR|N|N||CC traffic seen before the link was set up for encryption
167|PCIE_FATAL_TIMEOUT|N|Y||PCIE_FATAL_TIMEOUT
168|REDUCED_GPU_MEMORY_CAPACITY|Y|Y||Errors found in WPR (write protected region)
169|SEC2_HALT_ERROR|N|Y||Internal micro-controller halt
170|NVLINK_SECURE_OTHER|N|N||Interrupt seen in CC mode
171|UNCORRECTABLE_DRAM_ERROR|Y|Y||Details of an Xid 48 (DRAM)
172|UNCORRECTABLE_SRAM_ERROR|Y|Y||Details of an Xid 48 (SRAM)
"""


def _parse(table: str) -> dict[int, XidEntry]:
    entries: dict[int, XidEntry] = {}
    for line in table.strip().splitlines():
        code, mnemonic, a100, h100, bucket, description = (c.strip() for c in line.split("|"))
        first, _, last = code.partition("-")
        for xid in range(int(first), int(last or first) + 1):
            entries[xid] = XidEntry(xid, mnemonic, description, a100 == "Y", h100 == "Y", bucket)
    return entries


#: Xid -> its catalog row.
CATALOG: Mapping[int, XidEntry] = _parse(_TABLE)


def catalog_outcome(xid: int) -> XidOutcome:
    """The catalog's outcome for `xid`; an Xid it does not list marks the GPU `unhealthy`."""
    entry = CATALOG.get(xid)
    return XidOutcome.UNHEALTHY if entry is None else entry.outcome


__all__ = [
    "BUCKET_OUTCOMES",
    "CATALOG",
    "SOURCE_REVISION",
    "SOURCE_URL",
    "XidEntry",
    "XidOutcome",
    "catalog_outcome",
]
