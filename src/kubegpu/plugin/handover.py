"""The handover of registration between two `serve` processes on one plugin directory.

`follow` is a root task of the daemon. A successor waits until the kubelet holds the device
list of every resource it serves, asks the owner to yield (`PluginDirectory`), and takes
the owner lock once the owner has let it go; from then on, and in an owner from the start,
it waits for a successor's request and hands over: the manager stops registering and
stops sending device lists (`PluginManager.yield_registration`), then the lock is released.
The process keeps answering the calls still sent to it until SIGTERM, when it drains and
exits as a lone plugin does. Should the successor stop or die first, the process owns the
directory again (`PluginDirectory.own_again`), registers again
(`PluginManager.resume_registration`) and waits for the next successor as any owner does.
"""

from __future__ import annotations

import asyncio
import logging

from kubegpu.plugin.directory import PluginDirectory, Role
from kubegpu.plugin.manager import PluginManager
from kubegpu.watch import Backoff, PathWatch

log = logging.getLogger("kubegpu.plugin")

#: The inotify fallback's period; also how often a successor retries the owner lock at
#: most (an owner killed by SIGKILL lets it go without any event in the directory).
POLL_INTERVAL = 0.05
RETRY_CAP = 2.0


async def follow(directory: PluginDirectory, manager: PluginManager) -> None:
    """Run until cancelled: take over as a successor, hand over as an owner."""
    changed = asyncio.Event()
    with PathWatch(
        lambda: [directory.takeover_file, manager.kubelet_socket],
        changed.set,
        poll_interval=POLL_INTERVAL,
        name=f"handover in {directory.path}",
    ):
        if directory.role is Role.SUCCESSOR:
            await manager.wait_registered()
            backoff = Backoff(POLL_INTERVAL, RETRY_CAP)
            while True:
                try:
                    directory.request_takeover()
                    break
                except OSError as exc:  # the plugin directory is being re-created
                    log.warning("cannot ask for the handover yet (%s); retrying", exc)
                    changed.clear()
                    await backoff.wait(changed)
            log.info(
                "registered beside the kubegpu serve already serving %s (socket slot %d); "
                "asked it to hand over",
                directory.path,
                directory.slot,
            )
            backoff.reset()
            while not directory.try_own():
                changed.clear()
                await backoff.wait(changed)
            log.info("took over registration in %s", directory.path)
        while True:
            while not directory.takeover_requested():
                changed.clear()
                await changed.wait()
            await manager.yield_registration()
            directory.yield_ownership()
            log.info(
                "a successor registered: handed registration over; answering calls until SIGTERM"
            )
            backoff = Backoff(POLL_INTERVAL, RETRY_CAP)
            while True:
                try:
                    await directory.own_again()
                    break
                except FileNotFoundError:  # the plugin directory is being re-created
                    changed.clear()
                    await backoff.wait(changed)
            log.warning(
                "the kubegpu serve that took over from this one in %s has stopped: "
                "registering again",
                directory.path,
            )
            await manager.resume_registration()
