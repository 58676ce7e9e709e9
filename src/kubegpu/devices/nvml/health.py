"""NVIDIA GPU health through NVML: probes, the Xid/ECC event set and the MIG layout check.

`watch` runs in the health thread: it registers every GPU that reports Xid or ECC events in
one event set, waits on it, maps events to the GPU or MIG slice they concern (an event
without a device concerns every GPU, as NVIDIA's plugin treats it; a double-bit ECC error
reads as Xid 48), and every `layout_check_seconds` compares the MIG layout with the last
one to report a reconfigured GPU. Failures become `PROBE_FAILED` events, never exceptions.

Failing safe when NVML breaks: a failed event wait or event set reports every GPU ever seen
(not only those registered, so a watch that never started still fences the node); a GPU
that drops out of the layout check (lost, off the bus) is reported before the rediscovery;
and when NVML says it is gone (driver unloaded, reloaded or upgraded under the process) the
session initialises it again, so probes, events and discovery recover when the driver is
back. A probe passes only when NVML answers and reports no reset pending for the GPU.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from kubegpu.devices.model import HealthEvent, HealthEventKind, StopFlag
from kubegpu.devices.nvml.session import Session
from kubegpu.watch.backoff import Backoff

log = logging.getLogger("kubegpu.devices.nvml")

#: Xid the driver logs for an uncorrectable (double-bit) ECC error.
XID_DOUBLE_BIT_ECC = 48
#: gpuInstanceId/computeInstanceId of an event that concerns a whole GPU.
NO_ID = 0xFFFFFFFF
#: First and longest wait between attempts to (re)create the event set.
FIRST_BACKOFF_S = 1.0
MAX_BACKOFF_S = 30.0


def probe(s: Session, uuid: str) -> str | None:
    """A cheap NVML round trip (the handle by UUID, its memory info), then pending resets.

    When NVML itself is gone it is initialised again and the probe retried once.
    """
    generation = s.generation
    try:
        return _probe_once(s, uuid)
    except s.error as err:
        if not (s.is_gone(err) and s.reinit(generation)):
            return f"{uuid}: {err}"
    try:
        return _probe_once(s, uuid)
    except s.error as err:
        return f"{uuid}: {err}"


def _probe_once(s: Session, uuid: str) -> str | None:
    nvml = s.nvml
    handle = nvml.nvmlDeviceGetHandleByUUID(uuid)
    nvml.nvmlDeviceGetMemoryInfo(handle)
    if uuid.startswith("MIG-"):
        # Pending resets are a property of the physical GPU.
        handle = s.optional(nvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle, handle, default=None)
        if handle is None:
            return None
    pending = reset_pending(s, handle)
    return None if pending is None else f"{uuid}: {pending}"


#: nvmlGpuRecoveryAction_t values other than NONE, as NVML's documentation words them.
RECOVERY_ACTIONS = {1: "a GPU reset", 2: "a node reboot", 3: "a P2P drain", 4: "drain and reset"}


def reset_pending(s: Session, handle: Any) -> str | None:
    """What NVML says must still happen to the GPU before it is fit for work, or None.

    Three readings, each skipped where the GPU or driver does not support it: the GPU
    recovery action (recent drivers: the value behind Xid 154), rows waiting for a reset
    to be remapped (Ampere and later) and pages waiting to be retired (earlier GPUs). Any
    other error is raised: a GPU that cannot answer is not fit either.
    """
    nvml = s.nvml
    unsupported = {
        nvml.NVML_ERROR_NOT_SUPPORTED,
        nvml.NVML_ERROR_FUNCTION_NOT_FOUND,
        nvml.NVML_ERROR_INVALID_ARGUMENT,
    }

    def read(name: str, *args: Any) -> Any:
        fn = getattr(nvml, name, None)  # older bindings lack the newer readings
        if fn is None:
            return None
        try:
            return fn(*args)
        except s.error as err:
            if err.value in unsupported:
                return None
            raise

    field = getattr(nvml, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", None)
    values = None if field is None else read("nvmlDeviceGetFieldValues", handle, [field])
    if values is not None and int(values[0].nvmlReturn) == nvml.NVML_SUCCESS:
        action = int(values[0].value.uiVal)
        if action != 0:  # NVML_GPU_RECOVERY_ACTION_NONE
            what = RECOVERY_ACTIONS.get(action, f"recovery action {action}")
            return f"NVML reports {what} pending"
    rows = read("nvmlDeviceGetRemappedRows", handle)
    if rows is not None and rows[2]:
        return "row remapping is waiting for a GPU reset"
    pages = read("nvmlDeviceGetRetiredPagesPendingStatus", handle)
    if pages is not None and int(pages) == nvml.NVML_FEATURE_ENABLED:
        return "page retirement is waiting for a GPU reset"
    return None


def watch(
    s: Session,
    stop: StopFlag,
    emit: Callable[[HealthEvent], None],
    *,
    wait_timeout_ms: int,
    layout_check_seconds: float,
    clock: Callable[[], float],
) -> None:
    """Forward Xid/ECC events until `stop` is set; report failures as events, never raise."""
    nvml = s.nvml
    event_set: Any = None
    watched: dict[str, Any] = {}
    backoff = Backoff(FIRST_BACKOFF_S, MAX_BACKOFF_S)
    layout = mig_layout(s)
    next_layout_check = clock() + layout_check_seconds
    try:
        while not stop.is_set():
            if event_set is None:
                event_set, watched = register_events(s, emit, watched)
                if event_set is None:
                    backoff.block(stop)
                    continue
            generation = s.generation
            try:
                data = nvml.nvmlEventSetWait_v2(event_set, wait_timeout_ms)
            except s.error as err:
                if err.value != nvml.NVML_ERROR_TIMEOUT:
                    log.warning(
                        "waiting for NVML events failed (%s); retrying in %.0fs",
                        err,
                        backoff.delay,
                    )
                    # Free first: a fresh set is registered after the back-off.
                    free_event_set(s, event_set)
                    event_set = None
                    report_all(s, watched, emit, f"event wait: {err}")
                    if s.is_gone(err):
                        s.reinit(generation)
                    backoff.block(stop)
            else:
                backoff.reset()
                dispatch(s, data, watched, emit)
            if clock() >= next_layout_check:
                next_layout_check = clock() + layout_check_seconds
                layout = check_layout(s, layout, emit)
    finally:
        if event_set is not None:
            free_event_set(s, event_set)


def report_all(
    s: Session, watched: dict[str, Any], emit: Callable[[HealthEvent], None], detail: str
) -> None:
    """Every GPU known, registered or not, fails: NVML as a whole is not answering."""
    for uuid in sorted(set(watched) | s.gpu_uuids):
        emit(HealthEvent(uuid, HealthEventKind.PROBE_FAILED, detail=detail))


def free_event_set(s: Session, event_set: Any) -> None:
    try:
        s.nvml.nvmlEventSetFree(event_set)
    except s.error as err:
        log.debug("nvmlEventSetFree failed: %s", err)


def register_events(
    s: Session, emit: Callable[[HealthEvent], None], previous: dict[str, Any]
) -> tuple[Any, dict[str, Any]]:
    """A new event set with every GPU that supports Xid/ECC events registered."""
    nvml = s.nvml
    wanted = (
        nvml.nvmlEventTypeXidCriticalError
        | nvml.nvmlEventTypeDoubleBitEccError
        | nvml.nvmlEventTypeSingleBitEccError
    )
    generation = s.generation
    try:
        event_set = nvml.nvmlEventSetCreate()
        count = int(nvml.nvmlDeviceGetCount())
    except s.error as err:
        log.warning("cannot create an NVML event set (%s)", err)
        report_all(s, previous, emit, f"event set: {err}")
        if s.is_gone(err):
            s.reinit(generation)
        return None, previous
    watched: dict[str, Any] = {}
    for index in range(count):
        found = s.handle_and_uuid(index)
        if found is None:
            continue
        handle, uuid = found
        watched[uuid] = handle
        try:
            mask = wanted & int(nvml.nvmlDeviceGetSupportedEventTypes(handle))
            if not mask:
                raise nvml.NVMLError(nvml.NVML_ERROR_NOT_SUPPORTED)
            nvml.nvmlDeviceRegisterEvents(handle, mask, event_set)
        except s.error as err:
            if err.value == nvml.NVML_ERROR_NOT_SUPPORTED:
                log.info("GPU %s does not report Xid events; relying on probes", uuid)
            else:
                log.warning("GPU %s: cannot register for health events (%s)", uuid, err)
                emit(
                    HealthEvent(
                        uuid, HealthEventKind.PROBE_FAILED, detail=f"register events: {err}"
                    )
                )
    return event_set, watched


def dispatch(
    s: Session, data: Any, watched: dict[str, Any], emit: Callable[[HealthEvent], None]
) -> None:
    nvml = s.nvml
    event_type = int(data.eventType)
    if event_type & nvml.nvmlEventTypeXidCriticalError:
        xid = int(data.eventData)
    elif event_type & nvml.nvmlEventTypeDoubleBitEccError:
        xid = XID_DOUBLE_BIT_ECC
    else:
        # Single-bit ECC errors are corrected by the hardware: not a health problem.
        log.debug("ignoring NVML event type %#x", event_type)
        return
    uuid = None
    if data.device:
        uuid = s.optional(nvml.nvmlDeviceGetUUID, data.device, default=None)
    if uuid is None:
        # An event without a device concerns them all, as NVIDIA's plugin treats it.
        for gpu_uuid in watched:
            emit(
                HealthEvent(gpu_uuid, HealthEventKind.XID, xid=xid, detail="event without a device")
            )
        return
    gi_id, ci_id = int(data.gpuInstanceId), int(data.computeInstanceId)
    if gi_id != NO_ID and ci_id != NO_ID:
        key = (str(uuid), gi_id, ci_id)
        if key not in s.mig_uuids and uuid in watched:
            scan_migs(s, watched[uuid], str(uuid))
        uuid = s.mig_uuids.get(key, uuid)
    emit(HealthEvent(str(uuid), HealthEventKind.XID, xid=xid))


def scan_migs(s: Session, handle: Any, gpu_uuid: str) -> frozenset[str]:
    """The MIG UUIDs of one GPU (raises NVMLError), refreshing the (gi, ci) map."""
    nvml = s.nvml
    try:
        mode = nvml.nvmlDeviceGetMigMode(handle)
    except s.error as err:
        if err.value == nvml.NVML_ERROR_NOT_SUPPORTED:
            return frozenset()
        raise
    if mode[0] != nvml.NVML_DEVICE_MIG_ENABLE:
        return frozenset()
    uuids = set()
    for _, mig_handle in s.iter_mig_handles(handle, gpu_uuid):
        uuid = str(nvml.nvmlDeviceGetUUID(mig_handle))
        gi_id = int(nvml.nvmlDeviceGetGpuInstanceId(mig_handle))
        ci_id = int(nvml.nvmlDeviceGetComputeInstanceId(mig_handle))
        s.mig_uuids[(gpu_uuid, gi_id, ci_id)] = uuid
        uuids.add(uuid)
    return frozenset(uuids)


def mig_layout(s: Session) -> dict[str, frozenset[str] | None]:
    """GPU UUID -> its MIG UUIDs (None when unreadable this time)."""
    generation = s.generation
    try:
        count = int(s.nvml.nvmlDeviceGetCount())
    except s.error as err:
        if s.is_gone(err):
            s.reinit(generation)
        return {}
    layout: dict[str, frozenset[str] | None] = {}
    for index in range(count):
        found = s.handle_and_uuid(index)
        if found is None:
            continue
        handle, uuid = found
        try:
            layout[uuid] = scan_migs(s, handle, uuid)
        except s.error as err:
            log.debug("GPU %s: MIG layout unreadable (%s)", uuid, err)
            layout[uuid] = None
    return layout


def check_layout(
    s: Session, old: dict[str, frozenset[str] | None], emit: Callable[[HealthEvent], None]
) -> dict[str, frozenset[str] | None]:
    new = mig_layout(s)
    absent = object()
    for uuid in sorted(old.keys() | new.keys()):
        if uuid in new and new[uuid] is None:
            # Unreadable now: not evidence of a change; keep the last known layout.
            if uuid in old:
                new[uuid] = old[uuid]
            continue
        if uuid in new and uuid in old and old[uuid] is None:
            continue
        if old.get(uuid, absent) != new.get(uuid, absent):
            if uuid not in new:
                # Gone from NVML's list (lost, off the bus, or NVML itself down): fence it
                # now, whatever the rediscovery below makes of it.
                log.warning("GPU %s no longer answers NVML", uuid)
                emit(
                    HealthEvent(
                        uuid, HealthEventKind.PROBE_FAILED, detail="GPU no longer answers NVML"
                    )
                )
            log.info("GPU %s: MIG layout or GPU set changed", uuid)
            emit(HealthEvent(uuid, HealthEventKind.RECONFIGURED))
    return new
