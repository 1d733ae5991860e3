"""The worker actors of one job under one lifecycle, for fixed and elastic runs alike.

::

    STARTING ──started──▶ RUNNING ──drain()──▶ DRAINING ──stop()──▶ STOPPED
        │                    │                                            ▲
        └────────────────────┴── stop(): a start failed, a worker died, ──┘
                                 Ctrl-C, the run or the executor ended

A fixed group is RUNNING once every rank is configured; an elastic one from its first worker on
(it keeps adding workers while it runs). DRAINING starts no more workers. A fixed group whose call
failed because a rank's function raised stays RUNNING, its ``failed_call`` set: the next call takes
it once the others' calls have ended (:meth:`WorkerGroup.settle_failed_call`), or stops it.

A worker starts in steps, each one Ray call with its own budget: its actor is created and reports
its slot (within ``placement_group_timeout_s``), then an elastic worker is configured (importing torch,
which under CPU load can take far longer than ``timeout_s``: it has ``elastic_timeout``, the time the
job may wait for workers anyway; a worker that dies meanwhile fails its start at once). A fixed
group's workers, whose placement group the cluster has granted, take each step (the process, ranks,
configuration, the executable) within the larger of ``timeout_s`` and ``placement_group_timeout_s``.
:meth:`WorkerGroup.poll_starts` advances every start without blocking on any one of them, and
:meth:`WorkerGroup.poll_liveness` pings without waiting for the answers, so that a control loop can
keep watching everything else. A fixed group starts all its workers at
once, gives them ranks and stops whatever it started if any step fails.

The workers' records reach the run's callbacks through :class:`~hvdray.driver.records.RecordStream`;
a failed rank is named by :mod:`hvdray.driver.failures`; the job's actors are named here, once.
"""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import ray

from hvdray.collective.topology import WorkerSlot
from hvdray.driver.cluster import actor_class
from hvdray.driver.coordinator_host import (
    CoordinatorClient,
    JobCoordinator,
    fixed_worker_class,
    start_coordinating_worker,
)
from hvdray.driver.datasets import DatasetSplitter, end_split
from hvdray.driver.failures import ROOT_CAUSE_GRACE_S, CoordinatorLostError, consequence_level, failure_error
from hvdray.driver.node_liveness import NodeProbe
from hvdray.driver.records import Callback, RecordStream
from hvdray.settings import Settings
from hvdray.worker.actor import Worker

log = logging.getLogger(__name__)

_FEASIBLE_CHECK_S = 1.0  # how often a fixed start waiting for its bundles checks that they can still be had
_PING_EVERY_S = 0.5  # liveness: a worker is pinged again this long after it answered
_NAME_FREED_POLL_S = 0.05  # how often a worker's start looks again whether its name is free
_NODE_ASKED_EVERY_S = 1.0  # liveness: the node of a silent worker found up is asked again this long after

#: how long an idle worker has to exit on its own when its group stops (see ``WorkerGroup.stop``), as
#: Ray Train gives its workers
WORKER_EXIT_PATIENCE_S = 5.0


def actor_name(executor_id: str, role: str) -> str:
    """The Ray name of one of the job's actors (``coordinator``, ``rank-3``, ``elastic-<id>``) or of its
    placement group (``pg``), so that ``ray list actors`` / ``ray list placement-groups`` and the
    dashboard show who is who."""
    return f"hvdray-{executor_id}-{role}"


class GroupState(enum.Enum):
    STARTING = "starting"
    RUNNING = "running"
    DRAINING = "draining"
    STOPPED = "stopped"


@dataclass
class GroupWorker:
    """One worker actor of the group and what the driver knows about it."""

    worker_id: str
    actor: Any
    node_id: Optional[str]  # where it was asked to run (elastic) or runs (once its slot is known)
    slot: Optional[WorkerSlot] = None
    rank: Optional[int] = None  # in the current epoch; None until it is in the ring
    run_ref: Optional[ray.ObjectRef] = None
    done: bool = False
    result: Any = None


@dataclass
class _Start:
    """A worker on its way in: the Ray call it waits on now and the time that call may take."""

    worker: GroupWorker
    call: ray.ObjectRef
    deadline: float
    out_of_time: str  # the error's text when the call outlives its budget
    configuring: bool = False  # False: waiting for its slot; True: waiting for configure()


@dataclass(frozen=True)
class StartFailure:
    """A worker that did not start; its actor has been killed."""

    worker_id: str
    node_id: Optional[str]
    error: BaseException
    worker_died: bool  # its process died or its node went away (not a timeout)


class RunOutcome(enum.Enum):
    RETURNED = "returned"
    LOST = "lost"  # the worker died (killed, its node lost, out of memory)
    RAISED = "raised"  # the function raised


@dataclass(frozen=True)
class RunResult:
    """How one worker's function call ended."""

    worker: GroupWorker
    outcome: RunOutcome
    error: Optional[BaseException] = None
    out_of_memory: bool = False


def _raised_by_the_function(exc: BaseException) -> bool:
    """Whether a worker's call ended with an exception raised in it (the user's, or one from an actor it
    called: a dataset split the driver ended), its worker alive; a dead worker's call ends with Ray's
    ``RayActorError`` or ``OutOfMemoryError`` instead. Whether the actors the workers need (the job's
    coordinator) are alive, :meth:`WorkerGroup.settle_failed_call` asks."""
    return isinstance(exc, ray.exceptions.RayTaskError)


class WorkerGroup:
    """The job's worker actors: started, watched and stopped here.

    ``elastic`` groups name workers by id, configure each on its own as it starts (it then waits for a
    membership epoch) and answer pings while busy; fixed groups start all ranks at once
    (:meth:`start_fixed`). A group that owns its coordinator closes the job there when it stops. A fixed
    group given no coordinator keeps it in its first worker (``coordinator_host.CoordinatingWorker``)."""

    def __init__(
        self,
        executor_id: str,
        settings: Settings,
        coordinator: Optional[JobCoordinator],
        runtime_env: Optional[dict[str, Any]],
        elastic: bool,
        owns_coordinator: bool,
    ) -> None:
        self.executor_id = executor_id
        self.state = GroupState.STARTING
        self.workers: dict[str, GroupWorker] = {}  # started workers, by id
        self._starting: dict[str, _Start] = {}
        self._settings = settings
        self._worker_settings = settings.for_workers()
        self._coordinator: Optional[JobCoordinator] = coordinator
        self._coordinator_answered = False  # see ask_coordinator
        self._runtime_env = runtime_env
        self._elastic = elastic
        self._owns_coordinator = owns_coordinator
        self._hosted_by_worker = coordinator is None  # the coordinator dies with a worker: see gather()
        self.call = 0  # the number of the latest call sent to the workers (see begin_call)
        #: a rank raised in the last call and the workers were kept: see :meth:`settle_failed_call`
        self.failed_call = False
        self.epoch = 0  # the membership epoch the coordinator formed last
        self._datasets: Optional[DatasetSplitter] = None  # the current call's Ray Datasets, split per epoch
        self._split: list[dict[str, Any]] = []  # the shards of the current split, one per rank (none: [])
        self._pings: dict[str, tuple[ray.ObjectRef, float]] = {}  # worker id -> (ping in flight, sent at)
        self._next_ping: dict[str, float] = {}  # worker id -> when to ping it again
        self._node_probe = NodeProbe(interval_s=_NODE_ASKED_EVERY_S)
        #: the workers' records, handed to the run's callbacks and (``records.on_report``) its result
        self.records = RecordStream(lambda: self._coordinator.client if self._coordinator is not None else None,
                                    self.ask_coordinator)

    @property
    def coordinator(self) -> CoordinatorClient:
        assert self._coordinator is not None, "the group was stopped"
        return self._coordinator.client

    @property
    def _secret(self) -> bytes:
        assert self._coordinator is not None, "the group was stopped"
        return self._coordinator.secret

    # -- starting ------------------------------------------------------------------------------
    def launch(self, worker_id: str, actor_options: dict[str, Any], node_id: Optional[str] = None) -> None:
        """Create one worker actor with ``actor_options`` (from placement); it joins once it answers. The
        first worker of a fixed group without a coordinator is created holding the job's coordinator."""
        if self.state in (GroupState.DRAINING, GroupState.STOPPED):
            raise RuntimeError(f"cannot start workers in a {self.state.value} worker group")
        options = dict(actor_options)
        if self._runtime_env:
            options["runtime_env"] = self._runtime_env
        options["name"] = actor_name(self.executor_id, f"elastic-{worker_id}" if self._elastic else f"rank-{worker_id}")
        if self._elastic:
            options["max_concurrency"] = 2  # ping answers while run is busy
            actor = self._create_named(lambda: actor_class(Worker).options(**options).remote(), options["name"])
        elif self._coordinator is None:
            actor, self._coordinator = self._create_named(lambda: start_coordinating_worker(options), options["name"])
        else:
            worker_class = fixed_worker_class(hosts_coordinator=False)
            actor = self._create_named(lambda: worker_class.options(**options).remote(), options["name"])
        self._starting[worker_id] = self._awaiting(GroupWorker(worker_id, actor, node_id), actor.slot.remote())

    def _set_up(self, what: str, calls: Any) -> Any:
        """``ray.get(calls)`` within the set-up's budget, or a TimeoutError saying which step of a fixed
        start ran out."""
        seconds, named = self._setup_budget()
        try:
            return ray.get(calls, timeout=seconds)
        except ray.exceptions.GetTimeoutError as exc:
            raise TimeoutError(
                f"hvdray executor {self.executor_id}: the started workers were not {what} within {named}"
            ) from exc

    def _create_named(self, create: Callable[[], Any], name: str) -> Any:
        """``create()``, which creates the actor called ``name``, made again while that name is taken.
        A rank's name is the same in every group of an executor, and Ray frees it only once the actor
        that had it is dead: right after a failed run, the killed worker of the last group may still
        hold it. Waits at most ``placement_group_timeout_s``, the budget of a worker's start."""
        seconds = self._settings.placement_group_timeout_s
        deadline = time.monotonic() + seconds
        while True:
            try:
                return create()
            except ray.exceptions.ActorAlreadyExistsError as exc:
                if time.monotonic() >= deadline:
                    raise RuntimeError(
                        f"hvdray executor {self.executor_id}: the worker's actor name {name!r} was still taken "
                        f"by another actor after placement_group_timeout_s={seconds} s"
                    ) from exc
                time.sleep(_NAME_FREED_POLL_S)

    def _awaiting(self, worker: GroupWorker, call: ray.ObjectRef, configuring: bool = False) -> _Start:
        """A start step with its own budget: an elastic worker placement_group_timeout_s to start (it may
        wait for the cluster's resources) and elastic_timeout to be configured; a fixed group's worker,
        whose placement group the cluster has granted, the set-up's budget (:meth:`_setup_budget`)."""
        what = "was not configured" if configuring else "did not start"
        if self._elastic:
            budget = "elastic_timeout" if configuring else "placement_group_timeout_s"
            seconds, named = getattr(self._settings, budget), f"{budget}={getattr(self._settings, budget)} s"
        else:
            seconds, named = self._setup_budget()
        return _Start(worker, call, time.monotonic() + seconds, f"it {what} within {named}", configuring)

    def _setup_budget(self) -> tuple[float, str]:
        """Seconds a fixed group's started worker may take for each step of its set-up (its process, its
        ranks, configuration and rendezvous, the executable), and how errors name them: no wait for the
        cluster, so a short placement_group_timeout_s (set to fail fast on a busy cluster) does not cut
        them short on a slow machine, and neither does a short timeout_s."""
        timeout_s, placement_s = self._settings.timeout_s, self._settings.placement_group_timeout_s
        seconds = max(timeout_s, placement_s)
        return seconds, f"{seconds:g} s (the larger of timeout_s={timeout_s:g} and placement_group_timeout_s={placement_s:g})"

    @property
    def starting(self) -> int:
        """How many workers are on their way in."""
        return len(self._starting)

    def poll_starts(self, timeout: float = 0.0) -> tuple[list[GroupWorker], list[StartFailure]]:
        """Advance every start, waiting at most ``timeout`` (0: never blocks): the workers started now,
        and the starts that failed or ran out of budget (their actors are killed)."""
        if not self._starting:
            return [], []
        calls = {start.call: start for start in self._starting.values()}
        answered, _ = ray.wait(list(calls), num_returns=len(calls), timeout=timeout)
        answered_set = set(answered)
        started: list[GroupWorker] = []
        failed: list[StartFailure] = []
        for call, start in calls.items():
            worker = start.worker
            if call not in answered_set and time.monotonic() < start.deadline:
                continue
            try:
                if call not in answered_set:
                    raise ray.exceptions.GetTimeoutError(start.out_of_time)
                answer = ray.get(call)
            except Exception as exc:  # noqa: BLE001 - the node went away or is full: the caller decides
                del self._starting[worker.worker_id]
                ray.kill(worker.actor, no_restart=True)
                died = isinstance(exc, ray.exceptions.RayActorError)
                failed.append(StartFailure(worker.worker_id, worker.node_id, exc, died))
                continue
            if not start.configuring:
                worker.slot = answer
                worker.node_id = answer.node_id
                if self._elastic:  # configured on its own: it then waits in hvd.init for its epoch
                    configure = worker.actor.configure.remote(
                        None, 0, self._worker_settings, self._secret, self.coordinator, (), worker.worker_id,
                        joins_running_job=self.epoch > 0,
                    )
                    self._starting[worker.worker_id] = self._awaiting(worker, configure, configuring=True)
                    continue
            del self._starting[worker.worker_id]
            self.workers[worker.worker_id] = worker
            started.append(worker)
        if started and self._elastic and self.state is GroupState.STARTING:
            self.state = GroupState.RUNNING  # an elastic group runs from its first worker on
        return started, failed

    def start_fixed(
        self, actor_options: Callable[[int], dict[str, Any]], num_workers: int,
        executable: tuple[Optional[type], Sequence[Any], dict[str, Any]],
        still_feasible: Callable[[], None] = lambda: None,
    ) -> None:
        """Start ``num_workers`` ranks (``actor_options(i)`` places worker ``i``), give them ranks and
        build ``executable`` on each. If any step fails the group stops, and what it started with it.
        ``still_feasible`` raises if the placement can no longer be granted (a node died): called about
        every second while workers wait for their bundles, so such a start fails at once."""
        try:
            for index in range(num_workers):
                self.launch(str(index), actor_options(index))
            while self._starting:
                earliest = min(start.deadline for start in self._starting.values())
                _, failed = self.poll_starts(timeout=min(max(earliest - time.monotonic(), 0.0), _FEASIBLE_CHECK_S))
                if failed:
                    raise failed[0].error
                if self._starting:
                    still_feasible()
            workers = [self.workers[str(index)] for index in range(num_workers)]
            epoch, infos, gpus = self._set_up("given ranks", self.coordinator.assign.remote([w.slot for w in workers]))
            self.epoch = epoch
            self._set_up("configured", [
                w.actor.configure.remote(info, epoch, self._worker_settings, self._secret, self.coordinator, node_gpus)
                for w, info, node_gpus in zip(workers, infos, gpus)
            ])
            cls, args, kwargs = executable
            self._set_up("given their executable",
                         self.send(workers, lambda actor: actor.start_executable.remote(cls, args, kwargs)))
        except BaseException:
            self.stop()
            raise
        for worker, info in zip(workers, infos):
            worker.rank = info.rank
        self.state = GroupState.RUNNING
        log.info("hvdray executor %s started %d worker(s)", self.executor_id, num_workers)

    # -- running -------------------------------------------------------------------------------
    def ranked(self) -> list[GroupWorker]:
        """Workers in the ring, in rank order."""
        return sorted((w for w in self.workers.values() if w.rank is not None), key=lambda w: w.rank)

    def begin_call(self, datasets: Optional[DatasetSplitter] = None) -> int:
        """Number a new call of the user's functions on the workers (1, 2, ...: the same on every rank, so
        that a rank leaving its function tells its peers which call's ops will never come). With
        ``datasets`` the call's workers get one shard each, split anew for every membership epoch (the
        running ranks of a fixed group get theirs now)."""
        self.call += 1
        self._end_split()
        self._datasets = datasets
        if datasets is not None:
            self.ask_coordinator(self.coordinator.offer_datasets.remote(self.call, datasets.names), "an offer of datasets")
            if not self._elastic:
                self._publish_shards(self.epoch, self.ranked())
        return self.call

    def _publish_shards(self, epoch: int, ranked: Sequence[GroupWorker]) -> None:
        """Split the call's datasets over ``ranked`` (the members of ``epoch``, in rank order) and hand
        the shards to the coordinator, where each rank picks up its own."""
        assert self._datasets is not None
        self._end_split()
        self._split = self._datasets.split([w.actor for w in ranked], [w.node_id for w in ranked])
        self.ask_coordinator(self.coordinator.publish_shards.remote(self.call, epoch, self._split),
                             "the shards of a split")

    def _end_split(self) -> None:
        """Stop the current split: a rank still reading it (a peer died) raises instead of waiting forever."""
        split, self._split = self._split, []
        end_split(split)

    def run(self, worker: GroupWorker, fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> None:
        """Start ``fn`` on ``worker`` as the current call; :meth:`poll_runs` reports how it ends."""
        self.send([worker], lambda actor: actor.run.remote(fn, list(args), dict(kwargs), self.call))

    def send(self, workers: Sequence[GroupWorker], call: Callable[[Any], ray.ObjectRef]) -> list[ray.ObjectRef]:
        """``call(actor)`` for each worker (``run``, ``execute``, ...): the user's code, remembered as
        the worker's running call until the next one (see :meth:`stop`)."""
        refs = []
        for worker in workers:
            worker.run_ref = call(worker.actor)
            refs.append(worker.run_ref)
        return refs

    def poll_runs(self) -> list[RunResult]:
        """Runs that ended since they were last looked at (never blocks); a returned value is kept on
        its worker. A run that raised is reported again at the next poll: it is not done."""
        calls = {w.run_ref: w for w in self.workers.values() if w.run_ref is not None and not w.done}
        if not calls:
            return []
        ended, _ = ray.wait(list(calls), num_returns=len(calls), timeout=0)
        results = []
        for call in ended:
            worker = calls[call]
            try:
                worker.result = ray.get(call)
                worker.done = True
                results.append(RunResult(worker, RunOutcome.RETURNED))
            except ray.exceptions.RayActorError as exc:
                results.append(RunResult(worker, RunOutcome.LOST, exc))
            except ray.exceptions.OutOfMemoryError as exc:
                results.append(RunResult(worker, RunOutcome.LOST, exc, out_of_memory=True))
            except ray.exceptions.RayTaskError as exc:
                results.append(RunResult(worker, RunOutcome.RAISED, exc))
        return results

    def gather(self, calls: list[ray.ObjectRef], callbacks: Sequence[Callback]) -> list[Any]:
        """Wait for one call per rank (``calls`` in rank order), handing worker records to ``callbacks``
        meanwhile. The first rank that fails ends the wait and its error is raised, naming the rank. A
        lost worker stops the group; a rank whose function raised leaves the workers to finish the call
        (the ops its peers wait on fail at once, naming it), and the next call takes them if they did
        (:meth:`settle_failed_call`)."""
        rank_of = {call: rank for rank, call in enumerate(calls)}
        pending = list(calls)
        failures: list[tuple[int, BaseException]] = []
        grace_ends = None
        coordinator_lost = False
        while pending and (grace_ends is None or time.monotonic() < grace_ends):
            # wake when a call ends, when a worker record arrives, or when the grace period is over
            records = [self.records.arrival()] if self.records.wanted(callbacks) and not coordinator_lost else []
            timeout = None if grace_ends is None else max(grace_ends - time.monotonic(), 0.0)
            ray.wait(pending + records, num_returns=1, timeout=timeout)
            try:
                if records:
                    self.records.deliver(callbacks)
            except CoordinatorLostError:
                if not self._hosted_by_worker:
                    raise
                # it died with the worker that held it, whose own call ends with that: wait for it
                coordinator_lost = True
            ended, pending = ray.wait(pending, num_returns=len(pending), timeout=0)
            for call in ended:
                try:
                    ray.get(call)
                except BaseException as exc:  # noqa: BLE001 - re-raised with the rank attached
                    failures.append((rank_of[call], exc))
            if failures and grace_ends is None:
                if not all(consequence_level(exc) for _, exc in failures):
                    break
                # a peer's failure shows up in the others first (an op fails, a ring breaks): give the rank
                # that caused it a moment to report its own error, which says more
                grace_ends = time.monotonic() + ROOT_CAUSE_GRACE_S
        if failures:
            try:
                self.records.deliver(callbacks, flush=True)  # what was reported before the failure still counts
            except CoordinatorLostError:  # the coordinator is gone too: the rank's error says more
                log.debug("hvdray executor %s: the records of the failed call were lost", self.executor_id)
            rank, exc = min(failures, key=lambda failure: (consequence_level(failure[1]), failure[0]))
            if all(_raised_by_the_function(failure) for _, failure in failures):
                self._end_split()  # a peer still reading the call's shards raises instead of waiting for it
                self.failed_call = True
                aftermath = "the other workers finish the call, and the next call takes them if they did"
            else:
                self.stop()
                aftermath = "the other workers were stopped"
            raise failure_error(exc, rank, len(calls), aftermath=aftermath)
        self.records.deliver(callbacks, flush=True)
        return ray.get(calls)

    def settle_failed_call(self, wait_s: float) -> bool:
        """After a call in which a rank's function raised (:attr:`failed_call`): whether the workers can
        take the next call. They can once every worker's call has ended within ``wait_s`` (a peer blocked
        on an op the raising rank never submitted fails at once) and every engine still works (a broken
        ring keeps raising what broke it). The records that the call's workers sent after the failure are
        dropped: the failed call's result is final. False: the caller stops the group."""
        self.failed_call = False
        calls = [w.run_ref for w in self.workers.values() if w.run_ref is not None]
        ended, running = ray.wait(calls, num_returns=len(calls), timeout=wait_s) if calls else ([], [])
        if running:
            log.info("hvdray executor %s: %d worker(s) still in the failed call after %s s; starting new ones",
                     self.executor_id, len(running), wait_s)
            return False
        for call in ended:
            try:
                ray.get(call)
            except ray.exceptions.RayTaskError:
                pass  # the function raised (the failure, or what it caused in a peer)
            except ray.exceptions.RayError:  # the worker died after the failure
                return False
        try:
            ready = ray.get([w.actor.ready_after_failed_call.remote() for w in self.ranked()], timeout=wait_s)
            self.records.skip_pending()
        except (ray.exceptions.RayError, CoordinatorLostError):
            return False
        return all(ready)

    def poll_liveness(self, unanswered_s: float) -> list[str]:
        """Ids of running workers found gone, without waiting: a ping (one in flight per worker, sent
        again ``_PING_EVERY_S`` after its answer) that failed, or that has gone unanswered for
        ``unanswered_s`` while the worker's node is down (:mod:`hvdray.driver.node_liveness`: Ray itself
        reports such actors dead much later). A silent worker on a node that is up is slow, not gone:
        it is pinged on, and its node asked again at most every ``_NODE_ASKED_EVERY_S``."""
        now = time.monotonic()
        for worker in self.workers.values():
            if worker.done or worker.worker_id in self._pings:
                continue
            if now >= self._next_ping.get(worker.worker_id, 0.0):
                self._pings[worker.worker_id] = (worker.actor.ping.remote(), now)
        if not self._pings:
            return []
        by_ref = {ref: worker_id for worker_id, (ref, _) in self._pings.items()}
        answered, _ = ray.wait(list(by_ref), num_returns=len(by_ref), timeout=0)
        gone = []
        for ref in answered:
            worker_id = by_ref[ref]
            del self._pings[worker_id]
            self._next_ping[worker_id] = now + _PING_EVERY_S
            try:
                ray.get(ref)
            except Exception:  # noqa: BLE001 - any failure to answer means the worker is gone
                gone.append(worker_id)
        silent = {worker_id: self.workers[worker_id].node_id
                  for worker_id, (_, sent) in self._pings.items() if now - sent > unanswered_s}
        if silent:  # gone only if the node is: a worker on a node that is up is slow (starved), not dead
            down = self._node_probe.down(silent.values())
            gone += [worker_id for worker_id, node_id in silent.items() if node_id in down]
        return gone

    def held(self) -> dict[str, int]:
        """Workers per node, started or starting (Ray's free resources do not count them)."""
        held: dict[str, int] = {}
        for worker in [*self.workers.values(), *(start.worker for start in self._starting.values())]:
            if worker.node_id is not None:
                held[worker.node_id] = held.get(worker.node_id, 0) + 1
        return held

    def ask_coordinator(self, call: ray.ObjectRef, what: str) -> Any:
        """The answer to a call to the coordinator, waited for at most ``timeout_s``: a coordinator that
        died or stopped answering (its node lost or starved) fails the job instead of hanging it. Until
        it has answered once, a coordinator host started for this job has the rest of its start budget
        (``placement_group_timeout_s``), as a worker has: on a busy node its process may still be starting."""
        wait, limit = self._settings.timeout_s, f"timeout_s={self._settings.timeout_s:g} s"
        starting_for = self._coordinator.starts_by - time.monotonic() if self._coordinator is not None else 0.0
        if not self._coordinator_answered and starting_for > wait:
            wait = starting_for
            limit = f"its start budget (placement_group_timeout_s={self._settings.placement_group_timeout_s:g} s)"
        try:
            answer = ray.get(call, timeout=wait)
        except ray.exceptions.GetTimeoutError as exc:
            raise CoordinatorLostError(
                f"hvdray executor {self.executor_id}: the coordinator did not answer {what} within {limit}"
            ) from exc
        except ray.exceptions.RayActorError as exc:
            raise CoordinatorLostError(
                f"hvdray executor {self.executor_id}: the coordinator died ({what}): {exc}"
            ) from exc
        self._coordinator_answered = True
        return answer

    def waiting(self) -> set[str]:
        """Ids of workers waiting in the coordinator for a new membership epoch."""
        return set(self.ask_coordinator(self.coordinator.waiting.remote(), "which workers wait"))

    def abandon_epoch(self, epoch: int) -> None:
        """Give up on membership ``epoch``: workers waiting in its rendezvous are told at once, and those
        reading its dataset split (blocked there for a dead peer's part) fail at once."""
        self.ask_coordinator(self.coordinator.abandon.remote(epoch), f"the abandonment of epoch {epoch}")
        self._end_split()

    def form_epoch(self, order: Sequence[GroupWorker]) -> int:
        """A new membership epoch of ``order``'s workers, ranked by the coordinator; returns its number."""
        epoch, infos, _ = self.ask_coordinator(
            self.coordinator.assign.remote([w.slot for w in order], [w.worker_id for w in order]),
            "the ranks of a new epoch",
        )
        for worker, info in zip(order, infos):
            worker.rank = info.rank
        self.epoch = epoch
        if self._datasets is not None:
            self._publish_shards(epoch, self.ranked())
        return epoch

    def announce_new_hosts(self) -> None:
        """Members raise HostsUpdatedInterrupt at their next commit, to re-form with the new workers."""
        self.ask_coordinator(self.coordinator.notify_hosts_updated.remote(), "an announcement of new hosts")

    # -- ending --------------------------------------------------------------------------------
    def remove(self, worker_ids: Sequence[str]) -> list[GroupWorker]:
        """Kill these workers and tell the coordinator to forget them; returns those that were here."""
        removed = []
        for worker_id in worker_ids:
            worker = self.workers.pop(worker_id, None)
            self._pings.pop(worker_id, None)
            self._next_ping.pop(worker_id, None)
            if worker is not None:
                ray.kill(worker.actor, no_restart=True)
                removed.append(worker)
        self.ask_coordinator(self.coordinator.forget.remote(list(worker_ids)), "a request to forget workers")
        return removed

    def cancel_starts(self) -> None:
        """Kill the workers still on their way in."""
        for start in self._starting.values():
            ray.kill(start.worker.actor, no_restart=True)
        self._starting.clear()

    def drain(self) -> None:
        """No new workers from now on: cancel the starts; the running calls end on their own."""
        if self.state is not GroupState.STOPPED:
            self.cancel_starts()
            self.state = GroupState.DRAINING

    def stop(self) -> None:
        """End every worker (and close the job's coordinator, if the group owns it); safe to call twice.

        A worker running none of the user's code (its last call ended, or it had none) exits on its own,
        as a process at the end of a script does: its ``atexit`` handlers and finalizers run and its
        open files are flushed (``Worker.exit_process``, which ends the process after
        :data:`WORKER_EXIT_PATIENCE_S` if a non-daemon thread or a handler holds it). One that does not
        leave Ray within that time is killed, as is every worker still in a call (it may wait in a
        collective for a peer that is gone)."""
        if self.state is GroupState.STOPPED:
            return
        self.failed_call = False
        self.cancel_starts()
        self.records.forget_waiting_call()
        self._end_split()
        workers = list(self.workers.values())
        calls = [w.run_ref for w in workers if w.run_ref is not None]
        ended = set(ray.wait(calls, num_returns=len(calls), timeout=0)[0]) if calls else set()
        idle = [w for w in workers if w.run_ref is None or w.run_ref in ended]
        if self._owns_coordinator and self._coordinator is not None:
            # its waits end first: the driver's wait for records holds a thread of a worker holding the table
            closed = self._coordinator.close()
            if closed is not None and self._hosted_by_worker and idle:
                ray.wait([closed], timeout=WORKER_EXIT_PATIENCE_S)
            self._coordinator = None
        exits = {w.actor.exit_process.remote(WORKER_EXIT_PATIENCE_S): w for w in idle}
        if exits:
            exited = set(ray.wait(list(exits), num_returns=len(exits), timeout=WORKER_EXIT_PATIENCE_S)[0])
            late = [exits[ref].worker_id for ref in exits if ref not in exited]
            if late:
                log.warning("hvdray executor %s: worker(s) %s did not exit within %s s; killed", self.executor_id,
                            ", ".join(late), WORKER_EXIT_PATIENCE_S)
        for worker in workers:
            # also those that left: Ray frees an actor's name (the next group's rank takes it) only once killed
            ray.kill(worker.actor, no_restart=True)
        self.state = GroupState.STOPPED
