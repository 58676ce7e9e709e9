"""The effective config as people and logs see it.

- `config_to_yaml`: the whole config as `kubegpu check` prints it: YAML in block style,
  the file's camelCase keys in the schema's order, every key that has a value (an unset
  one, `flags.mpsRoot` without MPS, is left out as in a file that does not set it). The
  text is itself a config file that loads back to the same config, so it can be pasted
  into a ConfigMap.
- `config_digest`: a short hash of the effective config. Two nodes that log the same
  digest serve the same config, whatever file, flags and env vars made it.
- `config_summary`: the few settings that change what a node advertises (the MIG
  strategy, how devices reach containers, sharing, renamed resources, IMEX) in one
  bounded phrase for `serve`'s log line; the rest is in the digest.
- `log_config`: that line. At `info` a person reads where the config came from, its
  digest and its summary in one short line, and a log shipper (`--log-format json`) gets
  the whole config as the record's `config` field, to query. At `debug` the whole config
  follows as one JSON line, for text logs; `kubegpu check` prints it as YAML.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from typing import Final

import yaml

from kubegpu.config.loader import config_to_json, config_to_raw
from kubegpu.config.v1 import Config, ResourcePattern, SharingStrategy
from kubegpu.untrusted import escape

__all__ = ["config_digest", "config_summary", "config_to_yaml", "log_config"]

#: Hex digits of the digest: enough to tell a fleet's configs apart, short enough to read.
DIGEST_CHARS: Final = 12
#: Resources named in the summary before the rest are only counted.
SUMMARY_ITEMS: Final = 3
#: An origin names a file or a node label's value: bounded like any outside string.
ORIGIN_CHARS: Final = 200


def config_to_yaml(config: Config) -> str:
    """The effective config as a readable YAML document (block style, schema order)."""
    return yaml.safe_dump(
        config_to_raw(config), sort_keys=False, default_flow_style=False, allow_unicode=True
    )


def config_digest(config: Config) -> str:
    """`sha256:` and the first hex digits of the hash of the config's compact JSON."""
    digest = hashlib.sha256(config_to_json(config).encode()).hexdigest()
    return f"sha256:{digest[:DIGEST_CHARS]}"


def config_summary(config: Config) -> str:
    """`migStrategy none; deviceListStrategy envvar; sharing timeSlicing nvidia.com/gpu x4`."""
    flags = config.flags
    parts = [
        f"migStrategy {flags.mig_strategy}",
        f"deviceListStrategy {','.join(flags.plugin.device_list_strategy)}",
        f"sharing {_sharing(config)}",
    ]
    renamed = _patterns("gpus", config.resources.gpus) + _patterns("mig", config.resources.mig)
    if renamed:
        parts.append(f"resources {_bounded(renamed)}")
    if config.imex.channel_ids:
        parts.append(f"imex channels {','.join(map(str, config.imex.channel_ids))}")
    return "; ".join(parts)


def log_config(log: logging.Logger, event: str, origin: str, config: Config) -> None:
    """`EVENT (ORIGIN) DIGEST: SUMMARY` at info, with `origin`, `config_digest` and the
    whole `config` as the record's fields; the whole config as JSON at debug."""
    digest = config_digest(config)
    origin = escape(origin, ORIGIN_CHARS)
    fields = {"origin": origin, "config_digest": digest, "config": config_to_raw(config)}
    log.info("%s (%s) %s: %s", event, origin, digest, config_summary(config), extra=fields)
    log.debug("%s %s: %s", event, digest, config_to_json(config))


def _sharing(config: Config) -> str:
    shown = [
        f"{kind}{' (renameByDefault)' if strategy.rename_by_default else ''} "
        f"{_bounded(_replicas(strategy))}"
        for kind, strategy in (
            ("timeSlicing", config.sharing.time_slicing),
            ("mps", config.sharing.mps),
        )
        if strategy is not None and strategy.resources
    ]
    return ", ".join(shown) or "none"


def _replicas(strategy: SharingStrategy) -> list[str]:
    return [
        f"{r.name} x{r.replicas}" + (f" as {r.rename}" if r.rename else "")
        for r in strategy.resources
    ]


def _patterns(kind: str, patterns: Sequence[ResourcePattern]) -> list[str]:
    return [f"{kind} {p.pattern} as {p.name}" for p in patterns]


def _bounded(items: Sequence[str]) -> str:
    """The first few items, then how many more: a log line stays short."""
    more = len(items) - SUMMARY_ITEMS
    shown = ", ".join(items[:SUMMARY_ITEMS])
    return f"{shown} (+{more} more)" if more > 0 else shown
