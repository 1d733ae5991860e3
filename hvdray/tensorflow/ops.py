"""``hvdray.tensorflow`` ops: horovod.tensorflow's signatures over the collective layer, with gradients.

Every op works on eager tensors and inside ``tf.function`` (see :mod:`hvdray.tensorflow.bridge`).
Arguments are checked when the op is called (at trace time inside ``tf.function``); what can only
be known when the op runs (another rank's shape, dim 0 against ``splits``) is checked by the engine.
Gradients flow where Horovod's do: through allreduce (Sum and Average), allgather, broadcast,
alltoall and reducescatter.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import numpy as np
import tensorflow as tf
import torch

from hvdray.collective import ops as _c
from hvdray.collective import surface
from hvdray.collective.basics import rank
from hvdray.collective.ops import Adasum, Average, Max, Min, Product, ReduceOp, Sum  # noqa: F401 - re-exported
from hvdray.collective.process_sets import ProcessSet, global_process_set, resolve
from hvdray.tensorflow import bridge
from hvdray.tensorflow.compression import Compression, for_tensorflow
from hvdray.tensorflow.convert import as_tensor, to_tf, to_torch, torch_dtype

#: every op of the surface in its blocking form (the only one a TensorFlow graph can hold), and the reduce ops
__all__ = [
    *surface.names(surface.BLOCKING_ONLY),
    *surface.REDUCE_OPS, "ReduceOp",
]


# -- argument checks -----------------------------------------------------------------------------
def check_common(
    compression: Any = Compression.none,
    process_set: Any = None,
    device_dense: Any = "",
    device_sparse: Any = "",
) -> ProcessSet:
    """Horovod's arguments that hvdray accepts only in the form it can honour; returns the process set
    to run on (the global one for ``None``), checked to be registered with this rank a member."""
    ps = global_process_set if process_set is None else process_set
    if ps is not global_process_set:
        resolve(ps, "process_set")
    for_tensorflow(compression)
    for argument, value in (("device_dense", device_dense), ("device_sparse", device_sparse)):
        if not isinstance(value, str):  # accepted for Horovod; the engine reduces on the host either way
            raise TypeError(f"{argument} must be a device string, got {type(value).__name__}")
    return ps


def _check_name(name: Optional[str]) -> Optional[str]:
    return None if name is None else _c.check_name(name, "op")  # an explicit name is only validated


def _check_allreduce(x: tf.Tensor, name: Optional[str], op: ReduceOp, pre: Any, post: Any, argument: str = "tensor"):
    # the engine's own checks, on an empty stand-in of the same dtype (shape does not matter to them)
    stand_in = torch.empty(0, dtype=torch_dtype(x.dtype))
    return _tf_names(_c.check_allreduce_args, stand_in, name, op, pre, post, argument)


def _check_scale(value: Any, argument: str, x: tf.Tensor) -> float:
    return _tf_names(_c.check_scale, value, argument, torch.empty(0, dtype=torch_dtype(x.dtype)))


def _tf_names(check: Callable[..., Any], *args: Any) -> Any:
    """Run one of the engine's checks; its messages name dtypes as TensorFlow does."""
    try:
        return check(*args)
    except ValueError as exc:
        raise ValueError(str(exc).replace("torch.", "")) from None


def _check_not_scalar(x: tf.Tensor, what: str, name: Optional[str]) -> None:
    if x.shape.rank == 0:
        label = f"tensor {name!r}" if name else "tensor"
        raise ValueError(f"{label} is a scalar; {what} needs at least one dimension (use tf.reshape(t, [1]))")


def _first_dim_unknown(x: tf.Tensor) -> tf.TensorShape:
    return tf.TensorShape([None]).concatenate(x.shape[1:]) if x.shape.rank else tf.TensorShape(None)


def _differentiable(
    forward: Callable[[list[tf.Tensor]], list[tf.Tensor]],
    backward: Callable[[list[tf.Tensor], list[tf.Tensor], list[tf.Tensor]], list[Optional[tf.Tensor]]],
    inputs: Sequence[tf.Tensor],
) -> list[tf.Tensor]:
    """``forward(inputs)`` with ``backward(inputs, outputs, output_grads)`` as its gradient."""

    @tf.custom_gradient
    def op(*xs: tf.Tensor):
        ys = forward(list(xs))

        def grad(*dys: Optional[tf.Tensor]):
            dys = [tf.zeros_like(y) if dy is None else dy for y, dy in zip(ys, dys)]
            return backward(list(xs), ys, dys)

        return ys, grad

    return list(op(*inputs))


# -- allreduce -----------------------------------------------------------------------------------
def _allreduce_raw(x: tf.Tensor, name: Optional[str], op: ReduceOp, pre: float, post: float, ps: ProcessSet) -> tf.Tensor:
    name = bridge.build_name(name, "allreduce")
    def kernel(xs: list[tf.Tensor]) -> list[tf.Tensor]:
        return [to_tf(_c.call_blocking(_c.allreduce_async, to_torch(xs[0]), name, op, pre, post, process_set=ps))]

    return bridge.run(kernel, [x], [x.dtype], [x.shape], "allreduce")[0]


def _gradient_op(op: ReduceOp, what: str) -> ReduceOp:
    if op not in (Average, Sum):
        raise ValueError(f"{what} with op={op.name.lower()} has no gradient; use hvd.Sum or hvd.Average")
    return op


def allreduce(
    tensor: Any,
    average: Optional[bool] = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = Compression.none,
    op: Optional[ReduceOp] = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    name: Optional[str] = None,
    process_set: Any = None,
) -> Any:
    """Reduce ``tensor`` across ranks (Average unless ``op`` says otherwise); differentiable.

    A ``tf.IndexedSlices`` is reduced as Horovod does: its values and indices are allgathered (Sum and
    Average only, without pre/postscale factors: ``NotImplementedError``, as Horovod).
    """
    ps = check_common(compression, process_set, device_dense, device_sparse)
    reduce_op = _c.resolve_op(op, average)
    name = _check_name(name)
    if isinstance(tensor, tf.IndexedSlices):
        check_sparse(reduce_op, prescale_factor, postscale_factor)
        return sparse_allreduce([tensor], reduce_op, 1.0, name, ps)[0]
    x = as_tensor(tensor)
    pre, post = _check_allreduce(x, name, reduce_op, prescale_factor, postscale_factor)

    def backward(xs, ys, dys):
        return [_allreduce_raw(dys[0], None, _gradient_op(reduce_op, "allreduce"), pre, post, ps)]

    compressor = for_tensorflow(compression)

    def forward(xs):
        wire, ctx = compressor.compress(xs[0])
        return [compressor.decompress(_allreduce_raw(wire, name, reduce_op, pre, post, ps), ctx)]

    return _differentiable(forward, backward, [x])[0]


def check_sparse(op: ReduceOp, prescale_factor: Any, postscale_factor: Any) -> None:
    """Horovod's limits on reducing ``tf.IndexedSlices``, raised as Horovod raises them."""
    if op == Adasum:
        raise NotImplementedError(
            "op=hvd.Adasum does not support tf.IndexedSlices; pass sparse_as_dense=True to reduce them densely"
        )
    if op not in (Average, Sum):
        raise NotImplementedError(f"tf.IndexedSlices support only op=hvd.Sum or hvd.Average, got {op.name.lower()}")
    if prescale_factor != 1.0 or postscale_factor != 1.0:
        raise NotImplementedError("prescale_factor and postscale_factor are not supported with tf.IndexedSlices")


def sparse_allreduce(
    slices: list[tf.IndexedSlices], op: ReduceOp, scale: float, name: Optional[str], ps: ProcessSet
) -> list[tf.IndexedSlices]:
    """Reduce ``tf.IndexedSlices`` as Horovod does: every rank's values and indices, allgathered (in one
    grouped allgather), values times ``scale``, then divided by the set's size for Average (TensorFlow's true
    division: integer values become floats, as in Horovod). ``op`` is Sum or
    Average; gradient reducers pass their predivide factor as ``scale``."""
    values = [as_tensor(s.values, f"tensors[{i}].values") for i, s in enumerate(slices)]
    indices = [as_tensor(s.indices, f"tensors[{i}].indices") for i, s in enumerate(slices)]
    gathered = grouped_allgather(values + indices, name=f"{name}.sparse" if name else None, process_set=ps)
    out = []
    for i, s in enumerate(slices):
        value = gathered[i] if scale == 1.0 else gathered[i] * tf.cast(scale, gathered[i].dtype)
        if op == Average:  # TensorFlow's true division, as Horovod: integer values come back as floats
            value = value / tf.cast(ps.size(), value.dtype)
        out.append(tf.IndexedSlices(value, gathered[len(slices) + i], dense_shape=s.dense_shape))
    return out


def _grouped_allreduce_raw(
    xs: list[tf.Tensor], name: Optional[str], op: ReduceOp, pre: float, post: float, ps: ProcessSet
) -> list[tf.Tensor]:
    name = bridge.build_name(name, "grouped_allreduce")

    def kernel(eager: list[tf.Tensor]) -> list[tf.Tensor]:
        reduced = _c.call_blocking(_c.grouped_allreduce_async, [to_torch(x) for x in eager], name, op, pre, post, process_set=ps)
        return [to_tf(r) for r in reduced]

    return bridge.run(kernel, xs, [x.dtype for x in xs], [x.shape for x in xs], "grouped_allreduce")


def grouped_allreduce(
    tensors: Sequence[Any],
    average: Optional[bool] = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = Compression.none,
    op: Optional[ReduceOp] = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    name: Optional[str] = None,
    process_set: Any = None,
) -> list[tf.Tensor]:
    """Reduce a list of tensors together (fused by the engine, one py_function in a graph); differentiable.

    ``tf.IndexedSlices`` among them are reduced as :func:`allreduce` reduces them (one grouped allgather).
    """
    ps = check_common(compression, process_set, device_dense, device_sparse)
    if not isinstance(tensors, (list, tuple)):
        raise TypeError(f"tensors must be a list of tensors, got {type(tensors).__name__}")
    if not tensors:
        return list(tensors)  # Horovod returns an empty list as it is
    reduce_op = _c.resolve_op(op, average)
    name = _check_name(name)
    sparse = [i for i, t in enumerate(tensors) if isinstance(t, tf.IndexedSlices)]
    dense = [i for i, t in enumerate(tensors) if not isinstance(t, tf.IndexedSlices)]
    out: list[Any] = [None] * len(tensors)
    if sparse:
        check_sparse(reduce_op, prescale_factor, postscale_factor)
        for i, reduced in zip(sparse, sparse_allreduce([tensors[i] for i in sparse], reduce_op, 1.0, name, ps)):
            out[i] = reduced
    if not dense:
        return out
    xs = []
    for i in dense:
        xs.append(as_tensor(tensors[i], f"tensors[{i}]"))
        pre, post = _check_allreduce(xs[-1], name, reduce_op, prescale_factor, postscale_factor, f"tensors[{i}]")
    compressor = for_tensorflow(compression)

    def backward(xs, ys, dys):
        return _grouped_allreduce_raw(dys, None, _gradient_op(reduce_op, "grouped_allreduce"), pre, post, ps)

    def forward(xs):
        packed = [compressor.compress(x) for x in xs]
        reduced = _grouped_allreduce_raw([w for w, _ in packed], name, reduce_op, pre, post, ps)
        return [compressor.decompress(r, ctx) for r, (_, ctx) in zip(reduced, packed)]

    for i, reduced in zip(dense, _differentiable(forward, backward, xs)):
        out[i] = reduced
    return out


# -- allgather, broadcast, alltoall, reducescatter ---------------------------------------------------
def _allgather_raw(xs: list[tf.Tensor], name: Optional[str], ps: ProcessSet) -> list[tf.Tensor]:
    """One allgather (one tensor) or a grouped one, as one node in a graph."""
    name = bridge.build_name(name, "allgather")

    def kernel(eager: list[tf.Tensor]) -> list[tf.Tensor]:
        if len(eager) == 1:
            return [to_tf(_c.call_blocking(_c.allgather_async, to_torch(eager[0]), name, ps))]
        return [to_tf(out) for out in _c.call_blocking(_c.grouped_allgather_async, [to_torch(x) for x in eager], name, ps)]

    what = "allgather" if len(xs) == 1 else "grouped_allgather"
    return bridge.run(kernel, xs, [x.dtype for x in xs], [_first_dim_unknown(x) for x in xs], what)


def allgather(
    tensor: Any, name: Optional[str] = None, ignore_name_scope: bool = False, process_set: Any = None
) -> tf.Tensor:
    """Concatenate every rank's ``tensor`` along dim 0 (first dimensions may differ); differentiable."""
    return _allgather([tensor], "tensor", name, process_set)[0]


def grouped_allgather(
    tensors: Sequence[Any], name: Optional[str] = None, ignore_name_scope: bool = False, process_set: Any = None
) -> list[tf.Tensor]:
    """:func:`allgather` of each of ``tensors``, negotiated together (one node in a graph); differentiable."""
    if not isinstance(tensors, (list, tuple)):
        raise TypeError(f"tensors must be a list of tensors, got {type(tensors).__name__}")
    if not tensors:
        return list(tensors)  # Horovod returns an empty list as it is
    return _allgather(tensors, "tensors", name, process_set)


def _allgather(tensors: Sequence[Any], argument: str, name: Optional[str], process_set: Any) -> list[tf.Tensor]:
    ps = check_common(process_set=process_set)
    name = _check_name(name)
    xs = [as_tensor(t, argument if argument == "tensor" else f"tensors[{i}]") for i, t in enumerate(tensors)]
    for x in xs:
        _check_not_scalar(x, "allgather", name)

    def backward(xs, ys, dys):
        # Horovod's gradient: the upstream gradient averaged across ranks, this rank's rows of it
        averaged = _grouped_allreduce_raw(dys, None, Average, 1.0, 1.0, ps)
        rows = tf.stack([tf.shape(x, out_type=tf.int64)[0] for x in xs])
        every_rank = tf.reshape(_allgather_raw([rows], None, ps)[0], [ps.size(), len(xs)])
        offsets = tf.reduce_sum(every_rank[: ps.rank()], axis=0)
        return [a[offsets[i] : offsets[i] + rows[i]] for i, a in enumerate(averaged)]

    return _differentiable(lambda xs: _allgather_raw(xs, name, ps), backward, xs)


def broadcast_tensors(
    xs: list[tf.Tensor], root_rank: int, names: list[Optional[str]], ps: ProcessSet
) -> list[tf.Tensor]:
    """Root's values of ``xs`` on every rank, in one exchange (one node in a graph) and without a gradient:
    :func:`broadcast` and ``broadcast_variables`` run on it. ``ps`` is a checked process set."""
    names = [bridge.build_name(n, "broadcast") for n in names]

    def kernel(eager: list[tf.Tensor]) -> list[tf.Tensor]:
        handles = [_c.broadcast_async(to_torch(x), root_rank, n, process_set=ps) for x, n in zip(eager, names)]
        return [to_tf(_c.synchronize(h)) for h in handles]

    return bridge.run(kernel, xs, [x.dtype for x in xs], [x.shape for x in xs], "broadcast")


def broadcast(
    tensor: Any, root_rank: int, name: Optional[str] = None, ignore_name_scope: bool = False, process_set: Any = None
) -> tf.Tensor:
    """Root's ``tensor`` on every rank; differentiable (as Horovod's: the upstream gradient averaged across
    ranks reaches root, the others get zeros)."""
    ps = check_common(process_set=process_set)
    name = _check_name(name)
    x = as_tensor(tensor)
    _c.check_root(root_rank, ps)

    def backward(xs, ys, dys):
        averaged = _allreduce_raw(dys[0], None, Average, 1.0, 1.0, ps)
        # Horovod's "* 0", not tf.zeros_like: a graph builds zeros_like of a known shape without its input, and
        # Session.run would then skip this rank's allreduce while the root's waits for it
        return [averaged if rank() == root_rank else averaged * tf.constant(0, averaged.dtype)]

    return _differentiable(lambda xs: broadcast_tensors(xs, root_rank, [name], ps), backward, [x])[0]


def _alltoall_raw(
    x: tf.Tensor, splits: Optional[tf.Tensor], name: Optional[str], ps: ProcessSet
) -> list[tf.Tensor]:
    name = bridge.build_name(name, "alltoall")

    def kernel(xs: list[tf.Tensor]) -> list[tf.Tensor]:
        split_list = [int(s) for s in np.asarray(xs[1]).reshape(-1)] if splits is not None else None
        output, received = _c.call_blocking(_c.alltoall_async, to_torch(xs[0]), split_list, name, ps)
        return [to_tf(output), to_tf(received)]

    inputs = [x] if splits is None else [x, splits]
    shapes = [_first_dim_unknown(x), tf.TensorShape([ps.size()])]
    return bridge.run(kernel, inputs, [x.dtype, tf.int32], shapes, "alltoall")


def alltoall(
    tensor: Any,
    splits: Any = None,
    name: Optional[str] = None,
    ignore_name_scope: bool = False,
    process_set: Any = None,
) -> Any:
    """Send slice i of dim 0 (``splits[i]`` rows, or equal parts) to rank i; differentiable.

    Returns the gathered tensor, and also the received splits (int32) when ``splits`` was given.
    """
    ps = check_common(process_set=process_set)
    name = _check_name(name)
    x = as_tensor(tensor)
    _check_not_scalar(x, "alltoall", name)
    split_tensor = None
    if splits is not None:
        try:
            split_tensor = tf.convert_to_tensor(splits)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"splits must be a list of ints or an integer tensor, got {splits!r}") from exc
        if not split_tensor.dtype.is_integer or split_tensor.shape.rank not in (None, 1):
            raise TypeError(f"splits must be a list of ints or a 1-d integer tensor, got {splits!r}")
        if split_tensor.shape[0] is not None and split_tensor.shape[0] != ps.size():
            raise ValueError(f"splits must hold one count per rank ({ps.size()}), got {split_tensor.shape[0]}")

    def backward(xs, ys, dys):
        return [_alltoall_raw(dys[0], ys[1], None, ps)[0]] + [None] * (len(xs) - 1)

    output, received = _differentiable(
        lambda xs: _alltoall_raw(xs[0], xs[1] if len(xs) > 1 else None, name, ps),
        backward,
        [x] if split_tensor is None else [x, split_tensor],
    )
    return (output, received) if splits is not None else output


def _reducescatter_raw(
    xs: list[tf.Tensor], name: Optional[str], op: ReduceOp, pre: float, post: float, ps: ProcessSet
) -> list[tf.Tensor]:
    """One reducescatter (one tensor) or a grouped one, as one node in a graph."""
    name = bridge.build_name(name, "reducescatter")

    def kernel(eager: list[tf.Tensor]) -> list[tf.Tensor]:
        if len(eager) == 1:
            return [to_tf(_c.call_blocking(_c.reducescatter_async, to_torch(eager[0]), name, op, pre, post, process_set=ps))]
        reduced = _c.call_blocking(
            _c.grouped_reducescatter_async, [to_torch(x) for x in eager], name, op, pre, post, process_set=ps
        )
        return [to_tf(out) for out in reduced]

    what = "reducescatter" if len(xs) == 1 else "grouped_reducescatter"
    return bridge.run(kernel, xs, [x.dtype for x in xs], [_first_dim_unknown(x) for x in xs], what)


def reducescatter(
    tensor: Any,
    device_dense: str = "",
    compression: Any = Compression.none,
    op: ReduceOp = Average,
    name: Optional[str] = None,
    process_set: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> tf.Tensor:
    """Reduce across ranks, then keep this rank's slice of dim 0 (the first ranks get any extra row);
    differentiable for Sum and Average."""
    return _reducescatter([tensor], "tensor", device_dense, compression, op, name, process_set, prescale_factor,
                          postscale_factor)[0]


def grouped_reducescatter(
    tensors: Sequence[Any],
    device_dense: str = "",
    compression: Any = Compression.none,
    op: ReduceOp = Average,
    process_set: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    name: Optional[str] = None,
) -> list[tf.Tensor]:
    """:func:`reducescatter` of each of ``tensors``, negotiated together (one node in a graph); differentiable."""
    if not isinstance(tensors, (list, tuple)):
        raise TypeError(f"tensors must be a list of tensors, got {type(tensors).__name__}")
    if not tensors:
        return list(tensors)  # Horovod returns an empty list as it is
    return _reducescatter(tensors, "tensors", device_dense, compression, op, name, process_set, prescale_factor,
                          postscale_factor)


def _reducescatter(
    tensors: Sequence[Any], argument: str, device_dense: Any, compression: Any, op: Any, name: Optional[str],
    process_set: Any, prescale_factor: Any, postscale_factor: Any,
) -> list[tf.Tensor]:
    ps = check_common(compression, process_set, device_dense)
    reduce_op = _c.resolve_op(op)
    name = _check_name(name)
    xs = [as_tensor(t, argument if argument == "tensor" else f"tensors[{i}]") for i, t in enumerate(tensors)]
    for x in xs:
        _check_not_scalar(x, "reducescatter", name)
        pre = _check_scale(prescale_factor, "prescale_factor", x)
        post = _check_scale(postscale_factor, "postscale_factor", x)
    compressor = for_tensorflow(compression)

    def backward(xs, ys, dys):
        # Horovod's gradient: every rank's upstream gradient gathered, times size() for Sum (not for Average)
        scale = pre * post * (ps.size() if _gradient_op(reduce_op, "reducescatter") == Sum else 1)
        gathered = _allgather_raw(dys, None, ps)
        return [g * tf.cast(scale, g.dtype) if scale != 1.0 else g for g in gathered]

    def forward(xs):
        packed = [compressor.compress(x) for x in xs]
        out = _reducescatter_raw([w for w, _ in packed], name, reduce_op, pre, post, ps)
        return [compressor.decompress(o, ctx) for o, (_, ctx) in zip(out, packed)]

    return _differentiable(forward, backward, xs)


# -- synchronisation and Python objects -------------------------------------------------------------
def _no_input_op(run: Callable[[], int], what: str) -> tf.Tensor:
    return bridge.run(lambda _: [tf.constant(run(), tf.int32)], [], [tf.int32], [tf.TensorShape([])], what)[0]


def barrier(process_set: Any = None) -> None:
    """Wait until every rank reaches the barrier (inside ``tf.function``: each time the graph runs)."""
    ps = check_common(process_set=process_set)
    _no_input_op(lambda: _c.barrier(ps) or 0, "barrier")


def join() -> tf.Tensor:
    """Declare this rank out of data (joined ranks add zeros to allreduces); returns the last rank to join."""
    return _no_input_op(_c.join, "join")


def check_session(session: Any) -> None:
    if session is not None:
        raise ValueError("session: TensorFlow 1 sessions are not supported; call this in eager mode")


def broadcast_object(obj: Any, root_rank: int = 0, session: Any = None, name: Optional[str] = None,
                     process_set: Any = None) -> Any:
    """Root's picklable ``obj`` on every rank (pickled and authenticated with the job's secret)."""
    check_session(session)
    ps = check_common(process_set=process_set)
    return _c.broadcast_object(obj, root_rank, name, process_set=ps)


def allgather_object(obj: Any, session: Any = None, name: Optional[str] = None, process_set: Any = None) -> list[Any]:
    """Every rank's picklable ``obj``, in rank order."""
    check_session(session)
    ps = check_common(process_set=process_set)
    return _c.allgather_object(obj, name, process_set=ps)
