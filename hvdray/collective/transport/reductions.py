"""How each reduction is named on the way to a strategy and computed by the ones that reduce themselves.

The engine speaks hvdray's :class:`~hvdray.collective.protocol.ReduceOp`; the strategies receive the
op as :data:`TRANSPORT_OPS` maps it: Gloo's reduction for the elementwise ones (averaging is a sum
here: the engine divides afterwards) and hvdray's ``ADASUM`` itself, which is no Gloo op. Strategies
that reduce in this process (shared memory, Gloo's small-message gather) use torch's elementwise op
for each Gloo reduction (:data:`REDUCERS`), and numpy's where they reduce a message block by block
(:func:`block_operands`).
"""

from __future__ import annotations

from typing import Callable, Sequence, Union

import numpy as np
import torch
from torch.distributed import ReduceOp

from hvdray.collective.protocol import ReduceOp as Reduction

#: what an allreduce strategy is asked to compute: a Gloo reduction, or ``Reduction.ADASUM``
TransportOp = Union[ReduceOp.RedOpType, Reduction]

#: the Gloo reduction of each of hvdray's elementwise ones. Plain strings look up as well.
GLOO_OPS: dict[Reduction, ReduceOp.RedOpType] = {
    Reduction.SUM: ReduceOp.SUM,
    Reduction.AVERAGE: ReduceOp.SUM,
    Reduction.MIN: ReduceOp.MIN,
    Reduction.MAX: ReduceOp.MAX,
    Reduction.PRODUCT: ReduceOp.PRODUCT,
}

#: the op each of hvdray's reductions reaches the strategies as (see the module docstring)
TRANSPORT_OPS: dict[Reduction, TransportOp] = {**GLOO_OPS, Reduction.ADASUM: Reduction.ADASUM}

#: the elementwise torch op of each reduction
REDUCERS: dict[ReduceOp.RedOpType, Callable[..., torch.Tensor]] = {
    ReduceOp.SUM: torch.add,
    ReduceOp.PRODUCT: torch.mul,
    ReduceOp.MIN: torch.minimum,
    ReduceOp.MAX: torch.maximum,
    ReduceOp.BAND: torch.bitwise_and,
}

#: the in-place list form of each reduction, for fused tensors reduced straight in the caller's tensors
FOREACH_REDUCERS: dict[ReduceOp.RedOpType, Callable[..., None]] = {
    ReduceOp.SUM: torch._foreach_add_,
    ReduceOp.PRODUCT: torch._foreach_mul_,
    ReduceOp.MIN: torch._foreach_minimum_,
    ReduceOp.MAX: torch._foreach_maximum_,
}


#: numpy's function for those of :data:`REDUCERS` where it gives torch's bits (``tests/unit/test_reductions.py``).
#: Not the minimum and maximum: numpy's NaNs carry other bits than torch's, and its float16 minimum of
#: 0 and -0 is 0 where torch's is -0.
_UFUNCS: dict[Callable[..., torch.Tensor], np.ufunc] = {
    torch.add: np.add,
    torch.mul: np.multiply,
    torch.bitwise_and: np.bitwise_and,
}

#: numpy's dtype of each torch dtype that ``torch.from_numpy`` takes back (by name: not every torch has the
#: unsigned 16-64-bit ones). Not bfloat16 even where numpy knows one: TensorFlow's ml_dtypes registers a
#: bfloat16 with numpy, which torch does not take.
NUMPY_DTYPES: dict[torch.dtype, np.dtype] = {
    getattr(torch, name): np.dtype(name)
    for name in ("bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
                 "float16", "float32", "float64", "complex64", "complex128")
    if hasattr(torch, name)
}

#: the dtypes whose blocks go numpy's way: not complex numbers (numpy multiplies them otherwise, to other
#: bits), nor the unsigned 16-64-bit ones (torch reduces few of them; untested against numpy)
_NUMPY_REDUCED = frozenset({
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.float16, torch.float32, torch.float64,
})

#: a tensor, or a numpy view of one: what a reducer from :func:`block_operands` takes (and slices alike)
Operand = Union[torch.Tensor, np.ndarray]


class _RawMemory:
    """Memory at an address as numpy takes it (its array interface)."""

    __slots__ = ("__array_interface__",)

    def __init__(self, address: int, count: int, dtype: np.dtype) -> None:
        self.__array_interface__ = {"data": (address, False), "shape": (count,), "typestr": dtype.str, "version": 3}


def block_operands(
    reducer: Callable[..., torch.Tensor], tensors: Sequence[torch.Tensor],
) -> tuple[Callable[..., Operand], list[Operand]]:
    """``reducer`` (one of :data:`REDUCERS`) and the contiguous 1-D ``tensors`` (one dtype) as the operands of
    a reduction that goes block by block: numpy's function and numpy views of the tensors' memory where
    numpy has their dtype, else ``reducer`` and the tensors. Slicing an array and calling numpy costs a
    fraction of torch's per call, above all with the cache cold after the previous block's memory traffic
    (a 512 KiB block's add and three views: about 45 us against 155 us, warm 3 us against 18 us on the
    development machine), for the same bits; the loops themselves run at one speed.

    The views do not keep the tensors' memory alive (the caller holds the tensors while it reduces), and
    leave their storages as they are (``Tensor.numpy()`` would mark them unresizable for good). Call the
    reducer inside ``numpy.errstate(all="ignore")``: torch's ops do not warn of an overflow either.
    ``torch.as_tensor`` turns a block back into a tensor on the same memory."""
    ufunc = _UFUNCS.get(reducer)
    dtype = NUMPY_DTYPES[tensors[0].dtype] if tensors and tensors[0].dtype in _NUMPY_REDUCED else None
    if ufunc is None or dtype is None or any(t.is_neg() or t.is_conj() or not t.is_contiguous() for t in tensors):
        return reducer, list(tensors)
    return ufunc, [np.asarray(_RawMemory(t.data_ptr(), t.numel(), dtype)) for t in tensors]


def reduce_in_order(
    reducer: Callable[..., Operand], first: Operand, others: Sequence[Operand], out: Operand,
) -> Operand:
    """``out`` = ``first`` reduced with each of ``others`` in turn, left to right (``first`` may be ``out``;
    with no ``others``, a copy of ``first``). Every rank that reduces the same operands in the same order
    gets the same bits, whichever rank computed them: the strategies that reduce in this process keep to
    one order (local rank order) for that reason. Tensors with a reducer of :data:`REDUCERS`, or numpy
    arrays with its numpy function (:func:`block_operands`)."""
    if not others:
        if first is not out:
            out[...] = first
        return out
    reducer(first, others[0], out=out)
    for other in others[1:]:
        reducer(out, other, out=out)
    return out
