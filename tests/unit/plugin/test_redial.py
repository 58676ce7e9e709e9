"""How soon the plugin registers again a resource whose stream the kubelet ended
(`kubegpu.plugin.manager.Redial`), on a fake clock."""

from __future__ import annotations

from kubegpu.plugin.manager import Redial
from kubegpu.watch import Backoff


def test_at_once_first_then_growing_to_the_cap_then_at_once_after_a_quiet_spell() -> None:
    now = [0.0]
    redial = Redial(Backoff(0.1, 0.4, clock=lambda: now[0]), stable_for=60.0)
    delays = []
    for _ in range(5):  # a kubelet that drops every registration at once
        delays.append(redial.next_delay())
        now[0] += 0.01
    assert delays == [0.0, 0.1, 0.2, 0.4, 0.4]
    now[0] += 59.0  # 59 s since the last drop: still the same storm
    assert redial.next_delay() == 0.4
    now[0] += 60.0  # a minute without a drop: start over, at once
    assert redial.next_delay() == 0.0
    assert redial.next_delay() == 0.1
