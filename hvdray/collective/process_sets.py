"""Process sets: collectives over a subset of the job's ranks (Horovod's ``hvd.ProcessSet``).

Each registered set gets, on each of its members, its own engine: a private Gloo group on the job's
store under a set-specific key prefix, and its own negotiation thread. Collectives on disjoint sets
therefore run concurrently, and a set's negotiation never waits for ranks outside it. Adding and
removing sets is collective over the whole job (every rank calls it in the same order with the same
ranks), so every rank gives a set the same id. Set ranks in arguments (``root_rank``) are global
ranks, as in Horovod. After ``hvd.shutdown()`` (or an elastic reset) sets must be added again;
sets passed to ``hvd.init(process_sets=[...])`` are added by every ``init``.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable, Optional, Union

import torch

from hvdray.collective import session
from hvdray.collective.engine import Engine, Handle, Request
from hvdray.collective.protocol import OpDesc, OpKind, barrier_desc

log = logging.getLogger(__name__)

GLOBAL_ID = 0


class ProcessSet:
    """A sorted list of global ranks; ops given ``process_set=`` run among these ranks only."""

    def __init__(self, ranks: Iterable[int]) -> None:
        if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Iterable):
            raise TypeError(f"process_set ranks must be a list of ints, got {type(ranks).__name__}")
        ranks = list(ranks)
        bad = [r for r in ranks if isinstance(r, bool) or not isinstance(r, int) or r < 0]
        if bad:
            raise ValueError(f"process_set ranks must be non-negative ints, got {bad}")
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"process_set ranks must be unique, got {ranks}")
        if not ranks:
            raise ValueError("process_set needs at least one rank")
        self._ranks = sorted(ranks)
        self.process_set_id: Optional[int] = None

    @property
    def ranks(self) -> list[int]:
        """The set's global ranks, in order (a copy)."""
        return list(self._ranks)

    def size(self) -> int:
        """Number of ranks in the set."""
        return len(self.ranks)

    def included(self) -> bool:
        """True if this process's rank is a member."""
        return session.rank_info("ProcessSet.included()").rank in self.ranks

    def rank(self) -> int:
        """This process's rank within the set (its position in ``ranks``)."""
        me = session.rank_info("ProcessSet.rank()").rank
        if me not in self.ranks:
            raise ValueError(f"process_set {self!r}: rank {me} is not a member")
        return self.ranks.index(me)

    def __repr__(self) -> str:
        return f"ProcessSet(id={self.process_set_id}, ranks={self._ranks})"


class _GlobalProcessSet(ProcessSet):
    """Every rank of the job: what ops use when no ``process_set`` is given."""

    def __init__(self) -> None:
        self._ranks = []
        self.process_set_id = GLOBAL_ID

    @property
    def ranks(self) -> list[int]:
        """Every rank of the job as it is now (it changes with an elastic reset)."""
        return list(range(session.rank_info("global_process_set").size))

    def __repr__(self) -> str:
        return "global_process_set"


global_process_set: ProcessSet = _GlobalProcessSet()


def resolve(process_set: Any, what: str) -> tuple[Engine, ProcessSet]:
    """The engine an op on ``process_set`` (None: the global set) runs on, with the set itself.

    Raises a ValueError naming ``process_set`` when it is not registered or this rank is not a member.
    """
    if process_set is None or process_set is global_process_set:
        return session.engine(what), global_process_set
    check_registered(process_set)
    set_id = process_set.process_set_id
    me = session.rank_info(what).rank
    if me not in process_set.ranks:
        raise ValueError(f"{what}: rank {me} is not a member of process_set {process_set!r}")
    return session.engine(what, set_id), process_set


def check_registered(process_set: Any) -> None:
    """``process_set`` is a registered ProcessSet (this rank need not be a member), or an error naming it."""
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"process_set must be an hvd.ProcessSet, got {type(process_set).__name__}")
    set_id = process_set.process_set_id
    if set_id is None or session.current().process_sets.sets.get(set_id) is not process_set:
        raise ValueError(
            f"process_set {process_set!r} is not registered; pass it to hvd.init(process_sets=[...]) or "
            "hvd.add_process_set() on every rank first"
        )


def add_process_set(process_set: Union[ProcessSet, Iterable[int]]) -> ProcessSet:
    """Register a process set; every rank of the job must call it, in the same order, with the same ranks."""
    problem: Optional[Exception] = None
    if isinstance(process_set, ProcessSet):
        ps: Optional[ProcessSet] = process_set
    else:
        try:
            ps = ProcessSet(process_set)
        except (TypeError, ValueError) as exc:  # raised below, after the peers have been told
            ps, problem = None, exc
    if ps is not None and (ps is global_process_set or ps.process_set_id is not None):
        raise ValueError(f"process_set {ps!r} is already registered")
    info = session.rank_info("add_process_set")
    engine = session.engine("add_process_set")
    # every rank sends the ranks it passed (-1: invalid), so that a disagreement or a bad list fails on
    # every rank instead of leaving the others waiting
    mine = torch.tensor([-1] if ps is None else [len(ps.ranks), *ps.ranks], dtype=torch.int64)
    name = engine.auto_name("add_process_set")
    desc = OpDesc(name, OpKind.ALLGATHER, mine.dtype, mine.shape, generated=True)
    gathered = engine.submit_and_wait(Request(desc, mine, None, Handle(name))).tolist()
    passed: list[Optional[list[int]]] = []
    offset = 0
    for _ in range(info.size):
        n = gathered[offset]
        passed.append(None if n < 0 else gathered[offset + 1 : offset + 1 + n])
        offset += 1 + max(n, 0)
    if ps is None:
        raise problem  # type: ignore[misc]
    invalid = [r for r, p in enumerate(passed) if p is None]
    if invalid:
        raise ValueError(f"add_process_set: rank(s) {invalid} passed an invalid process_set")
    differing = {r: p for r, p in enumerate(passed) if p != ps.ranks}
    if differing:
        raise ValueError(
            f"add_process_set: ranks disagree on the process_set: rank {info.rank} passed {ps.ranks}, "
            f"but {differing}; every rank must add the same sets in the same order"
        )
    outside = [r for r in ps.ranks if r >= info.size]
    if outside:
        raise ValueError(f"process_set {ps.ranks} has rank(s) {outside} outside the job of size {info.size}")
    registry = session.current().process_sets
    with registry.lock:
        duplicate = next((s for s in registry.sets.values() if s.ranks == ps.ranks), None)
        if duplicate is not None:
            raise ValueError(f"a process_set with ranks {ps.ranks} is already registered: {duplicate!r}")
        set_id, registry.next_id = registry.next_id, registry.next_id + 1
    if info.rank in ps.ranks:
        session.start_set_engine(set_id, ps.ranks.index(info.rank), len(ps.ranks))
    with registry.lock:
        ps.process_set_id = set_id
        registry.sets[set_id] = ps
    log.debug("added %r", ps)
    return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a process set (collective over the job); False if it was not registered."""
    if process_set is global_process_set:
        raise ValueError("process_set: the global process set cannot be removed")
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"process_set must be an hvd.ProcessSet, got {type(process_set).__name__}")
    set_id = process_set.process_set_id
    registry = session.current().process_sets
    if set_id is None or registry.sets.get(set_id) is not process_set:
        return False
    engine = session.engine("remove_process_set")
    # every member is here before any member's engine stops
    name = engine.auto_name("remove_process_set")
    engine.submit_and_wait(Request(barrier_desc(name), None, None, Handle(name)))
    session.stop_set_engine(set_id)
    with registry.lock:
        registry.sets.pop(set_id, None)
        process_set.process_set_id = None
    return True


def add_initial_sets(process_sets: Any) -> None:
    """``hvd.init(process_sets=[...])``: register each set (a ProcessSet or a list of ranks) in order."""
    if process_sets is None or process_sets == "dynamic":  # Horovod's flag; every set here may be added later
        return
    if isinstance(process_sets, (str, bytes)) or not isinstance(process_sets, Iterable):
        raise TypeError(f"process_sets must be a list of hvd.ProcessSet, got {type(process_sets).__name__}")
    for ps in process_sets:
        if isinstance(ps, ProcessSet) and ps.process_set_id is not None:
            continue  # still registered (init called again while running)
        add_process_set(ps)
