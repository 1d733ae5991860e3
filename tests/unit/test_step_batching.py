"""Step-aware batching in a size-1 job (no peers, so the engine's rounds are deterministic).

Once a rank's steps repeat, the engine waits for the whole step before negotiating: one round and
one fused reduction per training step instead of one per early gradient. Ops outside the learned
step, polls and waits must not be held back by that.
"""

import contextlib
import statistics
import time

import pytest
import torch

import hvdray.torch as hvd
from hvdray.collective import session


@pytest.fixture
def engine():
    """A size-1 job's engine with learned steps on the engine thread (auto puts a job of one rank's on the
    waiting thread): what most tests here watch is when the engine thread runs a step by itself."""
    with _engine_with(steps_on_waiting_thread=False) as started:
        yield started


def _model_and_optimizer():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                              torch.nn.Linear(64, 10))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.01), named_parameters=net.named_parameters())
    return net, opt


def _learn_a_step_of_six() -> list[torch.Tensor]:
    """Four identical steps of six named allreduces, each waited on: the engine learns the step."""
    grads = [torch.ones(100) for _ in range(6)]
    for _ in range(4):
        handles = [hvd.allreduce_async_(g, name=f"g{i}", op=hvd.Sum) for i, g in enumerate(grads)]
        for h in handles:
            hvd.synchronize(h)
    return grads


@contextlib.contextmanager
def _engine_with(**changes):
    """A size-1 job's engine, started with these settings changed for the test."""
    settings = session.settings()
    previous = {name: getattr(settings, name) for name in changes}
    try:
        for name, value in changes.items():
            setattr(settings, name, value)
        hvd.init()
        torch.set_num_threads(1)
        yield session.engine()
        hvd.shutdown()
    finally:
        for name, value in previous.items():
            setattr(settings, name, value)


@pytest.mark.parametrize("on_waiting_thread", [False, True], ids=["engine thread", "waiting thread"])
def test_a_repeated_training_step_costs_one_round_and_one_fused_reduction(on_waiting_thread):
    # an idle tick (every 100 ms while nothing is waited on) is a round of its own, and a loaded machine's
    # step can last longer than that: with a long idle cycle, each round counted is one the step cost
    with _engine_with(idle_cycle_time_ms=5000.0, steps_on_waiting_thread=on_waiting_thread) as engine:
        assert engine._idle_s == 5.0 and engine._steps_on_waiting_thread is on_waiting_thread
        net, opt = _model_and_optimizer()
        x, y = torch.randn(16, 32), torch.randint(0, 10, (16,))
        stats, per_step = engine.stats, []
        for _ in range(12):
            before = stats.rounds, stats.allreduce_calls, stats.caller_ticks, stats.wakeups
            opt.zero_grad()
            torch.nn.functional.cross_entropy(net(x), y).backward()
            opt.step()
            per_step.append(tuple(now - then for now, then in zip(
                (stats.rounds, stats.allreduce_calls, stats.caller_ticks, stats.wakeups), before)))
    # the first steps negotiate names and learn the step; from then on, 6 gradients go as one: run by the
    # engine thread, or by optimizer.step()'s wait while the engine thread sleeps on (no wake-up at all)
    if on_waiting_thread:
        assert per_step[4:] == [(1, 1, 1, 0)] * 8, per_step
    else:
        assert [step[:3] for step in per_step[4:]] == [(1, 1, 0)] * 8, per_step


@pytest.mark.parametrize("per_step", [8, 3], ids=["every variant", "variants rotating"])
def test_a_repeated_step_of_unnamed_calls_in_flight_costs_one_round(per_step):
    # unnamed async allreduces (each call a new generated name, its family's next variant slot), submitted
    # with a gradient's worth of work between them and then waited on: once learned, the step is "per_step
    # calls of this family" whichever variants they take (3 a step rotate through the 8 variants), so the
    # engine waits for all of them and runs them in one round and one fused reduction, as a named step's
    with _engine_with(idle_cycle_time_ms=5000.0, steps_on_waiting_thread=False) as engine:
        stats, rounds = engine.stats, []
        for step in range(12):
            before = stats.rounds, stats.allreduce_calls
            handles = []
            for i in range(per_step):
                handles.append(hvd.allreduce_async(torch.full((5,), float(step + i)), op=hvd.Sum))
                time.sleep(0.002)  # the next gradient's computation: the engine would tick on this one meanwhile
            results = [hvd.synchronize(h).tolist() for h in handles]
            assert results == [[float(step + i)] * 5 for i in range(per_step)]
            rounds.append((stats.rounds - before[0], stats.allreduce_calls - before[1]))
    assert rounds[4:] == [(1, 1)] * 8, rounds


def test_a_learned_step_nobody_waits_for_still_runs():
    # steps on the waiting thread (auto's choice for a job of one rank): the engine thread runs a whole step
    # nobody waits for (or polls) when its wait for the rest of the step ends (the idle cycle, 100 ms by
    # default), not never
    with _engine_with() as engine:
        assert engine._steps_on_waiting_thread
        grads = _learn_a_step_of_six()
        lags = []
        for _ in range(3):
            calls = engine.stats.allreduce_calls
            handles = [hvd.allreduce_async_(g, name=f"g{i}", op=hvd.Sum) for i, g in enumerate(grads)]
            submitted = time.monotonic()
            while engine.stats.allreduce_calls == calls and time.monotonic() - submitted < 5.0:
                time.sleep(0.001)  # nobody waits or polls (done() would hurry the step along)
            lags.append(time.monotonic() - submitted)
            for h in handles:
                hvd.synchronize(h)
    assert max(lags) < 2.0, lags
    assert all(g.tolist() == [1.0] * 100 for g in grads)


def test_a_caller_slower_than_the_engine_still_gets_its_steps_learned(engine):
    # a loaded machine (CI): every gradient is reduced before the next one arrives and before the caller
    # waits, so no wait ever finds an op in flight. Waiting on finished ops must still end the step.
    grads = [torch.ones(100) for _ in range(6)]
    per_step = []
    for _ in range(8):
        calls = engine.stats.allreduce_calls
        handles = []
        for i, g in enumerate(grads):
            handles.append(hvd.allreduce_async_(g, name=f"g{i}", op=hvd.Sum))
            if engine._step.expected:
                time.sleep(0.003)  # a learned step: the engine holds the gradients back
            else:  # until then, each one is reduced before the next comes
                deadline = time.monotonic() + 2.0
                while engine.stats.allreduce_calls == calls + i and time.monotonic() < deadline:
                    time.sleep(0.001)
        time.sleep(0.02)  # the rest of the backward pass, before optimizer.step() waits
        for h in handles:
            hvd.synchronize(h)
        per_step.append(engine.stats.allreduce_calls - calls)
    assert per_step[3:] == [1] * 5, per_step


def test_a_step_that_finishes_before_anyone_waits_stays_one_round(engine):
    # gradients arrive over time (a backward pass), and once the step is known it is reduced before the
    # caller looks at it (optimizer.step() comes later): its completion alone must end the step
    grads = [torch.ones(100) for _ in range(6)]
    per_step, lags = [], []
    for step in range(12):
        calls = engine.stats.allreduce_calls
        handles = []
        for i, g in enumerate(grads):
            handles.append(hvd.allreduce_async_(g, name=f"g{i}", op=hvd.Sum))
            if step >= 4:
                time.sleep(0.003)
        if step >= 4:  # the first steps are submitted at once and waited on, and learned that way
            # nobody waits or polls: watch the engine's counter (done() would hurry the step along)
            submitted = time.monotonic()
            while engine.stats.allreduce_calls == calls and time.monotonic() - submitted < 2.0:
                time.sleep(0.001)
            lags.append(time.monotonic() - submitted)
            time.sleep(0.02)  # the handles finish right after the counter moves
            assert all(h.done() for h in handles)
        for h in handles:
            hvd.synchronize(h)
        per_step.append(engine.stats.allreduce_calls - calls)
    assert per_step[6:] == [1] * 6, per_step  # (rounds are not counted: an idle tick may fall in a step)
    # at once, not after the engine's 100 ms idle tick (the median: one stall of a loaded machine may not count)
    assert statistics.median(lags) < 0.05, lags


def test_a_learned_step_wakes_the_engine_once_not_once_per_gradient(engine):
    grads = _learn_a_step_of_six()
    per_step = []
    for _ in range(5):
        time.sleep(0.02)  # the previous step's tick is over: the engine sleeps, waiting for this one
        wakeups, calls = engine.stats.wakeups, engine.stats.allreduce_calls
        handles = []
        for i, g in enumerate(grads):  # a backward pass: gradients arrive over time
            handles.append(hvd.allreduce_async_(g, name=f"g{i}", op=hvd.Sum))
            time.sleep(0.003)
        for h in handles:
            hvd.synchronize(h)
        per_step.append((engine.stats.wakeups - wakeups, engine.stats.allreduce_calls - calls))
    # woken by the step's last gradient (not by each of the six), and one fused reduction
    assert sorted(per_step)[2] == (1, 1), per_step
    assert all(calls == 1 and woke <= 2 for woke, calls in per_step), per_step


def test_a_fusion_buffers_worth_goes_before_the_step_is_whole(engine):
    settings = session.settings()
    hvd.shutdown()
    previous, settings.fusion_threshold_mb = settings.fusion_threshold_mb, 1000 / (1 << 20)  # 1000 bytes
    try:
        hvd.init()
        grads = _learn_a_step_of_six()  # 400 bytes each: three fusion buffers a step
        stats = session.engine().stats
        for _ in range(3):
            calls = stats.allreduce_calls
            handles = []
            for i, g in enumerate(grads[:-1]):
                handles.append(hvd.allreduce_async_(g, name=f"g{i}", op=hvd.Sum))
                time.sleep(0.01)  # 50 ms in all: well inside the engine's 100 ms idle tick
            # the first buffers went while the rest of the step was still being submitted
            assert stats.allreduce_calls - calls >= 2
            handles.append(hvd.allreduce_async_(grads[-1], name="g5", op=hvd.Sum))
            for h in handles:
                hvd.synchronize(h)
    finally:
        settings.fusion_threshold_mb = previous


def test_an_op_outside_the_learned_step_is_not_held_back(engine):
    _learn_a_step_of_six()
    assert len(engine._step.expected) == 6  # the step was learned
    hvd.allreduce(torch.ones(3), name="metric")  # negotiated once, cached from now on
    took = []
    for _ in range(5):
        started = time.perf_counter()
        hvd.allreduce(torch.ones(3), name="metric")
        took.append(time.perf_counter() - started)
    # the engine's idle tick is 100 ms: a blocked caller must not wait for it
    assert statistics.median(took) < 0.05, took


def test_polling_alone_drives_a_partial_step(engine):
    grads = _learn_a_step_of_six()
    started = time.perf_counter()
    handle = hvd.allreduce_async_(grads[0], name="g0", op=hvd.Sum)  # a sixth of the learned step
    while not hvd.poll(handle):
        time.sleep(0.001)
    assert time.perf_counter() - started < 0.05
    hvd.synchronize(handle)


def test_a_partial_step_still_finishes_without_any_caller(engine):
    grads = _learn_a_step_of_six()
    handle = hvd.allreduce_async_(grads[0], name="g0", op=hvd.Sum)
    time.sleep(0.5)  # nobody waits or polls: the engine's idle tick still runs it
    assert handle.done()
    hvd.synchronize(handle)


def test_an_idle_engine_with_fusion_off_does_not_spin(engine):
    settings = session.settings()
    hvd.shutdown()
    previous, settings.fusion_threshold_mb = settings.fusion_threshold_mb, 0.0
    try:
        hvd.init()
        _learn_a_step_of_six()
        clock = time.pthread_getcpuclockid(session.engine()._thread.ident)
        before = time.clock_gettime(clock)
        time.sleep(0.5)  # nothing submitted: the engine must sleep, not tick back to back
        assert time.clock_gettime(clock) - before < 0.05
    finally:
        settings.fusion_threshold_mb = previous
