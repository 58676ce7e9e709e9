"""How a config file's bytes become data, against NVIDIA's parser.

NVIDIA's plugin reads its config with `sigs.k8s.io/yaml.Unmarshal` (YAML or JSON; an
empty `version` means v1; any other version is refused): see
NVIDIA/k8s-device-plugin@v0.20.0:api/config/v1/config.go (1b826acc6af3), parseConfigFrom.
That wraps go-yaml v2's non-strict `Unmarshal`, which keeps the last of two duplicate keys
and refuses documents whose alias expansion is excessive: see
NVIDIA/k8s-device-plugin@v0.20.0:vendor/go.yaml.in/yaml/v2/decode.go (1b826acc6af3), the
`d.strict` check in `mappingSlice`/`mapping` and the `alias_ratio_range` budget.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path

import pytest

from kubegpu.config import Config, MigStrategy, parse_config, yamlsafe
from kubegpu.config.source import ConfigSource
from kubegpu.errors import ConfigError
from kubegpu.resources import build_resources
from tests.builders import gpu, inventory
from tests.conformance.origin import NVIDIA_DP
from tests.waiting import WAIT

CONFIG_GO = NVIDIA_DP.cite("api/config/v1/config.go")
DECODE_GO = NVIDIA_DP.cite("vendor/go.yaml.in/yaml/v2/decode.go")

MIXED = "version: v1\nflags:\n  migStrategy: mixed\n"


# -- where kubegpu reads what NVIDIA reads ------------------------------------------------------


def test_json_is_read_as_yaml() -> None:
    """config.go: parseConfig reads "either YAML or JSON"."""
    as_json = json.dumps({"version": "v1", "flags": {"migStrategy": "mixed"}})
    assert parse_config(as_json) == parse_config(MIXED)


@pytest.mark.parametrize("text", ["", "flags: {}\n", "# comments only\n"])
def test_no_version_means_v1(text: str) -> None:
    """config.go: an empty Version is set to v1 (a file with no keys is all defaults)."""
    assert parse_config(text) == Config()


def test_another_version_is_refused() -> None:
    """config.go: a Version other than v1 is "unknown version"."""
    with pytest.raises(ConfigError, match=r"^cm\.yaml: version: unsupported config version"):
        parse_config("version: v2\n", "cm.yaml")


def test_an_alias_bomb_is_refused() -> None:
    """decode.go: go-yaml refuses excessive aliasing; so does kubegpu."""
    bomb = "".join(
        f"l{n}: &l{n} [{', '.join([f'*l{n - 1}'] * 9) if n else ', '.join(['lol'] * 9)}]\n"
        for n in range(9)
    )
    with pytest.raises(ConfigError, match="expands to more than"):
        parse_config(bomb)


def test_modest_anchors_are_read() -> None:
    """decode.go: anchors and aliases are ordinary YAML; a small reuse is fine."""
    text = (
        "version: v1\nsharing:\n  timeSlicing:\n    resources:\n"
        "    - &gpu {name: nvidia.com/gpu, replicas: 4}\n"
        "    - <<: *gpu\n      name: nvidia.com/mig-1g.10gb\n"
    )
    shared = parse_config(text).sharing.time_slicing
    assert shared is not None and [r.replicas for r in shared.resources] == [4, 4]


# -- where kubegpu differs on purpose -----------------------------------------------------------


@pytest.mark.deliberate("duplicate-keys-rejected")
def test_duplicate_keys_are_refused() -> None:
    """decode.go: non-strict go-yaml keeps the last duplicate; kubegpu refuses it."""
    with pytest.raises(ConfigError, match=r"^cm.yaml: flags.migStrategy: duplicate key"):
        parse_config("version: v1\nflags:\n  migStrategy: none\n  migStrategy: mixed\n", "cm.yaml")


@pytest.mark.deliberate("config-size-limits")
def test_expansion_beyond_the_budget_is_refused() -> None:
    """decode.go: go-yaml allows ~400,000 alias-driven values; kubegpu yamlsafe.MAX_NODES."""
    values = ", ".join(["1"] * 100)
    text = f"a: &a [{values}]\nb: [{', '.join(['*a'] * (yamlsafe.MAX_NODES // 100 + 1))}]\n"
    with pytest.raises(ConfigError, match="expands to more than"):
        parse_config(text)


@pytest.mark.deliberate("replicas-fit-kubelet-message")
def test_replicas_beyond_the_kubelet_message_are_refused() -> None:
    """config.go: NVIDIA takes any replica count; kubegpu refuses lists over 4 MiB."""
    config = parse_config(
        "version: v1\nsharing:\n  timeSlicing:\n    resources:\n"
        "    - name: nvidia.com/gpu\n      replicas: 9000\n"
    )
    with pytest.raises(ConfigError, match="4 MiB"):
        build_resources(inventory(*(gpu(i) for i in range(8))), config)


@pytest.mark.deliberate("empty-reload-keeps-last-good")
async def test_an_empty_file_on_reload_keeps_the_last_config(tmp_path: Path) -> None:
    """config.go: an empty file is the defaults; on a *reload* kubegpu keeps the last good."""
    path = tmp_path / "config.yaml"
    path.write_text(MIXED)
    source = ConfigSource(config_file=path, overrides={}, poll_interval=0.05)
    updates = source.updates()
    try:
        first = await asyncio.wait_for(anext(updates), WAIT)
        assert first.config is not None and first.config.flags.mig_strategy is MigStrategy.MIXED
        path.write_text("")
        second = await asyncio.wait_for(anext(updates), WAIT)
        assert second.config is None and "the file is empty" in str(second.error)
    finally:
        with contextlib.suppress(Exception):
            await updates.aclose()  # type: ignore[attr-defined]


def test_the_citations_are_pinned() -> None:
    """The module docstring cites exactly what origin.py pins."""
    assert CONFIG_GO in (__doc__ or "").replace("\n", " ")
    assert DECODE_GO in (__doc__ or "").replace("\n", " ")
