"""Property-based checks of the collective ops on real Ray workers, with careless and unusual input.

Hypothesis runs on the driver and draws one case at a time; every rank of a 2-worker job runs the
case (each builds its own tensor from the case's seed and its rank), and the driver compares what
came back with a reference it computes itself from the same tensors.

* good input of unusual shape (every dtype; scalar, zero-size, 1-4 dims; contiguous, transposed,
  strided, broadcast-expanded and channels-last layouts) gives the right answer;
* non-finite values reduce as IEEE 754 arithmetic says (what torch computes on one process);
* bad input (wrong types, unknown ops, out-of-range roots, bad names, bad splits, process sets with
  unknown ranks or never registered, ops after ``shutdown``) raises ``ValueError``/``TypeError`` naming the argument, on every rank, fast, and the
  ring keeps working afterwards.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import pytest
import ray.cloudpickle
import torch
from hypothesis import HealthCheck, given, settings as hsettings, strategies as st

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

SIZE = 2
#: A bad argument is caught before anything is sent; generous for a loaded 2-core machine.
QUICK_S = 3.0
HYPOTHESIS = hsettings(
    max_examples=40, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

DTYPES = ["float32", "float64", "float16", "bfloat16", "uint8", "int8", "int32", "int64", "bool"]
LAYOUTS = ["contiguous", "transposed", "strided", "expanded", "channels_last"]


@pytest.fixture(scope="module")
def job(ray_local):
    from hvdray import RayExecutor

    settings = RayExecutor.create_settings(timeout_s=30, placement_group_timeout_s=60, stall_warning_s=4, stall_shutdown_s=8)
    executor = RayExecutor(settings, num_workers=SIZE)
    executor.start()
    executor.run(_init)
    try:
        yield executor
    finally:
        executor.shutdown()


def _init() -> None:
    import torch

    import hvdray.torch as hvd

    torch.set_num_threads(1)
    hvd.init()


# -- building the same tensors on the workers and on the driver -----------------------------------
def make_tensor(case: dict[str, Any], rank: int) -> torch.Tensor:
    """Rank ``rank``'s tensor for ``case``, in the case's layout (the values depend on seed and rank)."""
    dtype = getattr(torch, case["dtype"])
    shape = list(case["shape"])
    layout = case["layout"]
    if case.get("ragged") and shape:
        shape[0] += rank  # allgather with different first dimensions
    gen = torch.Generator().manual_seed(case["seed"] * 31 + rank)

    def values(dims: list[int]) -> torch.Tensor:
        if dtype == torch.bool:
            return torch.randint(0, 2, dims, generator=gen).bool()
        if dtype.is_floating_point:
            return (torch.randn(dims, generator=gen, dtype=torch.float64) * 4).to(dtype)
        low = 0 if dtype == torch.uint8 else -4
        return torch.randint(low, 5, dims, generator=gen).to(dtype)

    if layout == "transposed" and len(shape) >= 2:
        return values(shape[::-1]).permute(*reversed(range(len(shape))))
    if layout == "strided" and shape:
        wide = values(shape[:-1] + [shape[-1] * 2])
        return wide[..., ::2]
    if layout == "expanded" and shape:
        return values([1] + shape[1:]).expand(*shape)
    if layout == "channels_last" and len(shape) == 4:
        return values(shape).contiguous(memory_format=torch.channels_last)
    return values(shape)


def reference(case: dict[str, Any]) -> torch.Tensor:
    """What the collective must return, computed on the driver from every rank's tensor."""
    tensors = [make_tensor(case, r) for r in range(SIZE)]
    kind, op = case["kind"], case.get("op")
    if kind == "allgather":
        return torch.cat([t.reshape(t.shape) for t in tensors], dim=0)
    if kind == "broadcast":
        return tensors[case["root"]].clone()
    wide = [t.to(torch.float64) if t.is_floating_point() else t.to(torch.int64) for t in tensors]
    if op == "sum":
        out = sum(wide[1:], wide[0].clone())
    elif op == "product":
        out = wide[0].clone()
        for t in wide[1:]:
            out = out * t
    elif op == "min":
        out = torch.stack(wide).amin(0)
    elif op == "max":
        out = torch.stack(wide).amax(0)
    else:  # average
        out = sum(wide[1:], wide[0].clone())
        out = out / SIZE if out.is_floating_point() else torch.div(out, SIZE, rounding_mode="trunc")  # toward zero, as Horovod
    if tensors[0].dtype == torch.bool:
        return out.bool() if op in ("sum", "max") else out.to(torch.bool)
    return out.to(tensors[0].dtype)


def _run_case(case: dict[str, Any]):
    """On every rank: run the case's op and return the result (on the driver it is compared)."""
    import hvdray.torch as hvd

    tensor = make_tensor(case, hvd.rank())
    name = f"case.{case['seed']}.{case['kind']}.{case['dtype']}.{case['layout']}.{case.get('op')}"
    if case["kind"] == "allreduce":
        op = {"sum": hvd.Sum, "average": hvd.Average, "min": hvd.Min, "max": hvd.Max, "product": hvd.Product}[case["op"]]
        result = hvd.allreduce(tensor, name=name, op=op)
    elif case["kind"] == "allgather":
        result = hvd.allgather(tensor, name=name)
    else:
        result = hvd.broadcast(tensor, root_rank=case["root"], name=name)
    return result, tensor.shape


def _tolerance(dtype: torch.dtype) -> dict[str, float]:
    if dtype in (torch.float16, torch.bfloat16):
        return {"rtol": 2e-2, "atol": 5e-2}
    if dtype == torch.float32:
        return {"rtol": 1e-5, "atol": 1e-5}
    return {"rtol": 1e-12, "atol": 1e-12}


shapes = st.lists(st.integers(0, 5), min_size=0, max_size=4)


@st.composite
def reduce_cases(draw):
    dtype = draw(st.sampled_from(DTYPES))
    ops = ["sum", "min", "max"]
    if dtype != "bool":
        ops += ["product", "average"]
    return {
        "kind": "allreduce", "dtype": dtype, "shape": draw(shapes), "layout": draw(st.sampled_from(LAYOUTS)),
        "op": draw(st.sampled_from(ops)), "seed": draw(st.integers(0, 10**6)),
    }


@st.composite
def movement_cases(draw):
    kind = draw(st.sampled_from(["allgather", "broadcast"]))
    shape = draw(st.lists(st.integers(0, 5), min_size=1 if kind == "allgather" else 0, max_size=4))
    return {
        "kind": kind, "dtype": draw(st.sampled_from(DTYPES)), "shape": shape,
        "layout": draw(st.sampled_from(LAYOUTS)), "seed": draw(st.integers(0, 10**6)),
        "root": draw(st.integers(0, SIZE - 1)), "ragged": kind == "allgather" and draw(st.booleans()),
    }


def _check(job, case):
    expected = reference(case)
    for rank, (result, shape) in enumerate(job.run(_run_case, args=[case])):
        assert result.dtype == expected.dtype, (case, rank)
        assert tuple(result.shape) == tuple(expected.shape), (case, rank)
        if expected.dtype == torch.bool or not expected.is_floating_point():
            assert torch.equal(result, expected), (case, rank, result, expected)
        else:
            torch.testing.assert_close(result, expected, equal_nan=True, **_tolerance(expected.dtype))


@HYPOTHESIS
@given(case=reduce_cases())
def test_allreduce_of_any_dtype_shape_and_layout(job, case):
    _check(job, case)


@HYPOTHESIS
@given(case=movement_cases())
def test_allgather_and_broadcast_of_any_dtype_shape_and_layout(job, case):
    _check(job, case)


# -- IEEE 754: infinities and NaN ----------------------------------------------------------------
SPECIALS = [float("inf"), float("-inf"), float("nan"), 0.0, -0.0, 1.5, -2.0]


def _ieee_tensors(dtype_name: str) -> list[torch.Tensor]:
    """Every pair of special values appears once across the two ranks."""
    dtype = getattr(torch, dtype_name)
    a = torch.tensor([x for x in SPECIALS for _ in SPECIALS], dtype=dtype)
    b = torch.tensor([y for _ in SPECIALS for y in SPECIALS], dtype=dtype)
    return [a, b]


def _ieee_allreduce(dtype_name: str) -> dict[str, torch.Tensor]:
    import hvdray.torch as hvd

    mine = _ieee_tensors(dtype_name)[hvd.rank()]
    ops = {"sum": hvd.Sum, "product": hvd.Product, "min": hvd.Min, "max": hvd.Max, "average": hvd.Average}
    out = {k: hvd.allreduce(mine, name=f"ieee.{dtype_name}.{k}", op=op) for k, op in ops.items()}
    # grouped: a NaN mask rides beside each floating-point tensor, none beside the integer one
    ints = torch.tensor([hvd.rank(), 5 - hvd.rank()])
    for k in ("min", "max"):
        out[f"grouped_{k}"] = hvd.grouped_allreduce([mine, ints, mine * 2], name=f"ieee.{dtype_name}.g{k}", op=ops[k])
    return out


@pytest.mark.parametrize("dtype_name", ["float32", "float64", "float16", "bfloat16"])
def test_non_finite_values_reduce_as_ieee_says(job, dtype_name):
    a, b = _ieee_tensors(dtype_name)
    expected = {
        "sum": a + b,
        "product": a * b,
        "min": torch.minimum(a, b),  # NaN wins, as IEEE 754-2019 minimum() says
        "max": torch.maximum(a, b),
        "average": (a + b) / 2,
    }
    grouped = {"grouped_min": [expected["min"], torch.tensor([0, 4]), torch.minimum(2 * a, 2 * b)],
               "grouped_max": [expected["max"], torch.tensor([1, 5]), torch.maximum(2 * a, 2 * b)]}
    for rank, got in enumerate(job.run(_ieee_allreduce, args=[dtype_name])):
        for key, wants in grouped.items():
            assert len(got[key]) == 3, (rank, key, got[key])
            assert torch.equal(got[key][1], wants[1]), (rank, key, got[key])
            for part in (0, 2):
                want, result = wants[part], got[key][part]
                assert torch.equal(result.isnan(), want.isnan()), (rank, key, part, result, want)
                assert torch.equal(result[~want.isnan()], want[~want.isnan()]), (rank, key, part, result, want)
        for op, want in expected.items():
            assert torch.equal(got[op].isnan(), want.isnan()), (rank, op, got[op], want)
            finite = ~want.isnan()
            assert torch.equal(got[op][finite], want[finite]), (rank, op, got[op], want)


# -- a very large tensor (bigger than the fusion buffer) ----------------------------------------
def _large(n: int) -> tuple[float, float, int]:
    import torch

    import hvdray.torch as hvd

    t = torch.full((n,), float(hvd.rank() + 1), dtype=torch.float32)
    out = hvd.allreduce(t, name="very.large", op=hvd.Sum)
    return float(out.min()), float(out.max()), out.numel()


def test_tensor_larger_than_the_fusion_buffer(job):
    n = (80 << 20) // 4  # 80 MiB of float32: above the default 64 MiB fusion threshold
    for lo, hi, count in job.run(_large, args=[n]):
        assert (lo, hi, count) == (3.0, 3.0, n)


# -- bad input: the same clear error on every rank, fast ------------------------------------------
BAD_CALLS = {
    # label: (argument named in the error, the call)
    "tensor-list": ("tensor", lambda hvd, t: hvd.allreduce([1.0, 2.0], name="bad")),
    "tensor-numpy": ("tensor", lambda hvd, t: hvd.allreduce(t.numpy(), name="bad")),
    "tensor-complex": ("tensor", lambda hvd, t: hvd.allreduce(t.to(torch.complex64), name="bad")),
    "tensor-sparse": ("tensor", lambda hvd, t: hvd.allreduce(t.to_sparse(), name="bad")),
    "op-unknown": ("op", lambda hvd, t: hvd.allreduce(t, name="bad", op="median")),
    "op-bool-average": ("bool", lambda hvd, t: hvd.allreduce(t > 0, name="bad", op=hvd.Average)),
    "prescale-bool": ("prescale_factor", lambda hvd, t: hvd.allreduce(t > 0, name="bad", op=hvd.Max, prescale_factor=0.5)),
    "prescale-str": ("prescale_factor", lambda hvd, t: hvd.allreduce(t, name="bad", prescale_factor="2")),
    "prescale-tensor": ("prescale_factor", lambda hvd, t: hvd.allreduce(t, name="bad", prescale_factor=t)),
    "postscale-tensor": ("postscale_factor", lambda hvd, t: hvd.allreduce(t, name="bad", postscale_factor=t)),
    "name-empty": ("name", lambda hvd, t: hvd.allreduce(t, name="")),
    "name-int": ("name", lambda hvd, t: hvd.allreduce(t, name=7)),
    "root-negative": ("root_rank", lambda hvd, t: hvd.broadcast(t, root_rank=-1, name="bad")),
    "root-too-big": ("root_rank", lambda hvd, t: hvd.broadcast(t, root_rank=SIZE, name="bad")),
    "root-float": ("root_rank", lambda hvd, t: hvd.broadcast(t, root_rank=0.0, name="bad")),
    "allgather-scalar": ("scalar", lambda hvd, t: hvd.allgather(t[0], name="bad")),
    "splits-wrong-sum": ("splits", lambda hvd, t: hvd.alltoall(t, splits=[1, 1], name="bad")),
    "splits-wrong-type": ("splits", lambda hvd, t: hvd.alltoall(t, splits="1,1", name="bad")),
    "handle-wrong": ("handle", lambda hvd, t: hvd.synchronize(42)),
    "objects-root": ("root_rank", lambda hvd, t: hvd.broadcast_object({"a": 1}, root_rank=5)),
    "process-set-unknown-rank": ("outside the job", lambda hvd, t: hvd.add_process_set([0, SIZE + 3])),
    "process-set-negative-rank": ("process_set", lambda hvd, t: hvd.add_process_set([-1, 0])),
    "process-set-not-ranks": ("process_set", lambda hvd, t: hvd.add_process_set("0,1")),
    "process-set-unregistered": (
        "process_set", lambda hvd, t: hvd.allreduce(t, name="bad", process_set=hvd.ProcessSet([0, 1]))
    ),
    "process-set-wrong-type": ("process_set", lambda hvd, t: hvd.allreduce(t, name="bad", process_set=[0, 1])),
}


def _bad_call(label: str):
    import torch

    import hvdray.torch as hvd

    argument, call = BAD_CALLS[label]
    t = torch.arange(6, dtype=torch.float32) - 2
    started = time.monotonic()
    try:
        call(hvd, t)
    except (ValueError, TypeError) as exc:
        outcome = (type(exc).__name__, str(exc))
    else:
        outcome = (None, "")
    elapsed = time.monotonic() - started
    # the ring still works after the bad call
    ok = hvd.allreduce(torch.ones(3), name=f"after.{label}", op=hvd.Sum)
    return outcome, elapsed, ok.tolist()


@pytest.mark.parametrize("label", sorted(BAD_CALLS))
def test_bad_input_names_the_argument_on_every_rank(job, label):
    argument = BAD_CALLS[label][0]
    results = job.run(_bad_call, args=[label])
    errors = [outcome for outcome, _, _ in results]
    assert errors[0][0] is not None, f"{label}: no error raised"
    assert all(e == errors[0] for e in errors), f"{label}: ranks disagree: {errors}"
    assert argument in errors[0][1], f"{label}: the error does not name {argument!r}: {errors[0][1]}"
    for _, elapsed, ok in results:
        assert elapsed < QUICK_S, f"{label} took {elapsed:.1f} s"
        assert ok == [float(SIZE)] * 3


def _after_shutdown():
    import torch

    import hvdray.torch as hvd

    hvd.shutdown()
    outcomes = []
    for call in (
        lambda: hvd.allreduce(torch.ones(2), name="late"),
        lambda: hvd.broadcast(torch.ones(2), root_rank=0, name="late"),
        lambda: hvd.rank(),
    ):
        try:
            call()
            outcomes.append(None)
        except ValueError as exc:
            outcomes.append(str(exc))
    hvd.init()  # leave the job usable for the tests after this one
    return outcomes


def test_ops_after_shutdown_say_to_call_init(job):
    for outcomes in job.run(_after_shutdown):
        assert all(o is not None and "hvd.init()" in o for o in outcomes), outcomes
