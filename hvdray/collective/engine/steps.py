"""Step-aware batching's memory: which cached ops make up one of this rank's training steps.

Once a rank's steps repeat, the engine waits for a whole step (or a fusion buffer's worth of it)
before it ticks: one negotiation and one fused reduction per step instead of one per early gradient.
A step is the cached ops submitted until nothing is in flight any more after the step was submitted
whole or a caller waited on one of its ops (a backward pass and ``optimizer.step()``).
"""

from __future__ import annotations


class LearnedStep:
    """The cached slots of this rank's last complete step (``expected``) and of the current one.

    Touched only under the engine's lock (a caller's nudge closes the step from its own thread)."""

    __slots__ = ("expected", "current", "closing", "unsent_bytes")

    def __init__(self) -> None:
        self.expected: frozenset[int] = frozenset()
        self.current: set[int] = set()
        # the step is over once nothing is in flight after it was submitted whole or a caller waited on
        # it (not when its first tensors finish before its last ones are submitted)
        self.closing = False
        self.unsent_bytes = 0  # of cached requests sorted since the last tick

    def add(self, slots: list[int], nbytes: int) -> None:
        """Requests of ``nbytes`` in all went to these cached slots."""
        self.current.update(slots)
        self.unsent_bytes += nbytes

    def close(self) -> None:
        """The step is over once nothing is in flight: it was submitted whole, or a caller waits on it. A
        wait after the step was learned (its ops finished, the next step not begun) closes nothing: it
        must not end the next step at its first gradient."""
        if self.current:
            self.closing = True

    def learn_if_over(self) -> None:
        """At a tick's start with nothing older in flight: a closed step becomes the expected one."""
        if self.current and self.closing:
            self.expected, self.current, self.closing = frozenset(self.current), set(), False

    def submitted_whole(self) -> bool:
        """Every slot of the expected step has a request, and some of them are not sent yet."""
        return bool(self.unsent_bytes) and self.current >= self.expected

    def missing(self) -> int:
        """How many of the expected step's slots have no request yet (at least 1: a wake-up count)."""
        return max(1, len(self.expected) - len(self.current & self.expected))

    def forget(self) -> None:
        """Slots changed meaning or fusion changed: learn the step again."""
        self.expected = frozenset()
        self.current = set()
        self.closing = False
