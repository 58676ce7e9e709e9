"""The DRA checkpoint: atomic, checksummed, and what `recover` does after a crash."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from kubegpu.dra.checkpoint import (
    CHECKPOINT_FILE,
    Checkpoint,
    ClaimRecord,
    ClaimState,
    CorruptCheckpoint,
    recover,
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
