"""A blocking op's tick runs on the thread that waits for it while the engine thread sleeps (no hand-off to
the engine thread and back); asynchronous ops still go without a wait; several threads waiting at once,
inference mode and a timed wait take the engine thread's way where they must."""

from __future__ import annotations

import pytest

#: the module's executors beyond tests/conftest.py's pair: one per ``steps_on_waiting_thread`` (None: auto)
STEPS_ON_WAITING_THREAD = {"steps on the waiting thread": True, "steps on the engine thread": False,
                           "steps where auto puts them": None}
EXECUTORS = {name: (2, {"steps_on_waiting_thread": setting, "idle_cycle_time_ms": 200})
             for name, setting in STEPS_ON_WAITING_THREAD.items()}


def _blocking_ops(count: int):
    import torch

    import hvdray.torch as hvd
    from hvdray.collective import session

    hvd.init()
    torch.set_num_threads(1)
    stats = session.engine().stats
    before_ticks, before_rounds = stats.caller_ticks, stats.rounds
    size, rank = hvd.size(), hvd.rank()
    wrong = []
    for i in range(count):
        t = torch.full((3,), float(rank + i))
        if hvd.allreduce(t, name="blocking.sum", op=hvd.Sum).tolist() != [float(sum(range(size)) + size * i)] * 3:
            wrong.append(("allreduce", i))
        if hvd.allreduce(t, op=hvd.Sum).tolist() != [float(sum(range(size)) + size * i)] * 3:  # a generated name
            wrong.append(("unnamed allreduce", i))
        if hvd.broadcast(t, root_rank=1, name="blocking.bcast").tolist() != [float(1 + i)] * 3:
            wrong.append(("broadcast", i))
        if hvd.allgather(t[:1], name="blocking.gather").tolist() != [float(r + i) for r in range(size)]:
            wrong.append(("allgather", i))
    hvd.barrier()
    return wrong, stats.caller_ticks - before_ticks, stats.rounds - before_rounds


def test_blocking_ops_tick_on_the_waiting_thread(shared_executor):
    for wrong, caller_ticks, rounds in shared_executor.run(_blocking_ops, args=[60]):
        assert wrong == []
        # 241 ops: most rounds ran on the caller's thread (the engine thread takes one when it wakes by itself
        # first, or when a rank's round met the peer's idle round and the op went on on the engine thread)
        assert rounds >= 241
        assert caller_ticks >= 241 // 2, (caller_ticks, rounds)


def _patience_of_the_rounds(count: int):
    """Which waits of the node's barrier were patient (``NodeBarrier.patient``): those of ``count`` blocking
    allreduces, then those of a second of idle ticks; each as (on the engine thread, patient)."""
    import threading
    import time

    import torch

    import hvdray.torch as hvd
    from hvdray.collective import session

    hvd.init()
    barrier = session.engine().comm._node.barrier
    seen = []
    real = barrier._await

    def recording(peer):
        seen.append((threading.current_thread().name.startswith("hvdray-engine"), barrier._patience.depth > 0))
        return real(peer)

    barrier._await = recording
    try:
        t = torch.ones(3)
        for _ in range(count):
            hvd.allreduce_(t, name="patience.sum", op=hvd.Sum)
        hvd.barrier()
        blocking = list(seen)
        time.sleep(0.2)  # a round still going on when the loop ended is over
        seen.clear()
        time.sleep(1.0)  # the engine thread's idle ticks (idle_cycle_time_ms is 100 at most)
        idle = list(seen)
    finally:
        del barrier._await
    return blocking, idle


def test_rounds_a_caller_blocks_on_wait_patiently_and_idle_ticks_do_not(shared_executor):
    """The waits of a round that a caller blocks on give the core away longer before they sleep (a peer a
    little behind costs no sleep and wake-up); the engine thread's idle ticks keep the short budget, so an
    idle engine does not spin on its core while a peer computes."""
    for blocking, idle in shared_executor.run(_patience_of_the_rounds, args=[30]):
        on_the_caller = [patient for engine_thread, patient in blocking if not engine_thread]
        assert len(on_the_caller) >= 30 and all(on_the_caller), blocking
        assert idle and not any(patient for _, patient in idle), idle


def _async_and_concurrent():
    import threading
    import time

    import torch

    import hvdray.torch as hvd
    from hvdray.collective import session

    hvd.init()
    torch.set_num_threads(1)
    stats = session.engine().stats
    size = hvd.size()
    out = {}

    # an async op finishes without anyone waiting on it: the engine thread ticks it
    ticks = stats.caller_ticks
    handle = hvd.allreduce_async(torch.ones(4), name="async.alone", op=hvd.Sum)
    deadline = time.monotonic() + 30
    while not hvd.poll(handle) and time.monotonic() < deadline:
        time.sleep(0.001)
    out["async done by polling"] = hvd.poll(handle) and hvd.synchronize(handle).tolist() == [float(size)] * 4
    out["async ticks on the caller"] = stats.caller_ticks - ticks

    # a wait with a timeout never runs a tick on the caller (the flag round could outlast the timeout)
    ticks = stats.caller_ticks
    handle = hvd.allreduce_async(torch.ones(2), name="async.timed", op=hvd.Sum)
    out["timed wait"] = handle._parts[0].wait(timeout=30).tolist() == [float(size)] * 2
    out["timed wait ticks on the caller"] = stats.caller_ticks - ticks

    # four threads each run blocking ops at once: one at a time ticks, the others wait for the engine thread
    errors, results = [], {}

    def blocking_ops(k: int) -> None:
        try:
            for i in range(25):
                value = hvd.allreduce(torch.full((2,), float(k * 100 + i)), name=f"thread{k}.{i}", op=hvd.Sum)
                results[(k, i)] = value.tolist() == [float(size * (k * 100 + i))] * 2
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(repr(exc))

    threads = [threading.Thread(target=blocking_ops, args=(k,)) for k in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    out["threads finished"] = not any(thread.is_alive() for thread in threads)
    out["thread errors"] = errors
    out["thread results"] = len(results) == 100 and all(results.values())

    # grad mode and inference mode are the caller's again after a tick it ran; buffers a tick made in
    # inference mode are ordinary tensors that later rounds on the engine thread write into
    grads = [torch.ones(8) for _ in range(3)]
    with torch.inference_mode():
        first = hvd.grouped_allreduce([g * 2 for g in grads], name="modes.group", op=hvd.Sum)
        out["inference mode kept"] = torch.is_inference_mode_enabled()
        # tensors made in inference mode, written in place (the engine's thread is not in inference mode)
        made_here = torch.ones(5)
        reduced = hvd.allreduce_(made_here, name="modes.inplace", op=hvd.Sum)
        sent = hvd.broadcast_(torch.full((2,), float(hvd.rank())), root_rank=0, name="modes.bcast")
        handle = hvd.allreduce_async_(torch.ones(3), name="modes.async", op=hvd.Sum)
        later = hvd.synchronize(handle)
        out["inference results"] = (
            reduced is made_here and made_here.tolist() == [float(size)] * 5 and sent.tolist() == [0.0, 0.0]
            and later.tolist() == [float(size)] * 3 and all(t.is_inference() for t in (reduced, sent, later))
        )
    handles = [hvd.allreduce_async_(g, name=f"modes.{i}", op=hvd.Sum) for i, g in enumerate(grads)]
    time.sleep(0.05)  # the engine thread runs these before anyone waits
    second = [hvd.synchronize(h) for h in handles]
    again = hvd.grouped_allreduce([g.clone() for g in grads], name="modes.group", op=hvd.Sum)
    out["grad mode kept"] = torch.is_grad_enabled()
    out["modes results"] = (
        all(t.tolist() == [2.0 * size] * 8 for t in first)
        and all(t.tolist() == [float(size)] * 8 for t in second)
        and all(t.tolist() == [float(size * size)] * 8 for t in again)
    )
    hvd.barrier()
    return out


def test_async_ops_threads_and_modes_around_caller_ticks(shared_executor):
    for out in shared_executor.run(_async_and_concurrent):
        assert out["async done by polling"], out
        assert out["async ticks on the caller"] == 0, out
        assert out["timed wait"], out
        assert out["timed wait ticks on the caller"] == 0, out
        assert out["threads finished"] and out["thread errors"] == [], out
        assert out["thread results"], out
        assert out["inference mode kept"] and out["grad mode kept"], out
        assert out["inference results"], out
        assert out["modes results"], out


def _training_steps(steps: int):
    """A DistributedOptimizer's steps, and after them a learned step of async ops that nobody waits for (it
    must still run), one that is only polled, and one where rank 1 waits a while before it synchronizes."""
    import time

    import torch

    import hvdray.torch as hvd
    from hvdray.collective import session

    hvd.init()
    torch.set_num_threads(1)
    engine = session.engine()
    stats = engine.stats
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), named_parameters=net.named_parameters())
    hvd.broadcast_parameters(net.state_dict(), root_rank=0)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(hvd.rank()))
    y = torch.randint(0, 4, (8,), generator=torch.Generator().manual_seed(10 + hvd.rank()))
    ticks = []
    for _ in range(steps):
        before = stats.caller_ticks
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
        ticks.append(stats.caller_ticks - before)
    weights = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    same = hvd.allgather(weights.unsqueeze(0), name="weights")
    out = {
        "mode": engine._steps_on_waiting_thread,
        "late caller ticks": ticks[steps // 2:],
        "replicas agree": bool(torch.equal(same[0], same[-1])),
    }

    grads = [torch.ones(64) for _ in range(4)]

    def step(wait) -> list:
        handles = [hvd.allreduce_async_(g.fill_(1.0), name=f"async.{i}", op=hvd.Sum) for i, g in enumerate(grads)]
        wait(handles)
        return [hvd.synchronize(h).tolist() == [float(hvd.size())] * 64 for h in handles]

    for _ in range(4):  # the engine learns this step of four
        step(lambda handles: None)
    unwaited = time.monotonic()

    def nobody_waits(handles):
        while not all(h._parts[0]._done for h in handles):  # read without a poll or a wait: no nudge
            time.sleep(0.005)

    out["unwaited step done"] = all(step(nobody_waits))
    out["unwaited step took"] = time.monotonic() - unwaited
    before = stats.caller_ticks

    def polls(handles):
        while not all(hvd.poll(h) for h in handles):
            time.sleep(0.001)

    out["polled step done"] = all(step(polls))
    out["polled caller ticks"] = stats.caller_ticks - before
    out["late waiter done"] = all(step(lambda handles: time.sleep(0.3 if hvd.rank() == 1 else 0.0)))
    hvd.barrier()
    return out


@pytest.mark.shared_executor(*STEPS_ON_WAITING_THREAD)
def test_a_learned_step_runs_on_the_thread_that_waits_for_it_or_on_the_engine_thread(shared_executor):
    from hvdray.collective.topology import engine_threads_have_cores

    setting = shared_executor.settings.steps_on_waiting_thread
    for out in shared_executor.run(_training_steps, args=[12]):
        # auto: True where 2 ranks leave no core to spare for their engine threads (this 2-core machine)
        assert out["mode"] is (setting if setting is not None else not engine_threads_have_cores(2))
        assert out["replicas agree"], out
        if out["mode"]:  # the steps ran on the waiting thread (but for one the engine thread woke up for)
            assert sum(t >= 1 for t in out["late caller ticks"]) >= 5, out
        else:
            assert out["late caller ticks"] == [0] * 6, out
        assert out["unwaited step done"] and out["unwaited step took"] < 5.0, out
        assert out["polled step done"] and out["polled caller ticks"] == 0, out
        assert out["late waiter done"], out
