"""The elastic driver: an explicit state machine that keeps a worker group training as Ray nodes come and go.

Each tick, :meth:`ElasticDriver.step` looks at the world (the workers' runs and starts, the
coordinator's waiting list, the discovery) for the current state and returns the transition to take,
or None to stay. Only :meth:`ElasticDriver._enter` changes the state, and only along
:data:`NEXT_STATES`::

    STARTING ──first epoch formed──▶ RUNNING ──a member returned──▶ FINISHING ──▶ FINISHED
                                      │    ▲
         new workers started, members │    │ every live worker waits for the next epoch:
         told to re-form at a commit  ▼    │ a new membership epoch is formed
                                   RESIZING / RECOVERING ◀── a worker died, or a member's ring broke
                                                              (from STARTING, RUNNING or RESIZING)

    ERRORED from anywhere: reset_limit exceeded, below min_workers for longer than elastic_timeout,
    an exception raised by the user's function, or the coordinator lost.

Leaving STARTING, RESIZING or RECOVERING forms a new membership epoch in the coordinator: the
survivors (in their old rank order) then the new workers. Entering RECOVERING abandons the current
epoch, so that members still in its rendezvous stop waiting at once. While the job trains or
re-forms, every worker is pinged without waiting for the answer; one that fails to answer is dropped
and its node cooled down (never the last usable node). A live worker is never dropped for being slow
to rejoin, unless it stays away for elastic_timeout. Every transition is logged and sent to the
run's callbacks as ``{"event": "elastic", ...}``. What to do about failures and sizes is asked of
:mod:`hvdray.driver.policies`; the workers themselves are started and stopped by the worker group.
"""

from __future__ import annotations

import enum
import logging
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import ray

from hvdray.driver.datasets import DatasetSplitter
from hvdray.driver.discovery import HostDiscovery, slots_per_node
from hvdray.driver.failures import (
    ROOT_CAUSE_GRACE_S,
    CoordinatorLostError,
    consequence_level,
    failure_error,
    ring_broke,
)
from hvdray.driver.placement import node_worker_options
from hvdray.driver.policies import Clock, ElasticLimits, FailurePolicy, RunErrorDecision, ScalingPolicy
from hvdray.driver.records import hand_to_callbacks
from hvdray.driver.worker_group import GroupWorker, RunOutcome, WorkerGroup
from hvdray.settings import Settings

log = logging.getLogger(__name__)

_TICK_S = 0.05
_UNANSWERED_S = 2.0  # a worker whose ping goes unanswered this long is gone (its node is down, most likely)


class DriverState(enum.Enum):
    STARTING = "starting"
    RUNNING = "running"
    RESIZING = "resizing"
    RECOVERING = "recovering"
    FINISHING = "finishing"
    FINISHED = "finished"
    ERRORED = "errored"


#: Which state may follow which: the one place that says so. Every live state may also end in ERRORED;
#: RECOVERING may start over (another worker lost meanwhile restarts its rejoin deadline).
NEXT_STATES: dict[DriverState, frozenset[DriverState]] = {
    DriverState.STARTING: frozenset({DriverState.RUNNING, DriverState.RECOVERING, DriverState.FINISHING}),
    DriverState.RUNNING: frozenset({DriverState.RESIZING, DriverState.RECOVERING, DriverState.FINISHING}),
    DriverState.RESIZING: frozenset({DriverState.RUNNING, DriverState.RECOVERING, DriverState.FINISHING}),
    DriverState.RECOVERING: frozenset({DriverState.RUNNING, DriverState.RECOVERING, DriverState.FINISHING}),
    DriverState.FINISHING: frozenset({DriverState.FINISHED}),
    DriverState.FINISHED: frozenset(),
    DriverState.ERRORED: frozenset(),
}
_TERMINAL = frozenset({DriverState.FINISHED, DriverState.ERRORED})


class ElasticJobError(RuntimeError):
    """An elastic job could not go on: reset_limit exceeded, too few workers for elastic_timeout, or a
    worker's function returned without calling ``hvd.init()``."""


@dataclass(frozen=True)
class Transition:
    """The state a step decided on, why, and (into ERRORED) the error the run raises."""

    state: DriverState
    reason: str
    error: Optional[BaseException] = None


def errored(error: BaseException) -> Transition:
    """The transition that ends the run with ``error``."""
    return Transition(DriverState.ERRORED, str(error), error)


def _rank_or_last(rank: Optional[int]) -> int:
    """A worker's rank for ordering, a worker without one (not in an epoch yet) after every rank."""
    return rank if rank is not None else sys.maxsize


def _named(worker: GroupWorker) -> str:
    """A worker as an error names it: its id, and its rank if it had one."""
    return f"worker {worker.worker_id}" + (f" (rank {worker.rank})" if worker.rank is not None else "")


def allowed(old: DriverState, new: DriverState) -> bool:
    """True when the machine may move from ``old`` to ``new``."""
    return new in NEXT_STATES[old] or (new is DriverState.ERRORED and old not in _TERMINAL)


class ElasticDriver:
    """Runs one ``executor.run(fn)`` of an elastic job from start to a result or a clear error."""

    def __init__(
        self,
        group: WorkerGroup,
        limits: ElasticLimits,
        settings: Settings,
        discovery: HostDiscovery,
        cpus_per_worker: float,
        gpus_per_worker: float,
        failure_policy: FailurePolicy,
        clock: Clock = time.monotonic,
    ) -> None:
        self._clock = clock
        self._group = group  # an elastic group of its own: stopped when the run ends
        self._settings = settings
        self._discovery = discovery
        self._cpus = cpus_per_worker
        self._gpus = gpus_per_worker
        self._failures = failure_policy
        self._scaling = ScalingPolicy(limits, clock)
        self._state = DriverState.STARTING
        self._epoch = 0
        self._resets = 0
        self._next_discovery = 0.0
        self._known_nodes: set[str] = set()  # the nodes the last discovery offered
        self._recovering_since = 0.0
        self._lost: list[str] = []  # workers lost since the last epoch formed ("worker <id> (rank <r>)")
        self._ring_broke_at: Optional[float] = None  # when a member's run first raised a broken ring, unexplained
        self._error: Optional[BaseException] = None
        self._call: tuple[Callable[..., Any], list[Any], dict[str, Any]] = (lambda: None, [], {})
        self._callbacks: list[Callable[[dict[str, Any]], None]] = []

    @property
    def state(self) -> DriverState:
        return self._state

    # -- the machine ----------------------------------------------------------------------------
    def run(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any],
        kwargs: dict[str, Any],
        callbacks: Sequence[Callable[[dict[str, Any]], None]],
        datasets: Optional[DatasetSplitter] = None,
    ) -> list[Any]:
        """Drive the job until every member of the last epoch returned; results in rank order. ``datasets``
        are split anew over the members of every epoch."""
        self._call = (fn, list(args), dict(kwargs))
        self._group.begin_call(datasets)  # every worker of this run, started now or later, runs this one call
        self._callbacks = list(callbacks)
        self._report(None, DriverState.STARTING, "job started")
        try:
            while self._state not in _TERMINAL:
                # first, all of them (flush): records arrive before the transition they cause
                self._group.records.deliver(self._callbacks, flush=True)
                transition = self.step()
                if transition is not None:
                    self._enter(transition)
                time.sleep(_TICK_S)
            self._group.records.deliver(self._callbacks, flush=True)
        except (ray.exceptions.RayActorError, CoordinatorLostError) as exc:  # worker deaths are handled above
            raise ElasticJobError(f"{exc}; the elastic job cannot go on") from exc
        finally:
            self.stop()
        if self._error is not None:
            raise self._error
        return [w.result for w in self._group.ranked() if w.done]

    def step(self) -> Optional[Transition]:
        """Look at the world in the current state; the transition to take, or None to stay."""
        steps = {
            DriverState.STARTING: self._step_starting,
            DriverState.RUNNING: self._step_running,
            DriverState.RESIZING: self._step_resizing,
            DriverState.RECOVERING: self._step_recovering,
            DriverState.FINISHING: self._step_finishing,
        }
        return steps[self._state]()

    def _enter(self, transition: Transition) -> None:
        """The only place the state changes, with each state's entry action."""
        old, new = self._state, transition.state
        if not allowed(old, new):
            raise AssertionError(f"hvdray elastic: no transition from {old.value} to {new.value}")
        self._state = new
        if new is DriverState.RECOVERING:
            if old is not DriverState.RECOVERING:
                self._recovering_since = self._clock()
            if self._epoch > 0:  # whoever waits in the current epoch's rendezvous learns at once it is over
                self._group.abandon_epoch(self._epoch)
        elif new is DriverState.FINISHING:
            self._group.drain()  # no new workers: the job ends with the members it has
        elif new is DriverState.ERRORED:
            self._error = transition.error
        self._report(old, new, transition.reason)

    def _step_starting(self) -> Optional[Transition]:
        """Place workers on the discovered slots; form the first epoch once they have all started."""
        ended = self._after_runs()
        if ended is not None:
            return ended
        self._place_workers(discover_anyway=True)
        given_up = self._given_up_below_minimum()
        if given_up is not None:
            return given_up
        if not self._scaling.enough(len(self._group.workers)) or self._group.starting:
            return None  # the first epoch waits for min_workers and for every worker started so far
        return self._form_epoch_when_ready(deadline=None)

    def _step_running(self) -> Optional[Transition]:
        """Watch the members; start workers on new slots (a resize) and notice hosts that left."""
        ended = self._after_runs()
        if ended is not None:
            return ended
        if self._members_waiting():
            return Transition(DriverState.RECOVERING, "a member left its epoch after a peer failure")
        if self._collect_started():
            self._group.announce_new_hosts()
            return Transition(DriverState.RESIZING, f"new workers started: {len(self._group.workers)} in the job")
        if not self._discovery_due():
            return None
        slots = self._discover()
        if slots is None:
            return None
        lost = [w for w, worker in self._group.workers.items() if worker.node_id not in slots]
        if lost:
            self._drop(lost, lost_workers=False)
            return Transition(DriverState.RECOVERING, f"hosts of worker(s) {lost} left the discovery")
        self._launch(self._free_slots(slots))
        return None

    def _step_resizing(self) -> Optional[Transition]:
        """New workers wait in hvd.init; members join them when they commit next."""
        ended = self._after_runs()
        if ended is not None:
            return ended
        self._collect_started()
        return self._form_epoch_when_ready(deadline=None)

    def _step_recovering(self) -> Optional[Transition]:
        """Drop the dead, start replacements only if below min_workers, re-form the ring from the rest.

        A live worker that has not rejoined yet (a survivor still in a collective, a rendezvous or its own
        code, slow under load) is waited for, up to elastic_timeout: slow is not dead."""
        ended = self._after_runs()
        if ended is not None:
            return ended
        self._place_workers(discover_anyway=False)
        given_up = self._given_up_below_minimum()
        if given_up is not None:
            return given_up
        if not self._scaling.enough(len(self._group.workers)):
            return None  # replacements are on their way
        return self._form_epoch_when_ready(deadline=self._recovering_since + self._scaling.limits.elastic_timeout)

    def _step_finishing(self) -> Optional[Transition]:
        """A member returned: wait for the others of its epoch, then drop everyone else."""
        ended = self._after_runs()
        if ended is not None:
            return ended
        members = self._group.ranked()
        waiting = self._group.waiting()
        if not all(m.done or m.worker_id in waiting for m in members):
            return None
        self._group.remove([w.worker_id for w in self._group.workers.values() if not w.done])
        return Transition(DriverState.FINISHED, f"{sum(m.done for m in members)} member(s) returned")

    # -- what happened and what it calls for (may drop workers; never changes the state) ----------
    def _after_runs(self) -> Optional[Transition]:
        """Collect ended runs and, while the job trains or re-forms, workers that stopped answering pings
        (never blocking): the dead are dropped; returns the transition they call for, if any."""
        finishing = self._state in (DriverState.FINISHING, DriverState.FINISHED)
        lost: list[str] = []
        if self._state in (DriverState.RUNNING, DriverState.RESIZING, DriverState.RECOVERING):
            lost += self._group.poll_liveness(_UNANSWERED_S)
        returned = False
        raised = []
        for ended in self._group.poll_runs():
            worker = ended.worker
            if ended.outcome is RunOutcome.RETURNED:
                if worker.rank is None and not finishing:  # the epochs would wait for it for ever
                    return errored(ElasticJobError(
                        f"worker {worker.worker_id} returned from the training function without joining the job: "
                        "an elastic job's function must call hvd.init() (membership epochs are formed from the "
                        "workers waiting in it); the job was stopped"))
                returned = True
            elif ended.outcome is RunOutcome.LOST:
                if ended.out_of_memory:
                    log.warning("hvdray elastic: worker %s was killed because its node ran out of memory",
                                worker.worker_id)
                if worker.worker_id not in lost:
                    lost.append(worker.worker_id)
            elif self._failures.run_error(worker.rank is not None, finishing) is RunErrorDecision.RAISE:
                assert ended.error is not None
                raised.append(ended)
        if raised:
            # of the errors that ended together, the root cause, not a peer's op that failed because of it
            first = min(raised, key=lambda e: (consequence_level(e.error), _rank_or_last(e.worker.rank)))
            broke = ring_broke(first.error)
            if broke and not (lost or self._lost):
                # a ring broken by a dead peer breaks in the survivors first: give the driver a moment to
                # notice the loss, which the error then names (a raised run is reported again next poll)
                if self._ring_broke_at is None:
                    self._ring_broke_at = self._clock()
                if self._clock() - self._ring_broke_at < ROOT_CAUSE_GRACE_S:
                    return None
            return errored(failure_error(first.error, first.worker.rank, worker_id=first.worker.worker_id,
                                         aftermath=self._why_stopped(broke, lost)))
        if lost:
            self._drop(lost, lost_workers=True)
        if self._state is DriverState.FINISHING:
            return None
        if returned:  # before a loss seen in the same poll: a member that returned never rejoins an epoch
            meanwhile = f" (worker(s) {lost} lost meanwhile)" if lost else ""
            return Transition(DriverState.FINISHING, f"a member returned from the training function{meanwhile}")
        if lost:
            return Transition(DriverState.RECOVERING, f"worker(s) {lost} died")
        return None

    def _why_stopped(self, broke: bool, lost_now: Sequence[str]) -> str:
        """What the note of the error that ends the run says. A ring that broke under a member's own
        collectives reaches the driver only from outside ``hvd.elastic.run`` (which catches it to roll back),
        so that is said, with the workers whose loss most likely broke it."""
        if not broke:
            return "the job was stopped"
        lost = self._lost + [_named(self._group.workers[w]) for w in lost_now if w in self._group.workers]
        cause = f" after the loss of {', '.join(lost)}" if lost else ""
        return (f"the job was stopped: the ring broke{cause} while this rank ran collectives outside "
                "hvd.elastic.run. As in Horovod's elastic mode, only the function that hvd.elastic.run wraps "
                "rolls back to its last commit and goes on; call the collectives from inside it")

    def _given_up_below_minimum(self) -> Optional[Transition]:
        """The transition to ERRORED once fewer than min_workers have run for longer than elastic_timeout."""
        reason = self._scaling.below_minimum(len(self._group.workers))
        return errored(ElasticJobError(reason)) if reason is not None else None

    def _form_epoch_when_ready(self, deadline: Optional[float]) -> Optional[Transition]:
        """When every live worker waits for a new epoch, form it (checking reset_limit first). Workers
        still not waiting after ``deadline`` (they answer pings, or they would be gone) are dropped, and
        their nodes stay usable: they are stuck, their node did not fail."""
        waiting = self._group.waiting()
        late = [w for w in self._group.workers if w not in waiting]
        if late:
            if deadline is not None and self._clock() > deadline:
                log.warning("hvdray elastic: worker(s) %s answer but did not rejoin within elastic_timeout=%s s; "
                            "dropping them", late, self._scaling.limits.elastic_timeout)
                self._drop(late, lost_workers=False)
            return None
        if not self._scaling.enough(len(self._group.workers)):
            return Transition(DriverState.RECOVERING, f"only {len(self._group.workers)} worker(s) left")
        if self._epoch > 0:
            refusal = self._failures.reset_refusal(self._resets)
            if refusal is not None:
                return errored(ElasticJobError(refusal))
            self._resets += 1
        order = sorted(self._group.workers.values(),
                       key=lambda w: (w.rank is None, w.rank if w.rank is not None else 0))
        self._epoch = self._group.form_epoch(order)
        self._lost.clear()  # the new epoch's rings were built without them: they break nothing any more
        return Transition(DriverState.RUNNING, f"membership epoch {self._epoch} formed with {len(order)} worker(s)")

    def _members_waiting(self) -> list[str]:
        """Members of the running epoch that left it: their ring broke."""
        waiting = self._group.waiting()
        return [w for w, worker in self._group.workers.items() if w in waiting and worker.rank is not None]

    def _discovery_due(self) -> bool:
        """True (and the next one scheduled) when it is time to ask the discovery again."""
        if self._clock() < self._next_discovery:
            return False
        self._next_discovery = self._clock() + self._settings.discovery_interval_s
        return True

    def _discover(self) -> Optional[dict[str, int]]:
        """Slots per node from the discovery; None when it failed (the job goes on, asking again later)."""
        try:
            slots = slots_per_node(self._discovery)
        except Exception:  # noqa: BLE001 - a failing discovery must not end the job
            log.warning("hvdray elastic: host discovery failed", exc_info=True)
            return None
        self._known_nodes = set(slots)
        return slots

    def _free_slots(self, slots: dict[str, int]) -> dict[str, int]:
        """Slots not yet used by this job, per node, never more in total than max_workers allows."""
        running = len(self._group.workers) + self._group.starting
        return self._scaling.free_slots(slots, self._group.held(), running, self._failures.usable)

    def held(self) -> dict[str, int]:
        """Workers this job runs per node (Ray's free resources do not count them)."""
        return self._group.held()

    # -- actions (start and drop workers; never change the state) ---------------------------------
    def _place_workers(self, discover_anyway: bool) -> None:
        """Collect started workers; below min_workers (or ``discover_anyway``) start more on free slots."""
        self._collect_started()
        below = not self._scaling.enough(len(self._group.workers))
        if (below or discover_anyway) and self._discovery_due():
            slots = self._discover()
            if slots is not None:
                self._launch(self._free_slots(slots))

    def _launch(self, free: dict[str, int]) -> None:
        """Start one worker per free slot; :meth:`_collect_started` gives them ``fn`` once they answer."""
        for node_id, count in free.items():
            for _ in range(count):
                options = node_worker_options(node_id, self._cpus, self._gpus)
                self._group.launch(uuid.uuid4().hex[:8], options, node_id=node_id)
        if free:
            log.info("hvdray elastic: starting %d worker(s) on %s", sum(free.values()),
                     {n[:8]: c for n, c in free.items()})
            # Ray's view of free resources lags the new actors: look again only once it has caught up
            self._next_discovery = self._clock() + 2 * self._settings.discovery_interval_s

    def _collect_started(self) -> int:
        """Workers that started are given ``fn`` (they wait in hvd.init); failed starts are reported to
        the failure policy. Returns how many started."""
        started, failed = self._group.poll_starts()
        for failure in failed:
            log.warning("hvdray elastic: could not start a worker on node %s: %s",
                        (failure.node_id or "?")[:8], failure.error)
            if failure.node_id is not None:
                self._failures.start_failed(failure.node_id, failure.worker_died, self._known_nodes)
        fn, args, kwargs = self._call
        for worker in started:
            self._group.run(worker, fn, args, kwargs)
        return len(started)

    def _drop(self, worker_ids: Sequence[str], lost_workers: bool) -> None:
        """Remove these workers; ``lost_workers``: they failed, and the policy hears of their nodes."""
        if not worker_ids:
            return
        for worker in self._group.remove(worker_ids):
            if lost_workers:
                self._lost.append(_named(worker))
            if lost_workers and worker.node_id is not None:
                delay = self._failures.worker_lost(worker.node_id, self._known_nodes)
                if delay is None:
                    log.warning("hvdray elastic: worker %s on node %s lost; the node is the last usable one and "
                                "stays in use", worker.worker_id, worker.node_id[:8])
                else:
                    log.warning("hvdray elastic: worker %s on node %s lost; node blacklisted for %s s",
                                worker.worker_id, worker.node_id[:8], delay)

    def stop(self) -> None:
        """End every worker of this run (see ``WorkerGroup.stop``; the coordinator belongs to the executor)."""
        self._group.stop()

    # -- reporting ---------------------------------------------------------------------------------
    def _report(self, old: Optional[DriverState], new: DriverState, reason: str) -> None:
        record = {
            "event": "elastic",
            "state": new.value,
            "previous": old.value if old is not None else None,
            "reason": reason,
            "epoch": self._epoch,
            "workers": len(self._group.workers),
            "resets": self._resets,
            "time": time.time(),
        }
        log.info("hvdray elastic: %s -> %s (%s); epoch %d, %d worker(s), %d reset(s)",
                 record["previous"], new.value, reason, self._epoch, len(self._group.workers), self._resets)
        hand_to_callbacks(self._callbacks, record)
