"""What a strategy is: one way to run one collective, asked in turn whether it serves an op.

The communicator holds an ordered list of strategies per collective (``order.py``) and runs an op with
the first one whose ``serves`` answers yes. A strategy owns nothing: the communicator builds and closes
the groups and the node segment a strategy runs over. ``serves`` is called for every op, so it only
reads what it was given (sizes, the op, fields set at construction), and allocates nothing.
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar, Optional, Sequence, TypeVar

import torch

from hvdray.collective.transport.reductions import TransportOp

#: an elementwise in-place op on reduced data (averaging's scale), given a list of tensors
Finish = Callable[[list[torch.Tensor]], None]


class AllreduceStrategy:
    """Reduces a tensor in place across the ranks. The list puts ``AdasumAllreduce`` first, so every
    later entry sees elementwise Gloo reductions only."""

    #: what logs and :attr:`Communicator.strategies` call it
    name: ClassVar[str] = "allreduce"
    #: the largest list of tensors (in bytes) :meth:`run_tensors` takes as one message; 0: none
    fused_message_bytes: int = 0

    def serves(self, tensor: torch.Tensor, op: TransportOp) -> bool:
        """Whether this strategy runs the allreduce of ``tensor`` with ``op``."""
        raise NotImplementedError

    def reduce(self, tensor: torch.Tensor, op: TransportOp) -> None:
        """Reduce ``tensor`` in place across every rank (what :meth:`run` does before its ``finish``; a
        strategy that overrides :meth:`run` needs none)."""
        raise NotImplementedError

    def run(self, tensor: torch.Tensor, op: TransportOp, finish: Optional[Finish] = None) -> None:
        """Reduce ``tensor`` in place across every rank, then run ``finish`` (elementwise, in place, on a
        list of tensors: averaging's division) on the result. A strategy that can finish each rank's
        reduced part while it is in the core's cache, before the peers copy it, overrides this."""
        self.reduce(tensor, op)
        if finish is not None:
            finish([tensor])

    def run_into(
        self, source: torch.Tensor, output: torch.Tensor, op: TransportOp, finish: Optional[Finish] = None,
    ) -> None:
        """Reduce ``source`` across every rank into ``output`` (same shape and dtype, no overlap), then
        ``finish`` it as :meth:`run` does; a strategy that reads its input and writes its result in
        separate passes overrides this copy."""
        output.copy_(source)
        self.run(output, op, finish)

    def run_tensors(
        self, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor], op: TransportOp,
        finish: Optional[Finish], shapes: Optional[tuple[torch.Size, ...]],
    ) -> None:
        """Reduce ``inputs`` as one message into ``outputs`` (see ``Communicator.allreduce_tensors``)."""
        raise NotImplementedError(f"the {self.name} strategy takes no fused tensor lists")


class AllgatherStrategy:
    """Gathers an equal-shaped tensor from every rank."""

    name: ClassVar[str] = "allgather"

    def serves(self, tensor: torch.Tensor) -> bool:
        """Whether this strategy runs the allgather of ``tensor``."""
        raise NotImplementedError

    def run(self, tensor: torch.Tensor, out: torch.Tensor) -> None:
        """Write every rank's ``tensor``, in rank order, into the contiguous ``out`` of shape
        ``(size, *tensor.shape)`` (the caller's result: no copy after the gather)."""
        raise NotImplementedError


class BroadcastStrategy:
    """Makes every rank's tensor rank ``root``'s."""

    name: ClassVar[str] = "broadcast"

    def serves(self, tensor: torch.Tensor, root: int) -> bool:
        """Whether this strategy runs the broadcast of ``tensor`` from ``root``."""
        raise NotImplementedError

    def run(self, tensor: torch.Tensor, root: int) -> None:
        """Overwrite ``tensor`` in place with rank ``root``'s."""
        raise NotImplementedError


class ReducescatterStrategy:
    """Reduces equal chunks across the ranks, rank r keeping the reduced chunk r."""

    name: ClassVar[str] = "reducescatter"

    def serves(self, tensor: torch.Tensor, op: TransportOp) -> bool:
        """Whether this strategy runs the reducescatter of ``tensor`` with ``op``."""
        raise NotImplementedError

    def run(self, tensor: torch.Tensor, out: torch.Tensor, op: TransportOp) -> None:
        """Write into the contiguous ``out`` the reduction across every rank of chunk ``rank`` of the
        contiguous ``tensor`` (``size`` equal chunks along dim 0, each shaped as ``out``), which is read
        only (it may be the caller's own)."""
        raise NotImplementedError


_Strategy = TypeVar(
    "_Strategy", "AllreduceStrategy", "AllgatherStrategy", "BroadcastStrategy", "ReducescatterStrategy"
)


class NoStrategyError(RuntimeError):
    """No strategy in a list serves an op (a list must end with one that serves everything)."""


def first_serving(strategies: Sequence[_Strategy], tensor: torch.Tensor, *args: Any) -> _Strategy:
    """The first of ``strategies`` whose ``serves(tensor, *args)`` answers yes (the op's other arguments:
    a reduction's op, a broadcast's root); a list ends with an entry that serves everything."""
    for strategy in strategies:
        if strategy.serves(tensor, *args):
            return strategy
    names = [strategy.name for strategy in strategies]
    raise NoStrategyError(f"no strategy of {names} serves {args} on {_describe(tensor)}")


def _describe(tensor: torch.Tensor) -> str:
    return f"a {tensor.dtype} tensor of shape {tuple(tensor.shape)} on {tensor.device}"


def flat_view(tensor: torch.Tensor) -> torch.Tensor:
    """The contiguous ``tensor`` as a 1-D tensor: itself when it is one, else ``tensor.view(-1)``. A view is
    a new tensor, and making one costs tens of microseconds with the cache cold after a large op."""
    return tensor if tensor.dim() == 1 else tensor.view(-1)


def on_contiguous(tensor: torch.Tensor, fn: Callable[[torch.Tensor], None]) -> None:
    """Run ``fn`` on a flat view of ``tensor`` (or of a contiguous copy, written back afterwards)."""
    if tensor.is_contiguous():
        fn(flat_view(tensor))
    else:
        flat = tensor.contiguous().view(-1)
        fn(flat)
        tensor.copy_(flat.view(tensor.shape))
