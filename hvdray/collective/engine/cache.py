"""The response cache: negotiated tensors get a slot id, so the steady state needs one tiny collective.

Every rank holds an identical cache, because every change to it is derived from data all ranks share
(completed negotiations, announcements, the round number). A rank whose new request matches its own
cached description only raises the slot's flag; one bitwise-AND allreduce of the flags per tick tells every rank
which cached tensors are ready everywhere, which are pending somewhere, and whether anybody needs a
full (named, JSON) negotiation round this tick.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
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

    def lookup(self, desc: OpDesc) -> Optional[int]:
        """The slot for this rank's request, if its name is cached with this rank's identical description
        (op, dtype, shape, reduction, root, scale factors, splits)."""
        slot = self._slot_of.get(desc.name)
        if slot is None or not self._mine[slot].matches(desc):
            return None
        return slot

    def slot_of(self, name: str) -> Optional[int]:
        return self._slot_of.get(name)

    def name_of(self, slot: int) -> str:
        return self._name_of[slot]

    def descs(self, slot: int) -> RankDescs:
        return self._descs[slot]

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


class FlagVector:
    """One rank's tick flags as a bit vector, combined across ranks with a bitwise-AND allreduce.

    Bits ``0..C-1``: slot pending here (AND: pending everywhere). Bits ``C..2C-1``: slot *not* pending
    here (AND: pending nowhere, so its complement is "pending somewhere"). Bit ``2C``: this rank does
    *not* need a full round. Bit ``2C+1``: a caller on this rank is blocked waiting on one of its ops (or
    it has joined); AND: every rank is (:attr:`everyone_blocked` after :meth:`read`). With the default
    capacity of 1024 the vector is 257 bytes.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._bits = np.zeros(2 * capacity + 2, dtype=np.uint8)
        self.tensor = torch.zeros((2 * capacity + 9) // 8, dtype=torch.uint8)
        self.everyone_blocked = False

    def fill(self, pending: list[int], joined: bool, wants_full: bool, blocked: bool = False) -> torch.Tensor:
        c, bits = self.capacity, self._bits
        if joined:
            # a joined rank agrees to every slot (it contributes zeros) and has nothing pending itself
            bits[: 2 * c] = 1
        else:
            bits[:c] = 0
            bits[pending] = 1
            np.subtract(1, bits[:c], out=bits[c : 2 * c])
        bits[2 * c] = 0 if wants_full else 1
        bits[2 * c + 1] = 1 if blocked or joined else 0
        self.tensor.copy_(torch.from_numpy(np.packbits(bits, bitorder="little")))
        return self.tensor

    def read(self) -> tuple[list[int], list[int], bool]:
        """After the AND-allreduce: (slots ready everywhere, slots pending somewhere, full round wanted); also
        sets :attr:`everyone_blocked`."""
        c = self.capacity
        bits = np.unpackbits(self.tensor.numpy(), count=2 * c + 2, bitorder="little")
        self.everyone_blocked = bool(bits[2 * c + 1])
        ready = np.flatnonzero(bits[:c]).tolist()
        somewhere = np.flatnonzero(bits[c : 2 * c] == 0).tolist()
        return ready, somewhere, not bits[2 * c]
