"""`kubegpu._idscan`, the compiled ID reader, against a Python reference written from its
contract (the comment at the top of src/kubegpu/_idscan.c): any keys, any bytes, any
bounds, the same answer or the same refusal (None), and no state carried between calls.

The extension is optional (no C compiler at install, no extension), so these tests skip
with that reason where it was not built, unless KUBEGPU_REQUIRE_COMPILED=1 (set by
.ci/run), where a missing extension fails instead. That the Python reader of
kubegpu.plugin.wire gives the same answers as this one is checked in test_wire.py.
"""

from __future__ import annotations

import os
import random
from collections.abc import Sequence

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kubegpu import topology

if topology.compiled_table is None:
    if os.environ.get("KUBEGPU_REQUIRE_COMPILED") == "1":
        pytest.fail(
            "kubegpu._idscan was not built, and KUBEGPU_REQUIRE_COMPILED=1 asks for it: "
            "install a C compiler and the Python headers, then reinstall (make venv)",
            pytrace=False,
        )
    pytest.skip(
        "kubegpu._idscan was not built (no C compiler at install); the Python reader is "
        "tested in test_wire.py",
        allow_module_level=True,
    )

from kubegpu._idscan import IdTable

Read = tuple[int, bool, set[str]] | None


def reference(
    keys: Sequence[bytes], values: Sequence[str], data: bytes, start: int, end: int
) -> Read:
    """The contract, step by step: field-1 entries with a one-byte length, each a key,
    none twice; more than half of the keys offered reads as the values not offered."""
    if not 0 <= start <= end <= len(data):
        return None
    index = {k: i for i, k in enumerate(keys)}
    seen: set[int] = set()
    pos = start
    while pos < end:
        if data[pos] != 0x0A or end - pos < 2 or data[pos + 1] >= 0x80:
            return None
        key = data[pos + 1 : pos + 2 + data[pos + 1]]
        if pos + 1 + len(key) > end or len(key) != data[pos + 1] + 1:
            return None
        i = index.get(key)
        if i is None or i in seen:
            return None
        seen.add(i)
        pos += 1 + len(key)
    lacking = 2 * len(seen) > len(keys)
    return len(seen), lacking, {v for i, v in enumerate(values) if (i in seen) != lacking}


def wire(text: bytes) -> bytes:
    """A key as the wire carries an ID: its one-byte length, then the bytes."""
    return bytes([len(text)]) + text


def entry(key: bytes) -> bytes:
    return b"\x0a" + key


# Keys in the ID's wire form (the table's use), a few of other forms (the contract allows
# any bytes), values that are any strings.
_wire_key = st.binary(max_size=40).map(wire)
_keys = st.lists(st.one_of(_wire_key, st.binary(min_size=1, max_size=9)), unique=True, max_size=24)


@st.composite
def tables_and_requests(draw: st.DrawFn) -> tuple[list[bytes], list[str], bytes, int, int]:
    keys = draw(_keys)
    values = [f"id-{i}-{draw(st.text(max_size=4))}" for i in range(len(keys))]
    pieces = draw(
        st.lists(
            st.one_of(
                st.sampled_from(keys).map(entry) if keys else st.just(b""),  # a key, maybe twice
                _wire_key.map(entry),  # most likely unknown
                st.binary(max_size=6),  # junk, long lengths, other tags
            ),
            max_size=40,
        )
    )
    mostly = draw(st.booleans())
    if keys and mostly:
        # Mostly offered, in any order: the "lacking" side of the threshold.
        offered = draw(st.permutations(keys))[: draw(st.integers(0, len(keys)))]
        pieces = [entry(k) for k in offered] + pieces[: draw(st.integers(0, 2))]
    data = b"".join(pieces)
    start = draw(st.integers(-2, len(data) + 2))
    end = draw(st.integers(-2, len(data) + 2))
    if draw(st.booleans()):
        start, end = 0, len(data)
    return keys, values, data, start, end


@given(tables_and_requests())
@settings(max_examples=1500, deadline=None)
@example(([wire(b"a")], ["A"], entry(wire(b"a")), 0, 2))
@example(([wire(b"a"), wire(b"b")], ["A", "B"], entry(wire(b"a")), 0, 3))  # half: not lacking
@example(([wire(b"a")], ["A"], entry(wire(b"a")) * 2, 0, 6))  # a repeat
@example(([wire(b"a")], ["A"], b"\x0a\x80\x01", 0, 3))  # a two-byte length
@example(([wire(b"a")], ["A"], b"\x0a\x01", 0, 2))  # runs past the end
@example(([wire(b"a")], ["A"], b"\x0a", 0, 1))  # a tag alone
def test_every_answer_is_the_references(
    case: tuple[list[bytes], list[str], bytes, int, int],
) -> None:
    keys, values, data, start, end = case
    table = IdTable(tuple(keys), tuple(values))
    expected = reference(keys, values, data, start, end)
    assert table.read(data, start, end) == expected
    # Marks from this call never leak into the next (a fresh mark per call).
    assert table.read(b"", 0, 0) == reference(keys, values, b"", 0, 0)
    assert table.read(data, start, end) == expected


def test_the_values_handed_back_are_the_tables_own_strings() -> None:
    values = tuple(f"GPU-{i}::{r}" for i in range(4) for r in range(3))
    keys = tuple(wire(v.encode()) for v in values)
    table = IdTable(keys, values)
    few = table.read(b"".join(map(entry, keys[:2])), 0, sum(len(k) + 1 for k in keys[:2]))
    assert few is not None and few[:2] == (2, False)
    assert {id(v) for v in few[2]} == {id(v) for v in values[:2]}
    most = b"".join(map(entry, keys[2:]))
    read = table.read(most, 0, len(most))
    assert read is not None and read[:2] == (len(keys) - 2, True)
    assert {id(v) for v in read[2]} == {id(v) for v in values[:2]}


def test_a_node_sized_table_reads_a_shuffled_request() -> None:
    """64 GPUs × 48 replicas, as `make bench` asks: every offered order gives one answer."""
    values = tuple(
        f"GPU-{u:08x}-0000-0000-0000-{u:012x}::{r}" for u in range(64) for r in range(48)
    )
    keys = tuple(wire(v.encode()) for v in values)
    table = IdTable(keys, values)
    rng = random.Random(7)
    for lacking in (0, 1, 40, 1535, 1536, 1537, 3072):
        offered = list(keys)
        rng.shuffle(offered)
        del offered[:lacking]
        data = b"".join(map(entry, offered))
        assert table.read(data, 0, len(data)) == reference(keys, values, data, 0, len(data))


@pytest.mark.parametrize(
    ("keys", "values", "error", "says"),
    [
        ((b"\x01a",), (), ValueError, "1 keys but 0 values"),
        (("a",), ("A",), TypeError, "entry 0 must be bytes"),
        ((b"",), ("A",), TypeError, "entry 0 must be bytes of 1 to 128"),
        ((b"x" * 129,), ("A",), TypeError, "entry 0 must be bytes of 1 to 128"),
        ((b"\x01a",), (b"A",), TypeError, "and a str"),
        ((b"\x01a", b"\x01b", b"\x01a"), ("A", "B", "C"), ValueError, "key 2 repeats key 0"),
        ([b"\x01a"], ("A",), TypeError, "must be tuple"),
    ],
)
def test_a_bad_table_is_refused_with_what_is_wrong(
    keys: object, values: object, error: type[Exception], says: str
) -> None:
    with pytest.raises(error, match=says):
        IdTable(keys, values)  # type: ignore[arg-type]


class _Sneaky(str):
    """A str whose hash runs Python code: refused, so read never calls back into Python."""

    def __hash__(self) -> int:
        return 0


def test_values_must_be_exact_strings() -> None:
    with pytest.raises(TypeError, match="and a str"):
        IdTable((b"\x01a",), (_Sneaky("A"),))


def test_any_buffer_is_read_and_other_arguments_are_refused() -> None:
    table = IdTable((wire(b"a"), wire(b"b"), wire(b"c")), ("A", "B", "C"))
    data = entry(wire(b"a")) + entry(wire(b"c"))
    for buffer in (data, bytearray(data), memoryview(data)):
        assert table.read(buffer, 0, len(data)) == (2, True, {"B"})
    # A slice that ends inside the second entry, or starts inside the first, is refused.
    assert table.read(data, 0, len(data) - 1) is None
    assert table.read(data, 1, len(data)) is None
    with pytest.raises(TypeError):
        table.read(data.decode(), 0, 1)  # type: ignore[arg-type]
    with pytest.raises(OverflowError):
        table.read(data, 0, 2**80)
