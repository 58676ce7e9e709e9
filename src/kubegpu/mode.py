"""Which kubelet API `serve` answers: one front per mode over the same core."""

from __future__ import annotations

from enum import StrEnum


class Mode(StrEnum):
    """`serve --mode` (`KUBEGPU_MODE`)."""

    #: The device plugin API (`v1beta1`): one socket per resource name, the default.
    PLUGIN = "plugin"
    #: Dynamic Resource Allocation: a DRA kubelet plugin publishing ResourceSlices.
    DRA = "dra"


__all__ = ["Mode"]
