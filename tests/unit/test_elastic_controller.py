"""The elastic driver's state machine, stepped by hand over a fake worker group and discovery (no Ray).

Each test scripts what the workers do (start, wait for an epoch, return, die, raise) and checks the
transitions ``step()`` chooses and the ``{"event": "elastic"}`` records they produce.
"""

from __future__ import annotations

import pytest

from hvdray.collective.errors import HorovodInternalError
from hvdray.collective.topology import WorkerSlot
from hvdray.driver import controller
from hvdray.driver.controller import (
    NEXT_STATES,
    DriverState,
    ElasticDriver,
    ElasticJobError,
    Transition,
    allowed,
)
from hvdray.driver.policies import ElasticLimits, FailurePolicy
from hvdray.driver.worker_group import GroupWorker, RunOutcome, RunResult, StartFailure
from hvdray.settings import make_settings

S = DriverState
A, B = "a" * 56, "b" * 56  # Ray node ids (hex); the driver places on them in id order


class FakeGroup:
    """Just enough of WorkerGroup: launches start at the next poll and then wait for an epoch."""

    def __init__(self) -> None:
        self.workers: dict[str, GroupWorker] = {}
        self.pending: dict[str, GroupWorker] = {}
        self.waiting_ids: set[str] = set()
        self.ended: list[RunResult] = []
        self.fail_starts: dict[str, bool] = {}  # node id -> worker_died
        self.unresponsive: list[str] = []
        self.epoch = 0
        self.abandoned: list[int] = []
        self.announced = 0
        self.drained = self.stopped = False

    @property
    def starting(self) -> int:
        return len(self.pending)

    def launch(self, worker_id, actor_options, node_id=None):
        assert not self.drained
        self.pending[worker_id] = GroupWorker(worker_id, actor=None, node_id=node_id)

    def poll_starts(self, timeout=0.0):
        started, failed = [], []
        for worker_id, worker in list(self.pending.items()):
            del self.pending[worker_id]
            if worker.node_id in self.fail_starts:
                failed.append(StartFailure(worker_id, worker.node_id, RuntimeError("no"), self.fail_starts[worker.node_id]))
                continue
            worker.slot = WorkerSlot(node_id=worker.node_id, hostname="h", ip="127.0.0.1", gpu_ids=())
            self.workers[worker_id] = worker
            started.append(worker)
        return started, failed

    def run(self, worker, fn, args, kwargs):
        worker.run_ref = object()
        self.waiting_ids.add(worker.worker_id)  # hvd.init: waits for its first epoch

    def poll_runs(self):
        ended = self.ended
        # as WorkerGroup's: a run that raised is not done, and is reported again at the next poll
        self.ended = [r for r in ended if r.outcome is RunOutcome.RAISED and r.worker.worker_id in self.workers]
        for result in ended:
            if result.outcome is RunOutcome.RETURNED:
                result.worker.done = True
        return ended

    def waiting(self):
        return set(self.waiting_ids)

    def form_epoch(self, order):
        self.epoch += 1
        for rank, worker in enumerate(order):
            worker.rank = rank
            self.waiting_ids.discard(worker.worker_id)
        return self.epoch

    def announce_new_hosts(self):
        self.announced += 1

    def poll_liveness(self, unanswered_s):
        return [w for w in self.unresponsive if w in self.workers]

    def abandon_epoch(self, epoch):
        self.abandoned.append(epoch)

    def ranked(self):
        return sorted((w for w in self.workers.values() if w.rank is not None), key=lambda w: w.rank)

    def held(self):
        held = {}
        for worker in [*self.workers.values(), *self.pending.values()]:
            held[worker.node_id] = held.get(worker.node_id, 0) + 1
        return held

    def remove(self, worker_ids):
        removed = [self.workers.pop(w) for w in worker_ids if w in self.workers]
        self.waiting_ids -= set(worker_ids)
        return removed

    def drain(self):
        self.pending.clear()
        self.drained = True

    def stop(self):
        self.stopped = True

    class records:  # noqa: N801 - stands for the group's RecordStream
        @staticmethod
        def deliver(callbacks, flush=False):
            pass

    # -- scripting what workers do --------------------------------------------------------------
    def by_rank(self, rank):
        return next(w for w in self.workers.values() if w.rank == rank)

    def end(self, worker, outcome, error=None, result=None, oom=False):
        worker.result = result
        self.ended.append(RunResult(worker, outcome, error, out_of_memory=oom))


@pytest.fixture
def slots(monkeypatch):
    """What the discovery offers now: node id -> slots (the driver reads it through slots_per_node)."""
    offered = {A: 2}
    monkeypatch.setattr(controller, "slots_per_node", lambda discovery: dict(offered))
    return offered


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _driver(group, min_workers=1, max_workers=4, reset_limit=None, elastic_timeout=600.0, policy=None, clock=None):
    limits = ElasticLimits(min_workers, max_workers, reset_limit, None, elastic_timeout)
    settings = make_settings(timeout_s=5, discovery_interval_s=0.01)
    driver = ElasticDriver(group, limits, settings, discovery=None, cpus_per_worker=1, gpus_per_worker=0,
                           failure_policy=policy or FailurePolicy(reset_limit, None), clock=clock or Clock())
    driver.records = []
    driver._callbacks = [driver.records.append]
    return driver


def _advance(driver, steps=1):
    """Run ``steps`` steps, taking each transition; returns the states entered."""
    entered = []
    for _ in range(steps):
        transition = driver.step()
        if transition is not None:
            driver._enter(transition)
            entered.append(transition.state)
    return entered


def _running(driver, group, slots):
    assert _advance(driver, 2) == [S.RUNNING]  # launch; then start, wait in hvd.init and form an epoch


def test_the_transition_table_is_the_only_way_between_states():
    for state in (S.STARTING, S.RUNNING, S.RESIZING, S.RECOVERING, S.FINISHING):
        assert allowed(state, S.ERRORED)
    assert allowed(S.RECOVERING, S.RECOVERING)
    assert not allowed(S.RUNNING, S.STARTING)
    assert not allowed(S.FINISHING, S.RUNNING)
    assert not any(allowed(S.FINISHED, s) or allowed(S.ERRORED, s) for s in S)
    assert NEXT_STATES[S.STARTING] == {S.RUNNING, S.RECOVERING, S.FINISHING}
    driver = _driver(FakeGroup())
    with pytest.raises(AssertionError, match="no transition from starting to finished"):
        driver._enter(Transition(S.FINISHED, "not from here"))


def test_starting_launches_on_free_slots_and_forms_the_first_epoch(slots):
    group = FakeGroup()
    driver = _driver(group, max_workers=3)
    slots.update({B: 4})
    assert _advance(driver) == []  # launches 3 workers (max_workers) on a, then b
    assert group.starting == 3 and group.held() == {A: 2, B: 1}
    assert _advance(driver) == [S.RUNNING]  # they start, get fn, wait in hvd.init: epoch 1 forms
    assert [w.rank for w in group.ranked()] == [0, 1, 2]
    last = driver.records[-1]
    assert {k: last[k] for k in ("event", "state", "previous", "epoch", "workers", "resets")} == {
        "event": "elastic", "state": "running", "previous": "starting", "epoch": 1, "workers": 3, "resets": 0
    }
    assert last["reason"] == "membership epoch 1 formed with 3 worker(s)"


def test_new_slots_while_running_resize_the_ring(slots):
    group = FakeGroup()
    driver = _driver(group)
    _running(driver, group, slots)
    slots[B] = 1
    driver._next_discovery = 0.0
    assert _advance(driver) == []  # the discovery shows a new slot: a worker starts there
    assert group.held() == {A: 2, B: 1}
    assert _advance(driver) == [S.RESIZING] and group.announced == 1
    assert _advance(driver) == []  # the members train on until their next commit
    group.waiting_ids.update(w.worker_id for w in group.ranked())
    assert _advance(driver) == [S.RUNNING]
    assert (driver.records[-1]["workers"], driver.records[-1]["resets"]) == (3, 1)


def test_a_worker_that_returns_without_joining_ends_the_job_naming_it(slots):
    """Its function never called hvd.init(): no epoch could ever form with it (the driver waited for it
    for ever, at the start or, as here, in a resize)."""
    group = FakeGroup()
    driver = _driver(group)
    _running(driver, group, slots)
    slots[B] = 1
    driver._next_discovery = 0.0
    assert _advance(driver, 2) == [S.RESIZING]
    newcomer = next(w for w in group.workers.values() if w.rank is None)
    group.waiting_ids.discard(newcomer.worker_id)
    group.end(newcomer, RunOutcome.RETURNED, result=None)
    assert _advance(driver) == [S.ERRORED]
    assert isinstance(driver._error, ElasticJobError)
    assert str(driver._error).startswith(f"worker {newcomer.worker_id} returned from the training function without "
                                         "joining the job: an elastic job's function must call hvd.init()")


def test_a_dead_member_blacklists_its_node_abandons_its_epoch_and_the_survivors_re_form(slots):
    group = FakeGroup()
    policy = FailurePolicy(None, None)
    driver = _driver(group, policy=policy)
    slots.clear()
    slots.update({A: 1, B: 1})
    _running(driver, group, slots)
    dead, survivor = group.by_rank(0), group.by_rank(1)
    assert (dead.node_id, survivor.node_id) == (A, B)
    group.end(dead, RunOutcome.LOST, RuntimeError("gone"))
    assert _advance(driver) == [S.RECOVERING]
    assert driver.records[-1]["reason"] == f"worker(s) {[dead.worker_id]} died"
    assert group.abandoned == [1]  # survivors in epoch 1's rendezvous are answered at once
    assert not policy.usable(A) and policy.usable(B)
    assert _advance(driver) == []  # the survivor has not left its epoch yet
    group.waiting_ids.add(survivor.worker_id)
    assert _advance(driver) == [S.RUNNING]
    assert (driver.records[-1]["epoch"], driver.records[-1]["resets"]) == (2, 1)
    assert survivor.rank == 0


def test_the_last_usable_node_is_not_blacklisted_when_its_worker_dies(slots):
    group = FakeGroup()
    policy = FailurePolicy(None, None)
    driver = _driver(group, policy=policy)
    _running(driver, group, slots)  # both workers on A, the only node
    group.end(group.by_rank(0), RunOutcome.LOST, RuntimeError("gone"))
    assert _advance(driver) == [S.RECOVERING]
    assert policy.usable(A)


def test_a_live_survivor_slow_to_rejoin_is_waited_for_up_to_elastic_timeout(slots):
    group = FakeGroup()
    policy = FailurePolicy(None, None)
    slots.clear()
    slots.update({A: 1, B: 1})
    clock = Clock()
    driver = _driver(group, policy=policy, elastic_timeout=60.0, clock=clock)
    _running(driver, group, slots)
    slow = group.by_rank(1)
    group.waiting_ids.add(group.by_rank(0).worker_id)  # rank 0's ring broke; rank 1 answers but is busy
    assert _advance(driver) == [S.RECOVERING]
    clock.now += 30  # far longer than timeout_s=5: still waited for
    assert _advance(driver, 3) == [] and slow.worker_id in group.workers
    group.waiting_ids.add(slow.worker_id)
    assert _advance(driver) == [S.RUNNING] and len(group.workers) == 2


def test_a_live_worker_away_longer_than_elastic_timeout_is_dropped_without_blacklisting(slots):
    group = FakeGroup()
    policy = FailurePolicy(None, None)
    slots.clear()
    slots.update({A: 1, B: 1})
    clock = Clock()
    driver = _driver(group, policy=policy, elastic_timeout=60.0, clock=clock)
    _running(driver, group, slots)
    stuck = group.by_rank(1)
    group.waiting_ids.add(group.by_rank(0).worker_id)
    assert _advance(driver) == [S.RECOVERING]
    clock.now += 61
    assert _advance(driver) == []  # dropped now; the rest re-forms at the next step
    assert stuck.worker_id not in group.workers and policy.usable(B)
    assert _advance(driver) == [S.RUNNING]


def test_reset_limit_ends_the_job(slots):
    group = FakeGroup()
    driver = _driver(group, reset_limit=0)
    _running(driver, group, slots)
    group.waiting_ids.update(group.workers)  # a peer failed: both members left the epoch
    assert _advance(driver) == [S.RECOVERING]
    assert _advance(driver) == [S.ERRORED]
    assert isinstance(driver._error, ElasticJobError) and "reset_limit=0" in str(driver._error)


def test_a_users_exception_ends_the_job_naming_the_rank(slots):
    group = FakeGroup()
    driver = _driver(group)
    _running(driver, group, slots)
    worker = group.by_rank(1)
    group.end(worker, RunOutcome.RAISED, KeyError("bad batch"))
    assert _advance(driver) == [S.ERRORED]
    assert driver._error.__notes__ == [f"hvdray: raised on rank 1 (worker {worker.worker_id}); the job was stopped"]


def _two_members_running(slots, clock):
    """A running epoch of two on node A: (driver, group, rank 1 (the one to lose), rank 0)."""
    group = FakeGroup()
    driver = _driver(group, clock=clock)
    _running(driver, group, slots)
    return driver, group, group.by_rank(1), group.by_rank(0)


def test_a_ring_broken_outside_elastic_run_ends_the_job_naming_the_loss_that_broke_it(slots):
    """A member's HorovodInternalError reaches the driver only from outside hvd.elastic.run (which catches
    it): the job ends, and the note names the lost worker and says where collectives recover."""
    driver, group, dead, survivor = _two_members_running(slots, Clock())
    group.end(dead, RunOutcome.LOST, RuntimeError("gone"))
    assert _advance(driver) == [S.RECOVERING]
    group.end(survivor, RunOutcome.RAISED, HorovodInternalError("local rank 1 died"))
    assert _advance(driver) == [S.ERRORED]
    assert isinstance(driver._error, HorovodInternalError)
    (note,) = driver._error.__notes__
    assert note.startswith(f"hvdray: raised on rank 0 (worker {survivor.worker_id}); the job was stopped: the ring "
                           f"broke after the loss of worker {dead.worker_id} (rank 1) while this rank ran collectives "
                           "outside hvd.elastic.run.")


@pytest.mark.parametrize("lost_meanwhile", [True, False])
def test_a_ring_broken_before_any_loss_is_seen_waits_a_moment_for_the_loss(slots, lost_meanwhile):
    """The survivor's broken ring often reaches the driver before the peer's death does: the driver waits up
    to ROOT_CAUSE_GRACE_S for the loss, then names it (or, if none comes, reports the ring's error)."""
    clock = Clock()
    driver, group, dead, survivor = _two_members_running(slots, clock)
    group.end(survivor, RunOutcome.RAISED, HorovodInternalError("local rank 1 died"))
    assert _advance(driver) == []
    clock.now += controller.ROOT_CAUSE_GRACE_S - 0.1
    assert _advance(driver) == []
    if lost_meanwhile:
        group.end(dead, RunOutcome.LOST, RuntimeError("gone"))
    else:
        clock.now += 0.1
    assert _advance(driver) == [S.ERRORED]
    note = driver._error.__notes__[0]
    assert "outside hvd.elastic.run" in note
    assert (f"after the loss of worker {dead.worker_id} (rank 1)" in note) is lost_meanwhile, note


def test_a_loss_the_job_recovered_from_is_not_named_for_a_later_broken_ring(slots):
    clock = Clock()
    driver, group, dead, survivor = _two_members_running(slots, clock)
    group.end(dead, RunOutcome.LOST, RuntimeError("gone"))
    assert _advance(driver) == [S.RECOVERING]
    group.waiting_ids.add(survivor.worker_id)
    assert _advance(driver) == [S.RUNNING]  # epoch 2, without the dead worker
    group.end(survivor, RunOutcome.RAISED, HorovodInternalError("timed out"))
    assert _advance(driver) == []  # unexplained: the grace again
    clock.now += controller.ROOT_CAUSE_GRACE_S
    assert _advance(driver) == [S.ERRORED]
    assert dead.worker_id not in driver._error.__notes__[0]


def test_a_returned_member_finishes_the_job_once_its_epoch_has_returned(slots):
    group = FakeGroup()
    driver = _driver(group)
    _running(driver, group, slots)
    group.end(group.by_rank(1), RunOutcome.RETURNED, result="one")
    assert _advance(driver) == [S.FINISHING]
    assert group.drained
    assert _advance(driver) == []  # rank 0 still trains
    group.end(group.by_rank(0), RunOutcome.RETURNED, result="zero")
    assert _advance(driver) == [S.FINISHED]
    assert driver.records[-1]["reason"] == "2 member(s) returned"
    assert [w.result for w in group.ranked() if w.done] == ["zero", "one"]


def test_members_that_returned_as_a_peer_was_lost_finish_the_job_without_it(slots):
    """The last commit's survivors return in the same poll that reports a peer's loss (its node went away
    after the others were done): the job finishes with them. Recovering instead waited for the returned
    members to rejoin, up to elastic_timeout (a fault-matrix case hung this way)."""
    group = FakeGroup()
    driver = _driver(group)
    slots.clear()
    slots.update({A: 2, B: 1})
    assert _advance(driver, 2) == [S.RUNNING]
    lost = group.by_rank(2)
    group.end(group.by_rank(0), RunOutcome.RETURNED, result="zero")
    group.end(lost, RunOutcome.LOST, RuntimeError("node gone"))
    group.end(group.by_rank(1), RunOutcome.RETURNED, result="one")
    assert _advance(driver) == [S.FINISHING]
    assert lost.worker_id not in group.workers and driver.records[-1]["reason"] == (
        f"a member returned from the training function (worker(s) {[lost.worker_id]} lost meanwhile)")
    assert _advance(driver) == [S.FINISHED]
    assert [w.result for w in group.ranked() if w.done] == ["zero", "one"]


def test_too_few_workers_for_elastic_timeout_ends_the_job(slots):
    group = FakeGroup()
    slots.clear()
    slots[A] = 1
    group.fail_starts[A] = False  # the node never manages to start a worker
    clock = Clock()
    driver = _driver(group, min_workers=2, elastic_timeout=0.05, clock=clock)
    assert _advance(driver) == []
    clock.now += 1.0
    assert _advance(driver) == [S.ERRORED]
    assert "fewer than min_workers=2" in str(driver._error)


def test_a_worker_that_does_not_answer_while_recovering_is_dropped(slots):
    group = FakeGroup()
    driver = _driver(group)
    _running(driver, group, slots)
    group.waiting_ids.add(group.by_rank(0).worker_id)  # rank 0's ring broke; rank 1 hangs
    group.unresponsive.append(group.by_rank(1).worker_id)
    assert _advance(driver) == [S.RECOVERING]
    assert _advance(driver) == [S.RUNNING]
    assert len(group.workers) == 1 and driver.records[-1]["reason"] == "membership epoch 2 formed with 1 worker(s)"
