"""Process sets on real workers: results stay inside a set, disjoint sets run concurrently, every op
takes ``process_set=`` (torch and TensorFlow), and misuse fails fast with a ValueError naming process_set."""

from __future__ import annotations

import pytest

#: the module's shared executors (tests/conftest.py): three and four workers on a loaded 2-core machine get
#: room for their start. Each check begins with ``hvd.shutdown()``, so that its ``hvd.init()`` starts a job
#: without the sets an earlier check added.
EXECUTORS = {name: (workers, {"timeout_s": 30, "placement_group_timeout_s": 90})
             for name, workers in (("three", 3), ("four", 4))}


def _isolation():
    import torch

    import hvdray.torch as hvd

    hvd.shutdown()
    evens, odds = hvd.ProcessSet([0, 2]), hvd.ProcessSet([1, 3])
    hvd.init(process_sets=[evens, odds])
    mine = evens if hvd.rank() % 2 == 0 else odds
    r = hvd.rank()
    out = {"set_rank": mine.rank(), "set_size": mine.size(), "ids": (evens.process_set_id, odds.process_set_id)}
    out["allreduce"] = hvd.allreduce(torch.tensor([float(r)]), op=hvd.Sum, name="x", process_set=mine).item()
    out["average"] = hvd.allreduce(torch.tensor([float(r)]), name="avg", process_set=mine).item()
    t = torch.tensor([float(r)])
    hvd.allreduce_(t, op=hvd.Sum, name="inplace", process_set=mine)
    out["inplace"] = t.item()
    out["grouped"] = [x.item() for x in hvd.grouped_allreduce(
        [torch.tensor([1.0 * r]), torch.tensor([2.0 * r])], op=hvd.Sum, process_set=mine)]
    out["allgather"] = hvd.allgather(torch.tensor([r] * (r + 1)), process_set=mine).tolist()
    out["broadcast"] = hvd.broadcast(torch.tensor([float(r)]), root_rank=mine.ranks[1], process_set=mine).item()
    out["alltoall"] = hvd.alltoall(torch.tensor([10 * r, 10 * r + 1]), process_set=mine).tolist()
    out["reducescatter"] = hvd.reducescatter(torch.tensor([1.0 * r, 2.0 * r]), op=hvd.Sum, process_set=mine).tolist()
    out["object"] = hvd.allgather_object(f"r{r}", process_set=mine)
    out["bobject"] = hvd.broadcast_object(f"from {r}", root_rank=mine.ranks[0], process_set=mine)
    hvd.barrier(process_set=mine)
    handle = hvd.allreduce_async(torch.tensor([1.0]), op=hvd.Sum, name="async", process_set=mine)
    out["async"] = hvd.synchronize(handle).item()
    out["global"] = hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum, name="x").item()  # same name, other set
    # DistributedOptimizer on a set averages gradients among the set only
    model = torch.nn.Linear(1, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), process_set=mine)
    (model(torch.tensor([[float(r)]])).sum()).backward()
    opt.step()
    out["weight"] = model.weight.item()
    return out


@pytest.mark.shared_executor("four")
def test_sets_isolate_and_every_op_takes_process_set(shared_executor):
    results = shared_executor.run(_isolation)
    for r, out in enumerate(results):
        members = [0, 2] if r % 2 == 0 else [1, 3]
        assert out["ids"] == (1, 2)
        assert out["set_rank"] == members.index(r) and out["set_size"] == 2
        assert out["allreduce"] == sum(members) == out["inplace"]
        assert out["average"] == sum(members) / 2
        assert out["grouped"] == [sum(members), 2 * sum(members)]
        assert out["allgather"] == [m for m in members for _ in range(m + 1)]
        assert out["broadcast"] == members[1]
        me = members.index(r)
        assert out["alltoall"] == [10 * m + me for m in members]
        assert out["reducescatter"] == [float(sum(members) * (me + 1))]
        assert out["object"] == [f"r{m}" for m in members]
        assert out["bobject"] == f"from {members[0]}"
        assert out["async"] == 2.0 and out["global"] == 4.0
        assert out["weight"] == pytest.approx(-sum(members) / 2)


def _concurrent():
    import threading
    import time

    import torch

    import hvdray.torch as hvd

    hvd.shutdown()
    hvd.init()
    evens = hvd.add_process_set([0, 2])
    odds = hvd.add_process_set(hvd.ProcessSet([1, 3]))
    mine = evens if hvd.rank() % 2 == 0 else odds
    if hvd.rank() == 1:
        time.sleep(2.0)  # the odd set starts late: the even set must not wait for it
    started = time.monotonic()
    for i in range(20):
        hvd.allreduce(torch.ones(1000), name=f"c{i}", process_set=mine)
    took = time.monotonic() - started
    finished = time.monotonic()
    # wall-clock finish times across ranks, to compare sets: the even set finishes first
    stamps = hvd.allgather_object(finished)
    removed = hvd.remove_process_set(mine if hvd.rank() < 2 else (odds if mine is evens else evens))
    return took, stamps, removed, threading.active_count()


@pytest.mark.shared_executor("four")
def test_disjoint_sets_run_concurrently(shared_executor):
    results = shared_executor.run(_concurrent)
    stamps = results[0][1]
    # ranks 0 and 2 finished their set's 20 ops before rank 1 (which slept 2 s first) finished
    assert max(stamps[0], stamps[2]) < stamps[1]


def _errors():
    import torch

    import hvdray.torch as hvd

    hvd.shutdown()
    hvd.init()
    pair = hvd.add_process_set([0, 1])
    errors = {}

    def capture(key, fn):
        try:
            fn()
        except (ValueError, TypeError) as exc:
            errors[key] = f"{type(exc).__name__}: {exc}"

    if hvd.rank() == 2:
        capture("not_member", lambda: hvd.allreduce(torch.ones(1), process_set=pair))
        capture("not_member_tf_like", lambda: hvd.barrier(process_set=pair))
    else:
        capture("root_outside", lambda: hvd.broadcast(torch.ones(1), root_rank=2, process_set=pair))
    capture("unregistered", lambda: hvd.allreduce(torch.ones(1), process_set=hvd.ProcessSet([0, 2])))
    capture("bad_type", lambda: hvd.allreduce(torch.ones(1), process_set=[0, 1]))
    capture("bad_ranks", lambda: hvd.ProcessSet([0, 0]))
    capture("duplicate", lambda: hvd.add_process_set([0, 1]))
    capture("disagree", lambda: hvd.add_process_set([0, 1 + hvd.rank() % 2]))
    capture("invalid_on_one", lambda: hvd.add_process_set([0, 0] if hvd.rank() == 1 else [0, 2]))
    capture("outside", lambda: hvd.add_process_set([0, 7]))
    capture("remove_global", lambda: hvd.remove_process_set(hvd.global_process_set))
    # after the errors, ops still work everywhere
    ok = hvd.allreduce(torch.ones(1), op=hvd.Sum, name="after").item()
    removed = hvd.remove_process_set(pair)
    capture("removed", lambda: hvd.allreduce(torch.ones(1), process_set=pair))
    return errors, ok, removed


@pytest.mark.shared_executor("three")
def test_misuse_raises_value_error_naming_process_set(shared_executor):
    for r, (errors, ok, removed) in enumerate(shared_executor.run(_errors)):
        assert ok == 3.0 and removed is True
        if r == 2:
            assert "process_set" in errors["not_member"] and "rank 2" in errors["not_member"]
            assert "process_set" in errors["not_member_tf_like"]
        else:
            assert "root_rank 2" in errors["root_outside"] and "process_set" in errors["root_outside"]
        assert "not registered" in errors["unregistered"]
        assert errors["bad_type"].startswith("TypeError") and "process_set" in errors["bad_type"]
        assert "unique" in errors["bad_ranks"]
        assert "already registered" in errors["duplicate"]
        assert "disagree" in errors["disagree"]
        assert ("unique" if r == 1 else "rank(s) [1] passed an invalid") in errors["invalid_on_one"]
        assert "outside the job" in errors["outside"]
        assert "global" in errors["remove_global"]
        assert "not registered" in errors["removed"]


def _tensorflow_sets():
    import tensorflow as tf

    import hvdray.tensorflow as hvd

    hvd.shutdown()
    hvd.init()
    mine = hvd.add_process_set([0, 1]), hvd.add_process_set([2])
    ps = mine[0] if hvd.rank() < 2 else mine[1]
    r = float(hvd.rank())
    out = {"allreduce": float(hvd.allreduce(tf.constant([r]), op=hvd.Sum, process_set=ps)[0])}

    @tf.function
    def graph(x):
        return hvd.allreduce(x, op=hvd.Sum, name="g", process_set=ps)

    out["graph"] = float(graph(tf.constant([r]))[0])
    out["allgather"] = hvd.allgather(tf.constant([r]), process_set=ps).numpy().tolist()
    out["broadcast"] = float(hvd.broadcast(tf.constant([r]), root_rank=ps.ranks[-1], process_set=ps)[0])
    out["grouped"] = [float(t[0]) for t in hvd.grouped_allreduce([tf.constant([r])], op=hvd.Sum, process_set=ps)]
    with tf.GradientTape() as tape:
        w = tf.Variable([1.0])
        loss = tf.reduce_sum(w * r)
    tape = hvd.DistributedGradientTape(tape, process_set=ps)
    out["tape"] = float(tape.gradient(loss, [w])[0][0])
    hvd.barrier(process_set=ps)
    return out


@pytest.mark.filterwarnings("ignore")
@pytest.mark.shared_executor("three")
def test_tensorflow_ops_take_process_set(shared_executor):
    pytest.importorskip("tensorflow")
    results = shared_executor.run(_tensorflow_sets)
    for r, out in enumerate(results):
        members = [0, 1] if r < 2 else [2]
        assert out["allreduce"] == out["graph"] == sum(members)
        assert out["allgather"] == [float(m) for m in members]
        assert out["broadcast"] == members[-1]
        assert out["grouped"] == [sum(members)]
        assert out["tape"] == pytest.approx(sum(members) / len(members))
