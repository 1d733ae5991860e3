"""The reductions that the transports compute in this process: numpy's functions on views of the tensors
(``block_operands``) give torch's bits for every dtype and op they take, warn of nothing torch does not
warn of, and leave the tensors' storages as they were; the ops, dtypes and tensors numpy cannot take
keep torch's op."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from torch.distributed import ReduceOp

from hvdray.collective.transport.reductions import REDUCERS, block_operands, reduce_in_order

_N = 1 << 16


def _operands(dtype: torch.dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(_N, generator=generator) > 0.5
    if dtype.is_floating_point:
        # tiny to huge magnitudes (sums and products that overflow), with NaNs and infinities among them
        values = torch.randn(_N, generator=generator) * torch.logspace(-8, 8, _N)
        values[seed::997] = float("nan")
        values[seed + 3::991] = float("inf")
        values[seed + 5::983] = -float("inf")
        return values.to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, (_N,), generator=generator, dtype=dtype)  # sums that wrap around


_NUMPY_CASES = [
    (dtype, op)
    for dtype in (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
                  torch.float32, torch.float64)
    for op in (ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.BAND)
    if not (dtype.is_floating_point and op == ReduceOp.BAND)
]


@pytest.mark.parametrize("dtype,op", _NUMPY_CASES, ids=lambda case: str(case).replace("torch.", ""))
def test_numpy_blocks_give_torchs_bits(dtype, op):
    reducer = REDUCERS[op]
    first, second, third = (_operands(dtype, seed) for seed in (0, 1, 2))
    expected = reducer(reducer(first, second), third)
    out = torch.empty_like(first)
    reduce, (out_view, first_view, second_view, third_view) = block_operands(reducer, [out, first, second, third])
    assert isinstance(out_view, np.ndarray) and reduce is not reducer
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an overflow must not warn, as torch's does not
        with np.errstate(all="ignore"):
            for a in range(0, _N, 1000):  # in blocks, as the transports go
                b = min(a + 1000, _N)
                reduce_in_order(reduce, first_view[a:b], [second_view[a:b], third_view[a:b]], out_view[a:b])
    assert torch.equal(out.view(-1).view(torch.uint8), expected.view(-1).view(torch.uint8)), (dtype, op)
    for tensor in (out, first, second, third):
        assert tensor.untyped_storage().resizable()  # Tensor.numpy() would have made it unresizable for good
        tensor.untyped_storage().resize_(tensor.untyped_storage().nbytes() + 64)


def test_torch_keeps_what_numpy_cannot_view():
    add = REDUCERS[ReduceOp.SUM]
    for op in (ReduceOp.MIN, ReduceOp.MAX):  # numpy's NaNs (and float16's signed zeros) differ from torch's
        tensors = [torch.ones(8), torch.ones(8)]
        assert block_operands(REDUCERS[op], tensors) == (REDUCERS[op], tensors)
    for dtype in (torch.bfloat16, torch.complex64):  # numpy has no bfloat16, and multiplies complex numbers otherwise
        tensors = [torch.ones(8, dtype=dtype), torch.ones(8, dtype=dtype)]
        assert block_operands(add, tensors) == (add, tensors)
    negated = torch.ones(8)._neg_view()  # a tensor whose values read negated: its raw memory holds +1
    reduce, operands = block_operands(add, [torch.empty(8), negated])
    assert reduce is add and operands[1] is negated
    strided = torch.ones(16)[::2]
    assert block_operands(add, [strided, strided])[0] is add
    # averaging's division works on a block through torch.as_tensor, on the same memory
    out = torch.zeros(8)
    reduce, (view, ones) = block_operands(add, [out, torch.ones(8)])
    reduce(view[2:6], ones[2:6], out=view[2:6])
    torch.as_tensor(view[2:6]).div_(4)
    assert out.tolist() == [0, 0, 0.25, 0.25, 0.25, 0.25, 0, 0]


def test_empty_tensors_reduce_to_nothing():
    add = REDUCERS[ReduceOp.SUM]
    empty = torch.empty(0)
    reduce, (out, source) = block_operands(add, [empty, torch.empty(0)])
    reduce_in_order(reduce, source, [source], out)
    assert len(out) == 0
