"""The declared op surface (collective/surface.py) and the frontend namespaces built from it."""

from __future__ import annotations

import inspect

import pytest
import torch

import hvdray.torch as hvd
from hvdray.collective import surface
from hvdray.collective.surface import Form
from hvdray.torch import ops as torch_ops


def test_names_follow_each_ops_declared_forms():
    assert surface.names([Form.BLOCKING], ["allreduce", "barrier"]) == ["allreduce", "barrier"]
    assert surface.names(surface.ALL_FORMS, ["allreduce", "allgather", "join"]) == [
        "allreduce", "allreduce_async", "allreduce_", "allreduce_async_", "allgather", "allgather_async", "join",
    ]
    assert surface.names([Form.INPLACE_ASYNC]) == ["allreduce_async_", "grouped_allreduce_async_", "broadcast_async_"]
    assert set(surface.REDUCE_OPS) == {"Average", "Sum", "Min", "Max", "Product", "Adasum"}


def test_forms_builds_one_named_documented_function_per_form():
    def build(form: Form):
        def op(x: int, scale: int = 1) -> tuple:
            """Scale ``x``."""
            return (x * scale, form.inplace, form.blocking)

        return op

    blocking_inplace, inplace_async = surface.forms("allreduce", build, Form.INPLACE, Form.INPLACE_ASYNC)
    assert (blocking_inplace.__name__, inplace_async.__qualname__) == ("allreduce_", "allreduce_async_")
    assert blocking_inplace(2, 3) == (6, True, True) and inplace_async(2) == (2, True, False)
    assert blocking_inplace.__doc__.startswith("Scale ``x``. The result is written into the input")
    assert inspect.signature(blocking_inplace) == inspect.signature(inplace_async)
    with pytest.raises(ValueError, match="barrier has no async form"):
        surface.forms("barrier", build, Form.ASYNC)


def test_the_torch_frontend_offers_every_form_with_one_signature_per_op():
    assert set(surface.names(surface.ALL_FORMS)) <= set(hvd.__all__)
    for op in ("allreduce", "grouped_allreduce"):
        async_, inplace, inplace_async = (getattr(hvd, op + form.value) for form in surface.ALL_FORMS[1:])
        assert inspect.signature(async_) == inspect.signature(inplace) == inspect.signature(inplace_async)
        assert [async_.__name__, inplace.__name__, inplace_async.__name__] == [
            op + "_async", op + "_", op + "_async_",
        ]
        assert async_.__module__ == "hvdray.torch.ops"
    assert list(inspect.signature(hvd.allreduce_async_).parameters) == [
        "tensor", "average", "name", "op", "prescale_factor", "postscale_factor", "process_set",
    ]
    assert list(inspect.signature(hvd.broadcast_async_).parameters) == ["tensor", "root_rank", "name", "process_set"]
    assert sorted(torch_ops.__all__) == sorted(
        [*surface.names(surface.ALL_FORMS), *surface.REDUCE_OPS, "ReduceOp", "poll", "synchronize",
         "sparse_allreduce_async"]
    )
    # Horovod's argument order, for callers that pass process_set positionally
    assert list(inspect.signature(hvd.broadcast_async).parameters) == ["tensor", "root_rank", "name", "process_set"]
    assert list(inspect.signature(hvd.reducescatter_async).parameters) == [
        "tensor", "name", "op", "process_set", "prescale_factor", "postscale_factor",
    ]


def test_the_torch_forms_reduce_in_place_or_into_a_new_tensor():
    hvd.init()
    try:
        x = torch.ones(3)
        new = hvd.synchronize(hvd.allreduce_async(x, op=hvd.Sum, name="surface.a"))
        assert torch.equal(new, x) and new is not x
        assert hvd.allreduce_(x, op=hvd.Sum, name="surface.b") is x
        assert hvd.synchronize(hvd.allreduce_async_(x, op=hvd.Sum, name="surface.c")) is x
        pair = [torch.ones(2), torch.zeros(2)]
        assert all(a is b for a, b in zip(hvd.grouped_allreduce_(pair, name="surface.d"), pair))
        assert all(a is not b for a, b in zip(hvd.synchronize(hvd.grouped_allreduce_async(pair)), pair))
        assert hvd.broadcast_(x, 0, name="surface.e") is x
        assert hvd.synchronize(hvd.broadcast_async_(x, 0)) is x
    finally:
        hvd.shutdown()


def test_the_tensorflow_frontend_offers_the_blocking_forms():
    tf_ops = pytest.importorskip("hvdray.tensorflow.ops")
    assert sorted(tf_ops.__all__) == sorted([*surface.names([Form.BLOCKING]), *surface.REDUCE_OPS, "ReduceOp"])
