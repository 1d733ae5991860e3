"""Horovod's semantics where a script depends on them, each checked against a hand computation on 2 real
workers: join with DistributedOptimizer on uneven data, the gradients of the collectives,
broadcast_optimizer_state's initialisation, and DistributedOptimizer on a process set; and on 3 workers,
a float average's rounding."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def pair(ray_local):
    """One pair of workers for the module: every check calls ``hvd.init()`` and leaves no process set behind,
    and a check that raises leaves the workers to the next (a new pair costs two worker starts)."""
    from hvdray import RayExecutor

    with RayExecutor(RayExecutor.create_settings(timeout_s=30, placement_group_timeout_s=60), num_workers=2) as pair:
        yield pair


def _uneven_batches():
    import torch

    import hvdray.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    model = torch.nn.Linear(2, 1)  # weight and bias: a fused batch of two gradients
    with torch.no_grad():
        model.weight.fill_(1.0)
        model.bias.fill_(1.0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters())
    for b in range(3 if hvd.rank() == 0 else 5):
        opt.zero_grad()
        model(torch.full((1, 2), float(hvd.rank() + 1 + b))).sum().backward()  # gradient: x, and 1 for the bias
        opt.step()
    last = hvd.join()
    return model.weight.flatten().tolist(), model.bias.item(), last


def test_join_lets_a_rank_with_fewer_batches_contribute_zeros(pair):
    """Rank 0 has 3 batches, rank 1 has 5. Steps 0-2 average both ranks' gradients; steps 3-4 average rank 1's
    with rank 0's zeros (divided by the size, 2), as Horovod does."""
    (w0, b0, last0), (w1, b1, last1) = pair.run(_uneven_batches)
    # steps 0-2: mean of x = ((1 + b) + (2 + b)) / 2 = 1.5, 2.5, 3.5; bias gradient 1
    assert w0 == pytest.approx([1 - 0.1 * (1.5 + 2.5 + 3.5)] * 2) and b0 == pytest.approx(1 - 0.1 * 3)
    # steps 3-4 on rank 1 alone: x = 5, 6 halved; bias gradient 1/2
    assert w1 == pytest.approx([w0[0] - 0.1 * (2.5 + 3.0)] * 2) and b1 == pytest.approx(b0 - 0.1 * 1.0)
    assert last0 == last1 == 1


def _joined_fused_averages():
    import itertools

    import torch

    import hvdray.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    wrong = []
    for dtype, dim, first, cached in itertools.product((torch.int32, torch.int64, torch.float64), (1, 3),
                                                     range(size), (False, True)):
        torch.manual_seed(1234)
        # two tensors fused into one message; at dim 3 it is past the small-message path
        a = torch.empty(*([5] * dim)).random_(-100, 100).to(dtype)
        b = torch.empty(*([17] * dim)).random_(-100, 100).to(dtype)
        if cached:  # the names run once with every rank first, so the joined round replays a cached plan
            hvd.synchronize(hvd.allreduce_async(a, name="joined.a"))
            hvd.synchronize(hvd.allreduce_async(b, name="joined.b"))
        if rank == first:
            hvd.join()
            continue
        handles = hvd.allreduce_async(a, name="joined.a"), hvd.allreduce_async(b, name="joined.b")
        results = [hvd.synchronize(h) for h in handles]
        hvd.join()
        for sent, got in zip((a, b), results):  # the joined rank's zeros count in the average's size
            want = (sent * (size - 1)).div(size, rounding_mode=None if dtype.is_floating_point else "trunc")
            if not torch.equal(got, want):
                wrong.append((str(dtype), dim, first, cached, tuple(sent.shape)))
    return wrong


def test_a_joined_ranks_zeros_count_in_fused_averages_of_every_size(pair):
    """Horovod's test_horovod_join_allreduce: with one rank joined, the other's fused Average of two
    tensors is (tensor * (size - 1)) / size, integers rounded toward zero, for small and large messages,
    named and cached. (A joined rank once took another way through the shared-memory transport than its
    peer, which then copied the joined rank's part unscaled: integers of 17**3 elements came back undivided.)"""
    assert pair.run(_joined_fused_averages) == [[], []]


def _collective_gradients():
    import torch

    import hvdray.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    r, out = hvd.rank(), {}
    scale = float(r + 1)  # each rank sends back a different gradient: 1 on rank 0, 2 on rank 1

    x = torch.ones(r + 1, 2, requires_grad=True)         # 1 row on rank 0, 2 on rank 1
    hvd.allgather(x).backward(torch.full((3, 2), scale))
    out["allgather"] = x.grad.tolist()

    xs = [torch.ones(r + 1, requires_grad=True), torch.ones(2, requires_grad=True)]
    gathered = hvd.grouped_allgather(xs)
    torch.autograd.backward(gathered, [torch.full((3,), scale), torch.full((4,), 2 * scale)])
    out["grouped_allgather"] = [t.grad.tolist() for t in xs]

    x = torch.ones(2, requires_grad=True)
    hvd.broadcast(x, root_rank=1).backward(torch.full((2,), scale))
    out["broadcast"] = x.grad.tolist()

    for op, pre in (("sum", 1.0), ("average", 1.0), ("sum", 0.5)):
        x = torch.ones(4, requires_grad=True)
        hvd.reducescatter(x, op=hvd.Sum if op == "sum" else hvd.Average, prescale_factor=pre).backward(
            torch.full((2,), scale))
        out[f"reducescatter_{op}_{pre}"] = x.grad.tolist()

    xs = [torch.ones(4, requires_grad=True), torch.ones(2, 3, requires_grad=True)]
    torch.autograd.backward(hvd.grouped_reducescatter(xs, op=hvd.Sum), [torch.full((2,), scale), torch.full((1, 3), scale)])
    out["grouped_reducescatter"] = [t.grad.tolist() for t in xs]
    return out


def test_collective_gradients_are_horovods(pair):
    """allgather and broadcast: the ranks' gradients averaged (Horovod's HorovodAllgather/HorovodBroadcast
    backward), broadcast's only on the root; reducescatter: the gathered gradient times size for Sum, 1 for
    Average, times the scale factors."""
    results = pair.run(_collective_gradients)
    mean = (1.0 + 2.0) / 2
    for r, out in enumerate(results):
        assert out["allgather"] == [[mean, mean]] * (r + 1)
        assert out["grouped_allgather"] == [[mean] * (r + 1), [2 * mean] * 2]
        assert out["broadcast"] == ([mean] * 2 if r == 1 else [0.0, 0.0])
        # rank 0's output rows got gradient 1, rank 1's got 2; allgathered: [1, 1, 2, 2]
        assert out["reducescatter_sum_1.0"] == [2.0, 2.0, 4.0, 4.0]
        assert out["reducescatter_average_1.0"] == [1.0, 1.0, 2.0, 2.0]
        assert out["reducescatter_sum_0.5"] == [1.0, 1.0, 2.0, 2.0]
        assert out["grouped_reducescatter"] == [[2.0, 2.0, 4.0, 4.0], [[2.0] * 3, [4.0] * 3]]


def _optimizer_state():
    import torch

    import hvdray.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    torch.manual_seed(hvd.rank())
    model = torch.nn.Linear(3, 1)
    opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.1))
    before = [p.detach().clone() for p in model.parameters()]
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    grads = [p.grad.tolist() if p.grad is not None else None for p in model.parameters()]
    state = opt.state_dict()["state"]
    unchanged = all(torch.equal(b, p) for b, p in zip(before, model.parameters()))  # Adam's step on zeros moves nothing
    lbfgs = None
    try:
        hvd.broadcast_optimizer_state(torch.optim.LBFGS(model.parameters()), root_rank=0)
    except ValueError as exc:
        lbfgs = str(exc)
    return grads, sorted(state[0]), state[0]["step"].item(), unchanged, lbfgs


def test_broadcast_optimizer_state_initialises_state_leaving_zero_gradients(pair):
    for grads, keys, step, unchanged, lbfgs in pair.run(_optimizer_state):
        assert grads == [[[0.0, 0.0, 0.0]], [0.0]]
        assert keys == ["exp_avg", "exp_avg_sq", "step"] and step == 1.0 and unchanged
        assert lbfgs == "optimizer: cannot broadcast torch.optim.LBFGS state (its state is not a tensor state_dict)"


def _optimizer_on_a_process_set():
    import torch

    import hvdray.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    first, second = hvd.add_process_set([0]), hvd.add_process_set([1])
    model = torch.nn.Linear(1, 1, bias=False)
    torch.nn.init.ones_(model.weight)
    # every rank wraps with the set of rank 0 only, as Horovod's test_optimizer_process_sets does
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), process_set=first)
    for _ in range(2):
        opt.zero_grad()
        model(torch.tensor([[float(hvd.rank() + 1)]])).sum().backward()
        opt.step()
    mine = first if hvd.rank() == 0 else second
    gathered = hvd.allgather(model.weight.detach().reshape(1), process_set=mine).tolist()
    hvd.remove_process_set(second)
    hvd.remove_process_set(first)
    return model.weight.item(), gathered


def test_distributed_optimizer_on_a_set_steps_locally_outside_it(pair):
    (w0, g0), (w1, g1) = pair.run(_optimizer_on_a_process_set)
    assert w0 == pytest.approx(1 - 2 * 0.1 * 1.0) and g0 == pytest.approx([w0])  # reduced within {0}: its own
    assert w1 == pytest.approx(1 - 2 * 0.1 * 2.0) and g1 == pytest.approx([w1])  # outside: a local step


def _dtypes_and_integer_scaling():
    import torch

    import hvdray.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    r, out = hvd.rank(), {}
    for dtype in (torch.int16, torch.uint16, torch.uint32, torch.complex64, torch.float8_e4m3fn):
        x = torch.full((r + 1, 2), r + 1).to(dtype)           # uneven rows: 1 on rank 0, 2 on rank 1
        gathered = hvd.allgather(x)
        b = torch.tensor(7 + r).to(dtype)                    # 0-dim, in place
        hvd.broadcast_(b, root_rank=1)
        received, splits = hvd.alltoall((torch.arange(3.0) + 10 * r).to(dtype), splits=[1, 2] if r == 0 else [2, 1])
        as_float = lambda t: t.to(torch.float32).tolist() if not t.is_complex() else t.real.tolist()  # noqa: E731
        out[str(dtype)] = (gathered.dtype == dtype, as_float(gathered), as_float(b), as_float(received), splits.tolist())
    t = torch.tensor([10, -7, 3], dtype=torch.int32) * (r + 1)   # rank 0: [10, -7, 3], rank 1: [20, -14, 6]
    out["prescale"] = hvd.allreduce(t, op=hvd.Sum, prescale_factor=0.5).tolist()
    out["postscale"] = hvd.allreduce(t, op=hvd.Sum, postscale_factor=0.3).tolist()
    inplace = t.clone()
    hvd.allreduce_(inplace, op=hvd.Sum, prescale_factor=0.5, postscale_factor=3)
    out["inplace"] = inplace.tolist()
    out["grouped"] = [g.tolist() for g in hvd.grouped_allreduce([t, t.long()], op=hvd.Sum, prescale_factor=0.5)]
    out["reducescatter"] = hvd.reducescatter(torch.tensor([5, 7, -9, 11]) * (r + 1), op=hvd.Sum,
                                             postscale_factor=0.5).tolist()
    half = torch.tensor([24.9, -36.1, 6.13], dtype=torch.float16) * (r + 1)
    out["half"] = hvd.allreduce(half, op=hvd.Sum, postscale_factor=0.3717).tolist()
    return out


def test_every_dtype_moves_and_integer_tensors_scale_as_horovod_scales_them(pair):
    """int16, uint16, uint32, complex and float8 in allgather, broadcast and alltoall (Gloo cannot move them:
    they travel as bytes); scale factors on integer tensors apply in float64 and truncate, on 16-bit floats in
    float32, as in Horovod."""
    import torch

    results = pair.run(_dtypes_and_integer_scaling)
    for r, out in enumerate(results):
        for dtype in ("torch.int16", "torch.uint16", "torch.uint32", "torch.complex64", "torch.float8_e4m3fn"):
            same_dtype, gathered, b, received, splits = out[dtype]
            assert same_dtype and gathered == [[1.0, 1.0], [2.0, 2.0], [2.0, 2.0]] and b == 8.0, dtype
            # rank 0 sends [0] to itself and [1, 2] to rank 1; rank 1 sends [10, 11] to rank 0 and [12] to itself
            assert (received, splits) == (([0.0, 10.0, 11.0], [1, 2]) if r == 0 else ([1.0, 2.0, 12.0], [2, 1])), dtype
        trunc = lambda v: [int(x) for x in (torch.tensor(v, dtype=torch.float64)).tolist()]  # noqa: E731
        assert out["prescale"] == [5 + 10, -3 + -7, 1 + 3]                 # trunc(x * 0.5) on each rank, then summed
        assert out["postscale"] == trunc([30 * 0.3, -21 * 0.3, 9 * 0.3])   # summed, then trunc(sum * 0.3)
        assert out["inplace"] == [(5 + 10) * 3, (-3 + -7) * 3, (1 + 3) * 3]
        assert out["grouped"] == [[15, -10, 4]] * 2
        # [15, 21, -27, 33] summed; rank 0 keeps rows 0-1, rank 1 rows 2-3; trunc(x * 0.5)
        assert out["reducescatter"] == ([7, 10] if r == 0 else [-13, 16])
        # 16-bit floats: the sum (exact here), then scaled in float32 and rounded to float16 once
        half = torch.tensor([24.9, -36.1, 6.13], dtype=torch.float16)
        assert out["half"] == ((half + half * 2).float() * 0.3717).half().tolist()


def _sparse_gradients():
    import torch

    import hvdray.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    r, out = hvd.rank(), {}
    local = torch.sparse_coo_tensor([[r, 3]], [1.0 + r, 10.0], (4,))  # rank 0: {0: 1, 3: 10}, rank 1: {1: 2, 3: 10}
    out["sum"] = hvd.synchronize(hvd.sparse_allreduce_async(local, "s", hvd.Sum)).to_dense().tolist()
    out["average"] = hvd.sparse_allreduce_async(local, name="a", op=hvd.Average)().to_dense().tolist()  # callable
    for dense in (False, True):
        emb = torch.nn.Embedding(4, 1, sparse=True)
        torch.nn.init.zeros_(emb.weight)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=1.0), sparse_as_dense=dense,
                                       named_parameters=emb.named_parameters())
        emb(torch.tensor([r, 3])).sum().backward()            # gradient 1 at rows r and 3
        opt.synchronize()
        out[f"grad_is_sparse_{dense}"] = emb.weight.grad.is_sparse
        with opt.skip_synchronize():
            opt.step()
        out[f"weights_{dense}"] = emb.weight.flatten().tolist()
    return out


def test_sparse_gradients_reduce_as_horovod_reduces_them(pair):
    """sparse_allreduce_async allgathers every rank's entries (Average divides by the size); the optimizer
    reduces sparse gradients that way, or with sparse_as_dense densely, leaving .grad sparse for the update."""
    for out in pair.run(_sparse_gradients):
        assert out["sum"] == [1.0, 2.0, 0.0, 20.0]
        assert out["average"] == [0.5, 1.0, 0.0, 10.0]
        for dense in (False, True):
            assert out[f"grad_is_sparse_{dense}"]
            # averaged gradient: 1/2 at rows 0 and 1, (1 + 1)/2 at row 3; SGD with lr 1
            assert out[f"weights_{dense}"] == [-0.5, -0.5, 0.0, -1.0]


def _every_torch_optimizer():
    import inspect

    import torch

    import hvdray.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    r = hvd.rank()
    # per-rank hyper-parameters, as Horovod's test_broadcast_state_options; each class takes the ones it has
    mine = [dict(lr=0.1, momentum=0.8, weight_decay=0.2, nesterov=True, betas=(0.9, 0.999), etas=(0.8, 2.4),
                 step_sizes=(1e-5, 100)),
            dict(lr=0.2, momentum=0.9, weight_decay=0.1, nesterov=False, betas=(0.8, 0.9), etas=(0.25, 1.75),
                 step_sizes=(1e-7, 5))]
    classes = sorted((c for c in torch.optim.Optimizer.__subclasses__() if c.__module__.startswith("torch.optim")
                      and c not in (torch.optim.LBFGS, torch.optim.SparseAdam)), key=lambda c: c.__name__)
    x, y = torch.randn(8, 5, generator=torch.Generator().manual_seed(r)), torch.randn(8, 3)
    out = {}
    for cls in classes:
        torch.manual_seed(r)  # the models start apart: broadcast_parameters joins them
        # no biases: 2-D parameters only, which every torch.optim class takes (Muon takes nothing else)
        model = torch.nn.Sequential(torch.nn.Linear(5, 4, bias=False), torch.nn.ReLU(), torch.nn.Linear(4, 3, bias=False),
                                    torch.nn.Linear(3, 3, bias=False))
        accepted = inspect.signature(cls.__init__).parameters
        opt = hvd.DistributedOptimizer(cls(model.parameters(), **{k: v for k, v in mine[r].items() if k in accepted}),
                                       named_parameters=model.named_parameters())
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        # Horovod's test_force_allreduce: rank 1's loss leaves the last layer without a gradient
        hidden = model[2](model[1](model[0](x)))
        loss = ((hidden if r == 1 else model[3](hidden)) - y).pow(2).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        grads = [p.grad.clone() for p in model.parameters()]
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        group = {k: opt.param_groups[0][k] for k in mine[0] if k in accepted}
        state = [(k, v.clone() if torch.is_tensor(v) else v)
                 for s in opt.state_dict()["state"].values() for k, v in sorted(s.items())]
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)  # the first steps' learning rates differed
        opt.zero_grad()
        (model[3](hidden.detach()) - y).pow(2).sum().backward()  # root's hyper-parameters still drive a step
        opt.step()
        out[cls.__name__] = {"group": group, "state": state, "grads": grads,
                             "stepped": [p.detach().clone() for p in model.parameters()]}
    return out


def test_every_torch_optimizer_takes_roots_state_and_hyper_parameters(pair):
    """Horovod's test_broadcast_state, test_broadcast_state_options and test_force_allreduce for every
    torch.optim class but LBFGS and SparseAdam (Horovod's list), Muon included on a model it takes (2-D
    parameters only): a gradient missing on one rank is still reduced (every rank ends with the same
    gradients), and after broadcast_optimizer_state every rank has root's hyper-parameters (their types
    too), state and next step."""
    import torch

    root, other = pair.run(_every_torch_optimizer)
    assert {"Adam", "SGD", "RMSprop", "Rprop", "ASGD"} <= set(root)
    for name in root:
        mine, theirs = root[name], other[name]
        for key, value in mine["group"].items():
            assert type(theirs["group"][key]) is type(value) and theirs["group"][key] == value, (name, key)
        assert [k for k, _ in theirs["state"]] == [k for k, _ in mine["state"]] and mine["state"], name
        for (key, a), (_, b) in zip(mine["state"], theirs["state"]):
            assert (torch.equal(a, b) if torch.is_tensor(a) else a == b), (name, key)
        assert mine["grads"][-1].abs().sum() > 0, name  # rank 0's gradient of the layer rank 1 did not use
        for what in ("grads", "stepped"):
            assert all(torch.equal(a, b) for a, b in zip(mine[what], theirs[what])), (name, what)


def _averages_of_the_same_tensor():
    import torch

    import hvdray.torch as hvd

    hvd.init()
    x = torch.randn(1000, generator=torch.Generator().manual_seed(7)) * 100  # the same on every rank
    lone = hvd.allreduce(x, name="lone")  # the default op: average
    handles = [hvd.allreduce_async(x[i * 200:(i + 1) * 200].clone(), name=f"fused.{i}") for i in range(5)]
    fused = torch.cat([hvd.synchronize(h) for h in handles])
    return x, lone, fused, hvd.size()


def test_a_float_average_over_three_ranks_is_the_correctly_rounded_quotient(make_executor):
    """Horovod scales an average by 1/size in double precision: for float32 that is the sum divided by the
    size, correctly rounded. Multiplying by 1/size in float32 instead is one ulp off for about a third of
    the elements when the size is not a power of two (Horovod's test_torch.py's join tests, with 3 ranks,
    compare such averages with a threshold of 0). A lone tensor and a fused batch."""
    ex = make_executor(num_workers=3, cpus_per_worker=0.5)  # beside the module's pair, on 4 CPUs
    for x, lone, fused, size in ex.run(_averages_of_the_same_tensor):
        want = (x + x + x) / size  # every rank's sum of three equal tensors, divided
        assert size == 3 and torch.equal(lone, want) and torch.equal(fused, want)
