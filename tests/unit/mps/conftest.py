"""MPS daemon supervision (`kubegpu.mps`) against the stand-in control binary
(tests/fixtures/fake-mps-control), and when that binary misbehaves.

Shared here: the stand-in's path (`FAKE`), the MPS commands a daemon received (`commands`,
also read by the DRA sizing tests) and whether a daemon's process still runs (`pid_alive`).
"""

from __future__ import annotations

from pathlib import Path

from kubegpu.mps import MpsDaemon

FAKE = str(Path(__file__).parents[2] / "fixtures" / "fake-mps-control")


def commands(d: MpsDaemon) -> list[str]:
    """The commands the stand-in received, in order (it logs each to its pipe directory)."""
    return (d.pipe_dir / "commands.log").read_text().splitlines()


def pid_alive(pid: int) -> bool:
    """Whether `pid` runs: a zombie (state Z, exited but not reaped) counts as gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"
