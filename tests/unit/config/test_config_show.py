"""The effective config shown to people and logs: YAML, a digest, a one-line summary."""

from __future__ import annotations

import json
import logging

import pytest

from kubegpu.config import Config, config_to_raw, parse_config
from kubegpu.config.show import config_digest, config_summary, config_to_yaml, log_config

SHARED = """version: v1
flags:
  migStrategy: mixed
  plugin:
    deviceListStrategy: [envvar, cdi-cri]
resources:
  gpus:
  - pattern: "*A100*"
    name: a100
sharing:
  timeSlicing:
    renameByDefault: true
    resources:
    - name: nvidia.com/gpu
      replicas: 4
    - name: nvidia.com/mig-1g.5gb
      replicas: 2
      rename: small
imex:
  channelIDs: [0]
"""


def test_the_summary_names_what_changes_what_a_node_advertises() -> None:
    assert config_summary(Config()) == "migStrategy none; deviceListStrategy envvar; sharing none"
    assert config_summary(parse_config(SHARED)) == (
        "migStrategy mixed; deviceListStrategy envvar,cdi-cri; sharing timeSlicing "
        "(renameByDefault) nvidia.com/gpu x4, nvidia.com/mig-1g.5gb x2 as small; "
        "resources gpus *A100* as a100; imex channels 0"
    )


def test_the_summary_stays_short_however_many_resources_share() -> None:
    resources = "".join(
        f"    - name: nvidia.com/mig-{n}g.{n}0gb\n      replicas: 2\n" for n in range(1, 8)
    )
    config = parse_config(f"version: v1\nsharing:\n  timeSlicing:\n    resources:\n{resources}")
    summary = config_summary(config)
    assert summary.endswith("nvidia.com/mig-3g.30gb x2 (+4 more)") and len(summary) < 200


def test_the_digest_tells_configs_apart_and_ignores_how_they_were_written() -> None:
    shared = parse_config(SHARED)
    assert config_digest(shared) != config_digest(Config())
    # Written in another order and style, the same config has the same digest.
    assert config_digest(parse_config(config_to_yaml(shared))) == config_digest(shared)
    assert config_digest(Config()).startswith("sha256:") and len(config_digest(Config())) == 19


def test_the_yaml_is_block_style_in_schema_order_and_loads_back() -> None:
    shared = parse_config(SHARED)
    text = config_to_yaml(shared)
    assert text.startswith("version: v1\nflags:\n  migStrategy: mixed\n")
    assert "  plugin:\n    passDeviceSpecs: false\n    deviceListStrategy:\n    - envvar\n" in text
    assert parse_config(text) == shared


def test_the_log_line_is_short_and_carries_the_whole_config_as_fields(
    caplog: pytest.LogCaptureFixture,
) -> None:
    config = parse_config(SHARED)
    with caplog.at_level(logging.DEBUG, logger="kubegpu.test"):
        log_config(logging.getLogger("kubegpu.test"), "effective config", "file /c.yaml", config)
    info, debug = caplog.records
    assert info.levelno == logging.INFO
    message = info.getMessage()
    assert message.startswith(f"effective config (file /c.yaml) {config_digest(config)}: ")
    assert len(message) < 300
    assert info.__dict__["config"] == config_to_raw(config)
    assert info.__dict__["config_digest"] == config_digest(config)
    assert info.__dict__["origin"] == "file /c.yaml"
    assert debug.levelno == logging.DEBUG
    assert json.loads(debug.getMessage().split(": ", 1)[1]) == config_to_raw(config)


def test_an_origin_from_outside_is_escaped_and_bounded(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="kubegpu.test"):
        origin = "named config 'a\nb\u202e' " + "x" * 500
        log_config(logging.getLogger("kubegpu.test"), "config reloaded", origin, Config())
    (record,) = caplog.records
    assert "\n" not in record.getMessage() and "\u202e" not in record.getMessage()
    assert record.__dict__["origin"].endswith("x...") and len(record.__dict__["origin"]) < 250
