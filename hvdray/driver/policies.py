"""What an elastic job does about failures and sizes: small decision classes, no Ray and no actors.

The controller asks; these answer. ``FailurePolicy`` says which node to avoid and for how long, whether
another reset is allowed and whether a worker's error ends the job. ``ScalingPolicy`` says how many
workers to start where and when too few workers have lasted too long. Neither starts, stops or kills
anything: the controller and the worker group do that.
"""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, Optional

log = logging.getLogger(__name__)

Clock = Callable[[], float]


@dataclass(frozen=True)
class ElasticLimits:
    """The sizes and limits an elastic job keeps to (validated by the executor)."""

    min_workers: int
    max_workers: int
    reset_limit: Optional[int]
    cooldown_range: Optional[tuple[float, float]]
    elastic_timeout: float


#: the cooldown of a node where a worker failed, when the executor was given no ``cooldown_range``
DEFAULT_COOLDOWN_RANGE = (10.0, 300.0)


@dataclass
class Blacklist:
    """Nodes where a worker failed; each comes back after an exponential backoff within the cooldown
    range (:data:`DEFAULT_COOLDOWN_RANGE` when None): never for good, a node may recover."""

    cooldown_range: Optional[tuple[float, float]]
    clock: Clock = time.monotonic
    _until: dict[str, float] = field(default_factory=dict)
    _failures: dict[str, int] = field(default_factory=dict)

    def add(self, node_id: str) -> float:
        """Blacklist ``node_id``; returns the cooldown in seconds (low, doubling per failure, up to high)."""
        count = self._failures[node_id] = self._failures.get(node_id, 0) + 1
        low, high = self.cooldown_range or DEFAULT_COOLDOWN_RANGE
        delay = min(high, low * 2 ** (count - 1))
        self._until[node_id] = self.clock() + delay
        return delay

    def blocked(self, node_id: str) -> bool:
        """True while ``node_id`` is in its cooldown."""
        return self._until.get(node_id, 0.0) > self.clock()


class RunErrorDecision(enum.Enum):
    """What a worker's exception means for the job."""

    RAISE = "raise"  # the job ends with this error
    IGNORE = "ignore"  # a worker outside the ring failed while the job finishes: nothing is lost


class FailurePolicy:
    """Failure decisions of one elastic executor; its blacklist outlives each ``run``."""

    def __init__(self, reset_limit: Optional[int], cooldown_range: Optional[tuple[float, float]],
                 clock: Clock = time.monotonic) -> None:
        self.reset_limit = reset_limit
        self.blacklist = Blacklist(cooldown_range, clock)

    def worker_lost(self, node_id: str, known_nodes: Iterable[str]) -> Optional[float]:
        """A worker on ``node_id`` died or stopped answering: avoid the node for a cooldown (returned, in
        seconds), unless no other of the ``known_nodes`` (the last discovery's) is usable: the last usable
        node is never blacklisted (None), or the job could only wait out elastic_timeout."""
        if not any(n != node_id and self.usable(n) for n in known_nodes):
            return None
        return self.blacklist.add(node_id)

    def start_failed(self, node_id: str, worker_died: bool, known_nodes: Iterable[str]) -> Optional[float]:
        """A worker could not start there. Its process dying marks the node (as :meth:`worker_lost`); a
        timeout or a refusal does not (discovery will say whether the node is still there). Returns the
        cooldown, if any."""
        return self.worker_lost(node_id, known_nodes) if worker_died else None

    def usable(self, node_id: str) -> bool:
        """False while ``node_id`` is blacklisted."""
        return not self.blacklist.blocked(node_id)

    def reset_refusal(self, resets_done: int) -> Optional[str]:
        """Why another membership reset is not allowed, or None when it is."""
        if self.reset_limit is not None and resets_done >= self.reset_limit:
            return (f"the elastic job needed reset number {resets_done + 1}, more than reset_limit="
                    f"{self.reset_limit}; giving up")
        return None

    @staticmethod
    def run_error(in_ring: bool, finishing: bool) -> RunErrorDecision:
        """A worker's function raised. Only a worker that never joined the ring may fail unnoticed, and
        only once the job is finishing (it was about to be dropped)."""
        return RunErrorDecision.IGNORE if finishing and not in_ring else RunErrorDecision.RAISE


class ScalingPolicy:
    """How many workers to run where, within ``limits``, and how long too few may go on."""

    def __init__(self, limits: ElasticLimits, clock: Clock = time.monotonic) -> None:
        self.limits = limits
        self._clock = clock
        self._below_min_since: Optional[float] = None

    def enough(self, workers: int) -> bool:
        """At least ``min_workers``: an epoch may form."""
        return workers >= self.limits.min_workers

    def free_slots(self, slots: Mapping[str, int], held: Mapping[str, int], workers: int,
                   usable: Callable[[str], bool]) -> dict[str, int]:
        """Workers to add per node: each usable node's slots not yet ``held`` by the job, never more in
        total than ``max_workers`` allows beside the ``workers`` running or starting (nodes in id order)."""
        room = self.limits.max_workers - workers
        free: dict[str, int] = {}
        for node_id in sorted(slots):
            if room <= 0:
                break
            if not usable(node_id):
                continue
            extra = min(slots[node_id] - held.get(node_id, 0), room)
            if extra > 0:
                free[node_id] = extra
                room -= extra
        return free

    def below_minimum(self, workers: int) -> Optional[str]:
        """Track time spent below ``min_workers``: None while the job may still wait (or has enough),
        the reason to give up once it has waited longer than ``elastic_timeout``."""
        if self.enough(workers):
            self._below_min_since = None
            return None
        now = self._clock()
        if self._below_min_since is None:
            self._below_min_since = now
            log.info("hvdray elastic: %d worker(s), waiting for min_workers=%d", workers, self.limits.min_workers)
            return None
        if now - self._below_min_since > self.limits.elastic_timeout:
            return (f"only {workers} worker(s) could run, fewer than min_workers={self.limits.min_workers}, "
                    f"for more than elastic_timeout={self.limits.elastic_timeout} s")
        return None
