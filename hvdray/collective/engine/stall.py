"""The stall inspector: rank 0 watches for ops that some ranks submitted and others did not.

Past ``stall_warning_s`` it logs a warning naming the op, the ranks that submitted it and the ranks
everyone waits for; past ``stall_shutdown_s`` (0: never) it asks every rank, in the next full round,
to drop the op, which fails it with an error naming the missing ranks. Named ops are watched in the
negotiation table; cached ops through the census of pending slots that a full round carries.

A deadlock is dropped sooner: when, for ``stall_warning_s``, every rank has had a caller blocked waiting
on one of its ops (the tick flags say so) and nothing ran, no rank can submit what the others wait for
(each waits for the others), so the stalled ops are dropped then instead of warned about.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Iterable, Optional

from hvdray.collective.engine.cache import ResponseCache
from hvdray.collective.engine.negotiation import Announced, Drop, RoundMessage
from hvdray.collective.errors import HvdrayError
from hvdray.collective.protocol import OpKind

log = logging.getLogger(__name__)


class StallInspector:
    """Rank 0's watch over stalled ops; its drops travel in rank 0's next round message."""

    def __init__(self, size: int, warning_s: float, shutdown_s: float) -> None:
        self._size = size
        self.warning_s = warning_s
        self.shutdown_s = shutdown_s
        self._since: dict[int, float] = {}  # cached slots pending somewhere but not everywhere, since when
        self._warned: set[int] = set()
        self._census: dict[int, set[int]] = {}  # slot -> ranks with it pending, from the last full round
        self._drops: list[Drop] = []  # stalled names to drop in the next full round
        self._stuck_since: Optional[float] = None  # since when every rank has been blocked and nothing ran

    def wants_full_round(self, announced: dict[str, Announced], joined: set[int]) -> bool:
        """Check named stalls; True when there is something to drop or a cached stall needs a census."""
        self._drops.extend(self._stalled_names(announced, joined))
        now = time.monotonic()
        deadlocked = self.deadlocked(now)
        census_due = any(
            now - since >= self.warning_s and (slot not in self._warned or deadlocked)
            or self.shutdown_s and now - since >= self.shutdown_s
            for slot, since in self._since.items()
        )
        return bool(self._drops) or census_due

    def watch_blocked(self, everyone_blocked: bool, ran: bool) -> None:
        """After each tick: whether every rank had a caller blocked on one of its ops, and whether anything ran."""
        if not everyone_blocked or ran:
            self._stuck_since = None
        elif self._stuck_since is None:
            self._stuck_since = time.monotonic()

    def deadlocked(self, now: float) -> bool:
        """True once every rank has been blocked, with nothing running, for ``warning_s``."""
        return self._stuck_since is not None and now - self._stuck_since >= self.warning_s

    def take_drops(self) -> list[Drop]:
        drops, self._drops = self._drops, []
        return drops

    def take_census(self, messages: list[RoundMessage]) -> None:
        """Which ranks have which cached slots pending, from a full round's messages."""
        census: dict[int, set[int]] = {}
        for sender, message in enumerate(messages):
            for slot in message.census:
                census.setdefault(slot, set()).add(sender)
        self._census = census

    def watch_cached(
        self, pending_somewhere: list[int], ready: list[int], cache: ResponseCache, joined: set[int]
    ) -> None:
        """After each tick's flags: time the cached slots pending somewhere but not ready everywhere."""
        now = time.monotonic()
        stalled = set(pending_somewhere) - set(ready)
        for slot in list(self._since):
            if slot not in stalled:
                del self._since[slot]
                self._warned.discard(slot)
        for slot in stalled:
            since = self._since.setdefault(slot, now)
            if slot not in self._census or now - since < self.warning_s:
                continue
            name = cache.name_of(slot)
            submitted = self._census[slot]
            missing = sorted(set(range(self._size)) - submitted - joined)
            if slot not in self._warned:
                self._warned.add(slot)
                _warn(cache.descs(slot)[0].kind, name, now - since, missing, submitted)
            deadlocked = self.deadlocked(now)
            if deadlocked or self.shutdown_s and now - since >= self.shutdown_s:
                self._drops.append(Drop(name, missing, deadlocked))

    def forget_slot(self, slot: int) -> None:
        """The slot was dropped or renegotiated."""
        self._since.pop(slot, None)

    def _stalled_names(self, announced: dict[str, Announced], joined: set[int]) -> list[Drop]:
        """Named (uncached) ops past ``warning_s`` get a warning; past ``shutdown_s`` (or in a deadlock), a drop."""
        now = time.monotonic()
        deadlocked = self.deadlocked(now)
        dropped = []
        for name, entry in announced.items():
            age = now - entry.first_seen
            if age < self.warning_s:
                continue
            missing = sorted(set(range(self._size)) - set(entry.descs) - joined)
            if not entry.warned:
                entry.warned = True
                _warn(next(iter(entry.descs.values())).kind, name, age, missing, entry.descs)
            if deadlocked or self.shutdown_s and age >= self.shutdown_s:
                dropped.append(Drop(name, missing, deadlocked))
        return dropped

    def dropped_error(self, kind: OpKind, drop: Drop) -> HvdrayError:
        """The error a dropped op fails with on the ranks that submitted it."""
        name, missing = drop.name, drop.missing
        if drop.deadlock:
            return HvdrayError(
                f"{kind} {name!r} can never complete: rank(s) {missing} never submitted it, and for "
                f"{self.warning_s:g} s every rank has been waiting on an op that another rank never submitted "
                "(a deadlock: the ranks call different collectives, or the same ones in another order or under "
                "other names)"
            )
        return HvdrayError(
            f"{kind} {name!r} stalled for more than {self.shutdown_s} s: rank(s) {missing} never submitted it "
            "(stall_shutdown_s)"
        )


def _warn(kind: OpKind, name: str, age: float, missing: list[int], submitted: Iterable[Any]) -> None:
    log.warning(
        "%s %r has waited %.0f s for rank(s) %s (ranks %s submitted it); a rank may be stuck or "
        "calling ops in a different order", kind, name, age, missing, sorted(submitted),
    )
