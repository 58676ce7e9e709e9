"""Configuration: the versioned schema, loading, and flag/env precedence.

Precedence, highest first: command-line flag, environment variable, config file, default.
`resolve` applies flag and env overrides (given as dotted key paths of the schema, e.g.
`flags.plugin.deviceIDStrategy`) on top of a file's config and validates the result.
"""

from kubegpu.config.loader import load_file, parse_config, resolve
from kubegpu.config.v1 import (
    VERSION,
    AllocationPolicy,
    Config,
    DeviceIDStrategy,
    DeviceListStrategy,
    Flags,
    HealthFlags,
    MigStrategy,
    PluginFlags,
    ReplicatedResource,
    ResourcePattern,
    Resources,
    Sharing,
    SharingStrategy,
)

__all__ = [
    "VERSION",
    "AllocationPolicy",
    "Config",
    "DeviceIDStrategy",
    "DeviceListStrategy",
    "Flags",
    "HealthFlags",
    "MigStrategy",
    "PluginFlags",
    "ReplicatedResource",
    "ResourcePattern",
    "Resources",
    "Sharing",
    "SharingStrategy",
    "load_file",
    "parse_config",
    "resolve",
]
