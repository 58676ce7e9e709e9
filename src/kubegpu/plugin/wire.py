"""A reader of GetPreferredAllocation's request bytes that makes no string per offered ID.

A kubelet offers every free ID of a resource in each call: 3,072 at 64 GPUs × 48 replicas.
Protobuf decoding makes a `str` of each, and looking each up in the spec hashes it again;
that was most of the call's cost over the socket. Here the request keeps its bytes, and a
container request's run of `available_deviceIDs` (field 1; api.proto) is split on the field's
tag byte and each piece, which is the ID as the wire has it (its one-byte length, then its
UTF-8 bytes), is looked up in a per-spec table of such encodings (`topology.encoded_ids`).
What comes back is the spec's own ID strings. Where kubegpu was built with a C compiler,
the kubelet's shape of run is walked by `kubegpu._idscan` instead (no object per ID at
all; `topology.id_table`), to the same answer; the Python below reads every other shape,
and every request where the extension is absent.

Nothing here guesses: a piece that is a table key is exactly one whole field entry, so a
prefix of matched pieces is what protobuf reads too. Whatever else the bytes hold (an ID not
in the table, an ID of length 10 whose length byte is the tag, other field orders, unknown
fields, long lengths, bad UTF-8, truncation) is either read field by field below or makes
`read_preferred` return None, and the caller decodes the request with protobuf as before,
which gives the same answer or the same error.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from itertools import islice
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kubegpu.topology import IdReader

#: Tags (field number << 3 | wire type) of the messages read here (api.proto).
_REQUESTS = 0x0A  # PreferredAllocationRequest.container_requests, length-delimited
_AVAILABLE = 0x0A  # ContainerPreferredAllocationRequest.available_deviceIDs
_MUST_INCLUDE = 0x12  # ... .must_include_deviceIDs
_SIZE = 0x18  # ... .allocation_size, varint
_SPLIT = bytes([_AVAILABLE])


class RawRequest:
    """A GetPreferredAllocation request as its bytes (the deserializer's answer)."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data


@dataclass(frozen=True)
class ContainerAsk:
    """One container request, read: the offered IDs the spec advertises, as its strings."""

    #: The offered IDs found in the spec (each the spec's own string); None when the
    #: request offered every ID of the table but `missing`, each once.
    available: set[str] | None
    #: With `available` None: the table's IDs the request did not offer (spec strings).
    missing: set[str]
    #: How many IDs were offered (more than `len(available)`: repeats).
    offered: int
    must_include: list[str]
    size: int


def read_preferred(
    data: bytes,
    encoded: Mapping[bytes, str],
    whole: frozenset[bytes] | None = None,
    table: IdReader | None = None,
) -> list[ContainerAsk] | None:
    """The container requests of `data`, or None where protobuf must decode it instead.

    `encoded` maps an ID's wire form (length byte + UTF-8) to the spec's ID; it holds only
    IDs shorter than 128 bytes with no 0x0a byte in that form. An offered ID that is not
    in it (one the spec no longer advertises) also gives None: the caller's protobuf path
    logs what vanished. `whole`, its keys when they are every ID the spec advertises, lets
    a request that offers most of them be read as what it lacks (`available` None).
    `table`, the compiled reader of the same keys (`topology.id_table`, given only with
    `whole`), reads the kubelet's shape of run in C to the answer the Python below gives.
    """
    asks: list[ContainerAsk] = []
    end = len(data)
    pos = 0
    while pos < end:
        if data[pos] != _REQUESTS:
            return None
        length, pos = _varint(data, pos + 1)
        if length < 0 or pos + length > end:
            return None
        ask = _container(data, pos, pos + length, encoded, whole, table)
        if ask is None:
            return None
        asks.append(ask)
        pos += length
    return asks


def _container(
    data: bytes,
    start: int,
    end: int,
    encoded: Mapping[bytes, str],
    whole: frozenset[bytes] | None,
    table: IdReader | None,
) -> ContainerAsk | None:
    """The container request in `data[start:end]`."""
    # The kubelet's shape first: offered IDs, no must-include IDs, a one-byte size last.
    # If every piece before the size is a table key, those bytes are exactly that many
    # field-1 entries, so the last two are the size field whatever their values suggest.
    if end - start > 2 and data[start] == _AVAILABLE and data[end - 2] == _SIZE:
        size = data[end - 1]
        if size < 0x80 and table is not None:
            # The same walk in C: None is anything but distinct keys, each one whole
            # entry, which the field-by-field read below sorts out as the split would.
            read = table.read(data, start, end - 2)
            if read is None:
                return _fields(data[start:end], encoded)
            offered, lacks, ids = read
            if lacks:
                return ContainerAsk(None, ids, offered, [], size)
            return ContainerAsk(ids, set(), offered, [], size)
        if size < 0x80:
            if end == len(data) and size != _AVAILABLE and _SPLIT not in data[1:start]:
                # The last container request: the whole message split as it is, rather
                # than a copy of its run (a kubelet's requests hold one container each).
                # The first two pieces are the empty one before the outer tag and the
                # outer length; the last ends with the size field. (A 0x0a in the outer
                # length, or as the size, would add an empty piece, never a table key, and
                # send the run the slow way; they are checked to keep it on this one.)
                parts = data.split(_SPLIT)
                del parts[:2]
                parts[-1] = parts[-1][:-2]
            else:
                # One copy of the run (slicing bytes copies), split in C.
                parts = data[start + 1 : end - 2].split(_SPLIT)
            if whole is not None and 2 * len(parts) > len(whole):
                # Most of the table offered: one C pass for the keys no piece names. As
                # len(parts) >= len(set(parts)) >= len(set(parts) & whole), the counts add
                # up to the table exactly when every piece is a distinct key.
                lacking = whole.difference(parts)
                if len(parts) + len(lacking) == len(whole):
                    return ContainerAsk(None, {encoded[k] for k in lacking}, len(parts), [], size)
            available: set[str | None] = set(map(encoded.get, parts))
            if None not in available:
                return ContainerAsk(available, set(), len(parts), [], size)  # type: ignore[arg-type]
    return _fields(data[start:end], encoded)


def _fields(sub: bytes, encoded: Mapping[bytes, str]) -> ContainerAsk | None:
    """Any other shape: the leading run of table keys, then field by field."""
    parts = sub.split(_SPLIT)
    found: list[str | None] = []
    matched = 0
    if len(parts) > 1 and not parts[0]:
        # The run of field-1 entries at the start: every matched piece is one whole entry.
        found = list(map(encoded.get, islice(parts, 1, None)))
        try:
            matched = found.index(None)
        except ValueError:
            matched = len(found)
        del found[matched:]
    # Where the matched run ends: each piece plus the tag byte before it.
    pos = matched + sum(map(len, islice(parts, 1, matched + 1)))
    known: set[str] = set(found)  # type: ignore[arg-type]  # no None left in it
    offered = matched
    must_include: list[str] = []
    size = 0
    end = len(sub)
    # The rest, field by field (the must-include IDs and the size, in the kubelet's order).
    while pos < end:
        tag = sub[pos]
        if tag == _SIZE:
            value, pos = _varint(sub, pos + 1)
            if not 0 <= value < 1 << 31:
                return None  # negative, over-long or truncated: protobuf's to judge
            size = value
            continue
        if tag not in (_AVAILABLE, _MUST_INCLUDE):
            return None
        length, start = _varint(sub, pos + 1)
        if length < 0 or start + length > end:
            return None
        one_byte_length = start == pos + 2
        pos = start + length
        try:
            text = sub[start:pos].decode()
        except UnicodeDecodeError:
            return None
        if tag == _MUST_INCLUDE:
            must_include.append(text)
            continue
        # The table's keys carry a one-byte length; a longer one is never in it.
        spec_id = encoded.get(sub[start - 1 : pos]) if one_byte_length else None
        if spec_id is None:
            return None
        known.add(spec_id)
        offered += 1
    return ContainerAsk(known, set(), offered, must_include, size)


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    """The varint at `pos` (at most 5 bytes) and the position after it; -1 if it is not one."""
    value = 0
    for shift in range(0, 35, 7):
        if pos >= len(data):
            return -1, pos
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
    return -1, pos
