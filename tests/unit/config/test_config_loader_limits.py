"""A shared resource must fit the kubelet's 4 MiB ListAndWatch message, or it is refused.

Above that size the kubelet drops the stream and the node shows 0 GPUs while the plugin
looks healthy (9,000 replicas on 8 GPUs), so the config is refused instead, at
start and on reload, with one line naming the key and the largest count that fits.
"""

from __future__ import annotations

import re

import pytest

from kubegpu.config import parse_config
from kubegpu.devices import Health
from kubegpu.errors import ConfigError
from kubegpu.plugin.server import device_list
from kubegpu.resources import (
    KUBELET_MAX_MESSAGE_BYTES,
    build_resources,
    list_message_bytes,
)
from tests.builders import gpu, inventory

EIGHT = inventory(*(gpu(i, numa=i % 2) for i in range(8)))


def shared(replicas: int) -> str:
    return (
        "version: v1\nsharing:\n  timeSlicing:\n    resources:\n"
        f"    - name: nvidia.com/gpu\n      replicas: {replicas}\n"
    )


def refusal(replicas: int) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        build_resources(EIGHT, parse_config(shared(replicas)))
    return info.value


@pytest.mark.parametrize("replicas", [9_000, 1_000_000_000])
def test_too_many_replicas_are_refused_in_one_line(replicas: int) -> None:
    text = str(refusal(replicas))
    assert text.startswith("sharing.timeSlicing.resources[0].replicas: ")
    assert "4 MiB" in text and "\n" not in text


def test_the_largest_count_offered_fits_and_one_more_does_not() -> None:
    most = int(re.search(r"use at most (\d+) replicas", str(refusal(9_000)))[1])  # type: ignore[index]
    (spec,) = build_resources(EIGHT, parse_config(shared(most)))
    assert len(spec.devices) == 8 * most
    assert device_list(spec).ByteSize() <= KUBELET_MAX_MESSAGE_BYTES
    refusal(most + 1)


def test_the_size_bound_is_above_the_real_message() -> None:
    # Unhealthy devices on a high NUMA node: the longest health and topology fields.
    node = inventory(*(gpu(i, numa=1_000_000) for i in range(4)))
    health = {g.uuid: Health.UNHEALTHY for g in node.gpus}
    for replicas in (2, 7, 1_000):
        (spec,) = build_resources(node.with_health(health), parse_config(shared(replicas)))
        ids = [d.id for d in spec.devices]
        assert list_message_bytes(ids) >= device_list(spec).ByteSize()


def test_unshared_gpus_are_never_refused() -> None:
    (spec,) = build_resources(EIGHT, parse_config("version: v1\n"))
    assert len(spec.devices) == 8
