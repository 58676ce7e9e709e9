"""The device plugin's own parts (`kubegpu.plugin`, `kubegpu.allocation`): the Allocate answer,
the plugin directory's roles and slots, registration and kubelet-restart detection, the redial
pacing.

Shared here: the `plugin_dir` fixture, an empty plugin directory short enough for socket paths.
"""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def plugin_dir(socket_dir: Path) -> Path:
    """An empty plugin directory (the kubelet's socket and ours), under /tmp: pytest's
    tmp_path can make a unix socket path longer than its 107-byte limit."""
    return socket_dir
