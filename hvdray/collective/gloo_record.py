"""A rank's record in Gloo's full-mesh connect, and the part of it that one peer reads.

torch's Gloo (TCP transport) connects a group's full mesh through the store: every rank publishes one
record per device, ``[host name length][host name][address length][address][one 8-byte pair
identifier per rank of the group]``, and every rank reads every record. A reader uses the host name,
the address and *its own* pair identifier only, yet the records are ``O(size)`` bytes each, so a
group's connect moves ``O(size**3)`` bytes through the rendezvous (8.8 GB for one group of 1,024 ranks).

:func:`part_for` (:class:`RecordCuts` for many reads) cuts a record down to what one reader uses, ``O(1)`` bytes; :func:`as_read_by` turns
that part back into a record of the original length (the other identifiers zero), which the reader's
Gloo parses exactly as it would the whole one: ``O(size**2)`` bytes in all. A value that is not such a
record (another Gloo version's layout, another key's value) passes through whole. Torch-free: the
coordinator cuts, the worker's store rebuilds.
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
    return RecordCuts().part_for(value, reader, size)


class RecordCuts:
    """:func:`part_for` for the many readers of the same values: every record of a group of N ranks is
    read N times, and its layout is found once (per group size), not at every read. At N = 1,024 that
    is 0.3 us a read instead of 1.35 (1.4 s of the coordinator's CPU per connect). Holds the values it
    has cut until :meth:`clear`."""

    def __init__(self) -> None:
        #: (id(value), size) -> (value, what every part of it starts with or None if it is no record, header length)
        self._layouts: dict[tuple[int, int], tuple[bytes, Optional[bytes], int]] = {}

    def part_for(self, value: bytes, reader: int, size: int) -> bytes:
        """As the module's :func:`part_for`."""
        layout = self._layouts.get((id(value), size))
        if layout is None or layout[0] is not value:  # kept values keep their ids: a new one is re-parsed
            header = _header_length(value, size)
            layout = (value, None if header is None else _PART + value[:header], header or 0)
            self._layouts[(id(value), size)] = layout
        _, prefix, header = layout
        if prefix is None or not 0 <= reader < size:
            return _WHOLE + value
        start = header + _PAIR_ID_BYTES * reader
        return prefix + value[start:start + _PAIR_ID_BYTES]

    def clear(self) -> None:
        """Forget every value (its epoch is over)."""
        self._layouts.clear()


def as_read_by(part: bytes, reader: int, size: int) -> bytes:
    """The value that :func:`part_for` cut ``part`` from, as rank ``reader`` reads it."""
    kind, body = part[:1], part[1:]
    if kind == _WHOLE:
        return body
    if kind != _PART or len(body) < _PAIR_ID_BYTES or not 0 <= reader < size:
        raise ValueError(f"not a part of a Gloo record for rank {reader} of {size}: {part[:16]!r}...")
    header, own = body[:-_PAIR_ID_BYTES], body[-_PAIR_ID_BYTES:]
    return header + bytes(_PAIR_ID_BYTES * reader) + own + bytes(_PAIR_ID_BYTES * (size - reader - 1))
