"""The replicated table of announced ops: what every rank said in each full round, and what it means.

Each full round every rank sends one :class:`RoundMessage` (compact JSON) and receives every rank's.
Every rank absorbs the same messages in the same order, so every rank holds the same table of
announced names and draws the same conclusions from it: which names are ready everywhere (in
announcement order), which descriptions mismatch (an error worded identically on every rank), and
which ranks have joined.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Optional

from hvdray.collective.autotune import TunedParams
from hvdray.collective.engine.cache import RankDescs
from hvdray.collective.protocol import SAME_SHAPE_KINDS, OpDesc, OpKind


@dataclass(frozen=True)
class Finished:
    """A rank left the function of executor call ``call``: ``how`` is "returned" or "raised"."""

    call: int
    how: str


class Drop(NamedTuple):
    """A stalled name rank 0 tells every rank to forget: the ranks that never submitted it, and whether every
    rank was blocked waiting meanwhile (a deadlock) rather than the stall outlasting stall_shutdown_s."""

    name: str
    missing: list[int]
    deadlock: bool = False


@dataclass
class RoundMessage:
    """What one rank says in a full round; empty fields stay off the wire."""

    announce: list[OpDesc] = field(default_factory=list)  # new names, announced with their descriptions
    census: list[int] = field(default_factory=list)  # cached slots pending here (rank 0 watches stalls)
    join: bool = False  # this rank called join()
    stop: bool = False  # this rank shuts down: every rank stops after this round
    drops: list[Drop] = field(default_factory=list)  # rank 0: stalled names to forget
    call: int = 0  # the executor call this rank's announcements belong to (0: outside any call)
    finished: Optional[Finished] = None  # this rank left the function of this call (returned or raised)
    tune: Optional[TunedParams] = None  # rank 0: autotune's parameters, applied by every rank now

    def encode(self) -> bytes:
        """Compact JSON; empty bytes when there is nothing to say."""
        wire: dict[str, Any] = {}
        if self.announce:
            wire["q"] = [desc.to_wire() for desc in self.announce]
        if self.census:
            wire["pc"] = self.census
        if self.join:
            wire["j"] = 1
        if self.stop:
            wire["x"] = 1
        if self.drops:
            wire["drop"] = [[d.name, d.missing, 1] if d.deadlock else [d.name, d.missing] for d in self.drops]
        if self.announce and self.call:
            wire["c"] = self.call
        if self.finished is not None:
            wire["f"] = [self.finished.call, self.finished.how]
        if self.tune is not None:
            wire["tune"] = [self.tune.fusion_threshold_mb, self.tune.cycle_time_ms, self.tune.cache_enabled]
        return json.dumps(wire, separators=(",", ":")).encode() if wire else b""

    @classmethod
    def decode(cls, payload: bytes) -> "RoundMessage":
        """A peer's :meth:`encode` back (JSON only: nothing from the socket is unpickled)."""
        if not payload:
            return cls()
        wire = json.loads(payload)
        tune = wire.get("tune")
        finished = wire.get("f")
        return cls(
            announce=[OpDesc.from_wire(d) for d in wire.get("q", ())],
            census=[int(slot) for slot in wire.get("pc", ())],
            join=bool(wire.get("j")),
            stop=bool(wire.get("x")),
            drops=[Drop(str(d[0]), [int(r) for r in d[1]], len(d) > 2 and bool(d[2])) for d in wire.get("drop", ())],
            call=int(wire.get("c", 0)),
            finished=None if finished is None else Finished(int(finished[0]), str(finished[1])),
            tune=None if tune is None else TunedParams(float(tune[0]), float(tune[1]), bool(tune[2])),
        )


@dataclass
class Announced:
    """What each rank announced under one name; identical on every rank."""

    descs: RankDescs = field(default_factory=dict)
    first_seen: float = 0.0
    warned: bool = False  # the stall inspector warned about it
    call: int = 0  # the latest executor call it was announced in


class NegotiationTable:
    """Names announced by some ranks and not run yet, in announcement order, plus who has joined."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.announced: dict[str, Announced] = {}  # insertion order: the order every rank runs them in
        self.joined: set[int] = set()
        self.last_joined = -1  # the rank whose join was absorbed last (ties in one round: the highest)
        self.finished: dict[int, Finished] = {}  # rank -> the last call it finished (left the function of)

    def absorb(self, messages: list[RoundMessage], now: float) -> tuple[bool, list[str]]:
        """Take in one full round's messages (index: sender). Returns whether anything new came, and the
        names announced, in order (a cached one among them must be renegotiated everywhere)."""
        busy = False
        names = []
        for sender, message in enumerate(messages):
            if message.finished is not None:
                self._finish(sender, message.finished)
        for sender, message in enumerate(messages):
            if message.announce and self.closed(message.call):
                continue  # announced in a call some rank has left: it can never run (the sender fails it)
            for desc in message.announce:
                busy = True
                name = desc.name
                names.append(name)
                entry = self.announced.get(name)
                if entry is None:
                    entry = self.announced[name] = Announced(first_seen=now)
                entry.descs[sender] = desc
                entry.call = max(entry.call, message.call)
            if message.join:
                busy = True
                self.joined.add(sender)
                self.last_joined = sender
        return busy, names

    def _finish(self, rank: int, finished: Finished) -> None:
        """``rank`` left the function of call ``finished.call``: names announced and joins made in that call
        (or before) can never complete now, and are forgotten by every rank alike."""
        self.finished[rank] = finished
        if finished.call:
            self.joined, self.last_joined = set(), -1  # joins of that call can never complete either
            self.announced = {
                name: entry for name, entry in self.announced.items() if entry.call > finished.call
            }

    def closed(self, call: int) -> bool:
        """True when some rank has left the function of executor call ``call`` (never for 0, no call)."""
        return bool(call) and any(f.call >= call for f in self.finished.values())

    def take_ready(self) -> list[tuple[str, RankDescs]]:
        """The names every rank has announced (a joined rank counts as having announced everything),
        removed from the table, in announcement order."""
        if not self.announced:
            return []
        joined, size = self.joined, self.size
        ready = [name for name, entry in self.announced.items() if len(entry.descs.keys() | joined) == size]
        return [(name, self.announced.pop(name).descs) for name in ready]

    def drop(self, name: str) -> None:
        """Forget a stalled name (every rank drops it in the same round)."""
        self.announced.pop(name, None)

    @property
    def everyone_joined(self) -> bool:
        return len(self.joined) == self.size

    def finish_join(self) -> int:
        """Every rank has joined: forget the joins; returns the last rank to join."""
        last = self.last_joined
        self.joined = set()
        self.last_joined = -1
        return last

    def problem(self, name: str, descs: RankDescs, cached: bool) -> Optional[str]:
        """Why this ready name cannot run (the same words on every rank), or None."""
        problem = None if cached else mismatch(name, descs)
        if problem is None and self.joined:
            desc = descs[min(descs)]
            if desc.kind is not OpKind.ALLREDUCE:
                problem = (
                    f"{desc.kind} {name!r} cannot run after rank(s) {sorted(self.joined)} called join(); "
                    "only allreduce works with joined ranks"
                )
        return problem


#: fields every rank must agree on beyond op, dtype and shape, with their names in Horovod's API
_AGREED = (("reduce_op", "reduction op"), ("root", "root_rank"), ("prescale", "prescale_factor"),
           ("postscale", "postscale_factor"))


def mismatch(name: str, descs: RankDescs) -> Optional[str]:
    """The first disagreement between the ranks' descriptions of ``name``, worded the same on every rank."""
    ranks = sorted(descs)
    ref_rank = ranks[0]
    ref = descs[ref_rank]
    kind = ref.kind
    for r in ranks[1:]:
        other = descs[r]
        if other.kind is not kind:
            return f"mismatched operations for {name!r}: rank {ref_rank} called {kind}, rank {r} called {other.kind}"
        if other.dtype is not ref.dtype:
            return (
                f"mismatched dtypes for {kind} {name!r}: rank {ref_rank} has {ref.describe('dtype')}, "
                f"rank {r} has {other.describe('dtype')}"
            )
        whole = kind in SAME_SHAPE_KINDS
        same_dims = tuple(other.shape) == tuple(ref.shape) if whole else (
            len(other.shape) == len(ref.shape) and tuple(other.shape[1:]) == tuple(ref.shape[1:])
        )
        if not same_dims:
            which = "shapes" if whole else "shapes beyond dim 0"
            return (
                f"mismatched {which} for {kind} {name!r}: rank {ref_rank} has {ref.describe('shape')}, "
                f"rank {r} has {other.describe('shape')}"
            )
        for attr, label in _AGREED:
            if getattr(other, attr) != getattr(ref, attr):
                return (
                    f"mismatched {label} for {kind} {name!r}: rank {ref_rank} has {ref.describe(attr)}, "
                    f"rank {r} has {other.describe(attr)}"
                )
        if kind is OpKind.ALLTOALL and (other.splits is None) != (ref.splits is None):
            return f"mismatched splits for alltoall {name!r}: some ranks passed splits and others did not"
    return None


def leavers(finished: dict[int, Finished], call: int) -> list[tuple[int, Finished]]:
    """The ranks of ``finished`` (rank -> the latest call it left) that have left the function of call
    ``call``, with how they left it, in rank order."""
    return sorted((r, f) for r, f in finished.items() if call and f.call >= call)
