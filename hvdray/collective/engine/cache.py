"""The response cache: negotiated tensors get a slot id, so the steady state needs one tiny collective.

Every rank holds an identical cache, because every change to it is derived from data all ranks share
(completed negotiations, announcements, the round number). A rank whose new request matches its own
cached description only raises the slot's flag; one bitwise-AND allreduce of the flags per tick tells every rank
which cached tensors are ready everywhere, which are pending somewhere, and whether anybody needs a
full (named, JSON) negotiation round this tick.
"""

from __future__ import annotations

import zlib
from array import array
from typing import Iterable, Optional

import torch

from hvdray.collective.protocol import OpDesc

#: every rank's description of one op, by rank
RankDescs = dict[int, OpDesc]


class ResponseCache:
    """Slots ``0..capacity-1`` holding every rank's description of one negotiated op name."""

    def __init__(self, capacity: int, rank: int) -> None:
        self.capacity = capacity
        #: replicated: autotune switches caching on or off on every rank in the same round
        self.enabled = capacity > 0
        self._rank = rank
        self._slot_of: dict[str, int] = {}
        self._descs: dict[int, RankDescs] = {}
        self._name_of: dict[int, str] = {}
        self._last_used: dict[int, int] = {}
        self._mine: dict[int, OpDesc] = {}  # this rank's description per slot
        self._free = list(range(capacity - 1, -1, -1))

    def __len__(self) -> int:
        return len(self._slot_of)

    def lookup(self, desc: OpDesc, name: Optional[str] = None) -> Optional[int]:
        """The slot for this rank's request, if its name (or ``name``: an unnamed op's family) is cached
        with this rank's identical description (op, dtype, shape, reduction, root, scale factors, splits)."""
        slot = self._slot_of.get(desc.name if name is None else name)
        if slot is None or not self._mine[slot].matches(desc):
            return None
        return slot

    def slot_of(self, name: str) -> Optional[int]:
        return self._slot_of.get(name)

    def name_of(self, slot: int) -> str:
        return self._name_of[slot]

    def descs(self, slot: int) -> RankDescs:
        return self._descs[slot]

    def holds(self, name: str, descs: RankDescs) -> bool:
        """Whether ``name`` is uncached, or cached with ``descs`` (every rank's description matching, whatever
        its name): an unnamed op's family (its rows per rank, its splits) may have changed."""
        slot = self._slot_of.get(name)
        if slot is None:
            return True
        cached = self._descs[slot]
        return cached.keys() == descs.keys() and all(cached[r].matches(desc) for r, desc in descs.items())

    def touch(self, slot: int, round_no: int) -> None:
        self._last_used[slot] = round_no

    def put(self, name: str, descs: RankDescs, round_no: int) -> Optional[int]:
        """Cache a completed negotiation; returns the slot evicted to make room, if any."""
        if self.capacity == 0 or name in self._slot_of:
            return None
        evicted = None
        if not self._free:
            evicted = min(self._last_used, key=lambda s: (self._last_used[s], s))
            self.evict(self._name_of[evicted])
        slot = self._free.pop()
        self._slot_of[name] = slot
        self._name_of[slot] = name
        self._descs[slot] = descs
        self._mine[slot] = descs[self._rank]
        self._last_used[slot] = round_no
        return evicted

    def evict(self, name: str) -> Optional[int]:
        slot = self._slot_of.pop(name, None)
        if slot is not None:
            del self._name_of[slot], self._descs[slot], self._last_used[slot], self._mine[slot]
            self._free.append(slot)
        return slot


#: the digest of an unnamed call's ops pending on their families' slots (:class:`FlagVector`)
_DIGEST_BYTES = 8
_DIGEST_MASK = (1 << 8 * _DIGEST_BYTES) - 1


def _digest(family: tuple[tuple[int, str], ...]) -> int:
    """64 bits that differ for unnamed calls that differ in their ops' slots or generated names: in the high 32
    the CRC-32 of the first op's name (the call's counter is in each of its ops' names, and CRC-32 detects any
    change of one such run of digits), in the low 32 its slot (one op: exact) or the CRC-32 of every op's slot."""
    slots = [slot for slot, _ in family]
    low = slots[0] if len(slots) == 1 else zlib.crc32(array("Q", slots).tobytes())
    return zlib.crc32(family[0][1].encode()) << 32 | low


#: the positions of the set bits of each byte value, ascending
_BITS_OF_BYTE = tuple(tuple(bit for bit in range(8) if value >> bit & 1) for value in range(256))


def _set_bits(value: int) -> list[int]:
    """The positions of the set bits of ``value`` (a non-negative int), ascending."""
    if value.bit_count() <= 16:  # one step per bit
        slots = []
        while value:
            lowest = value & -value
            slots.append(lowest.bit_length() - 1)
            value ^= lowest
        return slots
    raw = value.to_bytes((value.bit_length() + 7) // 8, "little")  # one step per byte, a table per bit
    return [8 * index + bit for index, byte in enumerate(raw) if byte for bit in _BITS_OF_BYTE[byte]]


class FlagVector:
    """One rank's tick flags as a bit vector, combined across ranks with a bitwise-AND allreduce.

    Four byte regions: in the first ``B = ceil(C / 8)`` bytes, bit ``i`` says slot ``i`` is pending here
    (AND: pending everywhere); in the next ``B`` bytes, bit ``i`` says slot ``i`` is *not* pending here
    (AND: pending nowhere, so its complement is "pending somewhere"); then 16 bytes that tell whether the
    ranks' oldest unnamed calls pending on their families' slots are the same call: a 64-bit digest of its
    ops' slots and generated names, then the digest's complement (the AND of the values equals the OR of them, the
    complement of the AND of the complements, only when every rank's value is the same); in the last
    byte, bit 0 says this rank does *not* need a full round, bit 1 that a caller on this rank is blocked
    waiting on one of its ops (or it has joined), and bit 2 that it has an unnamed call pending on its
    families' slots; AND: every rank is, or has (:attr:`everyone_blocked` and :attr:`family_agreed` after
    :meth:`read`). With the default capacity of 1024 the vector is 273 bytes.

    The engine fills and reads it on every tick, between a training step's compute, when little of this
    code is in the CPU's caches: it works on Python ints and bytes (a few calls a tick) rather than
    numpy arrays (a dozen, each costing 10-30 us cold).
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._span = (capacity + 7) // 8
        self._every_slot = (1 << capacity) - 1
        # the tensor the transport combines in place is a view of this buffer
        self._buffer = bytearray(2 * self._span + 2 * _DIGEST_BYTES + 1)
        self.tensor = torch.frombuffer(self._buffer, dtype=torch.uint8)
        self.everyone_blocked = False
        #: after :meth:`read`: None unless every rank has an unnamed call pending on families' slots;
        #: then whether all of them are the same call (the same slots and generated names)
        self.family_agreed: Optional[bool] = None

    def fill(
        self, pending: Iterable[int], joined: bool, wants_full: bool, blocked: bool = False,
        family: Optional[tuple[tuple[int, str], ...]] = None,
    ) -> torch.Tensor:
        """This rank's flags: the slots ``pending`` here, whether it has ``joined``, ``wants_full`` a full round
        and a caller is ``blocked`` on one of its ops, and its oldest unnamed call's ops on their families' slots
        (``family``: each op's slot and generated name, in the call's order), if any."""
        span, buffer = self._span, self._buffer
        if joined:
            # a joined rank agrees to every slot (it contributes zeros) and has nothing pending itself
            mine = free = self._every_slot
        else:
            mine = 0
            for slot in pending:
                mine |= 1 << slot
            free = self._every_slot ^ mine
        buffer[:span] = mine.to_bytes(span, "little")
        buffer[span : 2 * span] = free.to_bytes(span, "little")
        digest = 0 if family is None else _digest(family)
        at = 2 * span
        buffer[at : at + _DIGEST_BYTES] = digest.to_bytes(_DIGEST_BYTES, "little")
        buffer[at + _DIGEST_BYTES : at + 2 * _DIGEST_BYTES] = (digest ^ _DIGEST_MASK).to_bytes(_DIGEST_BYTES, "little")
        buffer[at + 2 * _DIGEST_BYTES] = (
            (0 if wants_full else 1) | (2 if blocked or joined else 0) | (0 if family is None else 4)
        )
        return self.tensor

    def read(self) -> tuple[list[int], list[int], bool]:
        """After the AND-allreduce: (slots ready everywhere, slots pending somewhere, full round wanted); also
        sets :attr:`everyone_blocked`."""
        span, buffer = self._span, self._buffer
        everywhere = int.from_bytes(buffer[:span], "little")
        somewhere = self._every_slot & ~int.from_bytes(buffer[span : 2 * span], "little")
        at = 2 * span
        last = buffer[at + 2 * _DIGEST_BYTES]
        self.everyone_blocked = bool(last & 2)
        self.family_agreed = None
        if last & 4:
            every = int.from_bytes(buffer[at : at + _DIGEST_BYTES], "little")
            some = _DIGEST_MASK ^ int.from_bytes(buffer[at + _DIGEST_BYTES : at + 2 * _DIGEST_BYTES], "little")
            self.family_agreed = every == some
        ready = _set_bits(everywhere)
        # the steady state: what is pending anywhere is pending everywhere
        return ready, list(ready) if somewhere == everywhere else _set_bits(somewhere), not last & 1
