"""Step-aware batching's memory: which cached ops make up one of this rank's training steps.

Once a rank's steps repeat, the engine waits for a whole step (or a fusion buffer's worth of it)
before it ticks: one negotiation and one fused reduction per step instead of one per early gradient.
A step is the cached ops submitted until nothing is in flight any more after the step was submitted
whole or a caller waited on one of its ops (a backward pass and ``optimizer.step()``).

A named op counts by its cached slot. An unnamed op counts by its family
(``protocol.family_variants``): its calls take a new slot, one of the family's variants, from call to call, so a
step of three unnamed allreduces of one family is "three of that family" whichever variants they take.
A step in which a family's slots were made is not learned: its first call went by name, uncounted, and the
calls after it by the family's slots.
"""

from __future__ import annotations

from collections import Counter


class LearnedStep:
    """The cached slots and unnamed families of this rank's last complete step (``expected``,
    ``expected_families``: how many calls of each) and of the current one.

    Touched only under the engine's lock (a caller's nudge closes the step from its own thread)."""

    __slots__ = ("expected", "current", "expected_families", "families", "closing", "partial", "unsent_bytes")

    def __init__(self) -> None:
        self.expected: frozenset[int] = frozenset()
        self.current: set[int] = set()
        self.expected_families: dict[str, int] = {}
        self.families: Counter[str] = Counter()
        # the step is over once nothing is in flight after it was submitted whole or a caller waited on
        # it (not when its first tensors finish before its last ones are submitted)
        self.closing = False
        self.partial = False  # a family's slots were made since the last step was learned
        self.unsent_bytes = 0  # of cached requests sorted since the last tick

    @property
    def is_open(self) -> bool:
        """Some op of the current step has been submitted."""
        return bool(self.current or self.families)

    @property
    def learned(self) -> bool:
        """A complete step is known (the engine waits for the next one to be whole)."""
        return bool(self.expected or self.expected_families)

    def add(self, slots: list[int], nbytes: int, families: tuple[str, ...] = ()) -> None:
        """Requests of ``nbytes`` in all went to these cached slots, and unnamed ones of these families
        (one entry per request)."""
        self.current.update(slots)
        if families:
            self.families.update(families)
        self.unsent_bytes += nbytes

    def close(self) -> None:
        """The step is over once nothing is in flight: it was submitted whole, or a caller waits on it. A
        wait after the step was learned (its ops finished, the next step not begun) closes nothing: it
        must not end the next step at its first gradient."""
        if self.current or self.families:
            self.closing = True

    def learn_if_over(self) -> None:
        """At a tick's start with nothing older in flight: a closed step becomes the expected one, unless
        it was partial (the expected step stays as it was)."""
        if self.closing and (self.current or self.families):
            if not self.partial:
                self.expected, self.expected_families = frozenset(self.current), dict(self.families)
            self.current, self.families = set(), Counter()
            self.closing = self.partial = False

    def family_negotiated(self) -> None:
        """An unnamed call went by name and its family's slots were made: the step it belongs to lacks that
        call but counts the family's later calls, which go by those slots, so that step is not learned."""
        self.partial = True

    def submitted_whole(self) -> bool:
        """Every slot of the expected step has a request, as many of each family as it had, and some of
        them are not sent yet."""
        if not self.unsent_bytes or not self.current >= self.expected:
            return False
        families = self.families
        return all(families[family] >= count for family, count in self.expected_families.items())

    def missing(self) -> int:
        """How many of the expected step's requests have not come yet (at least 1: a wake-up count)."""
        missing = len(self.expected) - len(self.current & self.expected)
        families = self.families
        missing += sum(max(0, count - families[family]) for family, count in self.expected_families.items())
        return max(1, missing)

    def forget(self) -> None:
        """Slots changed meaning or fusion changed: learn the step again."""
        self.expected = frozenset()
        self.current = set()
        self.expected_families = {}
        self.families = Counter()
        self.closing = self.partial = False
