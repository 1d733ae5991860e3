"""``hvdray.torch`` ops: horovod.torch's signatures, with autograd, over the collective layer.

Every op of :mod:`hvdray.collective.surface` in each of its forms. The blocking form of a
differentiable op is written here with its autograd function; an op's other forms share one body,
built per form by ``surface.forms`` (``_allreduce_form`` ...); an async form that is the collective
layer's own function (``allgather_async`` ...) is that function.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

from hvdray.collective import ops as _c
from hvdray.collective import surface
from hvdray.collective.basics import rank
from hvdray.collective.compression import Compression
from hvdray.collective.ops import (  # noqa: F401 - re-exported
    Adasum,
    Average,
    Max,
    Min,
    Product,
    ReduceOp,
    Sum,
    poll,
    synchronize,
)
from hvdray.collective.process_sets import ProcessSet, global_process_set
from hvdray.collective.surface import Form

#: every op of the surface in each of its forms, the reduce ops and the handle functions
__all__ = [
    *surface.names(surface.ALL_FORMS), *surface.REDUCE_OPS, "ReduceOp", "poll", "synchronize", "sparse_allreduce_async",
]


def _records(tensors: Sequence[Any]) -> bool:
    """Whether autograd records an op on ``tensors``: only then does a differentiable op go through its
    Function (a metric's, a buffer's or a parameter broadcast's op skips it), whose call costs about 5 us
    warm on the development machine and 15-25 us of a small blocking op between two ranks (a probe:
    docs/performance_bandwidth.md)."""
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


# -- allreduce -----------------------------------------------------------------------------------
def _allreduce_form(form: Form) -> Callable[..., Any]:
    inplace, blocking = form.inplace, form.blocking

    def allreduce(
        tensor: torch.Tensor,
        average: Optional[bool] = None,
        name: Optional[str] = None,
        op: Optional[ReduceOp] = None,
        prescale_factor: float = 1.0,
        postscale_factor: float = 1.0,
        process_set: ProcessSet = global_process_set,
    ) -> Any:
        """Reduce ``tensor`` across ranks (Average unless ``op`` says otherwise)."""
        return (_c.call_blocking if blocking else _c.call_async)(
            _c.allreduce_async, tensor, name, _c.resolve_op(op, average), prescale_factor, postscale_factor,
            output=tensor if inplace else None, process_set=process_set,
        )

    return allreduce


allreduce_async, allreduce_, allreduce_async_ = surface.forms(
    "allreduce", _allreduce_form, Form.ASYNC, Form.INPLACE, Form.INPLACE_ASYNC
)


def _allreduce_now(tensor: torch.Tensor, name: Optional[str], op: ReduceOp, pre: float, post: float, ps: Any) -> torch.Tensor:
    return _c.call_blocking(_c.allreduce_async, tensor, name, op, pre, post, process_set=ps)


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: Optional[str], op: ReduceOp, pre: float, post: float, ps: Any):
        ctx.args = (op, pre, post, ps)
        return _allreduce_now(tensor, name, op, pre, post, ps)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        op, pre, post, ps = ctx.args
        if op not in (Average, Sum):
            raise RuntimeError(f"allreduce with op={op.name.lower()} has no gradient; use Sum or Average")
        reduced = _c.call_blocking(_c.allreduce_async, grad.contiguous(), None, op, pre, post, process_set=ps)
        return reduced, None, None, None, None, None


def allreduce(
    tensor: torch.Tensor,
    average: Optional[bool] = None,
    name: Optional[str] = None,
    compression: Any = Compression.none,
    op: Optional[ReduceOp] = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """Reduce ``tensor`` across ranks (Average unless ``op`` says otherwise); differentiable."""
    _c.check_tensor(tensor, name=name)
    compressed, cctx = compression.compress(tensor)
    args = (compressed, name, _c.resolve_op(op, average), prescale_factor, postscale_factor, process_set)
    reduced = _Allreduce.apply(*args) if _records((compressed,)) else _allreduce_now(*args)
    return compression.decompress(reduced, cctx)


def _grouped_allreduce_form(form: Form) -> Callable[..., Any]:
    inplace, blocking = form.inplace, form.blocking

    def grouped_allreduce(
        tensors: Sequence[torch.Tensor],
        average: Optional[bool] = None,
        name: Optional[str] = None,
        op: Optional[ReduceOp] = None,
        prescale_factor: float = 1.0,
        postscale_factor: float = 1.0,
        process_set: ProcessSet = global_process_set,
    ) -> Any:
        """Reduce a list of tensors together (fused by the engine)."""
        return (_c.call_blocking if blocking else _c.call_async)(
            _c.grouped_allreduce_async, tensors, name, _c.resolve_op(op, average), prescale_factor,
            postscale_factor, inplace=inplace, process_set=process_set,
        )

    return grouped_allreduce


grouped_allreduce_async, grouped_allreduce_, grouped_allreduce_async_ = surface.forms(
    "grouped_allreduce", _grouped_allreduce_form, Form.ASYNC, Form.INPLACE, Form.INPLACE_ASYNC
)


def _grouped_allreduce_now(
    name: Optional[str], op: ReduceOp, pre: float, post: float, ps: Any, *tensors: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    return tuple(_c.call_blocking(_c.grouped_allreduce_async, list(tensors), name, op, pre, post, process_set=ps))


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, name: Optional[str], op: ReduceOp, pre: float, post: float, ps: Any, *tensors: torch.Tensor):
        ctx.args = (op, pre, post, ps)
        return _grouped_allreduce_now(name, op, pre, post, ps, *tensors)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor):
        op, pre, post, ps = ctx.args
        if op not in (Average, Sum):
            raise RuntimeError(f"grouped_allreduce with op={op.name.lower()} has no gradient; use Sum or Average")
        contiguous = [g.contiguous() for g in grads]
        reduced = _c.call_blocking(_c.grouped_allreduce_async, contiguous, None, op, pre, post, process_set=ps)
        return (None, None, None, None, None, *reduced)


def grouped_allreduce(
    tensors: Sequence[torch.Tensor],
    average: Optional[bool] = None,
    name: Optional[str] = None,
    compression: Any = Compression.none,
    op: Optional[ReduceOp] = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> list[torch.Tensor]:
    """Reduce a list of tensors together (fused); differentiable."""
    if not isinstance(tensors, (list, tuple)) or not tensors:
        raise ValueError("tensors must be a non-empty list of tensors")
    packed = [compression.compress(t) for t in tensors]
    compressed = [t for t, _ in packed]
    args = (name, _c.resolve_op(op, average), prescale_factor, postscale_factor, process_set, *compressed)
    reduced = _GroupedAllreduce.apply(*args) if _records(compressed) else _grouped_allreduce_now(*args)
    return [compression.decompress(t, cctx) for t, (_, cctx) in zip(reduced, packed)]


# -- allgather, broadcast, alltoall, reducescatter ---------------------------------------------------
allgather_async = _c.allgather_async


def _allgather_now(tensor: torch.Tensor, name: Optional[str], ps: Any) -> torch.Tensor:
    return _c.call_blocking(_c.allgather_async, tensor, name, ps)  # checks the argument first


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: Optional[str], ps: Any):
        gathered = _allgather_now(tensor, name, ps)
        ctx.rows, ctx.ps = tensor.shape[0], ps
        return gathered

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):  # Horovod's: the average of the ranks' gradients, this rank's rows
        ps = ctx.ps
        averaged = _c.call_blocking(_c.allreduce_async, grad.contiguous(), None, Average, process_set=ps)
        return _own_rows([averaged], [ctx.rows], ps)[0], None, None


def _own_rows(gathered: Sequence[torch.Tensor], rows: Sequence[int], ps: ProcessSet) -> list[torch.Tensor]:
    """This rank's slice of dim 0 of each allgathered ``gathered`` tensor, whose part here had ``rows`` rows."""
    counts = _c.call_blocking(_c.allgather_async, torch.tensor([rows], dtype=torch.int64), process_set=ps)
    offsets = counts[: ps.rank()].sum(dim=0).tolist()
    return [g.narrow(0, int(offset), n) for g, offset, n in zip(gathered, offsets, rows)]


def allgather(
    tensor: torch.Tensor, name: Optional[str] = None, process_set: ProcessSet = global_process_set
) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along dim 0 (first dimensions may differ); differentiable."""
    return (_Allgather.apply if _records((tensor,)) else _allgather_now)(tensor, name, process_set)


grouped_allgather_async = _c.grouped_allgather_async


def _grouped_allgather_now(name: Optional[str], ps: Any, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(_c.call_blocking(_c.grouped_allgather_async, list(tensors), name, ps))


class _GroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, name: Optional[str], ps: Any, *tensors: torch.Tensor):
        gathered = _grouped_allgather_now(name, ps, *tensors)
        ctx.rows, ctx.ps = [t.shape[0] for t in tensors], ps
        return gathered

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor):  # as allgather's, for each tensor of the group
        contiguous = [g.contiguous() for g in grads]
        averaged = _c.call_blocking(_c.grouped_allreduce_async, contiguous, None, Average, process_set=ctx.ps)
        return (None, None, *_own_rows(averaged, ctx.rows, ctx.ps))


def grouped_allgather(
    tensors: Sequence[torch.Tensor], name: Optional[str] = None, process_set: ProcessSet = global_process_set
) -> list[torch.Tensor]:
    """Allgather each of ``tensors`` (negotiated together); differentiable."""
    if not isinstance(tensors, (list, tuple)) or not tensors:
        raise ValueError("tensors must be a non-empty list of tensors")
    gather = _GroupedAllgather.apply if _records(tensors) else _grouped_allgather_now
    return list(gather(name, process_set, *tensors))


def _broadcast_form(form: Form) -> Callable[..., Any]:
    inplace, blocking = form.inplace, form.blocking

    def broadcast(
        tensor: torch.Tensor, root_rank: int, name: Optional[str] = None, process_set: ProcessSet = global_process_set
    ) -> Any:
        """Root's ``tensor`` (``root_rank`` is a global rank) on every rank."""
        return (_c.call_blocking if blocking else _c.call_async)(
            _c.broadcast_async, tensor, root_rank, name, inplace=inplace, process_set=process_set
        )

    return broadcast


broadcast_async, broadcast_, broadcast_async_ = surface.forms(
    "broadcast", _broadcast_form, Form.ASYNC, Form.INPLACE, Form.INPLACE_ASYNC
)


def _broadcast_now(tensor: torch.Tensor, root_rank: int, name: Optional[str], ps: Any) -> torch.Tensor:
    return _c.call_blocking(_c.broadcast_async, tensor, root_rank, name, process_set=ps)


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int, name: Optional[str], ps: Any):
        ctx.root_rank, ctx.ps = root_rank, ps
        return _broadcast_now(tensor, root_rank, name, ps)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):  # Horovod's: the ranks' average on the root, zeros elsewhere
        averaged = _c.call_blocking(_c.allreduce_async, grad.contiguous(), None, Average, process_set=ctx.ps)
        if rank() != ctx.root_rank:
            averaged.zero_()
        return averaged, None, None, None


def broadcast(
    tensor: torch.Tensor, root_rank: int, name: Optional[str] = None, process_set: ProcessSet = global_process_set
) -> torch.Tensor:
    """Root's ``tensor`` on every rank, as a new tensor; differentiable."""
    return (_Broadcast.apply if _records((tensor,)) else _broadcast_now)(tensor, root_rank, name, process_set)


alltoall_async = _c.alltoall_async  # result: (output, received_splits)


def _alltoall_now(tensor: torch.Tensor, splits: Any, name: Optional[str], ps: Any) -> tuple[torch.Tensor, torch.Tensor]:
    return _c.call_blocking(_c.alltoall_async, tensor, splits, name, ps)


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits: Any, name: Optional[str], ps: Any):
        output, received = _alltoall_now(tensor, splits, name, ps)
        ctx.received, ctx.ps = received, ps
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _received_grad: Any):
        back, _ = _c.call_blocking(_c.alltoall_async, grad.contiguous(), ctx.received, process_set=ctx.ps)
        return back, None, None, None


def alltoall(
    tensor: torch.Tensor, splits: Any = None, name: Optional[str] = None, process_set: ProcessSet = global_process_set
) -> Any:
    """Send slice i of dim 0 (``splits[i]`` rows, or equal parts) to rank i; differentiable.

    Returns the gathered tensor, and also the received splits when ``splits`` was given (Horovod's API).
    """
    output, received = (_Alltoall.apply if _records((tensor,)) else _alltoall_now)(tensor, splits, name, process_set)
    return (output, received) if splits is not None else output


def reducescatter_async(
    tensor: torch.Tensor,
    name: Optional[str] = None,
    op: ReduceOp = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> Any:
    """Reduce across ranks, then keep this rank's slice of dim 0. Returns a handle; ``synchronize(handle)``
    returns the result."""
    return _c.reducescatter_async(tensor, name, op, prescale_factor, postscale_factor, process_set=process_set)


def grouped_reducescatter_async(
    tensors: Sequence[torch.Tensor],
    name: Optional[str] = None,
    op: ReduceOp = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> Any:
    """Reducescatter each of ``tensors`` (negotiated together). Returns a handle; ``synchronize(handle)``
    returns the list of results."""
    return _c.grouped_reducescatter_async(tensors, name, op, prescale_factor, postscale_factor, process_set=process_set)


def _reducescatter_now(
    tensor: torch.Tensor, name: Optional[str], op: ReduceOp, pre: float, post: float, ps: Any
) -> torch.Tensor:
    return _c.call_blocking(_c.reducescatter_async, tensor, name, op, pre, post, process_set=ps)


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: Optional[str], op: ReduceOp, pre: float, post: float, ps: Any):
        ctx.args = (op, pre, post, ps)
        return _reducescatter_now(tensor, name, op, pre, post, ps)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        scale = _reducescatter_grad_scale(*ctx.args)
        gathered = _c.call_blocking(_c.allgather_async, grad.contiguous(), process_set=ctx.args[3])
        return gathered * scale, None, None, None, None, None


def _reducescatter_grad_scale(op: ReduceOp, pre: float, post: float, ps: ProcessSet) -> float:
    """Horovod's factor on a reducescatter's incoming gradient: size for Sum, 1 for Average, times the scales."""
    if op not in (Average, Sum):
        raise RuntimeError(f"reducescatter with op={op.name.lower()} has no gradient; use Sum or Average")
    return (ps.size() if op == Sum else 1.0) * pre * post


def reducescatter(
    tensor: torch.Tensor,
    name: Optional[str] = None,
    compression: Any = Compression.none,
    op: ReduceOp = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> torch.Tensor:
    """Reduce across ranks, then keep this rank's slice of dim 0; differentiable for Sum and Average."""
    _c.check_tensor(tensor, name=name)
    compressed, cctx = compression.compress(tensor)
    args = (compressed, name, _c.resolve_op(op), prescale_factor, postscale_factor, process_set)
    out = _Reducescatter.apply(*args) if _records((compressed,)) else _reducescatter_now(*args)
    return compression.decompress(out, cctx)


def _grouped_reducescatter_now(
    name: Optional[str], op: ReduceOp, pre: float, post: float, ps: Any, *tensors: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    return tuple(_c.call_blocking(_c.grouped_reducescatter_async, list(tensors), name, op, pre, post, process_set=ps))


class _GroupedReducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, name: Optional[str], op: ReduceOp, pre: float, post: float, ps: Any, *tensors: torch.Tensor):
        ctx.args = (op, pre, post, ps)
        return _grouped_reducescatter_now(name, op, pre, post, ps, *tensors)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor):
        scale = _reducescatter_grad_scale(*ctx.args)
        contiguous = [g.contiguous() for g in grads]
        gathered = _c.call_blocking(_c.grouped_allgather_async, contiguous, process_set=ctx.args[3])
        return (None, None, None, None, None, *[g * scale for g in gathered])


def grouped_reducescatter(
    tensors: Sequence[torch.Tensor],
    name: Optional[str] = None,
    compression: Any = Compression.none,
    op: ReduceOp = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> list[torch.Tensor]:
    """Reducescatter each of ``tensors`` (negotiated together); differentiable for Sum and Average."""
    if not isinstance(tensors, (list, tuple)) or not tensors:
        raise ValueError("tensors must be a non-empty list of tensors")
    packed = [compression.compress(t) for t in tensors]
    compressed = [t for t, _ in packed]
    args = (name, _c.resolve_op(op), prescale_factor, postscale_factor, process_set, *compressed)
    out = _GroupedReducescatter.apply(*args) if _records(compressed) else _grouped_reducescatter_now(*args)
    return [compression.decompress(t, cctx) for t, (_, cctx) in zip(out, packed)]


def sparse_allreduce_async(
    tensor: torch.Tensor, name: Optional[str] = None, op: ReduceOp = Average,
    process_set: ProcessSet = global_process_set,
) -> Any:
    """Reduce a sparse tensor by allgathering every rank's indices and values (Horovod's); returns a handle
    whose ``synchronize`` gives the sparse result."""
    return _c.sparse_allreduce_async(tensor, name, op, process_set)


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Wait until every rank (of ``process_set``) reaches the barrier."""
    _c.barrier(process_set)


def join(device: int = -1) -> int:
    """Declare this rank out of data; returns the last rank to join. ``device`` is accepted for Horovod."""
    return _c.join()


broadcast_object = _c.broadcast_object
allgather_object = _c.allgather_object
