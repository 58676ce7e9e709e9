"""The DRA checkpoint: atomic, checksummed, and what `recover` does after a crash."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from kubegpu.dra.checkpoint import (
    CHECKPOINT_FILE,
    KEPT_ASIDE,
    LEGACY_FILE,
    MAX_BYTES,
    Checkpoint,
    ClaimRecord,
    ClaimState,
    CorruptCheckpoint,
    DraCheckpointError,
    recover,
    retire,
    written_by_kubegpu,
)
from kubegpu.dra.claims import PreparedDevice, spec_file_name

DEVICE = PreparedDevice(("gpu",), "node-a", "gpu-0", ("k8s.gpu.nvidia.com/claim=u1-gpu-0",))


def spec(cdi_dir: Path, uid: str) -> Path:
    cdi_dir.mkdir(parents=True, exist_ok=True)
    path = cdi_dir / spec_file_name(uid)
    path.write_text("{}")
    return path


def test_round_trip(tmp_path: Path) -> None:
    saved = Checkpoint(tmp_path)
    saved.claims["u1"] = ClaimRecord("u1", ClaimState.PREPARED, "ns", "c", (DEVICE,))
    saved.save()
    assert Checkpoint.load(tmp_path).claims == saved.claims
    # Only the checkpoint is left: the temp file was renamed into place.
    assert [p.name for p in tmp_path.iterdir()] == [CHECKPOINT_FILE]


@pytest.mark.parametrize(
    "damage",
    [
        lambda text: text[: len(text) // 2],  # truncated
        lambda text: text.replace("gpu-0", "gpu-1"),  # altered: the checksum differs
        lambda text: json.dumps({"kind": "something-else"}),
        lambda text: "\xff\xfe not json",
    ],
)
def test_damage_is_detected(tmp_path: Path, damage: object) -> None:
    saved = Checkpoint(tmp_path)
    saved.claims["u1"] = ClaimRecord("u1", ClaimState.PREPARED, "ns", "c", (DEVICE,))
    saved.save()
    path = tmp_path / CHECKPOINT_FILE
    path.write_text(damage(path.read_text()))  # type: ignore[operator]
    with pytest.raises(CorruptCheckpoint):
        Checkpoint.load(tmp_path)


def test_recover_rolls_back_a_claim_cut_off_mid_prepare(tmp_path: Path) -> None:
    """Its spec was written (or half written), its record not: both files go, the
    prepared claim stays."""
    cdi_dir = tmp_path / "cdi"
    saved = Checkpoint(tmp_path / "data")
    saved.claims["u2"] = ClaimRecord("u2", ClaimState.PREPARED, "ns", "d", (DEVICE,))
    saved.save()
    unrecorded = spec(cdi_dir, "u1")
    half = cdi_dir / f".{spec_file_name('u3')}.k2j4x"
    half.write_text("{")
    kept = spec(cdi_dir, "u2")
    got = recover(tmp_path / "data", cdi_dir)
    assert set(got.claims) == {"u2"}
    assert sorted(p.name for p in cdi_dir.iterdir()) == [kept.name]
    assert not unrecorded.exists() and not half.exists()


def test_recover_removes_specs_no_claim_accounts_for(tmp_path: Path) -> None:
    cdi_dir = tmp_path / "cdi"
    recover(tmp_path / "data", cdi_dir)  # the first start writes an empty checkpoint
    orphan = spec(cdi_dir, "u9")  # a crash between writing the spec and recording it
    foreign = cdi_dir / "k8s.device-plugin.nvidia.com-gpu.json"
    foreign.write_text("{}")
    recover(tmp_path / "data", cdi_dir)
    assert not orphan.exists()
    assert foreign.exists()  # not a claim spec of ours


def test_the_first_start_writes_an_empty_checkpoint(tmp_path: Path) -> None:
    got = recover(tmp_path / "data", tmp_path / "cdi")
    assert got.claims == {}
    assert Checkpoint.load(tmp_path / "data").claims == {}
    assert (tmp_path / "data" / CHECKPOINT_FILE).exists()


def test_a_missing_checkpoint_keeps_the_claim_specs_on_disk_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The checkpoint lost (plugins directory moved or emptied), not the claims: the
    specs of the running pods' claims stay, as for a corrupt checkpoint."""
    data, cdi_dir = tmp_path / "data", tmp_path / "cdi"
    live = [spec(cdi_dir, "u1"), spec(cdi_dir, "u2")]
    with caplog.at_level(logging.ERROR, "kubegpu.dra"):
        got = recover(data, cdi_dir)
    assert all(path.exists() for path in live)
    assert got.claims == {
        "u1": ClaimRecord("u1", ClaimState.ADOPTED),
        "u2": ClaimRecord("u2", ClaimState.ADOPTED),
    }
    [error] = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert f"there is no DRA checkpoint {data / CHECKPOINT_FILE}" in error
    assert "keeping the 2 claim CDI spec(s)" in error
    # Recorded: the next start keeps them without adopting again.
    assert set(Checkpoint.load(data).claims) == {"u1", "u2"}
    recover(data, cdi_dir)
    assert all(path.exists() for path in live)


def test_a_corrupt_checkpoint_keeps_every_claim_spec_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    data, cdi_dir = tmp_path / "data", tmp_path / "cdi"
    data.mkdir()
    (data / CHECKPOINT_FILE).write_text("{not json")
    live = spec(cdi_dir, "u1")
    with caplog.at_level(logging.ERROR, "kubegpu.dra"):
        got = recover(data, cdi_dir)
    assert live.exists()
    assert got.claims == {"u1": ClaimRecord("u1", ClaimState.ADOPTED)}
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "corrupt" in errors[0].getMessage()
    # The new checkpoint is readable, and a second start keeps the adopted spec.
    recover(data, cdi_dir)
    assert live.exists()


# -- what the path holds: only a regular file is read ---------------------------------------


def _fifo(path: Path) -> None:
    os.mkfifo(path)


def _urandom_link(path: Path) -> None:
    path.symlink_to("/dev/urandom")


def _directory(path: Path) -> None:
    path.mkdir()


def _link_to_a_checkpoint(path: Path) -> None:
    elsewhere = path.parent / "elsewhere"
    Checkpoint(elsewhere).save()
    path.symlink_to(elsewhere / CHECKPOINT_FILE)


@pytest.mark.parametrize(
    ("plant", "kind"),
    [
        (_fifo, "a FIFO"),
        (_urandom_link, "a symbolic link"),
        (_directory, "a directory"),
        (_link_to_a_checkpoint, "a symbolic link"),
    ],
    ids=["fifo", "urandom-link", "directory", "link"],
)
def test_a_checkpoint_path_holding_no_regular_file_stops_the_start_in_one_line(
    tmp_path: Path, plant: Callable[[Path], None], kind: str
) -> None:
    """Never read (a FIFO would block the start for good, /dev/urandom fill memory), never
    moved: kubegpu writes only a regular file there, so someone else put this there."""
    data, cdi_dir = tmp_path / "data", tmp_path / "cdi"
    data.mkdir()
    path = data / CHECKPOINT_FILE
    plant(path)
    with pytest.raises(DraCheckpointError) as refused:
        recover(data, cdi_dir)
    line = str(refused.value)
    assert "\n" not in line
    assert line.startswith(f"DRA checkpoint {path} is {kind}, not a regular file")
    assert "remove it and start again" in line
    assert os.path.lexists(path) and sorted(p.name for p in data.iterdir()) == sorted(
        [CHECKPOINT_FILE, *(["elsewhere"] if plant is _link_to_a_checkpoint else [])]
    )


def test_a_data_directory_that_cannot_be_written_is_one_line(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.write_text("")  # a file where the directory goes (even root cannot write in it)
    with pytest.raises(
        DraCheckpointError,
        match=rf"^cannot write the DRA checkpoint in {data} \(File exists\); the kubelet "
        r"plugins directory must be writable, with room to write$",
    ):
        recover(data, tmp_path / "cdi")


# -- an unreadable checkpoint is kept aside, never overwritten -------------------------------


def _set_aside(data: Path, reason: str) -> list[Path]:
    return sorted(data.glob(f"{CHECKPOINT_FILE}.{reason}-*"))


def test_a_corrupt_checkpoint_is_kept_aside_and_the_log_says_where(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    data, cdi_dir = tmp_path / "data", tmp_path / "cdi"
    data.mkdir()
    (data / CHECKPOINT_FILE).write_bytes(b'{"kind": "kubegpu.dra/checkpoint", "claims": {"u1"')
    with caplog.at_level(logging.ERROR, "kubegpu.dra"):
        recover(data, cdi_dir)
    [copy] = _set_aside(data, "corrupt")
    assert copy.read_bytes() == b'{"kind": "kubegpu.dra/checkpoint", "claims": {"u1"'
    [error] = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert f"DRA checkpoint {data / CHECKPOINT_FILE} is corrupt" in error
    assert f"kept as {copy}" in error
    assert Checkpoint.load(data).claims == {}  # a fresh one in its place


def test_a_newer_version_checkpoint_is_kept_aside_as_unsupported(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    data, cdi_dir = tmp_path / "data", tmp_path / "cdi"
    data.mkdir()
    newer = json.dumps({"kind": "kubegpu.dra/checkpoint", "version": 2, "claims": {}})
    (data / CHECKPOINT_FILE).write_text(newer)
    with caplog.at_level(logging.ERROR, "kubegpu.dra"):
        recover(data, cdi_dir)
    [copy] = _set_aside(data, "unsupported")
    assert copy.read_text() == newer
    [error] = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert "it is version 2, written by another kubegpu; this one reads version 1" in error
    assert f"kept as {copy}" in error
    assert _set_aside(data, "corrupt") == []


def test_the_copies_kept_aside_are_bounded(tmp_path: Path) -> None:
    data, cdi_dir = tmp_path / "data", tmp_path / "cdi"
    data.mkdir()
    for i in range(KEPT_ASIDE + 3):
        (data / CHECKPOINT_FILE).write_text(f"damaged {i}")
        recover(data, cdi_dir)
    kept = _set_aside(data, "corrupt")
    # The newest ones: the last starts' files.
    assert [p.read_text() for p in kept] == [f"damaged {i}" for i in range(3, KEPT_ASIDE + 3)]


def test_a_checkpoint_over_the_size_bound_is_not_read_whole(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    with (data / CHECKPOINT_FILE).open("wb") as f:
        f.truncate(MAX_BYTES + 4096)  # sparse: costs no disk
    with pytest.raises(CorruptCheckpoint, match=f"over {MAX_BYTES} bytes"):
        Checkpoint.load(data)


# -- NVIDIA's file name: never ours, never touched --------------------------------------------

#: What NVIDIA's DRA driver keeps in `checkpoint.json` (the kubelet's checkpointmanager
#: format: a numeric checksum beside versioned bodies).
NVIDIA_CHECKPOINT = (
    b'{"version":"v2","checksum":2319426367,"v1":{"preparedClaims":{}},'
    b'"v2":{"checksum":1876543210,"preparedClaims":{}}}'
)


def test_nvidias_checkpoint_beside_ours_is_left_byte_identical(tmp_path: Path) -> None:
    data, cdi_dir = tmp_path / "data", tmp_path / "cdi"
    data.mkdir()
    nvidia = data / LEGACY_FILE
    nvidia.write_bytes(NVIDIA_CHECKPOINT)
    before = nvidia.stat()
    checkpoint = recover(data, cdi_dir)
    checkpoint.claims["u1"] = ClaimRecord("u1", ClaimState.PREPARED, "ns", "c", (DEVICE,))
    checkpoint.save()
    recover(data, cdi_dir)
    assert retire(Checkpoint(data), cdi_dir)
    after = nvidia.stat()
    assert nvidia.read_bytes() == NVIDIA_CHECKPOINT
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


def test_a_kubegpu_checkpoint_at_nvidias_name_is_adopted_with_its_claims(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An earlier kubegpu kept its checkpoint under NVIDIA's name: it moves to ours."""
    data, cdi_dir = tmp_path / "data", tmp_path / "cdi"
    older = Checkpoint(data)
    older.claims["u1"] = ClaimRecord("u1", ClaimState.PREPARED, "ns", "c", (DEVICE,))
    older.save()
    (data / CHECKPOINT_FILE).rename(data / LEGACY_FILE)
    kept = spec(cdi_dir, "u1")
    with caplog.at_level(logging.WARNING, "kubegpu.dra"):
        got = recover(data, cdi_dir)
    assert got.claims == older.claims
    assert kept.exists()
    assert sorted(p.name for p in data.iterdir()) == [CHECKPOINT_FILE]
    [moved] = [r.getMessage() for r in caplog.records]
    assert f"moved kubegpu's DRA checkpoint {data / LEGACY_FILE} to {data / CHECKPOINT_FILE}" in (
        moved
    )


def test_an_adopted_checkpoint_replaces_ours_and_ours_is_kept_aside(tmp_path: Path) -> None:
    """Only an older kubegpu writes the old name: it ran after ours was written."""
    data, cdi_dir = tmp_path / "data", tmp_path / "cdi"
    older = Checkpoint(data)
    older.claims["u2"] = ClaimRecord("u2", ClaimState.ADOPTED)
    older.save()
    (data / CHECKPOINT_FILE).rename(data / LEGACY_FILE)
    stale = Checkpoint(data)
    stale.save()
    spec(cdi_dir, "u2")
    got = recover(data, cdi_dir)
    assert set(got.claims) == {"u2"}
    [copy] = _set_aside(data, "superseded")
    assert json.loads(copy.read_text())["claims"] == {}


@pytest.mark.parametrize(
    "plant",
    [_fifo, _urandom_link, _directory, lambda p: p.write_bytes(b"\xff not json")],
    ids=["fifo", "urandom-link", "directory", "garbage"],
)
def test_anything_else_at_nvidias_name_is_left_alone(
    tmp_path: Path, plant: Callable[[Path], None]
) -> None:
    data = tmp_path / "data"
    data.mkdir()
    legacy = data / LEGACY_FILE
    plant(legacy)
    before = os.lstat(legacy)
    recover(data, tmp_path / "cdi")
    after = os.lstat(legacy)
    assert (after.st_ino, after.st_mode, after.st_mtime_ns) == (
        before.st_ino,
        before.st_mode,
        before.st_mtime_ns,
    )


def test_a_checkpoint_cut_short_is_still_known_for_kubegpus() -> None:
    body = {"kind": "kubegpu.dra/checkpoint", "version": 1, "claims": {}, "checksum": ""}
    text = json.dumps(body, separators=(",", ":")).encode()
    assert written_by_kubegpu(text) and written_by_kubegpu(text[:40])
    assert written_by_kubegpu(json.dumps(body, indent=2).encode())
    assert not written_by_kubegpu(NVIDIA_CHECKPOINT)
    assert not written_by_kubegpu(b"[" * 100_000)


# -- a clean stop leaves nothing when no claim is prepared -----------------------------------


def test_retire_removes_an_empty_checkpoint_and_its_empty_directory(tmp_path: Path) -> None:
    data, cdi_dir = tmp_path / "data", tmp_path / "cdi"
    checkpoint = recover(data, cdi_dir)
    assert retire(checkpoint, cdi_dir)
    assert not data.exists()


def test_retire_keeps_a_checkpoint_with_claims_or_unrecorded_specs(tmp_path: Path) -> None:
    data, cdi_dir = tmp_path / "data", tmp_path / "cdi"
    checkpoint = recover(data, cdi_dir)
    checkpoint.claims["u1"] = ClaimRecord("u1", ClaimState.ADOPTED)
    checkpoint.save()
    assert not retire(checkpoint, cdi_dir)
    checkpoint.claims.clear()
    checkpoint.save()
    spec(cdi_dir, "u9")  # left by an unprepare that could not remove it
    assert not retire(checkpoint, cdi_dir)
    assert (data / CHECKPOINT_FILE).exists()


def test_a_record_keeps_the_pods_its_claim_was_prepared_for(tmp_path: Path) -> None:
    """What the usage metrics tell neighbour claims apart by; an older kubegpu's record has
    none, and anything that is not a UID is dropped on reading."""
    uid, pod = "0a1b2c3d-0000-4000-8000-000000000001", "0a1b2c3d-0000-4000-8000-0000000000aa"
    record = ClaimRecord(uid, ClaimState.PREPARED, "ns", "c", (), pods=(pod,))
    assert ClaimRecord.from_json(uid, record.to_json()).pods == (pod,)
    older = {k: v for k, v in record.to_json().items() if k != "pods"}
    assert ClaimRecord.from_json(uid, older).pods == ()
    assert ClaimRecord.from_json(uid, {**older, "pods": ["../x", pod, 7]}).pods == (pod,)
