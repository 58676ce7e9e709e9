"""Fixtures for the kubelet emulator's tests: a running emulator and a plugin factory.

Each test of this package follows one expectation of shared/KUBELET.md. Synchronisation is
always a wait on the emulator's condition with a timeout, never a sleep.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from kubegpu.api import pb
from kubegpu.kubelet import (
    KubeletEmulator,
)
from tests.integration.kubelet.fakes import FakePlugin, MakePlugin
from tests.rig.dra import DRAKubelet
from tests.rig.kube import FakeKube
from tests.waiting import Kubelet


@pytest.fixture
async def kubelet(socket_dir: Path) -> AsyncIterator[KubeletEmulator]:
    emulator = Kubelet(socket_dir, grace_period=0.2, dial_timeout=2.0)
    await emulator.start()
    try:
        yield emulator
    finally:
        await emulator.stop()


@pytest.fixture
async def newest_kubelet(socket_dir: Path) -> AsyncIterator[KubeletEmulator]:
    """The emulator as a 1.37+ kubelet (an endpoint per plugin socket)."""
    emulator = Kubelet(socket_dir, grace_period=0.2, dial_timeout=2.0, version="1.37")
    await emulator.start()
    try:
        yield emulator
    finally:
        await emulator.stop()


@pytest.fixture(params=["1.36", "1.37"])
async def each_kubelet(
    socket_dir: Path, request: pytest.FixtureRequest
) -> AsyncIterator[KubeletEmulator]:
    """The emulator as each kubelet it models, one test run per version."""
    emulator = Kubelet(socket_dir, grace_period=0.2, dial_timeout=2.0, version=request.param)
    await emulator.start()
    try:
        yield emulator
    finally:
        await emulator.stop()


@pytest.fixture
async def make_plugin(socket_dir: Path) -> AsyncIterator[MakePlugin]:
    """Build plugins serving in `socket_dir`; every one is stopped at the end."""
    made: list[FakePlugin] = []

    def make(devices: Sequence[pb.Device], **kwargs: Any) -> FakePlugin:
        plugin = FakePlugin(socket_dir, devices, **kwargs)
        made.append(plugin)
        return plugin

    try:
        yield make
    finally:
        for plugin in made:
            await plugin.stop()


@pytest.fixture
def kube() -> FakeKube:
    """The API server the DRA tests' emulator and drivers share."""
    return FakeKube()


@pytest.fixture
async def node(socket_dir: Path, kube: FakeKube) -> AsyncIterator[DRAKubelet]:
    """The kubelet emulator's DRA side alone, retrying registrations quickly."""
    emulator = DRAKubelet(socket_dir, kube, retry_initial=0.05)
    await emulator.start()
    try:
        yield emulator
    finally:
        await emulator.stop()
