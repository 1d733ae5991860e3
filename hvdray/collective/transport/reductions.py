"""How each reduction is named on the way to a strategy and computed by the ones that reduce themselves.

The engine speaks hvdray's :class:`~hvdray.collective.protocol.ReduceOp`; the strategies receive the
op as :data:`TRANSPORT_OPS` maps it: Gloo's reduction for the elementwise ones (averaging is a sum
here: the engine divides afterwards) and hvdray's ``ADASUM`` itself, which is no Gloo op. Strategies
that reduce in this process (shared memory, Gloo's small-message gather) use torch's elementwise op
for each Gloo reduction (:data:`REDUCERS`).
"""

from __future__ import annotations

from typing import Callable, Sequence, Union

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


def reduce_in_order(
    reducer: Callable[..., torch.Tensor], first: torch.Tensor, others: Sequence[torch.Tensor], out: torch.Tensor,
) -> torch.Tensor:
    """``out`` = ``first`` reduced with each of ``others`` in turn, left to right (``first`` may be ``out``;
    with no ``others``, a copy of ``first``). Every rank that reduces the same operands in the same order
    gets the same bits, whichever rank computed them: the strategies that reduce in this process keep to
    one order (local rank order) for that reason."""
    if not others:
        return out if first is out else out.copy_(first)
    reducer(first, others[0], out=out)
    for other in others[1:]:
        reducer(out, other, out=out)
    return out
