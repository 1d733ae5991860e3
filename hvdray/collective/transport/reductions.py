"""How each reduction is named on the way to a strategy and computed by the ones that reduce themselves.

The engine speaks hvdray's :class:`~hvdray.collective.protocol.ReduceOp`; the strategies receive the
op as :data:`TRANSPORT_OPS` maps it: Gloo's reduction for the elementwise ones (averaging is a sum
here: the engine divides afterwards) and hvdray's ``ADASUM`` itself, which is no Gloo op. Strategies
that reduce in this process (shared memory, Gloo's small-message gather) use torch's elementwise op
for each Gloo reduction (:data:`REDUCERS`), and numpy's where they reduce a message block by block
(:func:`block_operands`).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence, Union

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


def unowned(tensor: torch.Tensor) -> torch.Tensor:
    """The contiguous ``tensor``'s memory as a 1-D tensor of its dtype that does not keep that memory alive (it
    stands on the address, as :func:`block_operands`' numpy views do): for operands kept from one op to the next
    (``pages_collectives.py``'s plans), which must hold nothing of this rank's. A plan that held a rank's output
    would keep it from ever going back to the output pool (every such op would then take fresh memory, and up to
    a plan's worth of outputs would stay alive); one that held its tensor, the tensor's moved pages. Valid only
    while the caller holds ``tensor``; the plans' keys are the addresses and sizes for that reason."""
    nbytes = tensor.numel() * tensor.element_size()
    raw = np.asarray(_RawMemory(tensor.data_ptr(), nbytes, np.dtype(np.uint8)))
    return torch.from_numpy(raw).view(tensor.dtype)


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


#: the dtypes whose blocks :class:`Scale` scales with numpy (torch's bits: ``tests/unit/test_engine_parts.py``).
#: Not float16: torch's division of it by a size that is not a power of two rounds otherwise than numpy's.
_NUMPY_SCALED = frozenset({np.dtype("float32"), np.dtype("float64")})


class Scale:
    """Averaging's division over ``size`` ranks (``average``) and a postscale ``factor``, run in place on
    reduced data: the engine's finish of an allreduce, which the transport runs on each rank's reduced part
    before the peers copy it (:data:`~hvdray.collective.transport.strategy.Finish`), and of a reducescatter.

    An integer average rounds toward zero, as Horovod's (its torch ops divide so; its core scales integers
    by 1/size in double and converts back, which truncates too). A float average without a postscale
    factor divides by the size: the correctly rounded quotient, as Horovod's scaling by 1/size in double
    gives, where multiplying by 1/size in the tensor's own precision is one ulp off for about a third of
    the elements when the size is not a power of two. When it is, 1/size is exact in every float dtype and
    the product is that same quotient, at about twice a division's speed (a division is the slowest part
    of a fused step's reduction while its data is in the cache).

    Called on a list of tensors (one dtype); :meth:`on_block` takes one block of :func:`block_operands`'
    own, which a float32 or float64 one it scales with numpy: the same bits at a fraction of the cost of
    turning it back into a tensor for torch's op (tens of microseconds a block with the cache busy)."""

    __slots__ = ("size", "average", "factor", "_scaling")

    def __init__(self, size: int, average: bool, factor: float = 1.0) -> None:
        self.size, self.average, self.factor = size, average, factor
        # what a float is scaled by (numpy's ufunc names it: a multiplication or a division) and the
        # operand; None: nothing to do to a float (an integer average divides toward zero all the same)
        self._scaling: Optional[tuple[np.ufunc, float]] = None
        if average and factor == 1.0:
            if size & (size - 1) == 0:  # a power of two (1 included: nothing to scale)
                self._scaling = (np.multiply, 1.0 / size) if size != 1 else None
            else:
                self._scaling = (np.true_divide, float(size))
        else:
            scale = factor / size if average else factor
            self._scaling = (np.multiply, scale) if scale != 1.0 else None

    def __repr__(self) -> str:
        return f"Scale(size={self.size}, average={self.average}, factor={self.factor})"

    def __call__(self, bufs: list[torch.Tensor]) -> None:
        if self.average and not bufs[0].is_floating_point():
            if self.size != 1:
                for buf in bufs:
                    buf.div_(self.size, rounding_mode="trunc")
            return
        if self._scaling is None:
            return
        ufunc, operand = self._scaling
        if ufunc is np.true_divide:
            torch._foreach_div_(bufs, operand)
        elif bufs[0].is_floating_point():
            torch._foreach_mul_(bufs, operand)
        else:
            for buf in bufs:
                buf.mul_(operand)

    def on_block(self, block: Operand) -> None:
        """Scale one block of :func:`block_operands`' (a numpy view or a tensor) in place, inside
        ``numpy.errstate(all="ignore")`` as its reducer."""
        if isinstance(block, np.ndarray):
            if block.dtype in _NUMPY_SCALED:
                if self._scaling is not None:
                    ufunc, operand = self._scaling
                    ufunc(block, operand, out=block)
                return
            block = torch.as_tensor(block)
        self([block])


def finish_block(finish: Callable[[list[torch.Tensor]], None], block: Operand) -> None:
    """Run an allreduce's ``finish`` on one block of :func:`block_operands`' (a numpy view or a tensor): a
    :class:`Scale` by :meth:`Scale.on_block`, any other on the block as a tensor."""
    if isinstance(finish, Scale):
        finish.on_block(block)
    else:
        finish([torch.as_tensor(block) if isinstance(block, np.ndarray) else block])
