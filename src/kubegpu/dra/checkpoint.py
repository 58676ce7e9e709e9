"""The prepared claims, persisted so that a plugin restart loses nothing and leaves nothing.

The kubelet may ask to unprepare a claim after the plugin restarted, when the claim is
already deleted from the API: only this file says which CDI spec was written for it. It
lives in the plugin's data directory (`<plugins dir>/<driver>/checkpoint.json`, next to
`dra.sock`), written atomically (temp file, fsync, rename, fsync of the directory) with a
checksum of its content, so a crash leaves the old or the new file, never half of one.

A claim's CDI spec is written (atomically, fsync'd) before its record, and its record is
dropped before its spec is removed, so the one thing a crash can leave is a spec no
record accounts for, or the temp file of a spec being written. `recover` runs at start,
before the kubelet can call, and removes both: the claim being prepared when the process
died is rolled back, the kubelet (which never got an answer) asks again, and the claim is
prepared afresh. Recording first instead would cost a second fsync'd checkpoint write on
every prepare and tell recovery nothing the directory does not.

A corrupt checkpoint cannot say which specs are still wanted. Removing them all would
break the running pods' containers on their next restart: the runtime reads a CDI spec
each time it creates a container, and the kubelet does not prepare a claim it already
prepared. So every claim spec on disk is kept and adopted: a later prepare of that claim
rebuilds it from the API (the same bytes), a later unprepare removes it. A spec of a claim
the kubelet never asks about again stays until it is removed by hand, which costs a file.

A checkpoint that is missing while claim specs are on disk says no more: the file was
lost (the plugins directory moved or was emptied), not the claims. Those specs are adopted
the same way. The first start writes an empty checkpoint at once, so from then on a spec
without a record is one a crash left mid-prepare, and is removed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from kubegpu.dra.claims import PreparedDevice, claim_uid_of, spec_file_name

log = logging.getLogger("kubegpu.dra")

CHECKPOINT_FILE = "checkpoint.json"
#: Written into the file, checked on load: another program's JSON is not ours.
KIND = "kubegpu.dra/checkpoint"
VERSION = 1


class ClaimState(StrEnum):
    #: The CDI spec is on disk and the answer is recorded.
    PREPARED = "prepared"
    #: A CDI spec found on disk while the checkpoint was unreadable (see the module doc).
    ADOPTED = "adopted"


@dataclass(frozen=True)
class ClaimRecord:
    uid: str
    state: ClaimState
    namespace: str = ""
    name: str = ""
    devices: tuple[PreparedDevice, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {
            "state": self.state.value,
            "namespace": self.namespace,
            "name": self.name,
            "devices": [d.to_json() for d in self.devices],
        }

    @classmethod
    def from_json(cls, uid: str, raw: Mapping[str, Any]) -> ClaimRecord:
        return cls(
            uid=uid,
            state=ClaimState(raw["state"]),
            namespace=str(raw.get("namespace", "")),
            name=str(raw.get("name", "")),
            devices=tuple(PreparedDevice.from_json(d) for d in raw.get("devices", [])),
        )


class CorruptCheckpoint(Exception):
    """The checkpoint file exists but cannot be read as ours."""


def _checksum(claims: Mapping[str, Any]) -> str:
    canonical = json.dumps(claims, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


@dataclass
class Checkpoint:
    """The claims of one plugin data directory; `save` after every change."""

    directory: Path
    claims: dict[str, ClaimRecord] = field(default_factory=dict)
    #: How many times the file was written (benchmarks and tests count fsyncs with it).
    writes: int = 0

    @property
    def path(self) -> Path:
        return self.directory / CHECKPOINT_FILE

    @classmethod
    def load(cls, directory: Path) -> Checkpoint:
        """The checkpoint in `directory` (empty when there is none); `CorruptCheckpoint`
        when the file is there but unreadable, truncated, altered or not ours."""
        path = directory / CHECKPOINT_FILE
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return cls(directory)
        except (OSError, UnicodeDecodeError) as exc:
            raise CorruptCheckpoint(f"cannot read it ({exc})") from exc
        try:
            raw = json.loads(text)
            if raw.get("kind") != KIND or raw.get("version") != VERSION:
                raise CorruptCheckpoint(
                    f"it is not a version {VERSION} {KIND} file (kind {raw.get('kind')!r})"
                )
            claims = raw["claims"]
            if raw.get("checksum") != _checksum(claims):
                raise CorruptCheckpoint("its checksum does not match its content")
            records = {uid: ClaimRecord.from_json(uid, c) for uid, c in claims.items()}
        except CorruptCheckpoint:
            raise
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CorruptCheckpoint(f"it is not valid ({type(exc).__name__}: {exc})") from exc
        return cls(directory, records)

    def save(self) -> None:
        """Write atomically and durably: temp file, fsync, rename, fsync the directory."""
        claims = {uid: r.to_json() for uid, r in sorted(self.claims.items())}
        body = {"kind": KIND, "version": VERSION, "claims": claims, "checksum": _checksum(claims)}
        self.directory.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=f".{CHECKPOINT_FILE}.", dir=self.directory)
        tmp = Path(tmp_name)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(body, f, separators=(",", ":"))
                f.flush()
                os.fsync(f.fileno())
            tmp.replace(self.path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        _fsync_dir(self.directory)
        self.writes += 1


def _fsync_dir(directory: Path) -> None:
    """Make a rename in `directory` durable (the rename itself lives in the directory)."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def claim_specs(cdi_dir: Path) -> Iterator[tuple[str, Path]]:
    """(claim UID, path) of every per-claim CDI spec of ours in `cdi_dir`."""
    for path in _entries(cdi_dir):
        uid = claim_uid_of(path.name)
        if uid is not None:
            yield uid, path


def _entries(directory: Path) -> list[Path]:
    try:
        return list(directory.iterdir())
    except FileNotFoundError:
        return []


def _half_written(path: Path) -> bool:
    """A temp file `cdi.write_spec` left when the process died mid-write (`.<name>.<rnd>`)."""
    name = path.name
    return name.startswith(".") and claim_uid_of(name[1:].rsplit(".", 1)[0]) is not None


def _adopt(data_dir: Path, cdi_dir: Path, why: str) -> Checkpoint:
    """A new checkpoint adopting every claim spec on disk, the old one being unusable."""
    adopted = {uid: ClaimRecord(uid, ClaimState.ADOPTED) for uid, _ in claim_specs(cdi_dir)}
    log.error(
        "%s; starting with an empty checkpoint and keeping the %d claim CDI spec(s) in %s "
        "for the kubelet to prepare or unprepare again",
        why,
        len(adopted),
        cdi_dir,
    )
    checkpoint = Checkpoint(data_dir, adopted)
    checkpoint.save()
    return checkpoint


def remove_spec(cdi_dir: Path, uid: str) -> bool:
    """Remove the claim's CDI spec; False when there was none."""
    try:
        (cdi_dir / spec_file_name(uid)).unlink()
    except FileNotFoundError:
        return False
    return True


def recover(data_dir: Path, cdi_dir: Path) -> Checkpoint:
    """The checkpoint of `data_dir`, with interrupted work undone (see the module doc)."""
    path = data_dir / CHECKPOINT_FILE
    try:
        missing = not path.exists()
        checkpoint = Checkpoint.load(data_dir)
    except CorruptCheckpoint as exc:
        return _adopt(data_dir, cdi_dir, f"DRA checkpoint {path} is corrupt: {exc}")
    if missing:
        if any(True for _ in claim_specs(cdi_dir)):
            return _adopt(
                data_dir,
                cdi_dir,
                f"there is no DRA checkpoint {path}, but there are claim CDI specs (was the "
                f"kubelet's plugins directory moved or emptied?)",
            )
        checkpoint.save()  # from now on a spec without a record is a crash's leftover
    for path in _entries(cdi_dir):
        if _half_written(path):
            path.unlink(missing_ok=True)
            log.info("removed %s: a CDI spec cut off mid-write", path)
    for uid, path in claim_specs(cdi_dir):
        if uid not in checkpoint.claims:
            path.unlink(missing_ok=True)
            log.warning(
                "removed CDI spec %s: claim %s was being prepared or unprepared when the "
                "plugin stopped; the kubelet asks again",
                path,
                uid,
            )
    return checkpoint


__all__ = [
    "CHECKPOINT_FILE",
    "Checkpoint",
    "ClaimRecord",
    "ClaimState",
    "CorruptCheckpoint",
    "claim_specs",
    "recover",
    "remove_spec",
]
