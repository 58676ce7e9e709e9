"""The device plugin's side of the error boundary (`kubegpu.rpc`): its logger.

Every RPC of the device plugin (the five of `v1beta1.DevicePlugin`) answers a failure
through `status_for`; the mapping itself, shared with the DRA kubelet plugin, is
`kubegpu.rpc.status_for`.
"""

from __future__ import annotations

import logging

import grpc

from kubegpu import rpc
from kubegpu.rpc import MAX_DETAILS, STATUS_CODES, bounded

log = logging.getLogger("kubegpu.plugin")


def status_for(exc: Exception, rpc_name: str) -> tuple[grpc.StatusCode, str]:
    """`kubegpu.rpc.status_for`, logged as the device plugin's."""
    return rpc.status_for(exc, rpc_name, log)


__all__ = ["MAX_DETAILS", "STATUS_CODES", "bounded", "status_for"]
