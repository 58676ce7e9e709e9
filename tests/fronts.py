"""The daemon's front, for tests that look inside it: typed, so a test of one mode fails
plainly when the daemon runs the other."""

from __future__ import annotations

from kubegpu.daemon import Daemon
from kubegpu.dra.driver import DraDriver
from kubegpu.dra.front import DraFront
from kubegpu.dra.stale import StaleResourceCheck
from kubegpu.plugin.front import PluginFront
from kubegpu.plugin.manager import PluginManager


def plugin_front(daemon: Daemon) -> PluginFront:
    front = daemon.front
    assert isinstance(front, PluginFront), f"not in device plugin mode: {front!r}"
    return front


def plugin_manager(daemon: Daemon) -> PluginManager:
    return plugin_front(daemon).manager


def dra_front(daemon: Daemon) -> DraFront:
    front = daemon.front
    assert isinstance(front, DraFront), f"not in DRA mode: {front!r}"
    return front


def dra_driver(daemon: Daemon) -> DraDriver:
    """The DRA driver of a started daemon."""
    driver = dra_front(daemon).driver
    assert driver is not None, "the DRA front has not started"
    return driver


def stale_check(daemon: Daemon) -> StaleResourceCheck:
    """The stale-resource check of a started daemon."""
    stale = dra_front(daemon).stale
    assert stale is not None, "the DRA front has not started"
    return stale
