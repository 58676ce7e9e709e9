"""`kubegpu.plugin.wire`: GetPreferredAllocation's bytes read without protobuf agree with
protobuf's own decoding, or are left to it (None) — never a different answer."""

from __future__ import annotations

import dataclasses
import logging
import random
from collections.abc import Sequence

import pytest
from google.protobuf.message import DecodeError
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kubegpu import topology
from kubegpu.api import pb
from kubegpu.config import AllocationPolicy, parse_config
from kubegpu.errors import AllocationError
from kubegpu.plugin.server import _prefer, _prefer_raw, undecodable
from kubegpu.plugin.wire import ContainerAsk, read_preferred
from kubegpu.resources import ResourceSpec, build_resources
from kubegpu.topology import encoded_ids, encoded_whole, id_table
from tests.builders import gpu, inventory

# Spec IDs that stress the reader: the usual replica IDs, one of 10 bytes (its length byte
# is the tag 0x0a), one holding a newline, one of 130 bytes (a two-byte length), non-ASCII.
ODD_UUIDS = ("GPU-10bytes"[:10], "GPU-new\nline", "GPU-" + "x" * 126, "GPU-é-ünï")


def _spec(uuids: tuple[str, ...] = (), replicas: int | None = 4) -> ResourceSpec:
    gpus = [gpu(i) for i in range(3)]
    gpus += [dataclasses.replace(gpu(3 + n), uuid=u) for n, u in enumerate(uuids)]
    config = "version: v1\n"
    if replicas is not None:
        config += (
            "sharing:\n  timeSlicing:\n    resources:\n"
            f"    - name: nvidia.com/gpu\n      replicas: {replicas}\n"
        )
    (spec,) = build_resources(inventory(*gpus), parse_config(config))
    return spec


SPEC = _spec()
ODD = _spec(ODD_UUIDS, replicas=None)  # whole GPUs: the IDs are the UUIDs


def _varint(value: int) -> bytes:
    out = bytearray()
    value &= (1 << 64) - 1  # negative int32s are ten-byte varints on the wire
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _string(tag: int, text: bytes) -> bytes:
    return bytes([tag]) + _varint(len(text)) + text


def _expected(data: bytes, spec: ResourceSpec) -> list[ContainerAsk]:
    """What the reader must answer when it answers: protobuf's decoding, mapped to the spec."""
    asks = []
    for req in pb.PreferredAllocationRequest.FromString(data).container_requests:
        offered = list(req.available_deviceIDs)
        assert set(offered) <= spec.by_id.keys()  # the reader leaves unknown IDs to protobuf
        asks.append(
            ContainerAsk(
                set(offered),
                set(),
                len(offered),
                list(req.must_include_deviceIDs),
                req.allocation_size,
            )
        )
    return asks


def _as_sets(asks: list[ContainerAsk], spec: ResourceSpec) -> list[ContainerAsk]:
    """Asks read as what they lack (`available` None) written out as what they offer."""
    out = []
    for ask in asks:
        if ask.available is None:
            # Only when each offered ID came once: exactly the table less what it lacks.
            assert ask.missing <= spec.by_id.keys()
            assert ask.offered == len(spec.by_id) - len(ask.missing)
            ask = dataclasses.replace(ask, available=set(spec.by_id) - ask.missing, missing=set())
        out.append(ask)
    return out


def _agrees(data: bytes, spec: ResourceSpec) -> list[ContainerAsk] | None:
    """The reader's answer, without and with the whole table; each agrees with protobuf,
    and the compiled reader (where it was built: test_idscan.py) answers as Python does."""
    got = read_preferred(data, encoded_ids(spec))
    whole = read_preferred(data, encoded_ids(spec), encoded_whole(spec))
    assert (got is None) == (whole is None)
    table = id_table(spec)
    assert (table is None) == (topology.compiled_table is None or encoded_whole(spec) is None)
    if table is not None:
        assert read_preferred(data, encoded_ids(spec), encoded_whole(spec), table) == whole
    if got is not None and whole is not None:
        assert got == _expected(data, spec)
        assert _as_sets(whole, spec) == got
        # What lands in the sets is the spec's own string (identity matches later).
        for ask in [*got, *whole]:
            assert all(i is spec.by_id[i].id for i in ask.available or ask.missing)
    return got


def test_the_kubelets_shape_is_read_without_protobuf() -> None:
    ids = [d.id for d in SPEC.devices]
    for size in (1, 8, 10, 127):  # 10: the size byte is the tag byte 0x0a
        data = pb.PreferredAllocationRequest(
            container_requests=[
                pb.ContainerPreferredAllocationRequest(
                    available_deviceIDs=ids[::-1], allocation_size=size
                )
            ]
        ).SerializeToString()
        got = _agrees(data, SPEC)
        assert got == [ContainerAsk(set(ids), set(), len(ids), [], size)]
        # With the whole table: every ID offered once, so read as lacking none.
        whole = read_preferred(data, encoded_ids(SPEC), encoded_whole(SPEC))
        assert whole == [ContainerAsk(None, set(), len(ids), [], size)]


def test_a_mostly_offered_run_is_read_as_what_it_lacks_only_when_exact() -> None:
    ids = [d.id for d in SPEC.devices]
    table, whole = encoded_ids(SPEC), encoded_whole(SPEC)

    def read(offered: Sequence[str]) -> list[ContainerAsk] | None:
        req = pb.ContainerPreferredAllocationRequest(available_deviceIDs=offered, allocation_size=1)
        data = pb.PreferredAllocationRequest(container_requests=[req]).SerializeToString()
        _agrees(data, SPEC)
        return read_preferred(data, table, whole)

    assert read(ids[2:]) == [ContainerAsk(None, {ids[0], ids[1]}, len(ids) - 2, [], 1)]
    # A repeat in place of a lacking ID: the counts match the table's, yet it is not the
    # table less one ID, so it is read as a set (whose size tells the repeat).
    assert read([ids[2], *ids[2:]]) == [ContainerAsk(set(ids[2:]), set(), len(ids) - 1, [], 1)]
    # An unknown ID in place of a lacking one: left to protobuf, which logs it.
    assert read(["GPU-gone::0", *ids[1:]]) is None
    # Half or fewer offered: read as a set.
    assert read(ids[: len(ids) // 2]) == [
        ContainerAsk(set(ids[: len(ids) // 2]), set(), len(ids) // 2, [], 1)
    ]
    # A spec whose IDs are not all table keys has no whole table.
    assert encoded_whole(ODD) is None


def test_the_last_requests_run_is_split_in_place_whatever_its_length_bytes() -> None:
    """The last container request's run is split out of the whole message: its outer
    length may hold the tag byte (0x0a: a length of 1,280 to 1,407) and so may its size;
    both are read right (or left to protobuf), as protobuf reads them."""
    ids = [d.id for d in SPEC.devices]
    entry = len(ids[0]) + 2  # tag, one-byte length, the ID
    for repeats in range(1, 40):
        offered = (ids * repeats)[: 1300 // entry + repeats % 5]
        for size in (9, 10, 11):
            req = pb.ContainerPreferredAllocationRequest(
                available_deviceIDs=offered, allocation_size=size
            )
            data = pb.PreferredAllocationRequest(container_requests=[req]).SerializeToString()
            got = _agrees(data, SPEC)
            assert got is not None and got[0].offered == len(offered)


def test_must_include_other_orders_and_several_containers_are_read_too() -> None:
    ids = [d.id.encode() for d in SPEC.devices]
    first = b"".join(
        [_string(0x12, ids[0]), b"\x18\x02", *(_string(0x0A, i) for i in ids[:5]), b"\x18\x03"]
    )
    second = b"\x18\x01" + b"".join(_string(0x0A, i) for i in ids[5:])
    data = _string(0x0A, first) + _string(0x0A, second)
    got = _agrees(data, SPEC)
    assert got is not None
    assert [(a.offered, a.must_include, a.size) for a in got] == [
        (5, [ids[0].decode()], 3),  # the last size wins, as in protobuf
        (len(ids) - 5, [], 1),
    ]


def test_ids_the_table_cannot_hold_are_read_field_by_field() -> None:
    table = encoded_ids(ODD)
    # 10 bytes (length byte 0x0a), a newline, a two-byte length: none is a key.
    assert set(table.values()) == {d.id for d in ODD.devices} - set(ODD_UUIDS[:3])
    ids = [d.id for d in ODD.devices]
    data = pb.PreferredAllocationRequest(
        container_requests=[
            pb.ContainerPreferredAllocationRequest(available_deviceIDs=ids, allocation_size=2)
        ]
    ).SerializeToString()
    # Left to protobuf (None) or read right; both give `_prefer`'s answer below.
    _agrees(data, ODD)
    policy = AllocationPolicy.DISTRIBUTED
    req = pb.PreferredAllocationRequest.FromString(data).container_requests[0]
    assert _prefer_raw(ODD, data, policy) == [_prefer(ODD, req, policy)]


def test_anything_unusual_is_left_to_protobuf() -> None:
    ids = [d.id.encode() for d in SPEC.devices]
    run = b"".join(_string(0x0A, i) for i in ids)
    cases = {
        "unknown ID": _string(0x0A, run + _string(0x0A, b"GPU-gone::0") + b"\x18\x01"),
        "unknown field": _string(0x0A, run + b"\x20\x01"),
        "unknown outer field": _string(0x0A, run) + b"\x10\x01",
        "negative size": _string(0x0A, run + b"\x18" + _varint(-1)),
        "bad UTF-8 must-include": _string(0x0A, run + _string(0x12, b"\xff")),
        "truncated": _string(0x0A, run + b"\x18\x01")[:-5],
        "trailing tag": _string(0x0A, run + b"\x0a"),
    }
    for what, data in cases.items():
        assert read_preferred(data, encoded_ids(SPEC)) is None, what


def test_undecodable_bytes_get_the_boundarys_error() -> None:
    data = _string(0x0A, _string(0x0A, b"GPU-\xff") + b"\x18\x01")
    with pytest.raises(DecodeError) as decoded:
        pb.PreferredAllocationRequest.FromString(data)
    with pytest.raises(AllocationError) as raised:
        _prefer_raw(SPEC, data, AllocationPolicy.DISTRIBUTED)
    assert str(raised.value) == str(undecodable(str(decoded.value)))


def test_vanished_and_repeated_ids_take_the_logged_path(caplog: pytest.LogCaptureFixture) -> None:
    ids = [d.id for d in SPEC.devices]
    policy = AllocationPolicy.DISTRIBUTED
    for offered in ([*ids, "GPU-gone::1"], [ids[0], ids[0], ids[5]]):
        req = pb.ContainerPreferredAllocationRequest(available_deviceIDs=offered, allocation_size=2)
        data = pb.PreferredAllocationRequest(container_requests=[req]).SerializeToString()
        caplog.clear()
        with caplog.at_level(logging.INFO, "kubegpu.plugin"):
            assert _prefer_raw(SPEC, data, policy) == [_prefer(SPEC, req, policy)]
        assert ("no longer advertised" in caplog.text) == ("GPU-gone::1" in offered)


# Any request: IDs of the spec or not, odd ones, repeats, fields in any order, any sizes.
_ALL_IDS = [d.id for d in SPEC.devices] + [d.id for d in ODD.devices]
_text = st.one_of(st.sampled_from(_ALL_IDS), st.text(max_size=12)).map(str.encode)
_field = st.one_of(
    _text.map(lambda t: _string(0x0A, t)),
    _text.map(lambda t: _string(0x12, t)),
    st.integers(-(2**31), 2**31 - 1).map(lambda n: b"\x18" + _varint(n)),
    st.binary(max_size=4),  # junk: unknown fields, bad tags, bad UTF-8
)
_container = st.lists(_field, max_size=12).map(b"".join)
_request = st.lists(_container.map(lambda c: _string(0x0A, c)), max_size=3).map(b"".join)


@given(_request, st.sampled_from([SPEC, ODD]), st.integers(0, 200))
@settings(max_examples=400, deadline=None)
@example(b"", SPEC, 0)
def test_any_bytes_read_as_protobuf_reads_them_or_left_to_it(
    data: bytes, spec: ResourceSpec, cut: int
) -> None:
    for candidate in (data, data[:cut], data[cut:]):
        try:
            pb.PreferredAllocationRequest.FromString(candidate)
        except DecodeError:
            assert read_preferred(candidate, encoded_ids(spec)) is None
            continue
        _agrees(candidate, spec)


@given(st.lists(st.sampled_from([d.id for d in SPEC.devices]), min_size=1), st.data())
@settings(max_examples=200, deadline=None)
def test_the_servicer_answers_the_same_either_way(offered: list[str], data: st.DataObject) -> None:
    must = data.draw(st.lists(st.sampled_from(offered), max_size=2, unique=True))
    size = data.draw(st.integers(-1, len(set(offered)) + 1))
    policy = data.draw(st.sampled_from(list(AllocationPolicy)))
    req = pb.ContainerPreferredAllocationRequest(
        available_deviceIDs=offered, must_include_deviceIDs=must, allocation_size=size
    )
    raw = pb.PreferredAllocationRequest(container_requests=[req, req]).SerializeToString()
    try:
        expected: list[list[str]] | str = [_prefer(SPEC, req, policy)] * 2
    except AllocationError as exc:
        expected = str(exc)
    try:
        got: list[list[str]] | str = _prefer_raw(SPEC, raw, policy)
    except AllocationError as exc:
        got = str(exc)
    assert got == expected


@given(st.integers(0, len(SPEC.devices)), st.randoms(use_true_random=False), st.data())
@settings(max_examples=150, deadline=None)
def test_the_servicer_answers_the_same_without_the_compiled_reader(
    lacking: int, rng: random.Random, data: st.DataObject
) -> None:
    """Where kubegpu._idscan was not built (no C compiler at install), `_prefer_raw` reads
    in Python; its answers are the same as with the compiled table, and as protobuf's."""
    ids = [d.id for d in SPEC.devices]
    rng.shuffle(ids)
    offered = ids[lacking:]
    size = data.draw(st.integers(1, max(1, len(offered))))
    policy = data.draw(st.sampled_from(list(AllocationPolicy)))
    req = pb.ContainerPreferredAllocationRequest(available_deviceIDs=offered, allocation_size=size)
    raw = pb.PreferredAllocationRequest(container_requests=[req]).SerializeToString()

    def answer() -> list[list[str]] | str:
        try:
            return _prefer_raw(SPEC, raw, policy)
        except AllocationError as exc:
            return str(exc)

    with_table = answer()
    saved = topology.compiled_table
    try:
        topology.compiled_table = None
        topology._table_cache.clear()
        assert topology.id_table(SPEC) is None
        assert answer() == with_table
    finally:
        topology.compiled_table = saved
        topology._table_cache.clear()
    try:
        expected: list[list[str]] | str = [_prefer(SPEC, req, policy)]
    except AllocationError as exc:
        expected = str(exc)
    assert with_table == expected
