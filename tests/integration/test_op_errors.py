"""Errors of the collective ops on real Ray workers: clear, the same on every rank, and quick.

* a shape, dtype, op or argument mismatch across ranks raises the same ``TensorMismatchError`` on
  every rank, naming the tensor, within a time bound, and the ring keeps working afterwards;
* an op before ``hvd.init()`` (here: after ``hvd.shutdown()``) says to call ``hvd.init()``;
* bad arguments raise ``ValueError`` / ``TypeError`` naming the argument, before anything is sent,
  and a bad call on one rank only does not desynchronize the generated names of later ops;
* an op whose Gloo call fails while it executes raises ``HorovodInternalError`` instead of hanging.

Every worker function catches the errors itself and returns them, so ``run`` returns normally.
"""

from __future__ import annotations

import sys
import time

import pytest
import ray.cloudpickle

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

#: A mismatch is found within a round or two of negotiation; generous for a loaded 2-core machine.
BOUND_S = 10.0
#: An error found before anything is sent (bad argument, not initialized, engine already broken).
QUICK_S = 3.0


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"np{n}")
def ex(request, ray_local):
    """One executor per size. A stall becomes an error after 6 s, so a desync fails instead of hanging."""
    from hvdray import RayExecutor

    settings = RayExecutor.create_settings(
        timeout_s=30, placement_group_timeout_s=60, stall_warning_s=4, stall_shutdown_s=6
    )
    executor = RayExecutor(settings, num_workers=request.param)
    executor.start()
    try:
        yield executor
    finally:
        executor.shutdown()


def _attempt(fn):
    """(exception type name, message, seconds) of calling ``fn``; type ``None`` when it succeeded."""
    started = time.monotonic()
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return type(exc).__name__, str(exc), time.monotonic() - started, exc
    return None, "", time.monotonic() - started, None


# -- mismatches across ranks ----------------------------------------------------------------------
def _mismatches():
    import torch

    import hvdray.torch as hvd

    hvd.init()
    torch.set_num_threads(1)
    odd = hvd.rank() == hvd.size() - 1  # the last rank disagrees with the others
    cases = {
        "mm.shape": lambda: hvd.allreduce(torch.ones(4 if odd else 3), name="mm.shape"),
        "mm.dtype": lambda: hvd.allreduce(torch.ones(3, dtype=torch.float64 if odd else torch.float32),
                                          name="mm.dtype"),
        "mm.kind": lambda: (hvd.broadcast(torch.ones(3), 0, name="mm.kind") if odd
                            else hvd.allreduce(torch.ones(3), name="mm.kind")),
        "mm.redop": lambda: hvd.allreduce(torch.ones(3), name="mm.redop", op=hvd.Max if odd else hvd.Sum),
        "mm.root": lambda: hvd.broadcast(torch.ones(3), 1 if odd else 0, name="mm.root"),
        "mm.scale": lambda: hvd.allreduce(torch.ones(3), name="mm.scale", prescale_factor=2.0 if odd else 1.0),
        "mm.agdims": lambda: hvd.allgather(torch.ones(2, 4 if odd else 3), name="mm.agdims"),
        "mm.agrank": lambda: hvd.allgather(torch.ones(2, 3, 1) if odd else torch.ones(2, 3), name="mm.agrank"),
        "mm.rs": lambda: hvd.reducescatter(torch.ones(5 if odd else 6, 2), name="mm.rs"),
        "mm.a2a": lambda: hvd.alltoall(torch.ones(hvd.size()), splits=[1] * hvd.size() if odd else None,
                                       name="mm.a2a"),
        "mm.grouped": lambda: hvd.grouped_allreduce([torch.ones(2), torch.ones(3 if odd else 2)], name="mm.grouped"),
    }
    out = {}
    for key, call in cases.items():
        kind, message, took, exc = _attempt(call)
        out[key] = (kind, message, took, isinstance(exc, hvd.TensorMismatchError), isinstance(exc, ValueError))
    # async: the error comes out of synchronize, not out of the call that submitted the op
    handle = hvd.allreduce_async(torch.ones(5 if odd else 6), name="mm.async")
    kind, message, took, exc = _attempt(lambda: hvd.synchronize(handle))
    out["mm.async"] = (kind, message, took, isinstance(exc, hvd.TensorMismatchError), True)
    # the ring still works, with generated names too
    out["after"] = hvd.allreduce(torch.ones(2), op=hvd.Sum)
    return out


def test_mismatch_raises_the_same_clear_error_on_every_rank(ex):
    size = ex.num_workers
    started = time.monotonic()
    results = ex.run(_mismatches)
    assert time.monotonic() - started < 2 * BOUND_S
    words = {
        "mm.shape": "shape", "mm.dtype": "dtype", "mm.kind": "operation", "mm.redop": "reduction op",
        "mm.root": "root_rank", "mm.scale": "prescale_factor", "mm.agdims": "shape", "mm.agrank": "shape",
        "mm.rs": "shape", "mm.a2a": "splits", "mm.grouped": "shape", "mm.async": "shape",
    }
    for key, word in words.items():
        name = "mm.grouped.1" if key == "mm.grouped" else key
        messages = set()
        for rank, out in enumerate(results):
            kind, message, took, is_mismatch, is_value_error = out[key]
            assert kind == "TensorMismatchError" and is_mismatch and is_value_error, (
                f"{key} on rank {rank}: {kind}: {message}"
            )
            assert repr(name) in message, f"{key}: the message does not name the tensor: {message}"
            assert word in message, f"{key}: {message}"
            assert took < BOUND_S, f"{key} took {took:.1f} s on rank {rank}"
            messages.add(message)
        assert len(messages) == 1, f"{key}: the ranks raised different messages: {messages}"
    for out in results:
        assert out["after"].tolist() == [float(size)] * 2


# -- before hvd.init() ----------------------------------------------------------------------------
def _before_init():
    import torch

    import hvdray.torch as hvd

    hvd.init()
    hvd.shutdown()
    initialized = hvd.is_initialized()
    cases = {
        "allreduce": lambda: hvd.allreduce(torch.ones(2)),
        "allreduce_named": lambda: hvd.allreduce(torch.ones(2), name="early"),
        "allreduce_async": lambda: hvd.allreduce_async(torch.ones(2)),
        "grouped_allreduce": lambda: hvd.grouped_allreduce([torch.ones(2)]),
        "allgather": lambda: hvd.allgather(torch.ones(2)),
        "broadcast": lambda: hvd.broadcast(torch.ones(2), 0),
        "alltoall": lambda: hvd.alltoall(torch.ones(2)),
        "reducescatter": lambda: hvd.reducescatter(torch.ones(2)),
        "barrier": hvd.barrier,
        "join": hvd.join,
        "rank": hvd.rank,
        "size": hvd.size,
        "broadcast_object": lambda: hvd.broadcast_object(1),
        "allgather_object": lambda: hvd.allgather_object(1),
    }
    out = {}
    for key, call in cases.items():
        kind, message, took, exc = _attempt(call)
        out[key] = (kind, message, took, isinstance(exc, hvd.NotInitializedError))
    hvd.init()  # later tests (and the ring) work again
    out["after"] = (hvd.is_initialized(), hvd.allreduce(torch.ones(2), op=hvd.Sum, name="after.reinit"))
    return initialized, out


def test_op_before_init_says_to_call_init(ex):
    size = ex.num_workers
    for initialized, out in ex.run(_before_init):
        assert not initialized
        for key, value in out.items():
            if key == "after":
                continue
            kind, message, took, is_not_init = value
            assert kind == "NotInitializedError" and is_not_init, f"{key}: {kind}: {message}"
            assert "hvd.init()" in message, f"{key}: {message}"
            assert took < QUICK_S, f"{key} took {took:.2f} s"
        reinitialized, after = out["after"]
        assert reinitialized and after.tolist() == [float(size)] * 2


# -- bad arguments --------------------------------------------------------------------------------
def _bad_arguments(only_rank_zero):
    import numpy as np
    import torch

    import hvdray.torch as hvd

    hvd.init()
    torch.set_num_threads(1)
    n = hvd.size()
    i16 = torch.ones(2, dtype=torch.int16)
    cases = {
        "int16": lambda: hvd.allreduce(i16),
        "int16_named": lambda: hvd.allreduce(i16, name="w"),
        "int16_async_": lambda: hvd.allreduce_async_(i16),
        "int16_sparse_allgather": lambda: hvd.allgather(i16.to_sparse()),
        "int16_reducescatter": lambda: hvd.reducescatter(i16),
        "int16_grouped": lambda: hvd.grouped_allreduce([torch.ones(2), i16]),
        "root_high": lambda: hvd.broadcast(torch.ones(2), n),
        "root_negative": lambda: hvd.broadcast_async_(torch.ones(2), -1),
        "root_type": lambda: hvd.broadcast(torch.ones(2), "0"),
        "root_object": lambda: hvd.broadcast_object({"a": 1}, root_rank=n),
        "list": lambda: hvd.allreduce([1.0, 2.0]),
        "ndarray": lambda: hvd.allreduce_async(np.ones(2)),
        "none_allgather": lambda: hvd.allgather(None),
        "none_broadcast": lambda: hvd.broadcast(None, 0),
        "grouped_item": lambda: hvd.grouped_allreduce([torch.ones(2), "x"]),
        "grouped_empty": lambda: hvd.grouped_allreduce([]),
        "prescale_bool": lambda: hvd.allreduce(torch.ones(2, dtype=torch.bool), op=hvd.Max, prescale_factor=2.0),
        "postscale_type": lambda: hvd.allreduce(torch.ones(2), postscale_factor="2"),
        "op": lambda: hvd.allreduce(torch.ones(2), op="median"),
        "op_and_average": lambda: hvd.allreduce(torch.ones(2), average=True, op=hvd.Sum),
        "bool_average": lambda: hvd.allreduce(torch.ones(2, dtype=torch.bool)),
        "bool_grouped_product": lambda: hvd.grouped_allreduce([torch.ones(2, dtype=torch.bool)], op=hvd.Product),
        "splits_sum": lambda: hvd.alltoall(torch.ones(n + 1), splits=[1] * n),
        "splits_len": lambda: hvd.alltoall(torch.ones(n), splits=[1] * (n + 1)),
        "splits_type": lambda: hvd.alltoall(torch.ones(n), splits="1"),
        "scalar_allgather": lambda: hvd.allgather(torch.tensor(1.0)),
        "scalar_reducescatter": lambda: hvd.reducescatter(torch.tensor(1.0)),
        "rs_product": lambda: hvd.reducescatter(torch.ones(n), op=hvd.Product),
        "name": lambda: hvd.allreduce(torch.ones(2), name=""),
        "handle": lambda: hvd.synchronize("not a handle"),
    }
    if n > 1:
        cases["alltoall_uneven"] = lambda: hvd.alltoall(torch.ones(n + 1))
    out = {}
    if not only_rank_zero or hvd.rank() == 0:
        for key, call in cases.items():
            kind, message, took, exc = _attempt(call)
            out[key] = (kind, message, took)
    # every rank, bad calls or not, now runs ops with generated names: they must still match
    started = time.monotonic()
    out["after"] = [
        hvd.allreduce(torch.ones(2), op=hvd.Sum),
        hvd.allgather(torch.ones(1)),
        hvd.broadcast(torch.ones(1), 0),
        hvd.reducescatter(torch.ones(n)),
        hvd.alltoall(torch.ones(n)),
        torch.tensor(hvd.allgather_object(1)),
        torch.tensor([hvd.broadcast_object(2)]),
    ]
    out["after_took"] = time.monotonic() - started
    return out


EXPECTED = {
    # key: (exception type, words the message must contain)
    "int16": ("ValueError", ["tensor", "int16"]),
    "int16_named": ("ValueError", ["'w'", "int16"]),
    "int16_async_": ("ValueError", ["tensor", "int16"]),
    "int16_sparse_allgather": ("ValueError", ["tensor", "sparse"]),
    "int16_reducescatter": ("ValueError", ["tensor", "int16"]),
    "int16_grouped": ("ValueError", ["tensors[1]", "int16"]),
    "root_high": ("ValueError", ["root_rank"]),
    "root_negative": ("ValueError", ["root_rank"]),
    "root_type": ("TypeError", ["root_rank"]),
    "root_object": ("ValueError", ["root_rank"]),
    "list": ("TypeError", ["tensor", "torch.Tensor"]),
    "ndarray": ("TypeError", ["tensor", "torch.Tensor"]),
    "none_allgather": ("TypeError", ["tensor"]),
    "none_broadcast": ("TypeError", ["tensor"]),
    "grouped_item": ("TypeError", ["tensors[1]"]),
    "grouped_empty": ("ValueError", ["tensors"]),
    "prescale_bool": ("ValueError", ["prescale_factor", "bool"]),
    "postscale_type": ("TypeError", ["postscale_factor"]),
    "op": ("ValueError", ["op"]),
    "op_and_average": ("ValueError", ["average"]),
    "bool_average": ("ValueError", ["bool"]),
    "bool_grouped_product": ("ValueError", ["tensors[0]", "bool"]),
    "splits_sum": ("ValueError", ["splits"]),
    "splits_len": ("ValueError", ["splits"]),
    "splits_type": ("TypeError", ["splits"]),
    "scalar_allgather": ("ValueError", ["scalar"]),
    "scalar_reducescatter": ("ValueError", ["scalar"]),
    "rs_product": ("UnsupportedReductionError", ["product"]),  # a RuntimeError (Horovod's type) and a ValueError
    "name": ("ValueError", ["name"]),
    "handle": ("TypeError", ["handle"]),
    "alltoall_uneven": ("ValueError", ["divisible"]),
}


def _check_after(out, size):
    assert out["after_took"] < BOUND_S, f"ops after the bad calls took {out['after_took']:.1f} s"
    ar, ag, bc, rs, a2a, objs, obj = out["after"]
    assert ar.tolist() == [float(size)] * 2
    assert ag.tolist() == [1.0] * size
    assert bc.tolist() == [1.0]
    assert rs.tolist() == [1.0]
    assert a2a.tolist() == [1.0] * size
    assert objs.tolist() == [1] * size and obj.tolist() == [2]


def test_bad_arguments_raise_naming_the_argument(ex):
    size = ex.num_workers
    for rank, out in enumerate(ex.run(_bad_arguments, args=[False])):
        for key, value in out.items():
            if key.startswith("after"):
                continue
            kind, message, took = value
            expected_kind, words = EXPECTED[key]
            assert kind == expected_kind, f"{key} on rank {rank}: {kind}: {message}"
            for word in words:
                assert word in message, f"{key}: {word!r} not in {message!r}"
            assert took < QUICK_S, f"{key} took {took:.2f} s"
        _check_after(out, size)


def test_bad_call_on_one_rank_keeps_generated_names_in_step(ex):
    """A rank that catches its own bad-argument error stays in step with the others' unnamed ops."""
    size = ex.num_workers
    results = ex.run(_bad_arguments, args=[True])
    assert len(results[0]) > 2 and all(set(out) == {"after", "after_took"} for out in results[1:])
    for out in results:
        _check_after(out, size)


# -- an op whose execution fails ------------------------------------------------------------------
def _failing_execution():
    import torch

    import hvdray.torch as hvd
    from hvdray.collective import session

    hvd.init()
    torch.set_num_threads(1)
    submit = {
        "allreduce": lambda: hvd.allreduce_async(torch.ones(3), name="boom.allreduce"),
        "broadcast": lambda: hvd.broadcast_async(torch.ones(3), 0, name="boom.broadcast"),
        "allgather": lambda: hvd.allgather_async(torch.ones(2), name="boom.allgather"),
    }
    out = {}
    for primitive, call in submit.items():
        # every rank's transport call fails once the op has been negotiated (no rank waits on a peer); the
        # engine moves a single tensor out of place with the *_into forms. Only the op's own data (float32)
        # fails: the engine's control round gathers its messages with the same allgather (int64 lengths,
        # uint8 bytes), and a peer's round may reach this rank before its own op does
        comm = session.engine().comm
        for method in (primitive, f"{primitive}_into"):
            if hasattr(comm, method):
                def boom(tensor, *args, primitive=primitive, passed=getattr(comm, method), **kwargs):
                    if tensor.dtype != torch.float32:
                        return passed(tensor, *args, **kwargs)
                    raise RuntimeError(f"injected {primitive} failure")

                setattr(comm, method, boom)
        handle = call()
        deadline = time.monotonic() + BOUND_S
        while not hvd.poll(handle) and time.monotonic() < deadline:
            time.sleep(0.01)
        if hvd.poll(handle):
            kind, message, _, exc = _attempt(lambda: hvd.synchronize(handle))
            is_internal = isinstance(exc, hvd.HorovodInternalError)
        else:
            kind, message, is_internal = "hung", f"still pending after {BOUND_S} s", False
        later = _attempt(lambda: hvd.allreduce(torch.ones(1), name=f"boom.later.{primitive}"))
        out[primitive] = (kind, message, is_internal, later[0], later[2])
        hvd.shutdown()
        hvd.init()
    out["after"] = hvd.allreduce(torch.ones(2), op=hvd.Sum, name="boom.after")
    return out


def test_op_failing_during_execution_raises_instead_of_hanging(ex):
    """The ops being executed when the ring breaks get the error too (and every later op at once)."""
    size = ex.num_workers
    for rank, out in enumerate(ex.run(_failing_execution)):
        for primitive in ("allreduce", "broadcast", "allgather"):
            kind, message, is_internal, later_kind, later_took = out[primitive]
            assert kind == "HorovodInternalError" and is_internal, f"{primitive} on rank {rank}: {kind}: {message}"
            assert f"injected {primitive} failure" in message
            assert later_kind == "HorovodInternalError" and later_took < QUICK_S
        assert out["after"].tolist() == [float(size)] * 2


def _unpicklable_objects():
    import threading

    import hvdray.torch as hvd

    hvd.init()
    started = time.monotonic()
    errors = []
    lock = threading.Lock()  # locks cannot be pickled
    try:
        hvd.broadcast_object(lock if hvd.rank() == 0 else None, root_rank=0, name="cfg")
    except ValueError as exc:
        errors.append(str(exc))
    try:
        hvd.allgather_object(lock if hvd.rank() == hvd.size() - 1 else hvd.rank(), name="parts")
    except ValueError as exc:
        errors.append(str(exc))
    after = hvd.allgather_object(hvd.rank())  # the ring still works
    return errors, after, time.monotonic() - started


def test_unpicklable_object_raises_on_every_rank_instead_of_hanging(ex):
    size = len(ex.run(lambda: 0))
    for errors, after, took in ex.run(_unpicklable_objects):
        assert len(errors) == 2
        assert "'cfg'" in errors[0] and "root rank 0 could not pickle" in errors[0]
        assert "'parts'" in errors[1] and f"[{size - 1}]" in errors[1]
        assert after == list(range(size))
        assert took < 10
