"""A rank's record in Gloo's full-mesh connect, and the part of it that one peer reads.

torch's Gloo (TCP transport) connects a group's full mesh through the store: every rank publishes one
record per device, ``[host name length][host name][address length][address][one 8-byte pair
identifier per rank of the group]``, and every rank reads every record. A reader uses the host name,
the address and *its own* pair identifier only, yet the records are ``O(size)`` bytes each, so a
group's connect moves ``O(size**3)`` bytes through the rendezvous (8.8 GB for one group of 1,024 ranks).

:func:`part_for` (:class:`RecordCuts` for a group's many readers) cuts a record down to what one
reader uses, ``O(1)`` bytes; :func:`as_read_by` turns that part back into a record of the original
length (the other identifiers zero), which the reader's Gloo parses exactly as it would the whole one:
``O(size**2)`` bytes in all. A value that is not such a record (another Gloo version's layout, another
key's value) passes through whole. Torch-free: the coordinator cuts, the worker's store rebuilds.
"""

from __future__ import annotations

import struct
from typing import Optional

_LENGTH = struct.Struct("=Q")  # size_t, as Gloo writes it (native order; every platform torch ships is 64-bit)
_PAIR_ID_BYTES = 8  # ssize_t
_WHOLE, _PART = b"\x00", b"\x01"  # what follows: the value as stored, or one reader's part of a record


def record(hostname: bytes, address: bytes, pair_ids: list[int]) -> bytes:
    """The record Gloo publishes for a rank (what the control-plane simulation replays)."""
    ids = struct.pack(f"={len(pair_ids)}q", *pair_ids)
    return _LENGTH.pack(len(hostname)) + hostname + _LENGTH.pack(len(address)) + address + ids


def _header_length(value: bytes, size: int) -> Optional[int]:
    """Bytes before the pair identifiers, if ``value`` is a record of a group of ``size`` ranks."""
    length = len(value)
    if length < 2 * _LENGTH.size:
        return None
    address_at = _LENGTH.size + _LENGTH.unpack_from(value, 0)[0]
    if length < address_at + _LENGTH.size:
        return None
    header = address_at + _LENGTH.size + _LENGTH.unpack_from(value, address_at)[0]
    return header if length == header + _PAIR_ID_BYTES * size else None


def part_for(value: bytes, reader: int, size: int) -> bytes:
    """What rank ``reader`` of a group of ``size`` needs of ``value``: its own pair identifier of a record
    (and the record's host name and address), or the whole value if it is not a record."""
    header = _header_length(value, size)
    if header is None or not 0 <= reader < size:
        return _WHOLE + value
    start = header + _PAIR_ID_BYTES * reader
    return _PART + value[:header] + value[start:start + _PAIR_ID_BYTES]


class RecordCuts:
    """What each reader of a Gloo group's records gets, found once for all of them: in a connect of N
    ranks each of the N readers reads the same N records, in rank order. The first read of a list of
    values finds each record's layout and gathers the records' pair-identifier tables into one N x N
    table; a reader's answer is then the records' heads, the same list for every reader, and its own
    column of that table as one string of 8-byte identifiers (:func:`parts`): O(1) Python steps and
    O(N) bytes copied in C a read, where cutting N parts took N Python steps a read. Holds the values
    it has cut until :meth:`clear`."""

    def __init__(self) -> None:
        #: (the ids of the values read, group size) -> their table; it keeps the values, so their ids stay theirs
        self._tables: dict[tuple[tuple[int, ...], int], _CutTable] = {}

    def parts_for(self, values: list[bytes], reader: int, size: int) -> tuple[list[bytes], bytes]:
        """``values`` as rank ``reader`` of a group of ``size`` reads them: ``(heads, ids)``, which
        :func:`parts` turns into ``[part_for(value, reader, size) for value in values]``."""
        key = (tuple(map(id, values)), size)
        table = self._tables.get(key)
        if table is None:
            table = self._tables[key] = _CutTable(values, size)
        return table.parts_for(reader)

    def clear(self) -> None:
        """Forget every value (its epoch is over)."""
        self._tables.clear()


class _CutTable:
    """One list of values as the readers of a group of ``size`` ranks read them."""

    def __init__(self, values: list[bytes], size: int) -> None:
        import numpy as np  # here, not at import: the workers only rebuild

        self.values = list(values)
        self.size = size
        headers = [_header_length(value, size) for value in self.values]
        #: each value's part without its reader's pair identifier: a record's head, or a whole value
        self.heads = [_WHOLE + value if header is None else _PART + value[:header]
                      for value, header in zip(self.values, headers)]
        none = bytes(_PAIR_ID_BYTES * size)  # a value that is no record has no identifiers: zeros, never read
        ids = b"".join([none if header is None else value[header:] for value, header in zip(self.values, headers)])
        #: row i: value i's pair identifiers, one 8-byte item per reader (copied as they are, never parsed)
        self.ids = np.frombuffer(ids, dtype=np.dtype(f"V{_PAIR_ID_BYTES}")).reshape(len(self.values), size)

    def parts_for(self, reader: int) -> tuple[list[bytes], bytes]:
        if not 0 <= reader < self.size:  # a reader outside the group: whole values
            return [_WHOLE + value for value in self.values], bytes(_PAIR_ID_BYTES * len(self.values))
        return self.heads, self.ids[:, reader].tobytes()


def parts(heads: list[bytes], ids: bytes) -> list[bytes]:
    """The parts one reader gets from :meth:`RecordCuts.parts_for`'s ``(heads, ids)``, one per value, as
    :func:`part_for` cuts them."""
    if len(ids) != _PAIR_ID_BYTES * len(heads):
        raise ValueError(f"ids must hold {_PAIR_ID_BYTES} bytes per head ({len(heads)}), got {len(ids)}")
    return [head + ids[_PAIR_ID_BYTES * i:_PAIR_ID_BYTES * (i + 1)] if head[:1] == _PART else head
            for i, head in enumerate(heads)]


def as_read_by(part: bytes, reader: int, size: int) -> bytes:
    """The value that :func:`part_for` cut ``part`` from, as rank ``reader`` reads it."""
    kind, body = part[:1], part[1:]
    if kind == _WHOLE:
        return body
    if kind != _PART or len(body) < _PAIR_ID_BYTES or not 0 <= reader < size:
        raise ValueError(f"not a part of a Gloo record for rank {reader} of {size}: {part[:16]!r}...")
    header, own = body[:-_PAIR_ID_BYTES], body[-_PAIR_ID_BYTES:]
    return header + bytes(_PAIR_ID_BYTES * reader) + own + bytes(_PAIR_ID_BYTES * (size - reader - 1))
