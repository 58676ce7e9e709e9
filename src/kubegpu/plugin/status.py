"""The one boundary between kubegpu's errors and the kubelet: exception -> gRPC status.

Every RPC of the device plugin (the five of `v1beta1.DevicePlugin`) answers a failure
through `status_for`, so the kubelet sees a code that says what went wrong and one
escaped line of at most `MAX_DETAILS` characters, never UNKNOWN or a traceback:

    AllocationError     INVALID_ARGUMENT      the request names unknown or duplicate IDs
    PreconditionError   FAILED_PRECONDITION   valid, but the node cannot serve it now
    ConfigError         FAILED_PRECONDITION   the config in force cannot serve it
    DeviceError         UNAVAILABLE           the GPU backend failed; a retry may work
    anything else       INTERNAL              a bug: logged with its traceback
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import grpc

from kubegpu.allocation import escape
from kubegpu.errors import (
    AllocationError,
    ConfigError,
    DeviceError,
    KubegpuError,
    PreconditionError,
)

log = logging.getLogger("kubegpu.plugin")

#: Status details longer than this are cut: gRPC refuses metadata over 16 KiB, and the
#: kubelet would then see RESOURCE_EXHAUSTED instead of our reason.
MAX_DETAILS = 1024

#: kubegpu error -> the code the kubelet gets; the first class in the MRO found wins.
STATUS_CODES: Mapping[type[KubegpuError], grpc.StatusCode] = {
    AllocationError: grpc.StatusCode.INVALID_ARGUMENT,
    PreconditionError: grpc.StatusCode.FAILED_PRECONDITION,
    ConfigError: grpc.StatusCode.FAILED_PRECONDITION,
    DeviceError: grpc.StatusCode.UNAVAILABLE,
}


def bounded(text: str, limit: int = MAX_DETAILS) -> str:
    """One line of at most about `limit` characters, fit for a gRPC status and a log."""
    return escape(text, limit)


def status_for(exc: Exception, rpc: str) -> tuple[grpc.StatusCode, str]:
    """The status code and one-line details for `exc` raised while answering `rpc`.

    A kubegpu error is the caller's or the node's problem and is logged as a warning; any
    other exception is a bug in kubegpu, logged with its traceback and answered INTERNAL.
    """
    for cls in type(exc).__mro__:
        code = STATUS_CODES.get(cls)
        if code is not None:
            message = bounded(str(exc))
            log.warning("%s refused: %s", rpc, message)
            return code, message
    message = bounded(f"internal error in kubegpu: {type(exc).__name__}: {exc}")
    if isinstance(exc, KubegpuError):
        log.error("%s failed: %s", rpc, message)
    else:
        log.exception("%s failed: %s", rpc, message, exc_info=exc)
    return grpc.StatusCode.INTERNAL, message


__all__ = ["MAX_DETAILS", "STATUS_CODES", "bounded", "status_for"]
