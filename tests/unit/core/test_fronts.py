"""The daemon's one choice of mode: a table of front classes by name (`daemon.FRONTS`).

Every mode names a class that loads, is built as the contract says (the settings and the
core, nothing wired after) and is a `Front`. The mapping below is also what mypy checks
each front's class against, as a `FrontFactory`.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from pathlib import Path
from typing import NoReturn

import pytest

from kubegpu.daemon import FRONTS, front_factory
from kubegpu.dra.front import DraFront
from kubegpu.events import NodeEvents
from kubegpu.front import Core, DaemonSettings, Front, FrontFactory
from kubegpu.metrics import Metrics
from kubegpu.mode import Mode
from kubegpu.plugin.front import PluginFront
from kubegpu.state import NodeStore
from tests.rig.kube import FakeKube

FACTORIES: Mapping[Mode, FrontFactory] = {Mode.PLUGIN: PluginFront, Mode.DRA: DraFront}


def test_every_mode_has_a_front() -> None:
    assert set(FRONTS) == set(Mode)


@pytest.mark.parametrize("mode", list(Mode))
def test_each_name_resolves_to_a_front_class_of_the_contract(mode: Mode, tmp_path: Path) -> None:
    factory = front_factory(mode)
    assert factory is FACTORIES[mode]
    cls: object = factory
    assert inspect.isclass(cls) and issubclass(cls, Front)
    assert list(inspect.signature(factory).parameters) == ["settings", "core"]

    def no_backend() -> NoReturn:
        raise AssertionError("a front reaches the backend only once started")

    core = Core(NodeStore(), FakeKube(), Metrics(), NodeEvents.disabled(), no_backend, None)
    built = factory(DaemonSettings(mode=mode, plugin_dir=tmp_path), core)
    assert isinstance(built, Front)
