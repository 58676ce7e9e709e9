"""Configuration: the versioned schema, loading, and flag/env precedence.

Precedence, highest first: command-line flag, environment variable, config file, default.
`load_config` (and `kubegpu.config.source.ConfigSource`, which also reloads) merges flag and
env overrides, given as dotted key paths of the file (e.g. `flags.plugin.deviceIDStrategy`),
into the file's keys and validates the result once, so every error names a key, its value
and a fix.

This package's names are pure values and functions. The live source (file watches, the
node's label through the Kubernetes API) is `kubegpu.config.source`, imported by the
commands that follow a config, so the rest load neither asyncio nor the Kubernetes client.
"""

from kubegpu.config.loader import (
    apply_overrides,
    build_config,
    config_to_json,
    config_to_raw,
    load_config,
    parse_config,
)
from kubegpu.config.names import parse_quantity, qualify_resource_name
from kubegpu.config.settings import driver_files_root, effective_config, flag_overrides
from kubegpu.config.v1 import (
    MPS_MAX_REPLICAS,
    SUPPORTED_VERSIONS,
    VERSION,
    AllocationPolicy,
    AmdNamingStrategy,
    ClaimSizing,
    Config,
    DeviceIDStrategy,
    DeviceListStrategy,
    Flags,
    GfdFlags,
    HealthFlags,
    Imex,
    MigStrategy,
    PluginFlags,
    ReplicatedResource,
    ResourcePattern,
    Resources,
    Sharing,
    SharingStrategy,
)

__all__ = [
    "MPS_MAX_REPLICAS",
    "SUPPORTED_VERSIONS",
    "VERSION",
    "AllocationPolicy",
    "AmdNamingStrategy",
    "ClaimSizing",
    "Config",
    "DeviceIDStrategy",
    "DeviceListStrategy",
    "Flags",
    "GfdFlags",
    "HealthFlags",
    "Imex",
    "MigStrategy",
    "PluginFlags",
    "ReplicatedResource",
    "ResourcePattern",
    "Resources",
    "Sharing",
    "SharingStrategy",
    "apply_overrides",
    "build_config",
    "config_to_json",
    "config_to_raw",
    "driver_files_root",
    "effective_config",
    "flag_overrides",
    "load_config",
    "parse_config",
    "parse_quantity",
    "qualify_resource_name",
]
