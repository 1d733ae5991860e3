"""RayExecutor on a real local Ray: the horovod.ray API, placement, callbacks, errors, clean shutdown."""

from __future__ import annotations

import os
import re
import sys
import threading
import time
from pathlib import Path

import pytest
import ray
import ray.cloudpickle
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from hvdray import RayExecutor, WorkerLostError, ray_logger

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import collective_checks as checks  # noqa: E402 - shared with the other executor and collective tests

ray.cloudpickle.register_pickle_by_value(checks)


def _live_placement_groups() -> int:
    return sum(1 for pg in placement_group_table().values() if pg["state"] != "REMOVED")


def _wait_for_cpus(expected: float, timeout_s: float = 15) -> float:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        free = ray.available_resources().get("CPU", 0)
        if free == expected:
            return free
        time.sleep(0.2)
    return ray.available_resources().get("CPU", 0)


def test_run_returns_results_in_rank_order(make_executor):
    ex = make_executor(num_workers=3)
    assert ex.run(checks.rank_and_size) == [(r, 3, r, 3, 0, 1) for r in range(3)]
    refs = ex.run_remote(lambda x, y=0: x + y, args=[1], kwargs={"y": 2})
    assert all(isinstance(r, ray.ObjectRef) for r in refs)
    assert ray.get(refs) == [3, 3, 3]


def _sum_over_ranks_of(k):
    import time

    import torch

    import hvdray.torch as hvd

    hvd.init()
    time.sleep(0.02 * hvd.rank())  # the ranks reach the allreduce at different times
    return hvd.allreduce(torch.tensor([float(k + hvd.rank())]), op=hvd.Sum).item()


def test_calls_from_several_threads_take_turns_and_each_gets_its_own_results(make_executor):
    """Threads that call one executor at once (a notebook's background cell beside the foreground one, a
    web handler's threads): every worker runs the calls in the same order, so each call's collectives pair
    with its own. Before, two threads sending to the ranks in turn gave the ranks different orders, and a
    call's allreduce on rank 0 met another call's on rank 1: wrong results, silently. The threads also
    start a new executor once, not once each (one placement group)."""
    ex = make_executor(start=False, num_workers=2)
    barrier = threading.Barrier(3)
    results: dict[int, list] = {}

    def calls(thread: int) -> None:
        barrier.wait()
        got = []
        for i in range(4):
            k = 100 * thread + i
            if i % 2:
                got.append((k, ray.get(ex.run_remote(_sum_over_ranks_of, args=[k]))))
            else:
                got.append((k, ex.run(_sum_over_ranks_of, args=[k])))
        results[thread] = got

    threads = [threading.Thread(target=calls, args=(t,)) for t in (1, 2, 3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert sorted(results) == [1, 2, 3], results
    for got in results.values():
        for k, values in got:
            assert values == [2.0 * k + 1] * 2, (k, values)
    assert _live_placement_groups() == 1
    ray.cloudpickle.dumps(ex)  # a closure that captures the executor still pickles, as before the turns


def test_elastic_runs_from_two_threads_take_turns(make_executor):
    """Each elastic run forms its own epochs of its own workers: from two threads at once they ran two
    drivers over one coordinator; now the second waits for the first."""
    ex = make_executor(min_workers=2, max_workers=2)
    barrier = threading.Barrier(2)
    results: dict[int, list] = {}

    def call(k: int) -> None:
        barrier.wait()
        results[k] = ex.run(_sum_over_ranks_of, args=[k])

    threads = [threading.Thread(target=call, args=(k,)) for k in (1, 1000)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert results == {1: [3.0, 3.0], 1000: [2001.0, 2001.0]}


def test_a_callback_that_calls_its_executor_is_refused_instead_of_waiting_for_itself(make_executor):
    ex = make_executor(num_workers=2)

    def calls_the_executor(record):
        ex.run(checks.rank_and_size)

    with pytest.raises(RuntimeError, match=r"run\(\) was called on hvdray executor \w+ from within a call of its own"):
        ex.run(_logs_then_trains_for_a_minute, callbacks=[calls_the_executor])
    assert ex.run(_sum_over_ranks_of, args=[1]) == [3.0, 3.0]


def test_stateful_executable_keeps_state_across_execute_calls(make_executor):
    class Counter:
        def __init__(self, start, step=1):
            self.value = start
            self.step = step

        def bump(self):
            self.value += self.step
            return self.value

    ex = make_executor(start=False, num_workers=2)
    ex.start(executable_cls=Counter, executable_args=[10], executable_kwargs={"step": 5})
    assert ex.execute(lambda w: w.bump()) == [15, 15]
    assert ex.execute(lambda w: w.bump()) == [20, 20]
    assert ex.execute_single(lambda w: w.bump()) == 25
    assert ex.execute(lambda w: w.value) == [25, 20]


def test_extra_env_vars_reach_the_workers(make_executor):
    ex = make_executor(start=False, num_workers=2)
    ex.start(extra_env_vars={"HVDRAY_TEST_MARK": "42"})
    assert ex.run(lambda: os.environ.get("HVDRAY_TEST_MARK")) == ["42", "42"]


def test_ray_logger_records_reach_every_callback(make_executor):
    ex = make_executor(num_workers=2)

    def train():
        import hvdray.torch as hvd

        hvd.init()
        for epoch in range(3):
            ray_logger.log({"epoch": epoch, "from": hvd.rank()})
        return hvd.rank()

    first, second = [], []
    assert ex.run(train, callbacks=[first.append, second.append]) == [0, 1]
    assert first == second
    assert sorted((r["rank"], r["epoch"]) for r in first) == [(r, e) for r in range(2) for e in range(3)]
    assert all(r["rank"] == r["from"] for r in first)


def _logs_then_trains_for_a_minute():
    import time

    import torch

    import hvdray.torch as hvd

    hvd.init()
    ray_logger.log({"started": hvd.rank()})
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        hvd.allreduce(torch.ones(1), name="step")
        time.sleep(0.05)
    return hvd.rank()


def _broken_callback(record):
    raise ValueError("the callback broke")


@pytest.mark.parametrize("elastic", [False, True], ids=["fixed", "elastic"])
def test_a_callback_that_raises_ends_the_run_and_stops_its_workers(make_executor, elastic):
    """The run raises the callback's error (with a note) at once, and the workers do not train on
    unseen: the fixed executor's workers used to run the call to its end while the next call queued
    behind it. The executor stays usable."""
    ex = make_executor(**({"min_workers": 2, "max_workers": 2} if elastic else {"num_workers": 2}))
    started = time.monotonic()
    with pytest.raises(ValueError, match="the callback broke") as raised:
        ex.run(_logs_then_trains_for_a_minute, callbacks=[_broken_callback])
    assert time.monotonic() - started < 30
    assert any("raised by the callback _broken_callback of run(); the run was stopped" in note for note in raised.value.__notes__)
    started = time.monotonic()
    assert ex.run(checks.rank_and_size)[1][:2] == (1, 2)
    assert time.monotonic() - started < 30  # not behind the first call's minute


@pytest.mark.parametrize("elastic", [False, True], ids=["fixed", "elastic"])
def test_shutdown_from_another_thread_ends_a_waiting_run_saying_so(make_executor, elastic, actors_left_behind):
    """A notebook's cell (or a Tune trial being stopped) shuts the executor down while another thread's
    run() waits: the run raises at once that the executor was shut down, not that a worker died
    unexpectedly (what it said before), and nothing is left."""
    import threading

    ex = make_executor(**({"min_workers": 2, "max_workers": 2} if elastic else {"num_workers": 2}))
    records, outcome = [], {}

    def run_in_thread():
        try:
            outcome["value"] = ex.run(_logs_then_trains_for_a_minute, callbacks=[records.append])
        except BaseException as exc:  # noqa: BLE001 - what the test looks at
            outcome["error"] = exc

    thread = threading.Thread(target=run_in_thread)
    thread.start()
    deadline = time.monotonic() + 60
    while len(records) < 2 and time.monotonic() < deadline:  # both ranks train
        time.sleep(0.1)
    assert len(records) >= 2, records
    stopped = time.monotonic()
    ex.shutdown()
    thread.join(30)
    assert not thread.is_alive() and time.monotonic() - stopped < 15
    error = outcome.get("error")
    assert isinstance(error, RuntimeError) and "was shut down (executor.shutdown(), from another thread)" in str(
        error), repr(error)
    deadline = time.monotonic() + 10
    while actors_left_behind() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert actors_left_behind() == []


def test_an_executor_dropped_without_shutdown_is_released_by_the_next_start(ray_local, actors_left_behind):
    """A notebook cell that makes and starts an executor, run three times: each run drops the last
    executor without shutdown(). Its placement group and workers used to stay until the driver exited, so
    the third start found 2 of the 4 CPUs free and timed out; the next start now releases them first."""
    import gc

    executor = None
    for _ in range(3):
        executor = RayExecutor(RayExecutor.create_settings(placement_group_timeout_s=10), num_workers=2)
        gc.collect()  # the executor before it is gone (at once where nothing else refers to it)
        executor.start()
        assert [r[:2] for r in executor.run(checks.rank_and_size)] == [(0, 2), (1, 2)]
        assert _live_placement_groups() == 1
    deadline = time.monotonic() + 10
    while len(actors_left_behind()) != 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(actors_left_behind()) == 2  # the last executor's workers only
    executor.shutdown()


def test_num_hosts_layout_places_workers_per_host(make_executor):
    ex = make_executor(num_hosts=1, num_workers_per_host=2)
    assert ex.num_workers == 2
    assert ex.run(checks.rank_and_size) == [(0, 2, 0, 2, 0, 1), (1, 2, 1, 2, 0, 1)]


@pytest.mark.parametrize(
    "kwargs, asked, why",
    [
        (dict(num_workers=3, cpus_per_worker=2), "3 bundle(s) of {'CPU': 2}", "the nodes hold 2 bundle(s)"),
        (dict(num_workers=1, cpus_per_worker=5), "1 bundle(s) of {'CPU': 5}", "no node has {'CPU': 5}"),
        (dict(num_workers=1, use_gpu=True), "{'CPU': 1, 'GPU': 1}", "no node has {'CPU': 1, 'GPU': 1}"),
        (dict(num_hosts=2, num_workers_per_host=1), "with strategy STRICT_SPREAD",
         "STRICT_SPREAD needs 2 distinct nodes that each fit a bundle, and 1 do"),
    ],
)
def test_infeasible_placement_fails_at_once_with_requested_and_available_per_node(ray_local, kwargs, asked, why):
    from hvdray.driver.placement import PlacementInfeasibleError

    before = _live_placement_groups()
    ex = RayExecutor(RayExecutor.create_settings(placement_group_timeout_s=60), **kwargs)
    started = time.monotonic()
    with pytest.raises(TimeoutError) as info:  # what horovod.ray users catch
        ex.start()
    assert time.monotonic() - started < 5  # not placement_group_timeout_s
    assert isinstance(info.value, PlacementInfeasibleError)
    message = str(info.value)
    assert asked in message and why in message, message
    (node,) = [n for n in ray.nodes() if n["Alive"]]
    assert re.search(rf"node {node['NodeID']} \(\S+\): CPU 4 total / [\d.]+ free", message), message
    assert _live_placement_groups() == before
    ex.shutdown()


def test_a_feasible_placement_the_cluster_is_too_busy_for_waits_for_the_timeout_and_can_be_retried(ray_local):
    busy = placement_group([{"CPU": 3}])  # another job holds 3 of the 4 CPUs
    ray.get(busy.ready())
    before = _live_placement_groups()
    ex = RayExecutor(RayExecutor.create_settings(placement_group_timeout_s=2), num_workers=2)
    started = time.monotonic()
    with pytest.raises(TimeoutError) as info:
        ex.start()
    assert 2 <= time.monotonic() - started < 10
    message = str(info.value)
    assert "2 bundle(s) of {'CPU': 1}" in message and "placement_group_timeout_s=2" in message, message
    assert "CPU 4 total / 1 free" in message, message
    assert _live_placement_groups() == before
    remove_placement_group(busy)
    ex.start()  # once the other job is gone, the same executor starts (a failed start shut it down before)
    try:
        assert [r[:2] for r in ex.run(checks.rank_and_size)] == [(0, 2), (1, 2)]
    finally:
        ex.shutdown()


class _SlowToBuild:
    """An executable whose construction on each worker takes ``seconds``."""

    def __init__(self, seconds):
        time.sleep(seconds)

    def ready(self):
        return True


def test_a_short_placement_timeout_does_not_cut_short_the_set_up_of_started_workers(ray_local):
    """``placement_group_timeout_s`` is the wait for the cluster; workers that started get their ranks,
    configuration and executable within ``timeout_s`` at least (a slow machine's set-up took longer
    than a 2 s placement timeout), and a set-up over both says so, leaving nothing behind."""
    before = _live_placement_groups()
    ex = RayExecutor(RayExecutor.create_settings(placement_group_timeout_s=1, timeout_s=30), num_workers=2)
    ex.start(executable_cls=_SlowToBuild, executable_args=[3])  # 3 s: over the placement timeout
    try:
        assert ex.execute(lambda worker: worker.ready()) == [True, True]
    finally:
        ex.shutdown()
    ex = RayExecutor(RayExecutor.create_settings(placement_group_timeout_s=1, timeout_s=2), num_workers=2)
    started = time.monotonic()
    with pytest.raises(TimeoutError) as info:
        ex.start(executable_cls=_SlowToBuild, executable_args=[20])
    assert time.monotonic() - started < 15  # not the 20 s of the construction
    message = str(info.value)
    assert "within 2 s" in message and "timeout_s=2" in message and "placement_group_timeout_s=1" in message, message
    assert _live_placement_groups() == before
    ex.shutdown()


def test_existing_placement_group_is_reused(ray_local):
    pg = placement_group([{"CPU": 1}, {"CPU": 1}, {"CPU": 0.01}])
    ray.get(pg.ready())
    before = _live_placement_groups()

    @ray.remote(num_cpus=0.01)
    def trial():
        ex = RayExecutor(RayExecutor.create_settings(timeout_s=20), num_workers=2)
        ex.start()
        try:
            return ex.run(checks.rank_and_size), _live_placement_groups()
        finally:
            ex.shutdown()

    strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=2, placement_group_capture_child_tasks=True)
    results, during = ray.get(trial.options(scheduling_strategy=strategy).remote())
    assert [r[:2] for r in results] == [(0, 2), (1, 2)]
    assert during == before  # no new group: the workers lived in the trial's group
    remove_placement_group(pg)


def test_context_manager_and_repeated_start_shutdown_release_everything(ray_local):
    total = ray.cluster_resources()["CPU"]
    groups = _live_placement_groups()
    for _ in range(3):
        with RayExecutor(RayExecutor.create_settings(timeout_s=20), num_workers=2) as ex:
            assert ex.run(checks.rank_and_size)[1][:2] == (1, 2)
        assert _wait_for_cpus(total) == total
        assert _live_placement_groups() == groups
    with pytest.raises(RuntimeError, match="shut down"):
        ex.run(checks.rank_and_size)


def test_a_stateful_executable_survives_a_call_that_raised(make_executor):
    class Counter:
        def __init__(self):
            self.value = 0

        def bump(self, fail_on=None):
            import hvdray.torch as hvd

            hvd.init()
            self.value += 1
            if hvd.rank() == fail_on:
                raise RuntimeError("bump failed")
            return self.value

    ex = make_executor(start=False, num_workers=2)
    ex.start(executable_cls=Counter)
    assert ex.execute(lambda w: w.bump()) == [1, 1]
    with pytest.raises(RuntimeError, match="bump failed"):
        ex.execute(lambda w: w.bump(fail_on=1))
    assert ex.execute(lambda w: w.bump()) == [3, 3]  # kept: the failed call's bump counted too


def test_dead_worker_becomes_an_error_within_the_timeout(make_executor):
    settings = RayExecutor.create_settings(timeout_s=5, placement_group_timeout_s=20)
    ex = make_executor(settings=settings, num_workers=2)

    def die_on_rank_zero():
        import torch

        import hvdray.torch as hvd

        hvd.init()
        if hvd.rank() == 0:
            os._exit(3)
        hvd.allreduce(torch.ones(1), name="peer-is-dead")
        return "unreachable"

    started = time.monotonic()
    with pytest.raises(WorkerLostError, match="rank 0"):
        ex.run(die_on_rank_zero)
    assert time.monotonic() - started < 5 + 5
    assert [r[:2] for r in ex.run(checks.rank_and_size)] == [(0, 2), (1, 2)]


class _RefusesWhenMarked:
    """An executable that cannot be built once ``marker`` exists (a restart that fails)."""

    def __init__(self, marker):
        if os.path.exists(marker):
            raise RuntimeError("this executable refuses to start again")


def _named_actor_alive(name: str) -> bool:
    try:
        ray.get_actor(name)
        return True
    except ValueError:
        return False


def test_a_restart_that_fails_leaves_no_actors_behind(make_executor, tmp_path, coordinator_place):
    marker = str(tmp_path / "refuse")
    ex = make_executor(start=False, num_workers=2)
    ex.start(executable_cls=_RefusesWhenMarked, executable_args=[marker])

    def die_on_rank_one():
        import hvdray.torch as hvd

        hvd.init()
        if hvd.rank() == 1:
            os._exit(3)
        time.sleep(60)

    with pytest.raises(WorkerLostError):
        ex.run(die_on_rank_one)
    open(marker, "w").close()
    with pytest.raises(Exception, match="refuses to start again"):
        ex.run(checks.rank_and_size)  # the executor starts new workers, and that start fails
    names = [f"hvdray-{ex._id}-{role}" for role in ("rank-0", "rank-1")]
    deadline = time.monotonic() + 10
    while any(_named_actor_alive(n) for n in names) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [n for n in names if _named_actor_alive(n)], "a failed restart left its actors running"
    if coordinator_place == "first worker":
        return  # the job's coordinator died with its first worker
    # the driver's coordinator actor stays for its next executors, holding no table of this job's (the
    # table is dropped by a call the driver does not wait for: an async actor may run it after a later one)
    from hvdray.driver import coordinator_host

    def open_jobs() -> int:
        return ray.get(coordinator_host._host[1].jobs.remote(), timeout=30)

    deadline = time.monotonic() + 10
    while open_jobs() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert open_jobs() == 0


@ray.remote(num_cpus=0)
class _NameHolder:
    """An actor that holds a rank's name, as the killed worker of a failed run does until Ray frees it."""

    def ready(self) -> bool:
        return True


def _hold_name(name: str):
    holder = _NameHolder.options(name=name).remote()
    ray.get(holder.ready.remote(), timeout=60)
    return holder


def test_a_start_waits_for_a_rank_name_the_last_group_still_holds(make_executor):
    ex = make_executor(start=False, num_workers=2)
    holder = _hold_name(f"hvdray-{ex._id}-rank-1")
    started = time.monotonic()
    threading.Timer(1.0, ray.kill, (holder,), {"no_restart": True}).start()
    ex.start()
    assert time.monotonic() - started >= 1.0, "the start did not wait for the name"
    assert [r[:2] for r in ex.run(checks.rank_and_size)] == [(0, 2), (1, 2)]


def test_a_rank_name_taken_for_good_fails_the_start_within_its_budget(make_executor):
    settings = RayExecutor.create_settings(timeout_s=5, placement_group_timeout_s=3)
    ex = make_executor(start=False, settings=settings, num_workers=2)
    name = f"hvdray-{ex._id}-rank-1"
    holder = _hold_name(name)
    try:
        started = time.monotonic()
        with pytest.raises(RuntimeError, match=rf"'{name}' was still taken .* placement_group_timeout_s=3"):
            ex.start()
        assert time.monotonic() - started < 3 + 10
        assert ray.get(holder.ready.remote(), timeout=30), "the start harmed the actor that had the name"
        rank_0 = f"hvdray-{ex._id}-rank-0"
        deadline = time.monotonic() + 10
        while _named_actor_alive(rank_0) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _named_actor_alive(rank_0), "the failed start left its first worker running"
    finally:
        ray.kill(holder, no_restart=True)


@pytest.mark.parametrize(
    "kwargs,argument",
    [
        ({"num_workers": 0}, "num_workers"),
        ({"num_workers": 2.5}, "num_workers"),
        ({"num_workers": 2, "num_hosts": 1}, "num_hosts"),
        ({"num_workers": 2, "min_workers": 1}, "min_workers"),
        ({"num_hosts": 0}, "num_hosts"),
        ({"num_hosts": 1, "num_workers_per_host": 0}, "num_workers_per_host"),
        ({"num_workers": 1, "cpus_per_worker": 0}, "cpus_per_worker"),
        ({"num_workers": 1, "gpus_per_worker": 1}, "gpus_per_worker"),
        ({"num_workers": 1, "use_gpu": True, "gpus_per_worker": -1}, "gpus_per_worker"),
        ({"min_workers": 4, "max_workers": 2}, "min_workers"),
        ({"min_workers": 1, "reset_limit": -1}, "reset_limit"),
        ({"min_workers": 1, "cooldown_range": (5, 1)}, "cooldown_range"),
        ({"min_workers": 1, "elastic_timeout": -3}, "elastic_timeout"),
        ({}, "num_workers"),
    ],
)
def test_bad_executor_arguments_name_the_argument(kwargs, argument):
    started = time.monotonic()
    with pytest.raises(ValueError, match=argument):
        RayExecutor(RayExecutor.create_settings(), **kwargs)
    assert time.monotonic() - started < 1


def test_bad_call_arguments(make_executor):
    ex = make_executor(start=False, num_workers=1)
    with pytest.raises(TypeError, match="settings"):
        RayExecutor({"timeout_s": 3}, num_workers=1)
    with pytest.raises(TypeError, match="extra_env_vars"):
        ex.start(extra_env_vars={"A": 1})
    ex.start()
    with pytest.raises(RuntimeError, match="already"):
        ex.start()
    with pytest.raises(TypeError, match="fn"):
        ex.run("not a function")
    with pytest.raises(TypeError, match="args"):
        ex.run(checks.rank_and_size, args="abc")
    with pytest.raises(TypeError, match="callbacks"):
        ex.run(checks.rank_and_size, callbacks=[42])


class _Counter:
    def __init__(self, start):
        self.value = start

    def bump(self):
        self.value += 1
        return self.value


def test_after_ray_shutdown_the_executor_starts_anew_and_shutdown_does_not_raise(ray_local):
    """A notebook that calls ray.shutdown() and ray.init() again, then uses the executor it made before:
    its next call starts new workers in the new Ray (the old ones went with the old session), the
    stateful executable built again from start()'s arguments; and shutdown() after a ray.shutdown() calls
    no Ray API. Before, the call failed with Ray's "Can't find actor ... from a different cluster" and
    shutdown() raised Ray's "owner is unknown" ValueError. (Last in this module: it ends the shared Ray.)"""
    ex = RayExecutor(RayExecutor.create_settings(timeout_s=20, placement_group_timeout_s=30), num_workers=2)
    ex.start(executable_cls=_Counter, executable_args=[10])
    assert ex.execute(lambda counter: counter.bump()) == [11, 11]
    ray.shutdown()
    ray.init(address="local", num_cpus=4, include_dashboard=False)
    assert ex.execute(lambda counter: counter.bump()) == [11, 11]  # built anew in the new session
    assert [r[:2] for r in ex.run(checks.rank_and_size)] == [(0, 2), (1, 2)]
    ray.shutdown()
    ex.shutdown()  # nothing to release: it went with the session
    with pytest.raises(RuntimeError, match="shut down"):
        ex.run(checks.rank_and_size)
