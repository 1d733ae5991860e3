"""Training with hvdray.torch on real Ray workers, checked against single-process torch on the driver.

* ``DistributedOptimizer`` on N ranks, each with 1/N of a batch, ends with the same parameters as plain
  SGD+momentum on the whole batch in one process (Average, Sum, backward_passes_per_step, predivide,
  fp16 compression, parameters unused on some or all ranks, synchronize() + skip_synchronize()).
* ``broadcast_parameters`` / ``broadcast_optimizer_state`` make ranks identical.
* ``SyncBatchNorm`` on 2 ranks equals ``torch.nn.BatchNorm{1,2}d`` on the full batch, forward and backward.
* Misuse of ``DistributedOptimizer`` fails loudly and names the argument.

One executor per job size is shared by the whole module (only one alive at a time: the local Ray
instance has 4 CPUs); each test is a single ``run`` call that batches several checks.
"""

from __future__ import annotations

import pytest
import torch

from hvdray import RayExecutor

BATCH = 12  # divisible by 2, 3 and by 2*3 (two micro-batches per rank)
STEPS = 4
LR = 0.1
MOMENTUM = 0.9
CLIP = 0.05  # small enough that clip_grad_norm_ really clips


@pytest.fixture(scope="module")
def executor_of_size(ray_local):
    """``executor_of_size(n)``: the module's started executor with n workers (one size alive at a time)."""
    alive: dict[int, RayExecutor] = {}

    def get(n: int) -> RayExecutor:
        if n not in alive:
            for ex in alive.values():
                ex.shutdown()
            alive.clear()
            settings = RayExecutor.create_settings(timeout_s=30, placement_group_timeout_s=60)
            ex = RayExecutor(settings, num_workers=n)
            ex.start()
            alive[n] = ex
        return alive[n]

    yield get
    for ex in alive.values():
        ex.shutdown()


# -- shared by the workers and the driver (pickled by value with the worker functions) ----------------
def _build_model(dtype: torch.dtype, extras: bool = False) -> torch.nn.Module:
    """Linear -> Tanh -> Linear, identical on every process; ``extras`` adds two odd parameters:
    ``partial`` (used in forward on rank 1 only) and ``unused`` (never used)."""
    import torch

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1 = torch.nn.Linear(4, 6)
            self.fc2 = torch.nn.Linear(6, 2)
            if extras:
                self.partial = torch.nn.Parameter(torch.linspace(0.5, 1.5, 2))
                self.unused = torch.nn.Parameter(torch.ones(3))

        def forward(self, x: torch.Tensor, rank: int) -> torch.Tensor:
            out = self.fc2(torch.tanh(self.fc1(x)))
            if extras and rank == 1:
                out = out * self.partial
            return out

    torch.manual_seed(1234)
    return Net().to(dtype)


def _shard_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, rank: int) -> torch.Tensor:
    return ((model(x, rank) - y) ** 2).mean()


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(STEPS, BATCH, 4, generator=g, dtype=torch.float64)
    y = torch.randn(STEPS, BATCH, 2, generator=g, dtype=torch.float64)
    return x, y


# -- DistributedOptimizer equivalence ------------------------------------------------------------------
CASES = {
    "average_named": {},
    "average_unnamed": {"named": False},
    "sum": {"op": "sum"},
    "backward_passes_2": {"passes": 2},
    "backward_passes_2_sum": {"passes": 2, "op": "sum"},
    "predivide": {"predivide": 2.0},
    "predivide_and_passes": {"predivide": 3.0, "passes": 2},
    "fp16": {"fp16": True},
    "unused_and_partial": {"extras": True},
    "synchronize_clip_skip": {"clip": True},
    # gradients in groups, each group one grouped_allreduce (Horovod's groups= and num_groups=)
    "groups_int": {"groups": 3},
    "groups_lists_passes_2": {"groups": [["fc1.weight", "fc2.bias"], ["fc2.weight"]], "passes": 2},
    "num_groups_unused_and_partial": {"num_groups": 2, "extras": True},
    "groups_fp16_sum": {"groups": 2, "fp16": True, "op": "sum"},
}


def _train_distributed(xs: torch.Tensor, ys: torch.Tensor, cases: dict) -> dict:
    """Every case: train on this rank's shard of each step's batch; return final params and grads."""
    import warnings

    import torch

    import hvdray.torch as hvd
    from hvdray.collective import ops as collective_ops

    hvd.init()
    torch.set_num_threads(1)
    rank, size = hvd.rank(), hvd.size()
    group_calls: list[int] = []  # the size of every grouped_allreduce the optimizer submits
    grouped = collective_ops.grouped_allreduce_async

    def counted(tensors, *args, **kwargs):
        group_calls.append(len(tensors))
        return grouped(tensors, *args, **kwargs)

    collective_ops.grouped_allreduce_async = counted
    results = {}
    for name, case in cases.items():
        dtype = torch.float32 if case.get("fp16") else torch.float64
        model = _build_model(dtype, case.get("extras", False))
        groups = case.get("groups")
        if isinstance(groups, list):  # parameter names -> the model's parameters
            by_name = dict(model.named_parameters())
            groups = [[by_name[n] for n in group] for group in groups]
        group_calls.clear()
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM),
            named_parameters=model.named_parameters() if case.get("named", True) else None,
            compression=hvd.Compression.fp16 if case.get("fp16") else hvd.Compression.none,
            backward_passes_per_step=case.get("passes", 1),
            op=hvd.Sum if case.get("op") == "sum" else hvd.Average,
            gradient_predivide_factor=case.get("predivide", 1.0),
            num_groups=case.get("num_groups", 0),
            groups=groups,
        )
        passes = case.get("passes", 1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(STEPS):
                x = xs[step].to(dtype).chunk(size)[rank]
                y = ys[step].to(dtype).chunk(size)[rank]
                for xm, ym in zip(x.chunk(passes), y.chunk(passes)):
                    _shard_loss(model, xm, ym, rank).backward()
                if case.get("clip"):
                    opt.synchronize()
                    torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
                    with opt.skip_synchronize():
                        opt.step()
                else:
                    opt.step()
                if step < STEPS - 1:
                    opt.zero_grad()
        results[name] = {
            "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "grads": {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()},
            "warnings": [str(w.message) for w in caught],
            "group_calls": list(group_calls),
        }
    collective_ops.grouped_allreduce_async = grouped
    return results


def _train_reference(xs: torch.Tensor, ys: torch.Tensor, size: int, case: dict) -> dict:
    """The same training in one process: the loss is the mean (Average) or sum (Sum) of the ranks' losses,
    each rank's loss being the sum over its micro-batches (gradients accumulate locally)."""
    dtype = torch.float32 if case.get("fp16") else torch.float64
    model = _build_model(dtype, case.get("extras", False))
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    passes = case.get("passes", 1)
    for step in range(STEPS):
        opt.zero_grad()
        total = 0
        for rank, (x, y) in enumerate(zip(xs[step].to(dtype).chunk(size), ys[step].to(dtype).chunk(size))):
            for xm, ym in zip(x.chunk(passes), y.chunk(passes)):
                total = total + _shard_loss(model, xm, ym, rank)
        if case.get("op") != "sum":
            total = total / size
        total.backward()
        if case.get("clip"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "grads": {n: torch.zeros_like(p) if p.grad is None else p.grad.clone() for n, p in model.named_parameters()},
    }


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: float, what: str) -> None:
    assert actual.dtype == expected.dtype, what
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol, msg=lambda m: f"{what}: {m}")


# -- broadcast_parameters / broadcast_optimizer_state ----------------------------------------------------
def _broadcasts() -> dict:
    import copy

    import torch

    import hvdray.torch as hvd

    hvd.init()
    torch.set_num_threads(1)
    rank = hvd.rank()

    def model_seeded(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        m = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2)).double()
        m.train()
        m(torch.randn(5, 3, dtype=torch.float64))  # running stats and num_batches_tracked differ per rank
        if seed % 2:
            m(torch.randn(5, 3, dtype=torch.float64))
        return m

    def snapshot(m: torch.nn.Module) -> dict:
        return {k: v.detach().clone() for k, v in m.state_dict().items()}

    def grads_step(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        opt.zero_grad()
        model(torch.randn(6, 3, generator=g, dtype=torch.float64)).pow(2).mean().backward()
        opt.step()

    out: dict = {}
    # state_dict (parameters and buffers, int64 num_batches_tracked included) from rank 0
    m = model_seeded(100 + rank)
    out["sd_before"] = snapshot(m)
    hvd.broadcast_parameters(m.state_dict(), root_rank=0)
    out["sd_after"] = snapshot(m)
    # named_parameters() from rank 1
    m = model_seeded(200 + rank)
    out["np_before"] = snapshot(m)
    hvd.broadcast_parameters(m.named_parameters(), root_rank=1)
    out["np_after"] = snapshot(m)
    # a plain list of parameters from rank 1
    m = model_seeded(300 + rank)
    out["list_before"] = snapshot(m)
    hvd.broadcast_parameters(list(m.parameters()), root_rank=1)
    out["list_after"] = snapshot(m)
    # the parameters stay leaves that autograd and optimizers still track
    out["still_leaves"] = all(p.is_leaf and p.requires_grad for p in m.parameters())

    # SGD with momentum: different lr and number of steps per rank; root 0
    model = model_seeded(1)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1 * (rank + 1), momentum=0.9)
    for i in range(rank + 1):
        grads_step(model, sgd, seed=10 * rank + i)
    out["sgd_before"] = copy.deepcopy(sgd.state_dict())
    hvd.broadcast_optimizer_state(sgd, root_rank=0)
    out["sgd_after"] = copy.deepcopy(sgd.state_dict())

    # Adam: rank 0 took no step (empty state), rank 1 took two with other hyper-parameters; root 1
    model = model_seeded(1)
    adam = torch.optim.Adam(model.parameters(), lr=0.01 * (rank + 1), betas=(0.9, 0.99 if rank else 0.999))
    for i in range(2 * rank):
        grads_step(model, adam, seed=20 + i)
    out["adam_before"] = copy.deepcopy(adam.state_dict())
    hvd.broadcast_optimizer_state(adam, root_rank=1)
    out["adam_after"] = copy.deepcopy(adam.state_dict())
    # the loaded state is usable: with equal parameters and data, one more step keeps ranks identical
    hvd.broadcast_parameters(model.state_dict(), root_rank=1)
    grads_step(model, adam, seed=99)
    out["adam_next_params"] = snapshot(model)
    out["adam_next_state"] = copy.deepcopy(adam.state_dict())

    # Horovod's usual start: wrap, then broadcast parameters and (still empty) optimizer state from rank 0
    model = model_seeded(400 + rank)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05 * (rank + 1), momentum=0.9),
        named_parameters=model.named_parameters(),
    )
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    for i in range(2):
        grads_step(model, opt, seed=50 + 10 * rank + i)  # different data per rank; gradients are averaged
    out["dist_params"] = snapshot(model)
    out["dist_state"] = copy.deepcopy(opt.state_dict())
    return out


def _assert_same(a, b, what: str) -> None:
    """Recursive exact equality of state_dict-like structures."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), what
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{what}: keys {list(a)} != {list(b)}"
        for k in a:
            _assert_same(a[k], b[k], f"{what}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), what
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{what}[{i}]")
    else:
        assert a == b, f"{what}: {a!r} != {b!r}"


def _differs(a: dict, b: dict) -> bool:
    try:
        _assert_same(a, b, "")
    except AssertionError:
        return True
    return False


# -- SyncBatchNorm ---------------------------------------------------------------------------------
def _sync_bn_cases() -> dict:
    g = torch.Generator().manual_seed(3)

    def batch(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64) * 2.0 + 0.7

    cases = {}
    for key, shape, splits, momentum in (
        ("1d", (8, 3), [4, 4], 0.1),
        ("1d_3dinput", (8, 3, 5), [4, 4], 0.3),
        ("2d", (8, 3, 4, 4), [4, 4], 0.1),
        ("2d_uneven", (8, 3, 2, 3), [3, 5], 0.1),
        ("1d_cumulative", (8, 3), [4, 4], None),
        ("2d_rank0_empty", (6, 3, 2, 2), [0, 6], 0.1),
        ("1d_float32_offset", (16, 3, 8), [8, 8], 0.1),
    ):
        cases[key] = {
            "splits": splits,
            "momentum": momentum,
            "dtype": torch.float64,
            "weight": torch.randn(3, generator=g, dtype=torch.float64),
            "bias": torch.randn(3, generator=g, dtype=torch.float64),
            "inputs": [batch(*shape) for _ in range(2)],
            "upstream": [torch.randn(*shape, generator=g, dtype=torch.float64) for _ in range(2)],
            "eval_input": batch(*shape),
        }
    # float32 activations far from zero (|mean| >> std): the statistics must not cancel catastrophically
    f32 = cases["1d_float32_offset"]
    f32["dtype"] = torch.float32
    for name in ("inputs", "eval_input"):
        shift = torch.tensor([50.0, -200.0, 20.0], dtype=torch.float64).view(1, 3, 1)
        value = f32[name]
        f32[name] = [(v * 0.5 + shift).float() for v in value] if isinstance(value, list) else (
            (value * 0.5 + shift).float()
        )
    f32["upstream"] = [u.float() for u in f32["upstream"]]
    f32["weight"], f32["bias"] = f32["weight"].float(), f32["bias"].float()
    return cases


def _sync_bn(cases: dict) -> dict:
    import torch

    import hvdray.torch as hvd

    hvd.init()
    torch.set_num_threads(1)
    rank = hvd.rank()
    out = {}
    for key, case in cases.items():
        bn = hvd.SyncBatchNorm(3, momentum=case["momentum"]).to(case["dtype"])
        with torch.no_grad():
            bn.weight.copy_(case["weight"])
            bn.bias.copy_(case["bias"])
        iters = []
        for x_full, up_full in zip(case["inputs"], case["upstream"]):
            x = x_full.split(case["splits"])[rank].clone().requires_grad_()
            y = bn(x)
            (y * up_full.split(case["splits"])[rank]).sum().backward()
            iters.append(_bn_step_record(bn, x, y))
        bn.eval()
        with torch.no_grad():
            y_eval = bn(case["eval_input"].split(case["splits"])[rank])
        out[key] = {"iters": iters, "eval": y_eval}
    return out


def _bn_step_record(bn: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict:
    """What one training step of a batch norm layer produced (then its gradients are cleared)."""
    record = {
        "y": y.detach(), "x_grad": x.grad, "w_grad": bn.weight.grad.clone(), "b_grad": bn.bias.grad.clone(),
        "running_mean": bn.running_mean.clone(), "running_var": bn.running_var.clone(),
        "num_batches_tracked": bn.num_batches_tracked.clone(),
    }
    bn.zero_grad()
    return record


def _bn_reference(case: dict, dims: int) -> dict:
    cls = {2: torch.nn.BatchNorm1d, 3: torch.nn.BatchNorm1d, 4: torch.nn.BatchNorm2d}[dims]
    bn = cls(3, momentum=case["momentum"]).double()  # float64 even for float32 cases: the exact answer
    with torch.no_grad():
        bn.weight.copy_(case["weight"])
        bn.bias.copy_(case["bias"])
    iters = []
    for x_full, up_full in zip(case["inputs"], case["upstream"]):
        x = x_full.double().requires_grad_()
        y = bn(x)
        (y * up_full.double()).sum().backward()
        iters.append(_bn_step_record(bn, x, y))
    bn.eval()
    with torch.no_grad():
        y_eval = bn(case["eval_input"].double())
    return {"iters": iters, "eval": y_eval}


# -- misuse ------------------------------------------------------------------------------------------
def _misuse() -> dict:
    import warnings

    import torch

    import hvdray.torch as hvd

    hvd.init()
    torch.set_num_threads(1)
    rank = hvd.rank()

    def raised(fn) -> str:
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            return f"{type(exc).__name__}: {exc}"
        return "nothing raised"

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1)).double()
    x = torch.randn(4, 3, dtype=torch.float64) + rank

    def loss():
        return model(x).pow(2).mean()

    def sgd():
        return torch.optim.SGD(model.parameters(), lr=0.1)

    out: dict = {"bad_args": {}}
    bad = out["bad_args"]
    bad["op_min"] = raised(lambda: hvd.DistributedOptimizer(sgd(), op=hvd.Min))
    bad["op_product"] = raised(lambda: hvd.DistributedOptimizer(sgd(), op=hvd.Product))
    bad["passes_0"] = raised(lambda: hvd.DistributedOptimizer(sgd(), backward_passes_per_step=0))
    bad["passes_float"] = raised(lambda: hvd.DistributedOptimizer(sgd(), backward_passes_per_step=1.5))
    named = list(model.named_parameters())
    bad["duplicate_names"] = raised(
        lambda: hvd.DistributedOptimizer(sgd(), named_parameters=[("w", p) for _, p in named])
    )
    bad["missing_names"] = raised(lambda: hvd.DistributedOptimizer(sgd(), named_parameters=named[:2]))
    bad["not_pairs"] = raised(lambda: hvd.DistributedOptimizer(sgd(), named_parameters=[p for _, p in named]))
    bad["not_optimizer"] = raised(lambda: hvd.DistributedOptimizer(model))
    bad["predivide_0"] = raised(lambda: hvd.DistributedOptimizer(sgd(), gradient_predivide_factor=0))
    bad["predivide_with_sum"] = raised(
        lambda: hvd.DistributedOptimizer(sgd(), op=hvd.Sum, gradient_predivide_factor=2.0)
    )
    bad["bad_compression"] = raised(lambda: hvd.DistributedOptimizer(sgd(), compression="fp16"))
    params = list(model.parameters())
    bad["groups_negative"] = raised(lambda: hvd.DistributedOptimizer(sgd(), groups=-1))
    bad["groups_type"] = raised(lambda: hvd.DistributedOptimizer(sgd(), groups="2"))
    bad["groups_empty"] = raised(lambda: hvd.DistributedOptimizer(sgd(), groups=[params[:1], []]))
    bad["groups_foreign"] = raised(
        lambda: hvd.DistributedOptimizer(sgd(), groups=[[params[0], torch.nn.Parameter(torch.ones(2))]])
    )
    bad["groups_twice"] = raised(lambda: hvd.DistributedOptimizer(sgd(), groups=[params[:2], params[1:3]]))
    bad["num_groups_and_groups"] = raised(lambda: hvd.DistributedOptimizer(sgd(), num_groups=2, groups=2))
    bad["num_groups_negative"] = raised(lambda: hvd.DistributedOptimizer(sgd(), num_groups=-1))

    # a failed wrap leaves the optimizer as it was: still a plain SGD that steps and can be wrapped
    plain = sgd()
    raised(lambda: hvd.DistributedOptimizer(plain, named_parameters=named[:1]))
    out["after_failed_wrap_type"] = type(plain).__name__
    loss().backward()
    out["after_failed_wrap_step"] = raised(plain.step)
    plain.zero_grad()
    opt = hvd.DistributedOptimizer(plain, named_parameters=named)
    out["wrapped_type"] = type(opt).__name__
    out["wrap_twice"] = raised(lambda: hvd.DistributedOptimizer(opt))

    # zero_grad between backward and step
    loss().backward()
    out["zero_grad_before_step"] = raised(opt.zero_grad)
    out["step_after_refused_zero_grad"] = raised(opt.step)
    opt.zero_grad()

    # a second backward without step (backward_passes_per_step=1)
    loss().backward()
    out["second_backward"] = raised(lambda: loss().backward())
    opt.synchronize()  # drain what the first backward submitted
    opt.zero_grad()

    # step() after synchronize() without skip_synchronize() warns (and reduces again)
    loss().backward()
    opt.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    out["double_sync_warnings"] = [str(w.message) for w in caught]
    opt.zero_grad()
    # and with skip_synchronize() it does not
    loss().backward()
    opt.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with opt.skip_synchronize():
            opt.step()
    out["skip_sync_warnings"] = [str(w.message) for w in caught]
    opt.zero_grad()

    # the job is still healthy afterwards: from equal parameters, a normal step keeps the ranks equal
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    loss().backward()
    opt.step()
    out["params"] = [p.detach().clone() for p in model.parameters()]

    # an LR scheduler made before wrapping: its step still reduces gradients, and the schedule applies
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1)).double()
    sched_opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(sched_opt, step_size=1, gamma=0.5)
    sched_opt = hvd.DistributedOptimizer(sched_opt, named_parameters=model.named_parameters())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            sched_opt.zero_grad()
            loss().backward()  # x differs per rank: only averaged gradients keep the ranks equal
            sched_opt.step()
            sched.step()
    out["sched_warnings"] = [str(w.message) for w in caught]
    out["sched_lr"] = sched_opt.param_groups[0]["lr"]
    out["sched_params"] = [p.detach().clone() for p in model.parameters()]
    return out


# -- tests -------------------------------------------------------------------------------------------
def test_broadcast_parameters_and_optimizer_state(executor_of_size):
    res = executor_of_size(2).run(_broadcasts)
    r0, r1 = res

    for key, root in (("sd", 0), ("np", 1), ("list", 1)):
        assert _differs(r0[f"{key}_before"], r1[f"{key}_before"]), f"{key}: ranks started equal; the test is vacuous"
        other = 1 - root
        for r in (0, 1):
            if key == "sd":
                _assert_same(res[r][f"{key}_after"], res[root][f"{key}_before"], f"{key} rank {r}")
            else:  # only parameters travel; buffers (running stats) stay each rank's own
                after, own_before = res[r][f"{key}_after"], res[r][f"{key}_before"]
                root_before = res[root][f"{key}_before"]
                for name in after:
                    is_buffer = name.split(".")[-1] in ("running_mean", "running_var", "num_batches_tracked")
                    expected = own_before[name] if is_buffer else root_before[name]
                    _assert_same(after[name], expected, f"{key} rank {r} {name}")
        assert _differs(res[other][f"{key}_before"], res[other][f"{key}_after"])
    assert r0["still_leaves"] and r1["still_leaves"]

    # SGD momentum from root 0
    assert _differs(r0["sgd_before"], r1["sgd_before"])
    assert r1["sgd_before"]["param_groups"][0]["lr"] == pytest.approx(0.2)
    for r in (0, 1):
        _assert_same(res[r]["sgd_after"], r0["sgd_before"], f"sgd rank {r}")
    assert r1["sgd_after"]["param_groups"][0]["lr"] == pytest.approx(0.1)
    assert len(r1["sgd_after"]["state"]) == 6 and all("momentum_buffer" in s for s in r1["sgd_after"]["state"].values())

    # Adam from root 1 onto a rank with empty state
    assert r0["adam_before"]["state"] == {} and len(r1["adam_before"]["state"]) == 6
    for r in (0, 1):
        _assert_same(res[r]["adam_after"], r1["adam_before"], f"adam rank {r}")
    assert r0["adam_after"]["param_groups"][0]["lr"] == pytest.approx(0.02)
    assert r0["adam_after"]["param_groups"][0]["betas"] == (0.9, 0.99)
    _assert_same(r0["adam_next_params"], r1["adam_next_params"], "adam next step params")
    _assert_same(r0["adam_next_state"], r1["adam_next_state"], "adam next step state")
    assert float(r0["adam_next_state"]["state"][0]["step"]) == 3.0

    # wrapped optimizer, broadcast before the first step: ranks stay in lockstep
    for key in ("running_mean", "running_var", "num_batches_tracked"):  # buffers are local: drop them
        for r in (0, 1):
            res[r]["dist_params"].pop(f"1.{key}")
    _assert_same(r0["dist_params"], r1["dist_params"], "distributed params")
    _assert_same(r0["dist_state"], r1["dist_state"], "distributed optimizer state")
    assert r1["dist_state"]["param_groups"][0]["lr"] == pytest.approx(0.05)


def test_sync_batch_norm_matches_batch_norm_on_the_full_batch(executor_of_size):
    cases = _sync_bn_cases()
    res = executor_of_size(2).run(_sync_bn, args=[cases])
    for key, case in cases.items():
        ref = _bn_reference(case, case["inputs"][0].dim())
        # float32: torch.nn.BatchNorm1d in float32 is within ~1e-5 of the float64 answer on these inputs
        tol = 1e-10 if case["dtype"] == torch.float64 else 2e-4

        def check(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
            assert got.dtype == case["dtype"], what
            _assert_close(got.double(), want, tol, what)

        for i, want in enumerate(ref["iters"]):
            what = f"{key} iteration {i}"
            for name in ("y", "x_grad"):
                check(torch.cat([res[r][key]["iters"][i][name] for r in (0, 1)]), want[name], f"{what} {name}")
            for name in ("w_grad", "b_grad"):  # each rank holds its own loss's part; together the full gradient
                check(res[0][key]["iters"][i][name] + res[1][key]["iters"][i][name], want[name], f"{what} {name}")
            for name in ("running_mean", "running_var"):
                for r in (0, 1):
                    check(res[r][key]["iters"][i][name], want[name], f"{what} {name} rank {r}")
            for r in (0, 1):
                assert torch.equal(res[r][key]["iters"][i]["num_batches_tracked"], want["num_batches_tracked"])
        check(torch.cat([res[r][key]["eval"] for r in (0, 1)]), ref["eval"], f"{key} eval")


def test_distributed_optimizer_misuse_fails_loudly(executor_of_size):
    res = executor_of_size(2).run(_misuse)
    bad = res[0]["bad_args"]
    assert bad == res[1]["bad_args"]
    expected = {
        "op_min": ("ValueError", "op="),
        "op_product": ("ValueError", "op="),
        "passes_0": ("ValueError", "backward_passes_per_step"),
        "passes_float": ("ValueError", "backward_passes_per_step"),
        "duplicate_names": ("ValueError", "duplicate names"),
        "missing_names": ("ValueError", "named_parameters"),
        "not_pairs": ("ValueError", "named_parameters"),
        "not_optimizer": ("TypeError", "optimizer"),
        "predivide_0": ("ValueError", "gradient_predivide_factor"),
        "predivide_with_sum": ("ValueError", "gradient_predivide_factor"),
        "bad_compression": ("TypeError", "compression"),
        "groups_negative": ("ValueError", "groups"),
        "groups_type": ("TypeError", "groups"),
        "groups_empty": ("ValueError", "groups[1]"),
        "groups_foreign": ("ValueError", "groups[0][1]"),
        "groups_twice": ("ValueError", "groups[1][0]"),
        "num_groups_and_groups": ("ValueError", "num_groups"),
        "num_groups_negative": ("ValueError", "num_groups"),
    }
    for key, (kind, text) in expected.items():
        assert bad[key].startswith(kind + ":") and text in bad[key], f"{key}: {bad[key]}"
    assert "['w']" in bad["duplicate_names"]
    assert "min" in bad["op_min"]

    for out in res:
        assert out["after_failed_wrap_type"] == "SGD"
        assert out["after_failed_wrap_step"] == "nothing raised"
        assert out["wrapped_type"] == "DistributedSGD"
        assert out["wrap_twice"].startswith("ValueError:") and "already" in out["wrap_twice"]
        assert out["zero_grad_before_step"].startswith("AssertionError:")
        assert "zero_grad" in out["zero_grad_before_step"]
        assert out["step_after_refused_zero_grad"] == "nothing raised"
        assert out["second_backward"].startswith("AssertionError:")
        assert "backward_passes_per_step" in out["second_backward"]
        assert len(out["double_sync_warnings"]) == 1 and "skip_synchronize" in out["double_sync_warnings"][0]
        assert out["skip_sync_warnings"] == []
    for a, b in zip(res[0]["params"], res[1]["params"]):
        assert torch.equal(a, b)

    for out in res:
        assert out["sched_warnings"] == []
        assert out["sched_lr"] == pytest.approx(0.025)
    for a, b in zip(res[0]["sched_params"], res[1]["sched_params"]):
        assert torch.equal(a, b), "an LR scheduler made before wrapping bypassed the gradient reduction"


@pytest.mark.parametrize("size", [2, 3])
def test_distributed_optimizer_matches_single_process_training(executor_of_size, size):
    xs, ys = _data()
    res = executor_of_size(size).run(_train_distributed, args=[xs, ys, CASES])
    assert len(res) == size
    for name, case in CASES.items():
        ref = _train_reference(xs, ys, size, case)
        tol = 2e-3 if case.get("fp16") else 1e-10
        for rank in range(size):
            got = res[rank][name]
            assert got["warnings"] == [], f"{name}: {got['warnings']}"
            assert got["params"].keys() == ref["params"].keys()
            for pname in ref["params"]:
                what = f"{name} size {size} rank {rank} {pname}"
                _assert_close(got["params"][pname], ref["params"][pname], tol, f"{what} param")
                assert got["grads"][pname] is not None, f"{what}: grad is None"
                _assert_close(got["grads"][pname], ref["grads"][pname], tol, f"{what} grad")
            if rank:  # every rank holds exactly the same parameters
                for pname in ref["params"]:
                    assert torch.equal(got["params"][pname], res[0][name]["params"][pname]), f"{name} {pname}"
        if case.get("fp16"):  # gradients really travelled as float16: off the float32 reference by more than noise
            worst = max((res[0][name]["grads"][n] - ref["grads"][n]).abs().max().item() for n in ref["grads"])
            assert worst > 1e-6, worst
        if case.get("clip"):  # clipping really changed the result
            unclipped = _train_reference(xs, ys, size, {})
            assert not torch.allclose(ref["params"]["fc1.weight"], unclipped["params"]["fc1.weight"], atol=1e-4)
        if case.get("extras"):
            assert torch.equal(res[0][name]["grads"]["unused"], torch.zeros(3, dtype=torch.float64))
            assert not torch.equal(res[0][name]["params"]["partial"], _build_model(torch.float64, True).partial)
        # groups: every step submitted each group once, as one grouped_allreduce of all its gradients
        trainable = 6 if case.get("extras") else 4
        groups = case.get("groups", case.get("num_groups"))
        if groups is None:
            want = []
        elif isinstance(groups, int):
            want = [trainable // groups + (1 if i < trainable % groups else 0) for i in range(groups)] * STEPS
        else:
            want = [len(g) for g in groups] * STEPS
        for rank in range(size):
            got_calls = res[rank][name]["group_calls"]  # in the order the groups completed
            assert sorted(got_calls) == sorted(want), f"{name} rank {rank}: {got_calls}"
        # the training really moved the parameters (the comparison is not vacuous)
        start = _build_model(torch.float64, case.get("extras", False))
        assert not torch.allclose(ref["params"]["fc1.weight"].double(), start.fc1.weight.detach(), atol=1e-3)
