"""One merge of command-line settings into the config, for every command.

Precedence, highest first: flag, env var, config file, default. The CLI resolves flag
against env var (click, `kubegpu.cli.options`); what it hands here is each setting's
value (None when neither was given) and the dotted config key it overrides, so that an
unset flag leaves the file's value and a set one beats it, in `serve`, `labels` and
`check` alike.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kubegpu.config.loader import load_config
from kubegpu.config.v1 import Config


def flag_overrides(values: Mapping[str, Any], keys: Mapping[str, str]) -> dict[str, Any]:
    """The values that were set, by dotted config key (`flags.migStrategy`)."""
    return {
        keys[name]: value for name, value in values.items() if name in keys and value is not None
    }


def effective_config(
    config_file: str | Path | None, values: Mapping[str, Any], keys: Mapping[str, str]
) -> Config:
    """The config file (if any) with the set flag/env values on top, validated once."""
    return load_config(config_file, flag_overrides(values, keys))


def driver_files_root(host: str, container: str) -> str:
    """Where this process reads the driver's files (the NVML library) from.

    `host` (`--nvidia-driver-root`) is a host path; in a pod it is mounted at `container`
    (`--container-driver-root`), which is where NVIDIA's plugin and GFD load NVML from.
    Run straight on the host (no such mount), the host path itself is the right place.
    """
    if host in ("", "/"):
        return "/"
    return container if Path(container).is_dir() else host
