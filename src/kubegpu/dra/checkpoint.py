"""The prepared claims, persisted so that a plugin restart loses nothing and leaves nothing.

The kubelet may ask to unprepare a claim after the plugin restarted, when the claim is
already deleted from the API: only this file says which CDI spec was written for it. It
lives in the plugin's data directory (`<plugins dir>/<driver>/kubegpu-checkpoint.json`,
next to `dra.sock`), written atomically (temp file, fsync, rename, fsync of the directory)
with a checksum of its content, so a crash leaves the old or the new file, never half of
one.

The name is kubegpu's own because the directory is NVIDIA's DRA driver's too (same driver
name, same kubelet paths): its `checkpoint.json` there is read by NVIDIA's driver at start,
which refuses to start on a file in any other format. A kubegpu that used that name before
left its file there: one recognised as kubegpu's by its content is moved to the new name
at start, and any other file under that name is never opened for writing, moved or deleted.
A stop with no claim prepared removes the checkpoint, so an uninstall leaves nothing in
the directory for the next driver to trip on.

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
The unreadable file itself is renamed aside (`<name>.corrupt-<UTC time>`, or
`.unsupported-` for one of another kubegpu version), the newest few of each kept, so what
it held can still be looked at.

A checkpoint that is missing while claim specs are on disk says no more: the file was
lost (the plugins directory moved or was emptied), not the claims. Those specs are adopted
the same way. Every start writes the checkpoint at once, so from then on a spec without a
record is one a crash left mid-prepare, and is removed.

The path is read as a regular file only, never through a link, without blocking and up to
a size bound (`kubegpu.files`): a FIFO or a device there can neither hang the start (which
SIGTERM could then not end) nor fill memory. kubegpu only ever writes a regular file
there, so anything else was put there by hand or by another program: start-up stops with
one line saying what to remove (`DraCheckpointError`), rather than move it and carry on
over a misplaced mount or link.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path
from typing import Any, Required, TypedDict

from kubegpu.dra.claims import PreparedDevice, PreparedDeviceJson, claim_uid_of, spec_file_name
from kubegpu.dra.sizing import ClaimLimits, LimitsJson
from kubegpu.errors import KubegpuError
from kubegpu.files import NotRegularFile, read_regular
from kubegpu.untrusted import escape, is_uid

log = logging.getLogger("kubegpu.dra")

#: kubegpu's own file name in the driver's data directory (see the module doc).
CHECKPOINT_FILE = "kubegpu-checkpoint.json"
#: NVIDIA's DRA driver's checkpoint (`{"checksum": <number>, "v1": ...}`, written by the
#: kubelet's checkpointmanager), and the name kubegpu used before.
LEGACY_FILE = "checkpoint.json"
#: Written into the file, checked on load: another program's JSON is not ours.
KIND = "kubegpu.dra/checkpoint"
VERSION = 1
#: How every checkpoint `save` wrote begins (the keys in their order, no spaces), so a
#: file of ours is known even when it was cut short.
_SIGNATURE = f'{{"kind":{json.dumps(KIND)}'.encode()
#: The largest checkpoint read. A record is a few hundred bytes; a node with thousands of
#: claims stays under a megabyte or two. A bigger file is treated as corrupt.
MAX_BYTES = 32 * 1024 * 1024
#: Set-aside copies of unreadable checkpoints kept per reason, the newest: enough to look
#: into a failure, few enough that a start failing over and over cannot fill the disk.
KEPT_ASIDE = 3


class ClaimState(StrEnum):
    #: The CDI spec is on disk and the answer is recorded.
    PREPARED = "prepared"
    #: A CDI spec found on disk while the checkpoint was unreadable (see the module doc).
    ADOPTED = "adopted"


class RecordJson(TypedDict, total=False):
    """A `ClaimRecord` as the checkpoint file holds it, under its claim's UID."""

    state: Required[str]
    namespace: Required[str]
    name: Required[str]
    devices: Required[list[PreparedDeviceJson]]
    limits: LimitsJson
    pods: list[str]


@dataclass(frozen=True)
class ClaimRecord:
    uid: str
    state: ClaimState
    namespace: str = ""
    name: str = ""
    devices: tuple[PreparedDevice, ...] = ()
    #: A claim on memory-sized devices: its limits and where they are held (its MPS
    #: daemon's directory, the cgroups with a kernel limit), to restart or stop them. A
    #: record without the key (an older kubegpu's, or an unsized claim) has none; an older
    #: kubegpu reading a record with it ignores it.
    limits: ClaimLimits | None = None
    #: The UIDs of the pods it was reserved for when prepared (`status.reservedFor`): the
    #: GPU usage metrics attribute a process to its claim by its pod. Absent in an older
    #: kubegpu's record; an older kubegpu ignores it.
    pods: tuple[str, ...] = ()

    def to_json(self) -> RecordJson:
        out: RecordJson = {
            "state": self.state.value,
            "namespace": self.namespace,
            "name": self.name,
            "devices": [d.to_json() for d in self.devices],
        }
        if self.limits is not None:
            out["limits"] = self.limits.to_json()
        if self.pods:
            out["pods"] = list(self.pods)
        return out

    @classmethod
    def from_json(cls, uid: str, raw: Mapping[str, Any]) -> ClaimRecord:
        limits = raw.get("limits")
        return cls(
            uid=uid,
            state=ClaimState(raw["state"]),
            namespace=str(raw.get("namespace", "")),
            name=str(raw.get("name", "")),
            devices=tuple(PreparedDevice.from_json(d) for d in raw.get("devices", [])),
            limits=ClaimLimits.from_json(limits) if limits is not None else None,
            pods=tuple(str(p) for p in raw.get("pods", ()) if is_uid(str(p))),
        )


class CorruptCheckpoint(Exception):
    """The checkpoint file exists but cannot be read as ours."""

    #: The suffix its copy is set aside under.
    aside = "corrupt"


class UnsupportedCheckpoint(CorruptCheckpoint):
    """A checkpoint of ours, of a version this kubegpu does not read (a newer one's)."""

    aside = "unsupported"


class DraCheckpointError(KubegpuError):
    """The checkpoint's path holds something other than a regular file, or its directory
    cannot be written: start-up stops with one line naming the path and what to do."""


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
        when the file is there but unreadable, truncated, altered or not ours;
        `DraCheckpointError` when the path holds no regular file."""
        path = directory / CHECKPOINT_FILE
        try:
            data = read_regular(path, MAX_BYTES, follow_links=False)
        except FileNotFoundError:
            return cls(directory)
        except NotRegularFile as exc:
            raise DraCheckpointError(
                f"DRA checkpoint {path} is {exc.kind}, not a regular file: kubegpu writes "
                f"nothing else there; remove it and start again (claim CDI specs on disk are "
                f"kept and adopted)"
            ) from exc
        except OSError as exc:
            raise CorruptCheckpoint(f"cannot read it ({exc.strerror or exc})") from exc
        if len(data) > MAX_BYTES:
            raise CorruptCheckpoint(f"it is over {MAX_BYTES} bytes")
        try:
            raw = json.loads(data)
            if not isinstance(raw, dict) or raw.get("kind") != KIND:
                kind = raw.get("kind") if isinstance(raw, dict) else None
                raise CorruptCheckpoint(f"it is not a {KIND} file (kind {escape(repr(kind), 64)})")
            if raw.get("version") != VERSION:
                raise UnsupportedCheckpoint(
                    f"it is version {escape(repr(raw.get('version')), 64)}, written by "
                    f"another kubegpu; this one reads version {VERSION}"
                )
            claims = raw["claims"]
            if raw.get("checksum") != _checksum(claims):
                raise CorruptCheckpoint("its checksum does not match its content")
            records = {uid: ClaimRecord.from_json(uid, c) for uid, c in claims.items()}
        except CorruptCheckpoint:
            raise
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
            why = escape(f"{type(exc).__name__}: {exc}", 200)
            raise CorruptCheckpoint(f"it is not valid ({why})") from exc
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
    with _writing(data_dir):
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
    """The checkpoint of `data_dir`, with interrupted work undone (see the module doc);
    `DraCheckpointError` when its path holds no file or its directory cannot be written."""
    with _writing(data_dir):
        data_dir.mkdir(parents=True, exist_ok=True)
    _adopt_legacy(data_dir)
    path = data_dir / CHECKPOINT_FILE
    missing = not os.path.lexists(path)
    try:
        checkpoint = Checkpoint.load(data_dir)
    except CorruptCheckpoint as exc:
        with _writing(data_dir):
            aside = _set_aside(path, exc.aside)
        what = "is corrupt" if exc.aside == "corrupt" else "cannot be read"
        return _adopt(data_dir, cdi_dir, f"DRA checkpoint {path} {what}: {exc}; kept as {aside}")
    if missing:
        if any(True for _ in claim_specs(cdi_dir)):
            return _adopt(
                data_dir,
                cdi_dir,
                f"there is no DRA checkpoint {path}, but there are claim CDI specs (was the "
                f"kubelet's plugins directory moved or emptied?)",
            )
        with _writing(data_dir):
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


def retire(checkpoint: Checkpoint, cdi_dir: Path) -> bool:
    """At a stop, after the last call: remove the checkpoint when it records no claim and
    no claim spec is on disk, so an uninstall leaves nothing behind (the next start writes
    it again at once); True when removed. A spec without a record keeps it: the next start
    must know that spec for a crash's leftover and remove it."""
    try:
        if checkpoint.claims or any(True for _ in claim_specs(cdi_dir)):
            return False
        checkpoint.path.unlink(missing_ok=True)
    except OSError as exc:
        log.warning("cannot remove DRA checkpoint %s (%s)", checkpoint.path, exc.strerror or exc)
        return False
    log.info("removed DRA checkpoint %s: no claim is prepared", checkpoint.path)
    # Empty now unless someone else keeps files there; a mount point stays as it is.
    with contextlib.suppress(OSError):
        checkpoint.directory.rmdir()
    return True


def written_by_kubegpu(data: bytes) -> bool:
    """Whether a file's bytes are a kubegpu checkpoint (of any version), told by content."""
    if data.startswith(_SIGNATURE):
        return True  # as `save` writes it, even cut short
    try:
        raw = json.loads(data)
    except (ValueError, RecursionError):
        return False
    return isinstance(raw, dict) and raw.get("kind") == KIND


def _adopt_legacy(data_dir: Path) -> None:
    """Move a checkpoint an earlier kubegpu left under NVIDIA's name to ours. Anything
    else under that name, NVIDIA's DRA driver's checkpoint first, is only read."""
    legacy = data_dir / LEGACY_FILE
    try:
        data = read_regular(legacy, MAX_BYTES, follow_links=False)
    except OSError:
        return  # absent, unreadable, or no regular file: nothing kubegpu wrote
    if len(data) > MAX_BYTES or not written_by_kubegpu(data):
        return
    path = data_dir / CHECKPOINT_FILE
    with _writing(data_dir):
        # Only an older kubegpu writes the old name, so a file there is newer than ours.
        superseded = _set_aside(path, "superseded") if os.path.lexists(path) else None
        legacy.replace(path)
        _fsync_dir(data_dir)
    log.warning(
        "moved kubegpu's DRA checkpoint %s to %s: that name is NVIDIA's DRA driver's%s",
        legacy,
        path,
        f" (the checkpoint it replaces is kept as {superseded})" if superseded else "",
    )


def _set_aside(path: Path, reason: str) -> Path:
    """Rename `path` to `<name>.<reason>-<UTC time>` beside it, keeping the newest
    `KEPT_ASIDE` of that reason; the new name."""
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S.%fZ")
    target = path.with_name(f"{path.name}.{reason}-{stamp}")
    for n in range(1, 1000):
        if not os.path.lexists(target):
            break
        target = path.with_name(f"{path.name}.{reason}-{stamp}-{n}")
    path.rename(target)
    _fsync_dir(path.parent)
    kept = sorted(path.parent.glob(f"{path.name}.{reason}-*"))
    for old in kept[:-KEPT_ASIDE]:
        with contextlib.suppress(OSError):  # a directory set aside stays: never rm -r
            old.unlink()
    return target


@contextlib.contextmanager
def _writing(data_dir: Path) -> Iterator[None]:
    """One line naming the directory and the fix for a write there that fails at start,
    instead of an errno line naming a temp file."""
    try:
        yield
    except OSError as exc:
        raise DraCheckpointError(
            f"cannot write the DRA checkpoint in {data_dir} ({exc.strerror or exc}); the "
            f"kubelet plugins directory must be writable, with room to write"
        ) from exc


__all__ = [
    "CHECKPOINT_FILE",
    "LEGACY_FILE",
    "Checkpoint",
    "ClaimRecord",
    "ClaimState",
    "CorruptCheckpoint",
    "DraCheckpointError",
    "RecordJson",
    "UnsupportedCheckpoint",
    "claim_specs",
    "recover",
    "remove_spec",
    "retire",
    "written_by_kubegpu",
]
