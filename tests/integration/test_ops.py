"""Every collective op of ``hvdray.torch`` on real Ray workers, checked against a numpy reference.

One executor per job size (1, 2, 3 workers) is shared by all tests of this module: the ``ex``
fixture is module-scoped and parametrized, so pytest runs every test for one size before it shuts
that executor down and starts the next. Each worker function builds its inputs deterministically from
(key, rank) with :func:`_make`; the driver rebuilds every rank's inputs with the same function and
computes what each rank must receive. Many checks are batched into one ``ex.run`` call.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import ray.cloudpickle
import torch

# Worker functions and helpers below travel to the Ray workers by value (the workers cannot import
# this test module).
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

FLOATS = ["float32", "float64", "float16", "bfloat16"]
INTS = ["uint8", "int8", "int32", "int64"]
DTYPES = FLOATS + INTS + ["bool"]
NUMERIC = FLOATS + INTS
OPS = ["average", "sum", "min", "max", "product"]
BOOL_OPS = ["sum", "min", "max"]  # average and product are refused for bool
#: (rtol, atol) per floating dtype; integers and bools are compared exactly.
TOL = {"float32": (1e-5, 1e-5), "float64": (1e-12, 1e-12), "float16": (5e-3, 2e-2), "bfloat16": (3e-2, 1e-1)}


# -- shared by driver and workers ---------------------------------------------------------------
def _make(key, rank, dtype, shape, kind="any"):
    """A deterministic tensor for (key, rank): small values so that integer sums never overflow."""
    import zlib as _zlib

    import numpy as _np
    import torch as _torch

    rng = _np.random.default_rng([_zlib.crc32(key.encode()), rank])
    n = int(_np.prod(shape)) if len(shape) else 1
    prod = kind == "prod"  # products of 3 ranks must stay in range too
    if dtype == "bool":
        values = rng.random(n) < 0.5
    elif dtype in ("float32", "float64", "float16", "bfloat16"):
        values = rng.uniform(0.5, 1.5, n) * rng.choice([-1.0, 1.0], n) if prod else rng.uniform(-4, 4, n)
    elif dtype == "uint8":
        values = rng.integers(0, 4 if prod else 80, n)
    else:
        values = rng.integers(-3, 4, n) if prod else rng.integers(-40, 41, n)
    return _torch.from_numpy(_np.asarray(values)).to(getattr(_torch, dtype)).reshape(tuple(shape))


def _init():
    import torch as _torch

    import hvdray.torch as hvd

    hvd.init()
    _torch.set_num_threads(1)
    return hvd


def _op(hvd, name):
    return {"average": hvd.Average, "sum": hvd.Sum, "min": hvd.Min, "max": hvd.Max, "product": hvd.Product}[name]


# -- driver-side reference ----------------------------------------------------------------------
def _np(t: torch.Tensor) -> np.ndarray:
    """float64 for floating tensors (bfloat16 has no numpy dtype), int64 for integers, bool for bool."""
    if t.dtype == torch.bool:
        return t.numpy()
    if t.is_floating_point():
        return t.detach().double().numpy()
    return t.numpy().astype(np.int64)


def _inputs(key, size, dtype, shape, kind="any"):
    return [_np(_make(key, r, dtype, shape, kind)) for r in range(size)]


def _reduce(arrays, op, dtype, size, pre=1.0, post=1.0):
    """What allreduce / reducescatter compute, in float64 / int64 / bool."""
    stack = np.stack(arrays)
    if dtype == "bool":
        return {"sum": np.any, "max": np.any, "min": np.all}[op](stack, axis=0)
    if dtype in FLOATS:
        stack = stack * pre
    out = {"average": np.sum, "sum": np.sum, "min": np.min, "max": np.max, "product": np.prod}[op](stack, axis=0)
    if op == "average":
        return out / size * post if dtype in FLOATS else _trunc_divide(out, size)
    return out * post if dtype in FLOATS else out


def _check(got, expected, dtype, what=""):
    """``got`` (a tensor from a worker) has ``dtype``, ``expected``'s shape, and its values."""
    assert isinstance(got, torch.Tensor), f"{what}: got {type(got).__name__}"
    assert got.dtype == getattr(torch, dtype), f"{what}: dtype {got.dtype}, expected {dtype}"
    expected = np.asarray(expected)
    assert tuple(got.shape) == expected.shape, f"{what}: shape {tuple(got.shape)}, expected {expected.shape}"
    if dtype in TOL:
        rtol, atol = TOL[dtype]
        np.testing.assert_allclose(_np(got), expected, rtol=rtol, atol=atol, err_msg=what)
    else:
        np.testing.assert_array_equal(_np(got), expected, err_msg=what)


def _rows(total, size):
    """reducescatter's split of dim 0: as even as possible, the first ranks get the extra row."""
    base, extra = divmod(total, size)
    return [base + (1 if r < extra else 0) for r in range(size)]


# -- the executors ------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=[1, 2, 3], ids=lambda n: f"np{n}")
def ex(request, ray_local):
    """One started executor per job size, shared by every test of the module for that size."""
    from hvdray import RayExecutor

    settings = RayExecutor.create_settings(timeout_s=30, placement_group_timeout_s=60)
    executor = RayExecutor(settings, num_workers=request.param)
    executor.start()
    try:
        assert executor.run(lambda: _init().size()) == [request.param] * request.param
        yield executor
    finally:
        executor.shutdown()


# -- allreduce ------------------------------------------------------------------------------------
def _allreduce_specs():
    specs = []
    for dtype in DTYPES:
        for op in BOOL_OPS if dtype == "bool" else OPS:
            specs.append((f"ar.{dtype}.{op}", dtype, (3, 4), op, "prod" if op == "product" else "any", 1.0, 1.0))
        if dtype in FLOATS:
            for op in ("sum", "average"):
                specs.append((f"ar.{dtype}.{op}.scaled", dtype, (5,), op, "any", 0.5, 3.0))
    return specs


def _allreduce_matrix(specs):
    hvd = _init()
    out = {}
    for key, dtype, shape, op, kind, pre, post in specs:
        x = _make(key, hvd.rank(), dtype, shape, kind)
        before = x.clone()
        y = hvd.allreduce(x, name=key, op=_op(hvd, op), prescale_factor=pre, postscale_factor=post)
        out[key] = (y, torch.equal(x, before))
    return out


def test_allreduce_every_op_and_dtype(ex):
    size = ex.num_workers
    specs = _allreduce_specs()
    results = ex.run(_allreduce_matrix, args=[specs])
    for key, dtype, shape, op, kind, pre, post in specs:
        expected = _reduce(_inputs(key, size, dtype, shape, kind), op, dtype, size, pre, post)
        for rank, result in enumerate(results):
            got, input_untouched = result[key]
            assert input_untouched, f"{key}: allreduce changed its input on rank {rank}"
            _check(got, expected, dtype, f"{key} on rank {rank}")


def _trunc_divide(a, n):
    """Integer division rounding toward zero (Horovod's integer Average)."""
    a = np.asarray(a)
    return (np.sign(a) * (np.abs(a) // n)).astype(a.dtype)


def test_integer_average_truncates_like_horovod(ex):
    """Integer Average is the sum divided by the size, rounded toward zero (negative sums round up)."""
    size = ex.num_workers

    def fn():
        hvd = _init()
        x = torch.tensor([hvd.rank() * 7 - 5, 1, -1, 2 * hvd.rank() + 1], dtype=torch.int64)
        return [hvd.allreduce(x.to(d), name=f"intavg.{d}", op=hvd.Average) for d in (torch.int32, torch.int64)]

    total = np.array([sum(r * 7 - 5 for r in range(size)), size, -size, size * size])
    for results in ex.run(fn):
        for got, dtype in zip(results, ("int32", "int64")):
            _check(got, _trunc_divide(total, size), dtype, f"integer average {dtype}")


def _allreduce_forms(n):
    import time

    hvd = _init()
    r = hvd.rank()
    out = {}
    # in place
    x = _make("forms.inplace", r, "float32", (4, 3))
    ret = hvd.allreduce_(x, name="forms.inplace", op=hvd.Sum)
    out["inplace"] = (x, ret is x)
    # async + poll + synchronize
    x = _make("forms.async", r, "float64", (6,))
    h = hvd.allreduce_async(x, name="forms.async", op=hvd.Average)
    polls = []
    while True:
        done = hvd.poll(h)
        polls.append(done)
        if done:
            break
        time.sleep(0.001)
    out["async"] = (hvd.synchronize(h), all(isinstance(p, bool) for p in polls))
    # async in place
    x = _make("forms.async_", r, "int32", (2, 5))
    h = hvd.allreduce_async_(x, name="forms.async_", op=hvd.Max)
    ret = hvd.synchronize(h)
    out["async_"] = (x, ret is x)
    # deprecated average=False means Sum
    out["average_false"] = hvd.allreduce(_make("forms.avgf", r, "float32", (3,)), average=False, name="forms.avgf")
    # default op is Average, default name is generated
    out["default"] = hvd.allreduce(_make("forms.default", r, "float32", (3,)))
    # grouped, in all four forms (mixed dtypes and shapes in one group)
    def group(tag):
        return [_make(f"{tag}.0", r, "float32", (3,)), _make(f"{tag}.1", r, "float64", (2, 2)),
                _make(f"{tag}.2", r, "int64", (4,))]

    out["grouped"] = hvd.grouped_allreduce(group("g"), name="g", op=hvd.Sum)
    ts = group("g_")
    ret = hvd.grouped_allreduce_(ts, name="g_", op=hvd.Sum)
    out["grouped_"] = (ts, [a is b for a, b in zip(ret, ts)])
    out["grouped_async"] = hvd.synchronize(hvd.grouped_allreduce_async(group("ga"), name="ga", op=hvd.Sum))
    ts = group("ga_")
    ret = hvd.synchronize(hvd.grouped_allreduce_async_(ts, name="ga_", op=hvd.Sum))
    out["grouped_async_"] = (ts, [a is b for a, b in zip(ret, ts)])
    # scalars (0-dim) and zero-size tensors
    out["scalar"] = hvd.allreduce(torch.tensor(float(r + 1)), name="forms.scalar", op=hvd.Sum)
    out["scalar_int"] = hvd.allreduce(torch.tensor(r + 1), name="forms.scalar_int", op=hvd.Product)
    out["empty"] = hvd.allreduce(torch.empty(0, 3), name="forms.empty", op=hvd.Sum)
    e = torch.empty(2, 0, dtype=torch.int32)
    out["empty_"] = (hvd.allreduce_(e, name="forms.empty_", op=hvd.Sum), e.shape)
    # non-contiguous inputs: a transpose and a strided slice, copied and in place
    base = _make("forms.nc", r, "float32", (4, 6))
    out["nc_t"] = hvd.allreduce(base.t(), name="forms.nc_t", op=hvd.Sum)
    out["nc_slice"] = hvd.allreduce(base[:, ::2], name="forms.nc_slice", op=hvd.Sum)
    b2 = base.clone()
    hvd.allreduce_(b2.t(), name="forms.nc_t_", op=hvd.Sum)
    b3 = base.clone()
    hvd.allreduce_(b3[:, 1::2], name="forms.nc_slice_", op=hvd.Sum)
    out["nc_inplace"] = (b2, b3)
    # many small tensors in flight at once (negotiated and fused together)
    hs = [hvd.allreduce_async(_make(f"many.{i}", r, "float32", (i + 1,)), name=f"many.{i}", op=hvd.Sum)
          for i in range(n)]
    out["many"] = [hvd.synchronize(h) for h in hs]
    return out


def test_allreduce_forms(ex):
    size = ex.num_workers
    n_many = 24
    results = ex.run(_allreduce_forms, args=[n_many])

    def ref(key, dtype, shape, op="sum"):
        return _reduce(_inputs(key, size, dtype, shape), op, dtype, size)

    base = [_np(_make("forms.nc", r, "float32", (4, 6))) for r in range(size)]
    total = np.sum(base, axis=0)
    for rank, out in enumerate(results):
        where = f"rank {rank}"
        x, same = out["inplace"]
        assert same, "allreduce_ must return its argument"
        _check(x, ref("forms.inplace", "float32", (4, 3)), "float32", f"allreduce_ on {where}")
        y, polls_are_bool = out["async"]
        assert polls_are_bool
        _check(y, ref("forms.async", "float64", (6,), "average"), "float64", f"allreduce_async on {where}")
        x, same = out["async_"]
        assert same, "synchronize(allreduce_async_(t)) must return t"
        _check(x, ref("forms.async_", "int32", (2, 5), "max"), "int32", f"allreduce_async_ on {where}")
        _check(out["average_false"], ref("forms.avgf", "float32", (3,)), "float32", "average=False")
        _check(out["default"], ref("forms.default", "float32", (3,), "average"), "float32", "default op")
        for form in ("grouped", "grouped_", "grouped_async", "grouped_async_"):
            got = out[form]
            if form.endswith("_"):
                got, identities = got
                assert all(identities), f"{form} must return its tensors"
            tag = {"grouped": "g", "grouped_": "g_", "grouped_async": "ga", "grouped_async_": "ga_"}[form]
            assert len(got) == 3
            for i, (dtype, shape) in enumerate([("float32", (3,)), ("float64", (2, 2)), ("int64", (4,))]):
                _check(got[i], ref(f"{tag}.{i}", dtype, shape), dtype, f"{form}[{i}] on {where}")
        _check(out["scalar"], np.float64(size * (size + 1) / 2), "float32", "scalar allreduce")
        _check(out["scalar_int"], np.int64(np.prod(np.arange(1, size + 1))), "int64", "scalar product")
        _check(out["empty"], np.zeros((0, 3)), "float32", "zero-size allreduce")
        e, shape = out["empty_"]
        assert tuple(shape) == (2, 0)
        _check(e, np.zeros((2, 0), dtype=np.int64), "int32", "zero-size allreduce_")
        _check(out["nc_t"], total.T, "float32", "transposed input")
        _check(out["nc_slice"], total[:, ::2], "float32", "strided input")
        b2, b3 = out["nc_inplace"]
        _check(b2, total, "float32", "allreduce_ on a transposed view")
        expected = base[rank].copy()
        expected[:, 1::2] = total[:, 1::2]
        _check(b3, expected, "float32", "allreduce_ on a strided view (other columns untouched)")
        assert len(out["many"]) == n_many
        for i, got in enumerate(out["many"]):
            _check(got, ref(f"many.{i}", "float32", (i + 1,)), "float32", f"many.{i} on {where}")


def _in_place_on_tensors_that_require_grad():
    import time

    hvd = _init()
    r = hvd.rank()

    def wait(handle):  # a bounded synchronize: a hang becomes a test failure
        deadline = time.monotonic() + 10
        while not hvd.poll(handle):
            if time.monotonic() > deadline:
                raise TimeoutError("the op never finished")
            time.sleep(0.005)
        return hvd.synchronize(handle)

    x = _make("rg.x", r, "float32", (3,)).requires_grad_(True)
    wait(hvd.allreduce_async_(x, name="rg.x", op=hvd.Average, postscale_factor=2.0))
    p = torch.nn.Parameter(_make("rg.p", r, "float32", (2, 3)))
    wait(hvd.broadcast_async_(p, 0, name="rg.p"))
    q = torch.nn.Parameter(_make("rg.q", r, "float32", (2, 3)))
    with torch.no_grad():
        wait(hvd.broadcast_async_(q.t(), 0, name="rg.q"))  # non-contiguous: copied back in place
    return [(t.detach().clone(), t.is_leaf, t.requires_grad, t.grad_fn is None) for t in (x, p, q)]


def test_in_place_ops_on_tensors_that_require_grad(ex):
    """allreduce_ / broadcast_ write into leaves that require grad (parameters), as in Horovod."""
    size = ex.num_workers
    x = _reduce(_inputs("rg.x", size, "float32", (3,)), "average", "float32", size, post=2.0)
    p, q = (_np(_make(k, 0, "float32", (2, 3))) for k in ("rg.p", "rg.q"))
    for rank, results in enumerate(ex.run(_in_place_on_tensors_that_require_grad)):
        for (got, is_leaf, requires_grad, no_history), expected, what in zip(results, (x, p, q), "xpq"):
            assert is_leaf and requires_grad and no_history, f"{what} on rank {rank}"
            _check(got, expected, "float32", f"{what} on rank {rank}")


# -- allgather ------------------------------------------------------------------------------------
def _allgather_all(dtypes):
    hvd = _init()
    r = hvd.rank()
    out = {}
    for dtype in dtypes:
        out[f"ag.{dtype}"] = hvd.allgather(_make(f"ag.{dtype}", r, dtype, (r + 1, 2, 3)), name=f"ag.{dtype}")
        # rank 0 contributes no rows
        out[f"ag0.{dtype}"] = hvd.allgather(_make(f"ag0.{dtype}", r, dtype, (r, 2)), name=f"ag0.{dtype}")
        h = hvd.allgather_async(_make(f"aga.{dtype}", r, dtype, (2,)), name=f"aga.{dtype}")
        out[f"aga.{dtype}"] = hvd.synchronize(h)
    out["empty"] = hvd.allgather(torch.empty(0, 3, dtype=torch.int64), name="ag.empty")
    out["nc"] = hvd.allgather(_make("ag.nc", r, "float32", (3, r + 2)).t(), name="ag.nc")
    return out


def test_allgather(ex):
    size = ex.num_workers
    results = ex.run(_allgather_all, args=[DTYPES])
    for dtype in DTYPES:
        expected = {
            "ag": np.concatenate([_np(_make(f"ag.{dtype}", r, dtype, (r + 1, 2, 3))) for r in range(size)]),
            "ag0": np.concatenate([_np(_make(f"ag0.{dtype}", r, dtype, (r, 2))) for r in range(size)]),
            "aga": np.concatenate([_np(_make(f"aga.{dtype}", r, dtype, (2,))) for r in range(size)]),
        }
        for rank, out in enumerate(results):
            for kind, ref in expected.items():
                _check(out[f"{kind}.{dtype}"], ref, dtype, f"{kind} {dtype} on rank {rank}")
    nc = np.concatenate([_np(_make("ag.nc", r, "float32", (3, r + 2))).T for r in range(size)])
    for rank, out in enumerate(results):
        _check(out["empty"], np.zeros((0, 3), dtype=np.int64), "int64", "zero-size allgather")
        _check(out["nc"], nc, "float32", f"allgather of a transposed tensor on rank {rank}")


# -- broadcast ------------------------------------------------------------------------------------
def _broadcast_all(dtypes):
    hvd = _init()
    r = hvd.rank()
    out = {}
    for root in range(hvd.size()):
        for dtype in dtypes:
            key = f"bc.{root}.{dtype}"
            x = _make(key, r, dtype, (2, 3))
            before = x.clone()
            y = hvd.broadcast(x, root, name=key)
            z = x.clone()
            z_ret = hvd.broadcast_(z, root, name=key + "_")
            w = x.clone()
            w_ret = hvd.synchronize(hvd.broadcast_async_(w, root, name=key + "async_"))
            v = hvd.synchronize(hvd.broadcast_async(x, root, name=key + "async"))
            out[key] = (y, z, w, v, torch.equal(x, before), z_ret is z, w_ret is w)
        base = _make(f"bc.{root}.nc", r, "float64", (3, 4))
        hvd.broadcast_(base.t(), root, name=f"bc.{root}.nc_t")
        base2 = _make(f"bc.{root}.nc", r, "float64", (3, 4))
        hvd.broadcast_(base2[:, ::2], root, name=f"bc.{root}.nc_slice")
        out[f"bc.{root}.nc"] = (base, base2)
        out[f"bc.{root}.scalar"] = hvd.broadcast(torch.tensor(r * 10), root, name=f"bc.{root}.scalar")
        out[f"bc.{root}.empty"] = hvd.broadcast(torch.empty(0, 2), root, name=f"bc.{root}.empty")
    return out


def test_broadcast_from_every_root(ex):
    size = ex.num_workers
    results = ex.run(_broadcast_all, args=[DTYPES])
    for root in range(size):
        for dtype in DTYPES:
            key = f"bc.{root}.{dtype}"
            expected = _np(_make(key, root, dtype, (2, 3)))
            for rank, out in enumerate(results):
                y, z, w, v, untouched, z_same, w_same = out[key]
                assert untouched and z_same and w_same, f"{key} on rank {rank}"
                for form, got in (("broadcast", y), ("broadcast_", z), ("broadcast_async_", w),
                                  ("broadcast_async", v)):
                    _check(got, expected, dtype, f"{form} {key} on rank {rank}")
        root_base = _np(_make(f"bc.{root}.nc", root, "float64", (3, 4)))
        for rank, out in enumerate(results):
            base, base2 = out[f"bc.{root}.nc"]
            _check(base, root_base, "float64", f"broadcast_ into a transposed view from {root} on rank {rank}")
            expected = _np(_make(f"bc.{root}.nc", rank, "float64", (3, 4)))
            expected[:, ::2] = root_base[:, ::2]
            _check(base2, expected, "float64", f"broadcast_ into a strided view from {root} on rank {rank}")
            _check(out[f"bc.{root}.scalar"], np.int64(root * 10), "int64", "scalar broadcast")
            _check(out[f"bc.{root}.empty"], np.zeros((0, 2)), "float32", "zero-size broadcast")


# -- alltoall -------------------------------------------------------------------------------------
def _splits(rank, size):
    """Rows rank ``rank`` sends to each rank: uneven, with zeros."""
    return [(rank + 2 * k) % 3 for k in range(size)]


def _alltoall_all(dtypes):
    hvd = _init()
    r, n = hvd.rank(), hvd.size()
    out = {}
    sp = [(r + 2 * k) % 3 for k in range(n)]
    for dtype in dtypes:
        out[f"even.{dtype}"] = hvd.alltoall(_make(f"a2a.even.{dtype}", r, dtype, (2 * n, 3)), name=f"even.{dtype}")
        got, received = hvd.alltoall(_make(f"a2a.sp.{dtype}", r, dtype, (sum(sp), 2)), splits=sp, name=f"sp.{dtype}")
        out[f"sp.{dtype}"] = (got, received)
    x = _make("a2a.sp.float32", r, "float32", (sum(sp), 2))
    out["tensor_splits"] = hvd.alltoall(x, splits=torch.tensor(sp, dtype=torch.int32), name="a2a.tsplits")
    out["async"] = hvd.synchronize(hvd.alltoall_async(x, splits=sp, name="a2a.async"))
    out["async_even"] = hvd.synchronize(hvd.alltoall_async(_make("a2a.even.int64", r, "int64", (2 * n, 3)),
                                                           name="a2a.async_even"))
    out["nc"] = hvd.alltoall(_make("a2a.nc", r, "float32", (4, n)).t(), name="a2a.nc")
    out["empty"] = hvd.alltoall(torch.empty(0, 2), splits=[0] * n, name="a2a.empty")
    return out


def test_alltoall(ex):
    size = ex.num_workers
    results = ex.run(_alltoall_all, args=[DTYPES])
    splits = [_splits(r, size) for r in range(size)]

    def expect_even(key, dtype, shape):
        xs = [_np(_make(key, j, dtype, shape)) for j in range(size)]
        rows = shape[0] // size
        return [np.concatenate([x[r * rows : (r + 1) * rows] for x in xs]) for r in range(size)]

    def expect_split(key, dtype):
        xs = [_np(_make(key, j, dtype, (sum(splits[j]), 2))) for j in range(size)]
        outs = []
        for r in range(size):
            parts = [xs[j][sum(splits[j][:r]) : sum(splits[j][: r + 1])] for j in range(size)]
            outs.append(np.concatenate(parts))
        return outs

    for dtype in DTYPES:
        even = expect_even(f"a2a.even.{dtype}", dtype, (2 * size, 3))
        split = expect_split(f"a2a.sp.{dtype}", dtype)
        for rank, out in enumerate(results):
            _check(out[f"even.{dtype}"], even[rank], dtype, f"alltoall {dtype} on rank {rank}")
            got, received = out[f"sp.{dtype}"]
            _check(got, split[rank], dtype, f"alltoall with splits {dtype} on rank {rank}")
            _check(received, [splits[j][rank] for j in range(size)], "int32", "received_splits")
    split = expect_split("a2a.sp.float32", "float32")
    even = expect_even("a2a.even.int64", "int64", (2 * size, 3))
    nc_in = [_np(_make("a2a.nc", j, "float32", (4, size))).T for j in range(size)]
    for rank, out in enumerate(results):
        received = [splits[j][rank] for j in range(size)]
        for form in ("tensor_splits", "async"):
            got, rec = out[form]
            _check(got, split[rank], "float32", f"alltoall ({form}) on rank {rank}")
            _check(rec, received, "int32", f"received_splits ({form})")
        got, rec = out["async_even"]
        _check(got, even[rank], "int64", "alltoall_async without splits")
        _check(rec, [2] * size, "int32", "received_splits without splits")
        _check(out["nc"], np.concatenate([x[rank : rank + 1] for x in nc_in]), "float32", "transposed alltoall")
        got, rec = out["empty"]
        _check(got, np.zeros((0, 2)), "float32", "zero-size alltoall")
        _check(rec, [0] * size, "int32", "zero-size received_splits")


# -- reducescatter --------------------------------------------------------------------------------
def _reducescatter_specs(size):
    specs = []
    for dtype in NUMERIC:
        for op in ("sum", "average", "min", "max"):
            specs.append((f"rs.{dtype}.{op}", dtype, (2 * size + 1, 3), op, 1.0, 1.0))
        specs.append((f"rs.{dtype}.short", dtype, (size + 1,), "sum", 1.0, 1.0))
        if size > 1:  # fewer rows than ranks: the last ranks get none
            specs.append((f"rs.{dtype}.fewer", dtype, (size - 1, 2), "sum", 1.0, 1.0))
        if dtype in FLOATS:
            for op in ("sum", "average"):
                specs.append((f"rs.{dtype}.{op}.scaled", dtype, (size + 2, 2), op, 0.5, 3.0))
    specs.append(("rs.empty", "float32", (0, 2), "sum", 1.0, 1.0))
    return specs


def _reducescatter_all(specs):
    hvd = _init()
    out = {}
    for key, dtype, shape, op, pre, post in specs:
        x = _make(key, hvd.rank(), dtype, shape)
        out[key] = hvd.reducescatter(x, name=key, op=_op(hvd, op), prescale_factor=pre, postscale_factor=post)
    h = hvd.reducescatter_async(_make("rs.async", hvd.rank(), "float32", (7, 2)), name="rs.async", op=hvd.Sum)
    out["rs.async"] = hvd.synchronize(h)
    out["rs.default"] = hvd.reducescatter(_make("rs.default", hvd.rank(), "float64", (5,)), name="rs.default")
    return out


def test_reducescatter(ex):
    size = ex.num_workers
    specs = _reducescatter_specs(size)
    specs_all = specs + [("rs.async", "float32", (7, 2), "sum", 1.0, 1.0),
                         ("rs.default", "float64", (5,), "average", 1.0, 1.0)]
    results = ex.run(_reducescatter_all, args=[specs])
    for key, dtype, shape, op, pre, post in specs_all:
        full = _reduce(_inputs(key, size, dtype, shape), op, dtype, size, pre, post)
        rows = _rows(shape[0], size)
        for rank, out in enumerate(results):
            start = sum(rows[:rank])
            _check(out[key], full[start : start + rows[rank]], dtype, f"{key} on rank {rank} (rows {rows})")


# -- barrier, objects -----------------------------------------------------------------------------
def _barrier_and_objects():
    import time

    hvd = _init()
    r = hvd.rank()
    if r == 0:
        time.sleep(0.3)
    before = time.time()
    hvd.barrier()
    after = time.time()
    mine = {"rank": r, "items": list(range(r)), "array": np.arange(r + 1), "text": "x" * (100 * r)}
    broadcasts = [hvd.broadcast_object(mine, root_rank=root, name=f"obj.{root}") for root in range(hvd.size())]
    broadcasts.append(hvd.broadcast_object(mine))  # default root 0, generated name
    gathered = hvd.allgather_object(mine)
    gathered_named = hvd.allgather_object((r, None), name="objs")
    hvd.barrier()
    return before, after, broadcasts, gathered, gathered_named


def test_barrier_broadcast_object_allgather_object(ex):
    size = ex.num_workers
    results = ex.run(_barrier_and_objects)
    rank0_entered = results[0][0]
    objs = [{"rank": r, "items": list(range(r)), "array": np.arange(r + 1), "text": "x" * (100 * r)}
            for r in range(size)]

    def same(a, b):
        return a.keys() == b.keys() and all(
            np.array_equal(a[k], b[k]) if isinstance(a[k], np.ndarray) else a[k] == b[k] for k in a
        )

    for rank, (before, after, broadcasts, gathered, gathered_named) in enumerate(results):
        assert after >= rank0_entered, f"rank {rank} left the barrier before rank 0 entered it"
        assert len(broadcasts) == size + 1
        for root, got in enumerate(broadcasts[:size]):
            assert same(got, objs[root]), f"broadcast_object from {root} on rank {rank}: {got}"
        assert same(broadcasts[-1], objs[0])
        assert len(gathered) == size and all(same(g, o) for g, o in zip(gathered, objs))
        assert gathered_named == [(r, None) for r in range(size)]


# -- join -----------------------------------------------------------------------------------------
def _join_scenario(last):
    """Every rank but ``last`` joins at once; ``last`` then reduces alone (the others count as zeros)."""
    hvd = _init()
    r = hvd.rank()
    out = {}
    if r == last:
        x = _make("join.x", r, "float32", (3, 2))
        out["sum"] = hvd.allreduce(x, name=f"join{last}.sum", op=hvd.Sum)
        out["avg"] = hvd.allreduce(x, name=f"join{last}.avg", op=hvd.Average)
        out["int"] = hvd.allreduce(torch.tensor([5, -7], dtype=torch.int64) * (r + 1), name=f"join{last}.int",
                                   op=hvd.Average)
        out["grouped"] = hvd.grouped_allreduce([x, x.double()], name=f"join{last}.grouped", op=hvd.Sum)
    out["last"] = hvd.join()
    # once everyone joined, the ring works as before
    out["after"] = hvd.allreduce(torch.full((2,), float(r + 1)), name=f"join{last}.after", op=hvd.Sum)
    return out


def test_join(ex):
    size = ex.num_workers
    for last in sorted({0, size - 1}):
        results = ex.run(_join_scenario, args=[last])
        x = _np(_make("join.x", last, "float32", (3, 2)))
        for rank, out in enumerate(results):
            assert out["last"] == last, f"join() on rank {rank} returned {out['last']}, the last to join was {last}"
            _check(out["after"], np.full(2, size * (size + 1) / 2), "float32", "allreduce after join")
        out = results[last]
        _check(out["sum"], x, "float32", "allreduce Sum with joined ranks")
        _check(out["avg"], x / size, "float32", "allreduce Average with joined ranks")
        _check(out["int"], _trunc_divide(np.array([5, -7]) * (last + 1), size), "int64", "int Average with join")
        _check(out["grouped"][0], x, "float32", "grouped allreduce with joined ranks")
        _check(out["grouped"][1], x, "float64", "grouped allreduce with joined ranks")


# -- out-of-order submission ----------------------------------------------------------------------
def _out_of_order():
    hvd = _init()
    r = hvd.rank()
    orders = [("a", "b", "c"), ("c", "b", "a"), ("b", "c", "a")]
    handles = {}
    for name in orders[r % 3]:
        if name == "a":
            handles[name] = hvd.allreduce_async(_make("ooo.a", r, "float32", (5,)), name="ooo.a", op=hvd.Sum)
        elif name == "b":
            handles[name] = hvd.allgather_async(_make("ooo.b", r, "int64", (r + 1, 2)), name="ooo.b")
        else:
            handles[name] = hvd.broadcast_async(_make("ooo.c", r, "float64", (3,)), 0, name="ooo.c")
    ooo = {name: hvd.synchronize(handles[name]) for name in orders[r % 3]}
    # the same names, all allreduces, in reverse order on odd ranks: results must not be swapped
    names = [f"ooo.ar.{i}" for i in range(4)]
    mine = names if r % 2 == 0 else names[::-1]
    hs = {n: hvd.allreduce_async(_make(n, r, "float32", (2,)), name=n, op=hvd.Sum) for n in mine}
    ooo.update({n: hvd.synchronize(h) for n, h in hs.items()})
    return ooo


def test_out_of_order_submission(ex):
    size = ex.num_workers
    results = ex.run(_out_of_order)
    a = _reduce(_inputs("ooo.a", size, "float32", (5,)), "sum", "float32", size)
    b = np.concatenate([_np(_make("ooo.b", r, "int64", (r + 1, 2))) for r in range(size)])
    c = _np(_make("ooo.c", 0, "float64", (3,)))
    for rank, out in enumerate(results):
        _check(out["a"], a, "float32", f"a on rank {rank}")
        _check(out["b"], b, "int64", f"b on rank {rank}")
        _check(out["c"], c, "float64", f"c on rank {rank}")
        for i in range(4):
            n = f"ooo.ar.{i}"
            _check(out[n], _reduce(_inputs(n, size, "float32", (2,)), "sum", "float32", size), "float32", n)


# -- autograd -------------------------------------------------------------------------------------
def _autograd():
    hvd = _init()
    r, n = hvd.rank(), hvd.size()
    grads = {}

    def leaf(key, shape):
        return _make(key, r, "float64", shape).requires_grad_(True)

    def weight(key, shape):
        return _make(key + ".w", r, "float64", shape)

    x = leaf("g.ar", (3, 2))
    y = hvd.allreduce(x, name="g.ar", op=hvd.Average, prescale_factor=0.5, postscale_factor=3.0)
    (y * weight("g.ar", (3, 2))).sum().backward()
    grads["allreduce_avg"] = x.grad

    x = leaf("g.ars", (4,))
    (hvd.allreduce(x, name="g.ars", op=hvd.Sum) * weight("g.ars", (4,))).sum().backward()
    grads["allreduce_sum"] = x.grad

    xs = [leaf("g.grp.0", (2,)), leaf("g.grp.1", (3,))]
    ys = hvd.grouped_allreduce(xs, name="g.grp", op=hvd.Sum)
    (sum((yy * weight(f"g.grp.{i}", yy.shape)).sum() for i, yy in enumerate(ys))).backward()
    grads["grouped"] = [xx.grad for xx in xs]

    total = n * (n + 1) // 2
    x = leaf("g.ag", (r + 1, 2))
    (hvd.allgather(x, name="g.ag") * weight("g.ag", (total, 2))).sum().backward()
    grads["allgather"] = x.grad

    x = leaf("g.bc", (4,))
    (hvd.broadcast(x, n - 1, name="g.bc") * weight("g.bc", (4,))).sum().backward()
    grads["broadcast"] = x.grad

    rows = 2 * n + 1
    mine = rows // n + (1 if r < rows % n else 0)
    x = leaf("g.rs", (rows, 2))
    (hvd.reducescatter(x, name="g.rs", op=hvd.Average) * weight("g.rs", (mine, 2))).sum().backward()
    grads["reducescatter"] = x.grad

    sp = [(r + 2 * k) % 3 for k in range(n)]
    recv = [(j + 2 * r) % 3 for j in range(n)]
    x = leaf("g.a2a", (sum(sp), 2))
    out, _ = hvd.alltoall(x, splits=sp, name="g.a2a")
    (out * weight("g.a2a", (sum(recv), 2))).sum().backward()
    grads["alltoall"] = x.grad

    # not recorded (no_grad, on a leaf that requires grad): the same results without autograd's history (the
    # ops skip their autograd Functions then)
    x = leaf("g.ng", (n, 2))
    with torch.no_grad():
        plain = {
            "allreduce": hvd.allreduce(x, name="g.ng.ar", op=hvd.Sum),
            "grouped_allreduce": hvd.grouped_allreduce([x], name="g.ng.gar", op=hvd.Sum)[0],
            "allgather": hvd.allgather(x, name="g.ng.ag"),
            "grouped_allgather": hvd.grouped_allgather([x], name="g.ng.gag")[0],
            "broadcast": hvd.broadcast(x, n - 1, name="g.ng.bc"),
            "alltoall": hvd.alltoall(x, name="g.ng.a2a"),
            "reducescatter": hvd.reducescatter(x, name="g.ng.rs", op=hvd.Sum),
            "grouped_reducescatter": hvd.grouped_reducescatter([x], name="g.ng.grs", op=hvd.Sum)[0],
        }
    grads["not recorded"] = {op: (y, y.grad_fn is None and not y.requires_grad) for op, y in plain.items()}
    return grads


def test_autograd_matches_the_math(ex):
    size = ex.num_workers
    results = ex.run(_autograd)

    def w(key, rank, shape):
        return _np(_make(key + ".w", rank, "float64", shape))

    def check(got, expected, what):
        _check(got, expected, "float64", what)

    ar_avg = 0.5 * 3.0 / size * sum(w("g.ar", k, (3, 2)) for k in range(size))
    ar_sum = sum(w("g.ars", k, (4,)) for k in range(size))
    grp = [sum(w(f"g.grp.{i}", k, shape) for k in range(size)) for i, shape in enumerate([(2,), (3,)])]
    total = size * (size + 1) // 2
    # Horovod's gradients: allgather's and broadcast's average the ranks' (broadcast's on the root only);
    # reducescatter(Average)'s gathers them unscaled (Sum's would be times size)
    ag_w = sum(w("g.ag", k, (total, 2)) for k in range(size)) / size
    bc_w = sum(w("g.bc", k, (4,)) for k in range(size)) / size
    rs_rows = _rows(2 * size + 1, size)
    rs_grad = np.concatenate([w("g.rs", k, (rs_rows[k], 2)) for k in range(size)])
    splits = [_splits(r, size) for r in range(size)]
    recv = [[splits[j][r] for j in range(size)] for r in range(size)]
    for rank, grads in enumerate(results):
        check(grads["allreduce_avg"], ar_avg, f"d allreduce(Average, pre, post) on rank {rank}")
        check(grads["allreduce_sum"], ar_sum, f"d allreduce(Sum) on rank {rank}")
        for i in range(2):
            check(grads["grouped"][i], grp[i], f"d grouped_allreduce[{i}] on rank {rank}")
        offset = rank * (rank + 1) // 2
        check(grads["allgather"], ag_w[offset : offset + rank + 1], f"d allgather on rank {rank}")
        check(grads["broadcast"], bc_w if rank == size - 1 else np.zeros(4), f"d broadcast on rank {rank}")
        check(grads["reducescatter"], rs_grad, f"d reducescatter(Average) on rank {rank}")
        # rows rank sent to k came back as rows of k's output, at the offset of rank's block there
        parts = []
        for k in range(size):
            wk = w("g.a2a", k, (sum(recv[k]), 2))
            start = sum(recv[k][:rank])
            parts.append(wk[start : start + splits[rank][k]])
        check(grads["alltoall"], np.concatenate(parts), f"d alltoall on rank {rank}")
        xs = [_np(_make("g.ng", k, "float64", (size, 2))) for k in range(size)]
        total = sum(xs)
        expected = {
            "allreduce": total, "grouped_allreduce": total, "allgather": np.concatenate(xs),
            "grouped_allgather": np.concatenate(xs), "broadcast": xs[size - 1],
            "alltoall": np.stack([x[rank] for x in xs]), "reducescatter": total[rank : rank + 1],
            "grouped_reducescatter": total[rank : rank + 1],
        }
        for op, (got, plain) in grads["not recorded"].items():
            assert plain, f"{op} under no_grad kept autograd's history on rank {rank}"
            check(got, expected[op], f"{op} under no_grad on rank {rank}")
