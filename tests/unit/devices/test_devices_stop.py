"""devices.Stop: the stop flag of a backend's watch thread, with wake hooks."""

from __future__ import annotations

import threading

from kubegpu.devices.stop import Stop
from tests.waiting import WAIT


def test_stop_wakes_each_hook_once_set_and_at_once_when_already_set() -> None:
    stop = Stop()
    woken: list[str] = []
    stop.on_set(lambda: woken.append("a"))
    forget_b = stop.on_set(lambda: woken.append("b"))
    forget_b()
    assert woken == []
    stop.set()
    assert woken == ["a"]
    stop.on_set(lambda: woken.append("late"))
    assert woken == ["a", "late"]


def test_stop_wakes_a_hook_from_the_setting_thread() -> None:
    stop = Stop()
    woke_in: list[threading.Thread] = []
    stop.on_set(lambda: woke_in.append(threading.current_thread()))
    setter = threading.Thread(target=stop.set)
    setter.start()
    setter.join(WAIT)
    assert woke_in == [setter]
    assert stop.wait(0) is True  # still an Event for everyone else
