"""Collective ops on CPU torch tensors: argument checks, naming, submission to the engine.

Frontends (``hvdray.torch``, ``hvdray.tensorflow``) call these; autograd and framework conversions
live in the frontends. Each ``*_async`` returns a handle for :func:`poll` / :func:`synchronize`; the
blocking form is the async form plus ``synchronize``.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import io
from typing import Any, Callable, Optional, Sequence

import cloudpickle
import torch

from hvdray.collective import session
from hvdray.collective.transport import GLOO_DTYPES
from hvdray.collective.engine import Engine, Handle, Request, submit_to_wait
from hvdray.collective.errors import UnsupportedReductionError
from hvdray.collective.process_sets import ProcessSet, resolve
from hvdray.collective.protocol import GENERATED_NAME_MARK, NAN_MASK_SUFFIX, OpDesc, OpKind, ReduceOp, barrier_desc


Average, Sum, Min, Max, Product = ReduceOp.AVERAGE, ReduceOp.SUM, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT
Adasum = ReduceOp.ADASUM


class OpHandle:
    """What ``*_async`` returns: the engine's handle plus the conversion applied to its result."""

    __slots__ = ("_parts", "_convert")

    def __init__(self, parts: list[Handle], convert: Callable[[list[Any]], Any]) -> None:
        self._parts = parts
        self._convert = convert

    def done(self) -> bool:
        return all(p.done() for p in self._parts)

    def result(self) -> Any:
        if self._convert is _first:  # one part, its result as it is: every gradient of every step
            return self._parts[0].wait()
        return self._convert([p.wait() for p in self._parts])


class CallableHandle(OpHandle):
    """A handle that is also Horovod's callable form (``sparse_allreduce_async(...)()`` returns the result)."""

    __slots__ = ()

    def __call__(self) -> Any:
        return self.result()


def poll(handle: OpHandle) -> bool:
    """True once the op behind ``handle`` has finished (successfully or not)."""
    _check_handle(handle)
    return handle.done()


def synchronize(handle: OpHandle) -> Any:
    """Wait for the op behind ``handle`` and return its result (or raise its error)."""
    _check_handle(handle)
    return handle.result()


def call_blocking(start: Callable[..., OpHandle], *args: Any, **kwargs: Any) -> Any:
    """``synchronize(start(*args, **kwargs))``: a blocking call of the ``*_async`` function ``start``. Its
    submission does not wake the engine thread, since this thread waits on the op at once, and that
    wait runs the engine's tick on this thread when the engine thread sleeps: no hand-off to the engine
    thread and back (see ``Engine._tick_for``)."""
    return synchronize(submit_to_wait(start, *args, **kwargs))


def call_async(start: Callable[..., OpHandle], *args: Any, **kwargs: Any) -> OpHandle:
    """``start(*args, **kwargs)``: the asynchronous counterpart of :func:`call_blocking`, for a frontend
    that builds both forms of an op from one body."""
    return start(*args, **kwargs)


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
    if type(op) is ReduceOp:  # the common case, without the enum's lookup by value
        return op
    try:
        return ReduceOp(op)
    except ValueError:
        raise ValueError(
            f"op must be one of hvd.Average, hvd.Sum, hvd.Min, hvd.Max, hvd.Product, hvd.Adasum; got {op!r}"
        ) from None


def check_tensor(
    tensor: Any, argument: str = "tensor", name: Optional[str] = None, any_dtype: bool = False
) -> torch.Tensor:
    """A CPU, dense torch tensor of a dtype Gloo can reduce (``any_dtype``: of any dtype, for the ops that
    only move data), or a TypeError/ValueError naming it."""
    if isinstance(tensor, torch.Tensor) and tensor.is_cpu and tensor.dtype in _GLOO_DTYPE_SET and not tensor.is_sparse:
        return tensor  # the common case, checked without building any message
    if any_dtype and isinstance(tensor, torch.Tensor) and tensor.is_cpu and tensor.layout is torch.strided:
        return tensor
    label = f"{argument} {name!r}" if name else argument
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{label} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise ValueError(
            f"{label} is on {tensor.device}; hvdray's Gloo engine reduces CPU tensors (move it with .cpu())"
        )
    if tensor.layout is not torch.strided:
        raise ValueError(f"{label} is sparse; pass a dense tensor (tensor.to_dense())")
    supported = ", ".join(str(d).replace("torch.", "") for d in GLOO_DTYPES)
    raise ValueError(f"{label} has dtype {tensor.dtype}, which Gloo cannot reduce; supported: {supported}")


_GLOO_DTYPE_SET = frozenset(GLOO_DTYPES)
_PLAIN = (float, int)  # exact types: a bool (a subclass of int) takes the slow path and is refused there


def check_name(name: Optional[str], op: str, engine: Optional[Engine] = None) -> str:
    """The op's name: ``name``, or one generated by ``engine`` (default: the global one). Call it after
    every other argument check, so that a call that fails its checks on one rank does not use up a
    generated name there (the ranks' generated names would no longer match)."""
    if name is None:
        return (engine or session.engine(op)).auto_name(op)
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
    if op == Adasum or tensor.dtype is torch.bool:  # the only dtype conditions beyond check_tensor's
        label = f"{argument} {name!r}" if name else argument
        if tensor.dtype == torch.bool and op in (Average, Product):
            raise ValueError(f"{label} is bool; {op.name.lower()} is not defined for bool tensors")
        if op == Adasum and not tensor.is_floating_point():
            raise ValueError(f"{label} has dtype {tensor.dtype}; op=hvd.Adasum needs a floating-point tensor")
    if type(prescale_factor) in _PLAIN and type(postscale_factor) in _PLAIN and prescale_factor == 1.0 == postscale_factor:
        return 1.0, 1.0  # the common case, without two more calls (types first: a tensor's == is no bool)
    return (
        check_scale(prescale_factor, "prescale_factor", tensor),
        check_scale(postscale_factor, "postscale_factor", tensor),
    )


def check_scale(value: Any, argument: str, tensor: torch.Tensor) -> float:
    """A scale factor as a float; a bool tensor takes none but 1.0 (integer tensors: see :func:`scale_as_horovod`)."""
    if type(value) in _PLAIN and value == 1.0:  # the common case (types first: a tensor's == is no bool)
        return 1.0
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{argument} must be a number, got {type(value).__name__}")
    value = float(value)
    if value != 1.0 and tensor.dtype == torch.bool:
        raise ValueError(f"{argument}={value} cannot scale a bool tensor")
    return value


#: where Horovod scales a tensor of a dtype in another: integers in float64 (truncated back), 16-bit floats in
#: float32 on the CPU (rounded back once)
_SCALED_IN = {torch.float16: torch.float32, torch.bfloat16: torch.float32}


def scale_as_horovod(tensor: torch.Tensor, factor: float) -> torch.Tensor:
    """``tensor * factor`` computed as Horovod computes it (see ``_SCALED_IN``), as a new tensor of its dtype."""
    wide = _SCALED_IN.get(tensor.dtype, torch.float64)
    return (tensor.to(wide) * factor).to(tensor.dtype)


def _outside_engine_scales(tensor: torch.Tensor, pre: float, post: float) -> tuple[torch.Tensor, float, float, float]:
    """``(input, pre, post, postscale left)``: an integer or 16-bit float tensor's scaling taken out of the
    engine's hands (prescaled here, postscaled on the result by :func:`_postscaled`), so that it is computed
    as Horovod computes it; other tensors pass through."""
    if (pre == 1.0 and post == 1.0) or (tensor.is_floating_point() and tensor.dtype not in _SCALED_IN):
        return tensor, pre, post, 1.0
    return (scale_as_horovod(tensor, pre) if pre != 1.0 else tensor), 1.0, 1.0, post


def _postscaled(convert: Callable[[list[Any]], Any], factors: list[float]) -> Callable[[list[Any]], Any]:
    """``convert`` after each result with a factor other than 1.0 is scaled in place, as Horovod scales it."""
    def scaled(results: list[Any]) -> Any:
        for result, factor in zip(results, factors):
            if factor != 1.0:
                result.copy_(scale_as_horovod(result, factor))
        return convert(results)

    return scaled


def check_root(root_rank: Any, process_set: Optional[ProcessSet] = None) -> int:
    """``root_rank`` (a global rank) checked against the job or the process set; returns its rank in the set."""
    size = session.rank_info("broadcast").size
    if isinstance(root_rank, bool) or not isinstance(root_rank, int):
        raise TypeError(f"root_rank must be an int, got {type(root_rank).__name__}")
    if not 0 <= root_rank < size:
        raise ValueError(f"root_rank {root_rank} is out of range for a job of size {size}")
    if process_set is None:
        return root_rank
    ranks = process_set.ranks
    if root_rank not in ranks:
        raise ValueError(f"root_rank {root_rank} is not a member of process_set {process_set!r}")
    return ranks.index(root_rank)


def _desc(kind: OpKind, name: str, tensor: torch.Tensor, **fields: Any) -> OpDesc:
    """The description of an op on ``tensor`` (not an allreduce's: see :func:`_allreduce_desc`)."""
    return OpDesc(name, kind, tensor.dtype, tensor.shape, generated=GENERATED_NAME_MARK in name, **fields)


def _submit(engine: Engine, desc: OpDesc, tensor: Optional[torch.Tensor], output: Optional[torch.Tensor]) -> Handle:
    return engine.submit(Request(desc, tensor, output, Handle(desc.name)))


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
    process_set: Optional[ProcessSet] = None,
) -> OpHandle:
    """Reduce ``tensor`` across ranks into ``output`` (a new tensor unless given; ``tensor`` for in-place)."""
    op = resolve_op(op)
    pre, post = check_allreduce_args(tensor, name, op, prescale_factor, postscale_factor)
    engine, _ = resolve(process_set, "allreduce")
    name = check_name(name, "allreduce", engine)
    if pre != 1.0 or post != 1.0:
        source, pre, post, late_post = _outside_engine_scales(tensor, pre, post)
        if late_post != 1.0 or source is not tensor:
            request = _allreduce_requests(engine, source, name, op, pre, post, output)[0]
            return OpHandle([engine.submit(request)], _postscaled(_first, [late_post]))
    requests = _allreduce_requests(engine, tensor, name, op, pre, post, output)
    if len(requests) == 1:
        return OpHandle([engine.submit(requests[0])], _first)
    engine.submit_many(requests)
    return OpHandle([r.handle for r in requests], _propagate_nan)


def _allreduce_requests(
    engine: Engine, tensor: torch.Tensor, name: str, op: ReduceOp, pre: float, post: float, output: Optional[torch.Tensor]
) -> list[Request]:
    """The engine requests of one checked allreduce: the tensor's, and for a floating-point min or max a
    NaN mask's beside it (Gloo's min/max keep or drop a NaN depending on the order of the operands;
    IEEE 754's minimum/maximum, and torch, propagate it)."""
    out = engine.outputs.empty_like(tensor) if output is None else output
    requests = [Request(_allreduce_desc(name, tensor, op, pre, post), tensor, out, Handle(name))]
    if (op is Min or op is Max) and tensor.is_floating_point():
        nan, nan_name = tensor.isnan(), f"{name}{NAN_MASK_SUFFIX}"
        nan_desc = _allreduce_desc(nan_name, nan, Max, 1.0, 1.0)
        requests.append(Request(nan_desc, nan, torch.empty_like(nan), Handle(nan_name)))
    return requests


def _allreduce_desc(name: str, tensor: torch.Tensor, op: ReduceOp, pre: float, post: float) -> OpDesc:
    """An allreduce's description, built positionally (this runs for every gradient of every step)."""
    return OpDesc(name, _ALLREDUCE, tensor.dtype, tensor.shape, op, pre, post, None, None, GENERATED_NAME_MARK in name)


_ALLREDUCE = OpKind.ALLREDUCE


def _propagate_nan(results: list[torch.Tensor]) -> torch.Tensor:
    reduced, nan = results
    return reduced.masked_fill_(nan, float("nan"))


def grouped_allreduce_async(
    tensors: Sequence[torch.Tensor],
    name: Optional[str] = None,
    op: ReduceOp = Average,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    inplace: bool = False,
    process_set: Optional[ProcessSet] = None,
) -> OpHandle:
    """Allreduce a list of tensors as one group, submitted together (and so negotiated and fused
    together where they fit); the result is a list."""
    _check_group(tensors)
    op = resolve_op(op)
    pre, post = 1.0, 1.0
    for i, t in enumerate(tensors):  # all checked before any is submitted
        pre, post = check_allreduce_args(t, None, op, prescale_factor, postscale_factor, f"tensors[{i}]")
    engine, _ = resolve(process_set, "grouped_allreduce")
    base = check_name(name, "grouped_allreduce", engine)
    requests: list[Request] = []
    parts = []  # requests per tensor: 1, or 2 with a NaN mask
    late_posts = []
    for i, t in enumerate(tensors):
        source, t_pre, t_post, late_post = _outside_engine_scales(t, pre, post)
        mine = _allreduce_requests(engine, source, f"{base}.{i}", op, t_pre, t_post, t if inplace else None)
        requests += mine
        parts.append(len(mine))
        late_posts.append(late_post)
    engine.submit_many(requests)
    handles = [r.handle for r in requests]
    if len(requests) == len(tensors):
        return OpHandle(handles, list if all(f == 1.0 for f in late_posts) else _postscaled(list, late_posts))
    return OpHandle(handles, functools.partial(_grouped_propagate_nan, parts))


def _grouped_propagate_nan(parts: list[int], results: list[torch.Tensor]) -> list[torch.Tensor]:
    """A grouped min/max's results: per tensor its result, with its NaN mask applied where it has one."""
    out, i = [], 0
    for n in parts:
        out.append(results[i] if n == 1 else _propagate_nan(results[i : i + 2]))
        i += n
    return out


def allgather_async(
    tensor: torch.Tensor, name: Optional[str] = None, process_set: Optional[ProcessSet] = None
) -> OpHandle:
    """Concatenate every rank's ``tensor`` along dim 0; the first dimensions may differ."""
    _check_allgather(tensor, name)
    engine, _ = resolve(process_set, "allgather")
    name = check_name(name, "allgather", engine)
    return OpHandle([_submit(engine, _desc(OpKind.ALLGATHER, name, tensor), tensor, None)], _first)


def _check_allgather(tensor: Any, name: Optional[str], argument: str = "tensor") -> None:
    check_tensor(tensor, argument, name=name, any_dtype=True)
    if tensor.dim() == 0:
        raise ValueError(f"{_label(name)} is a scalar; allgather needs at least one dimension (use .reshape(1))")


def grouped_allgather_async(
    tensors: Sequence[torch.Tensor], name: Optional[str] = None, process_set: Optional[ProcessSet] = None
) -> OpHandle:
    """Allgather each of ``tensors``, submitted together (negotiated as one group); the result is a list."""
    _check_group(tensors)
    for i, t in enumerate(tensors):
        _check_allgather(t, None, f"tensors[{i}]")
    engine, _ = resolve(process_set, "grouped_allgather")
    base = check_name(name, "grouped_allgather", engine)
    return _submit_group(engine, [(_desc(OpKind.ALLGATHER, f"{base}.{i}", t), t) for i, t in enumerate(tensors)])


def _check_group(tensors: Any) -> None:
    if not isinstance(tensors, (list, tuple)) or not tensors:
        raise ValueError("tensors must be a non-empty list of tensors")


def _submit_group(
    engine: Engine, ops: list[tuple[OpDesc, torch.Tensor]], convert: Callable[[list[Any]], Any] = list,
    handle_type: type[OpHandle] = OpHandle,
) -> OpHandle:
    requests = [Request(desc, tensor, None, Handle(desc.name)) for desc, tensor in ops]
    engine.submit_many(requests)
    return handle_type([r.handle for r in requests], convert)


def broadcast_async(
    tensor: torch.Tensor,
    root_rank: int,
    name: Optional[str] = None,
    inplace: bool = False,
    process_set: Optional[ProcessSet] = None,
) -> OpHandle:
    """Send root's ``tensor`` to every rank (into ``tensor`` itself when ``inplace``); ``root_rank`` is global."""
    check_tensor(tensor, name=name, any_dtype=True)
    engine, ps = resolve(process_set, "broadcast")
    root = check_root(root_rank, ps)
    name = check_name(name, "broadcast", engine)
    out = tensor if inplace else engine.outputs.empty_like(tensor)
    return OpHandle([_submit(engine, _desc(OpKind.BROADCAST, name, tensor, root=root), tensor, out)], _first)


def alltoall_async(
    tensor: torch.Tensor, splits: Any = None, name: Optional[str] = None, process_set: Optional[ProcessSet] = None
) -> OpHandle:
    """Scatter slices of dim 0 to every rank and gather theirs; result: ``(output, received_splits)``."""
    check_tensor(tensor, name=name, any_dtype=True)
    engine, ps = resolve(process_set, "alltoall")
    size = ps.size()
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
            f"{label} without splits needs dim 0 ({tensor.shape[0]}) divisible by the number of ranks ({size})"
        )
    name = check_name(name, "alltoall", engine)
    desc = _desc(OpKind.ALLTOALL, name, tensor, splits=split_list)
    return OpHandle([_submit(engine, desc, tensor, None)], _first)


def reducescatter_async(
    tensor: torch.Tensor,
    name: Optional[str] = None,
    op: ReduceOp = Average,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Optional[ProcessSet] = None,
) -> OpHandle:
    """Reduce across ranks and give each rank its slice of dim 0 (the first ranks get any extra row)."""
    op = resolve_op(op)
    pre, post = _check_reducescatter(tensor, name, op, prescale_factor, postscale_factor)
    engine, _ = resolve(process_set, "reducescatter")
    name = check_name(name, "reducescatter", engine)
    source, pre, post, late_post = _outside_engine_scales(tensor, pre, post)
    desc = _desc(OpKind.REDUCESCATTER, name, source, reduce_op=op, prescale=pre, postscale=post)
    return OpHandle([_submit(engine, desc, source, None)], _postscaled(_first, [late_post]) if late_post != 1.0 else _first)


def _check_reducescatter(
    tensor: Any, name: Optional[str], op: ReduceOp, prescale_factor: Any, postscale_factor: Any,
    argument: str = "tensor",
) -> tuple[float, float]:
    check_tensor(tensor, argument, name=name)
    if tensor.dim() == 0:
        raise ValueError(f"{_label(name)} is a scalar; reducescatter needs at least one dimension")
    if op in (Product, Adasum) or tensor.dtype == torch.bool:
        label = f"reducescatter {name!r}" if name else "reducescatter"
        raise UnsupportedReductionError(f"{label}: op {op.name.lower()} on {tensor.dtype} is not supported")
    return check_scale(prescale_factor, "prescale_factor", tensor), check_scale(postscale_factor, "postscale_factor", tensor)


def grouped_reducescatter_async(
    tensors: Sequence[torch.Tensor],
    name: Optional[str] = None,
    op: ReduceOp = Average,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Optional[ProcessSet] = None,
) -> OpHandle:
    """Reducescatter each of ``tensors``, submitted together (negotiated as one group); the result is a list."""
    _check_group(tensors)
    op = resolve_op(op)
    scales = [_check_reducescatter(t, None, op, prescale_factor, postscale_factor, f"tensors[{i}]")
              for i, t in enumerate(tensors)]
    engine, _ = resolve(process_set, "grouped_reducescatter")
    base = check_name(name, "grouped_reducescatter", engine)
    scaled = [_outside_engine_scales(t, pre, post) for t, (pre, post) in zip(tensors, scales)]
    late_posts = [late_post for *_, late_post in scaled]
    return _submit_group(engine, [
        (_desc(OpKind.REDUCESCATTER, f"{base}.{i}", t, reduce_op=op, prescale=pre, postscale=post), t)
        for i, (t, pre, post, _) in enumerate(scaled)
    ], list if all(f == 1.0 for f in late_posts) else _postscaled(list, late_posts))


def sparse_allreduce_async(
    tensor: torch.Tensor, name: Optional[str] = None, op: ReduceOp = Average, process_set: Optional[ProcessSet] = None
) -> OpHandle:
    """Reduce a sparse COO tensor as Horovod does: every rank's indices and values are allgathered, so the
    result holds every rank's entries (``coalesce()`` sums duplicates); Average divides the values by the size.
    The handle is also callable, as Horovod's is."""
    if not isinstance(tensor, torch.Tensor) or tensor.layout is not torch.sparse_coo or not tensor.is_cpu:
        raise ValueError(f"{_label(name)} must be a sparse COO CPU tensor (tensor.to_sparse()), got "
                         f"{getattr(tensor, 'layout', type(tensor).__name__)}")
    op = resolve_op(op)
    if op not in (Average, Sum):
        raise ValueError(f"sparse_allreduce supports op=hvd.Average or hvd.Sum, got {op.name.lower()}")
    values, indices = tensor._values().contiguous(), tensor._indices().t().contiguous()
    check_tensor(values, "tensor values", name=name)
    engine, ps = resolve(process_set, "sparse_allreduce")
    base = check_name(name, "sparse_allreduce", engine)
    convert = functools.partial(_sparse_result, tuple(tensor.shape), ps.size() if op is Average else 1)
    return _submit_group(engine, [
        (_desc(OpKind.ALLGATHER, f"{base}.values", values), values),
        (_desc(OpKind.ALLGATHER, f"{base}.indices", indices), indices),
    ], convert, CallableHandle)


def _sparse_result(shape: tuple[int, ...], divisor: int, results: list[torch.Tensor]) -> torch.Tensor:
    values, indices = results
    return torch.sparse_coo_tensor(indices.t(), values / divisor if divisor != 1 else values, shape)


def barrier(process_set: Optional[ProcessSet] = None) -> None:
    """Return once every rank (of ``process_set``) has reached this barrier."""
    engine, _ = resolve(process_set, "barrier")
    name = engine.auto_name("barrier")
    engine.submit_and_wait(Request(barrier_desc(name), None, None, Handle(name)))


def join() -> int:
    """Mark this rank done; joined ranks contribute zeros to allreduces. Returns the last rank to join."""
    return session.engine("join").join().wait()


# -- Python objects (pickled, authenticated with the job secret) --------------------------------
_MAC_BYTES = 32


def _seal(obj: Any) -> torch.Tensor:
    body = cloudpickle.dumps(obj)
    mac = hmac.new(session.job_secret(), body, hashlib.sha256).digest()
    return torch.frombuffer(bytearray(mac + body), dtype=torch.uint8)


def _open(buf: torch.Tensor, what: str) -> Any:
    raw = buf.numpy().tobytes()
    mac, body = raw[:_MAC_BYTES], raw[_MAC_BYTES:]
    expected = hmac.new(session.job_secret(), body, hashlib.sha256).digest()
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


def broadcast_object(
    obj: Any, root_rank: int = 0, name: Optional[str] = None, process_set: Optional[ProcessSet] = None
) -> Any:
    """Root's picklable ``obj`` on every rank. If root cannot pickle it, every rank raises."""
    engine, ps = resolve(process_set, "broadcast_object")
    check_root(root_rank, ps)
    is_root = session.rank_info().rank == root_rank
    payload, error = _try_seal(obj) if is_root else (torch.empty(0, dtype=torch.uint8), None)
    name = check_name(name, "broadcast_object", engine)
    length = torch.tensor([_UNPICKLABLE if error else payload.numel()], dtype=torch.int64)
    length = int(call_blocking(broadcast_async, length, root_rank, f"{name}.len", process_set=process_set).item())
    if length == _UNPICKLABLE:
        detail = f": {error}" if error else ""
        raise ValueError(f"broadcast_object {name!r}: root rank {root_rank} could not pickle its object{detail}")
    buf = payload if is_root else torch.empty(length, dtype=torch.uint8)
    buf = call_blocking(broadcast_async, buf, root_rank, f"{name}.data", process_set=process_set)
    return obj if is_root else _open(buf, f"broadcast_object {name!r}")


def allgather_object(
    obj: Any, name: Optional[str] = None, process_set: Optional[ProcessSet] = None
) -> list[Any]:
    """Every rank's picklable ``obj``, in rank order. If any rank cannot pickle its object, every rank raises."""
    engine, _ = resolve(process_set, "allgather_object")
    name = check_name(name, "allgather_object", engine)
    payload, error = _try_seal(obj)
    length = torch.tensor([_UNPICKLABLE if error else payload.numel()], dtype=torch.int64)
    sizes = call_blocking(allgather_async, length, f"{name}.len", process_set).tolist()
    failed = [r for r, n in enumerate(sizes) if n == _UNPICKLABLE]
    if failed:
        detail = f": {error}" if error else ""
        raise ValueError(f"allgather_object {name!r}: rank(s) {failed} could not pickle their object{detail}")
    data = call_blocking(allgather_async, payload, f"{name}.data", process_set)
    out, offset = [], 0
    for n in sizes:
        out.append(_open(data[offset : offset + n], f"allgather_object {name!r}"))
        offset += n
    return out
