"""Collective ops on CPU torch tensors: argument checks, naming, submission to the engine.

Frontends (``hvdray.torch``, ``hvdray.tensorflow``) call these; autograd and framework conversions
live in the frontends. Each ``*_async`` returns a handle for :func:`poll` / :func:`synchronize`; the
blocking form is the async form plus ``synchronize``.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import io
from typing import Any, Callable, Optional, Sequence

import cloudpickle
import torch

from hvdray.collective import context
from hvdray.collective.communicator import GLOO_DTYPES
from hvdray.collective.engine import GENERATED_NAME_MARK, Handle, Request


class ReduceOp(str, enum.Enum):
    """How allreduce and reducescatter combine tensors (Horovod's ``hvd.Average`` and friends)."""

    AVERAGE = "average"
    SUM = "sum"
    MIN = "min"
    MAX = "max"
    PRODUCT = "product"
    ADASUM = "adasum"  # see hvdray/collective/adasum.py


Average, Sum, Min, Max, Product = ReduceOp.AVERAGE, ReduceOp.SUM, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT
Adasum = ReduceOp.ADASUM


class OpHandle:
    """What ``*_async`` returns: the engine's handle plus the conversion applied to its result."""

    __slots__ = ("_parts", "_convert")

    def __init__(self, parts: Sequence[Handle], convert: Callable[[list[Any]], Any]) -> None:
        self._parts = list(parts)
        self._convert = convert

    def done(self) -> bool:
        return all(p.done() for p in self._parts)

    def result(self) -> Any:
        return self._convert([p.wait() for p in self._parts])


def poll(handle: OpHandle) -> bool:
    """True once the op behind ``handle`` has finished (successfully or not)."""
    _check_handle(handle)
    return handle.done()


def synchronize(handle: OpHandle) -> Any:
    """Wait for the op behind ``handle`` and return its result (or raise its error)."""
    _check_handle(handle)
    return handle.result()


def _check_handle(handle: Any) -> None:
    if not isinstance(handle, OpHandle):
        raise TypeError(f"handle must be what an hvdray *_async op returned, got {type(handle).__name__}")


# -- argument checks ----------------------------------------------------------------------------
def resolve_op(op: Optional[ReduceOp], average: Optional[bool] = None) -> ReduceOp:
    """Horovod's ``op=`` with the deprecated ``average=`` fallback; Average when neither is given."""
    if op is not None and average is not None:
        raise ValueError("pass either op= or the deprecated average=, not both")
    if op is None:
        return Sum if average is False else Average
    try:
        return ReduceOp(op)
    except ValueError:
        raise ValueError(
            f"op must be one of hvd.Average, hvd.Sum, hvd.Min, hvd.Max, hvd.Product, hvd.Adasum; got {op!r}"
        ) from None


def check_tensor(tensor: Any, argument: str = "tensor", name: Optional[str] = None) -> torch.Tensor:
    """A CPU, dense torch tensor of a dtype Gloo can reduce, or a TypeError/ValueError naming it."""
    label = f"{argument} {name!r}" if name else argument
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{label} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise ValueError(
            f"{label} is on {tensor.device}; hvdray's Gloo engine reduces CPU tensors (move it with .cpu())"
        )
    if tensor.dtype not in GLOO_DTYPES:
        supported = ", ".join(str(d).replace("torch.", "") for d in GLOO_DTYPES)
        raise ValueError(f"{label} has dtype {tensor.dtype}, which Gloo cannot reduce; supported: {supported}")
    if tensor.is_sparse:
        raise ValueError(f"{label} is sparse; pass a dense tensor (tensor.to_dense())")
    return tensor


def check_name(name: Optional[str], op: str) -> str:
    """The op's name: ``name``, or a generated one. Call it after every other argument check, so that
    a call that fails its checks on one rank does not use up a generated name there (the ranks'
    generated names would no longer match)."""
    if name is None:
        return context.engine(op).auto_name(op)
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty string, got {name!r}")
    return name


def _label(name: Optional[str]) -> str:
    return f"tensor {name!r}" if name else "tensor"


def check_allreduce_args(
    tensor: Any, name: Optional[str], op: "ReduceOp", prescale_factor: Any, postscale_factor: Any,
    argument: str = "tensor",
) -> tuple[float, float]:
    """Check an allreduce's tensor, op and scale factors; returns ``(prescale, postscale)`` as floats."""
    check_tensor(tensor, argument, name=name)
    label = f"{argument} {name!r}" if name else argument
    if tensor.dtype == torch.bool and op in (Average, Product):
        raise ValueError(f"{label} is bool; {op.name.lower()} is not defined for bool tensors")
    if op == Adasum and not tensor.is_floating_point():
        raise ValueError(f"{label} has dtype {tensor.dtype}; op=hvd.Adasum needs a floating-point tensor")
    return (
        check_scale(prescale_factor, "prescale_factor", tensor),
        check_scale(postscale_factor, "postscale_factor", tensor),
    )


def check_scale(value: Any, argument: str, tensor: torch.Tensor) -> float:
    """A scale factor as a float; anything but 1.0 needs a floating-point tensor."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{argument} must be a number, got {type(value).__name__}")
    value = float(value)
    if value != 1.0 and not tensor.is_floating_point():
        raise ValueError(f"{argument}={value} needs a floating-point tensor, got {tensor.dtype}")
    return value


def check_root(root_rank: Any) -> int:
    """``root_rank`` checked against the job size."""
    size = context.rank_info("broadcast").size
    if isinstance(root_rank, bool) or not isinstance(root_rank, int):
        raise TypeError(f"root_rank must be an int, got {type(root_rank).__name__}")
    if not 0 <= root_rank < size:
        raise ValueError(f"root_rank {root_rank} is out of range for a job of size {size}")
    return root_rank


def _meta(op: str, name: str, tensor: torch.Tensor, **extra: Any) -> dict[str, Any]:
    meta = {"o": op, "n": name, "d": str(tensor.dtype), "s": list(tensor.shape), **extra}
    if GENERATED_NAME_MARK in name:
        meta["a"] = 1  # generated names never repeat: the engine does not cache them
    return meta


def _submit(meta: dict[str, Any], tensor: Optional[torch.Tensor], output: Optional[torch.Tensor]) -> Handle:
    engine = context.engine(meta["o"])
    return engine.submit(Request(meta=meta, tensor=tensor, output=output, handle=Handle(meta["n"])))


def _first(results: list[Any]) -> Any:
    return results[0]


# -- ops ----------------------------------------------------------------------------------------
def allreduce_async(
    tensor: torch.Tensor,
    name: Optional[str] = None,
    op: ReduceOp = Average,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    output: Optional[torch.Tensor] = None,
) -> OpHandle:
    """Reduce ``tensor`` across ranks into ``output`` (a new tensor unless given; ``tensor`` for in-place)."""
    op = resolve_op(op)
    pre, post = check_allreduce_args(tensor, name, op, prescale_factor, postscale_factor)
    name = check_name(name, "allreduce")
    meta = _meta("allreduce", name, tensor, r=op.value, pre=pre, post=post)
    out = torch.empty_like(tensor, memory_format=torch.contiguous_format) if output is None else output
    return OpHandle([_submit(meta, tensor, out)], _first)


def grouped_allreduce_async(
    tensors: Sequence[torch.Tensor],
    name: Optional[str] = None,
    op: ReduceOp = Average,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    inplace: bool = False,
) -> OpHandle:
    """Allreduce a list of tensors as one group (fused where they fit); the result is a list."""
    if not isinstance(tensors, (list, tuple)) or not tensors:
        raise ValueError("tensors must be a non-empty list of tensors")
    op = resolve_op(op)
    for i, t in enumerate(tensors):  # all checked before any is submitted
        check_allreduce_args(t, None, op, prescale_factor, postscale_factor, f"tensors[{i}]")
    base = check_name(name, "grouped_allreduce")
    parts = []
    for i, t in enumerate(tensors):
        handle = allreduce_async(t, f"{base}.{i}", op, prescale_factor, postscale_factor, t if inplace else None)
        parts.extend(handle._parts)
    return OpHandle(parts, list)


def allgather_async(tensor: torch.Tensor, name: Optional[str] = None) -> OpHandle:
    """Concatenate every rank's ``tensor`` along dim 0; the first dimensions may differ."""
    check_tensor(tensor, name=name)
    if tensor.dim() == 0:
        raise ValueError(f"{_label(name)} is a scalar; allgather needs at least one dimension (use .reshape(1))")
    name = check_name(name, "allgather")
    return OpHandle([_submit(_meta("allgather", name, tensor), tensor, None)], _first)


def broadcast_async(
    tensor: torch.Tensor, root_rank: int, name: Optional[str] = None, inplace: bool = False
) -> OpHandle:
    """Send root's ``tensor`` to every rank (into ``tensor`` itself when ``inplace``)."""
    check_tensor(tensor, name=name)
    root = check_root(root_rank)
    name = check_name(name, "broadcast")
    out = tensor if inplace else torch.empty_like(tensor, memory_format=torch.contiguous_format)
    return OpHandle([_submit(_meta("broadcast", name, tensor, root=root), tensor, out)], _first)


def alltoall_async(tensor: torch.Tensor, splits: Any = None, name: Optional[str] = None) -> OpHandle:
    """Scatter slices of dim 0 to every rank and gather theirs; result: ``(output, received_splits)``."""
    check_tensor(tensor, name=name)
    size = context.rank_info("alltoall").size
    label = f"alltoall {name!r}" if name else "alltoall"
    if tensor.dim() == 0:
        raise ValueError(f"{_label(name)} is a scalar; alltoall needs at least one dimension")
    split_list = None
    if splits is not None:
        if isinstance(splits, torch.Tensor):
            split_list = [int(s) for s in splits.reshape(-1).tolist()]
        elif isinstance(splits, (list, tuple)) and all(isinstance(s, int) and not isinstance(s, bool) for s in splits):
            split_list = list(splits)
        else:
            raise TypeError(f"splits must be a list of ints or an integer tensor, got {splits!r}")
        if len(split_list) != size or any(s < 0 for s in split_list) or sum(split_list) != tensor.shape[0]:
            raise ValueError(
                f"splits {split_list} for {label} must hold {size} non-negative counts summing to "
                f"dim 0 of the tensor ({tensor.shape[0]})"
            )
    elif tensor.shape[0] % size:
        raise ValueError(
            f"{label} without splits needs dim 0 ({tensor.shape[0]}) divisible by the job size ({size})"
        )
    name = check_name(name, "alltoall")
    meta = _meta("alltoall", name, tensor, sp=split_list)
    return OpHandle([_submit(meta, tensor, None)], _first)


def reducescatter_async(
    tensor: torch.Tensor,
    name: Optional[str] = None,
    op: ReduceOp = Average,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> OpHandle:
    """Reduce across ranks and give each rank its slice of dim 0 (the first ranks get any extra row)."""
    op = resolve_op(op)
    check_tensor(tensor, name=name)
    if tensor.dim() == 0:
        raise ValueError(f"{_label(name)} is a scalar; reducescatter needs at least one dimension")
    if op in (Product, Adasum) or tensor.dtype == torch.bool:
        label = f"reducescatter {name!r}" if name else "reducescatter"
        raise ValueError(f"{label}: op {op.name.lower()} on {tensor.dtype} is not supported")
    pre = check_scale(prescale_factor, "prescale_factor", tensor)
    post = check_scale(postscale_factor, "postscale_factor", tensor)
    name = check_name(name, "reducescatter")
    meta = _meta("reducescatter", name, tensor, r=op.value, pre=pre, post=post)
    return OpHandle([_submit(meta, tensor, None)], _first)


def barrier() -> None:
    """Return once every rank has reached this barrier."""
    name = context.engine("barrier").auto_name("barrier")
    _submit({"o": "barrier", "n": name, "d": "", "s": [], "a": 1}, None, None).wait()


def join() -> int:
    """Mark this rank done; joined ranks contribute zeros to allreduces. Returns the last rank to join."""
    return context.engine("join").join().wait()


# -- Python objects (pickled, authenticated with the job secret) --------------------------------
_MAC_BYTES = 32


def _seal(obj: Any) -> torch.Tensor:
    body = cloudpickle.dumps(obj)
    mac = hmac.new(context.job_secret(), body, hashlib.sha256).digest()
    return torch.frombuffer(bytearray(mac + body), dtype=torch.uint8)


def _open(buf: torch.Tensor, what: str) -> Any:
    raw = buf.numpy().tobytes()
    mac, body = raw[:_MAC_BYTES], raw[_MAC_BYTES:]
    expected = hmac.new(context.job_secret(), body, hashlib.sha256).digest()
    if not hmac.compare_digest(mac, expected):
        raise ValueError(f"{what}: payload failed authentication with the job secret; refusing to unpickle it")
    return cloudpickle.load(io.BytesIO(body))


def _try_seal(obj: Any) -> tuple[Optional[torch.Tensor], Optional[BaseException]]:
    """Pickle and sign ``obj``; a failure is returned, so that the peers can be told instead of left waiting."""
    try:
        return _seal(obj), None
    except Exception as exc:  # noqa: BLE001 - any pickling failure; re-raised by the caller
        return None, exc


_UNPICKLABLE = -1  # the length a rank sends when its object could not be pickled


def broadcast_object(obj: Any, root_rank: int = 0, name: Optional[str] = None) -> Any:
    """Root's picklable ``obj`` on every rank. If root cannot pickle it, every rank raises."""
    check_root(root_rank)
    is_root = context.rank_info().rank == root_rank
    payload, error = _try_seal(obj) if is_root else (torch.empty(0, dtype=torch.uint8), None)
    name = check_name(name, "broadcast_object")
    length = torch.tensor([_UNPICKLABLE if error else payload.numel()], dtype=torch.int64)
    length = int(synchronize(broadcast_async(length, root_rank, name=f"{name}.len")).item())
    if length == _UNPICKLABLE:
        detail = f": {error}" if error else ""
        raise ValueError(f"broadcast_object {name!r}: root rank {root_rank} could not pickle its object{detail}")
    buf = payload if is_root else torch.empty(length, dtype=torch.uint8)
    buf = synchronize(broadcast_async(buf, root_rank, name=f"{name}.data"))
    return obj if is_root else _open(buf, f"broadcast_object {name!r}")


def allgather_object(obj: Any, name: Optional[str] = None) -> list[Any]:
    """Every rank's picklable ``obj``, in rank order. If any rank cannot pickle its object, every rank raises."""
    name = check_name(name, "allgather_object")
    payload, error = _try_seal(obj)
    length = torch.tensor([_UNPICKLABLE if error else payload.numel()], dtype=torch.int64)
    sizes = synchronize(allgather_async(length, name=f"{name}.len")).tolist()
    failed = [r for r, n in enumerate(sizes) if n == _UNPICKLABLE]
    if failed:
        detail = f": {error}" if error else ""
        raise ValueError(f"allgather_object {name!r}: rank(s) {failed} could not pickle their object{detail}")
    data = synchronize(allgather_async(payload, name=f"{name}.data"))
    out, offset = [], 0
    for n in sizes:
        out.append(_open(data[offset : offset + n], f"allgather_object {name!r}"))
        offset += n
    return out
