"""Averaging gradients across ranks: the reducer shared by ``DistributedGradientTape`` and Keras'
``DistributedOptimizer``, and the tape itself."""

from __future__ import annotations

from typing import Any, Optional, Sequence

import tensorflow as tf

from hvdray.collective import ops as _c
from hvdray.collective.compression import Compression
from hvdray.tensorflow import ops as _ops


class GradientReducer:
    """Reduces a list of gradients: dense ones in one grouped allreduce (fused by the engine, one
    ``py_function`` in a graph), ``tf.IndexedSlices`` by allgather (or densified with
    ``sparse_as_dense``); ``None`` stays ``None``. Names are stable, so every step negotiates the same tensors."""

    def __init__(
        self,
        name: str,
        compression: Any = Compression.none,
        sparse_as_dense: bool = False,
        op: Any = _c.Average,
        gradient_predivide_factor: float = 1.0,
        process_set: Any = None,
        device_dense: Any = "",
        device_sparse: Any = "",
    ) -> None:
        self.process_set = _ops.check_common(compression, process_set, device_dense, device_sparse)
        op = _c.resolve_op(op)
        if op not in (_c.Average, _c.Sum, _c.Adasum):
            raise ValueError(f"op= must be hvd.Average, hvd.Sum or hvd.Adasum for gradients, got {op.name.lower()}")
        if isinstance(gradient_predivide_factor, bool) or not isinstance(gradient_predivide_factor, (int, float)) or (
            gradient_predivide_factor <= 0
        ):
            raise ValueError(f"gradient_predivide_factor must be a number > 0, got {gradient_predivide_factor!r}")
        if gradient_predivide_factor != 1.0 and op != _c.Average:
            raise ValueError("gradient_predivide_factor needs op=hvd.Average")
        if not isinstance(sparse_as_dense, bool):
            raise TypeError(f"sparse_as_dense must be a bool, got {sparse_as_dense!r}")
        self.name = name
        self.compression = compression
        self.sparse_as_dense = sparse_as_dense
        self.op = op
        factor = float(gradient_predivide_factor)
        self.prescale, self.postscale = (1.0 / factor, factor) if op == _c.Average else (1.0, 1.0)

    def __call__(self, grads: Sequence[Any]) -> list[Any]:
        grads = list(grads)
        if self.process_set.size() == 1:
            return grads
        if self.sparse_as_dense:
            grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]
        out = list(grads)
        dense = [i for i, g in enumerate(grads) if g is not None and not isinstance(g, tf.IndexedSlices)]
        if dense:
            reduced = _ops.grouped_allreduce(
                [grads[i] for i in dense], compression=self.compression, op=self.op,
                prescale_factor=self.prescale, postscale_factor=self.postscale, name=self.name,
                process_set=self.process_set,
            )
            for i, value in zip(dense, reduced):
                out[i] = value
        for i, g in enumerate(grads):
            if isinstance(g, tf.IndexedSlices):
                out[i] = _ops.allreduce(
                    g, op=self.op, prescale_factor=self.prescale, postscale_factor=self.postscale,
                    name=f"{self.name}.sparse.{i}", process_set=self.process_set,
                )
        return out


class _DistributedTape:
    """Mixed in front of the tape's own class: ``gradient`` returns gradients reduced across ranks."""

    _hvd_reduce: GradientReducer

    def gradient(  # type: ignore[override]
        self,
        target: Any,
        sources: Any,
        output_gradients: Any = None,
        unconnected_gradients: tf.UnconnectedGradients = tf.UnconnectedGradients.NONE,
    ) -> Any:
        grads = super().gradient(target, sources, output_gradients, unconnected_gradients)  # type: ignore[misc]
        flat = tf.nest.flatten(grads)  # None and IndexedSlices are leaves
        return tf.nest.pack_sequence_as(grads, self._hvd_reduce(flat))


_tape_classes: dict[type, type] = {}


def DistributedGradientTape(  # noqa: N802 - Horovod's public name
    gradtape: tf.GradientTape,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = Compression.none,
    sparse_as_dense: bool = False,
    op: Any = _c.Average,
    gradient_predivide_factor: float = 1.0,
    process_set: Any = None,
    name: Optional[str] = None,
) -> tf.GradientTape:
    """Make ``gradtape.gradient(...)`` average (or sum) the gradients across ranks.

    The tape itself is turned into its distributed form and returned, so it may be wrapped inside
    or after its ``with`` block.
    """
    if not isinstance(gradtape, tf.GradientTape):
        raise TypeError(f"gradtape must be a tf.GradientTape, got {type(gradtape).__name__}")
    if isinstance(gradtape, _DistributedTape):
        raise ValueError("gradtape is already a DistributedGradientTape")
    reducer = GradientReducer(
        name or "DistributedGradientTape", compression, sparse_as_dense, op, gradient_predivide_factor,
        process_set, device_dense, device_sparse,
    )
    base = type(gradtape)
    cls = _tape_classes.get(base)
    if cls is None:
        cls = _tape_classes[base] = type(f"Distributed{base.__name__}", (_DistributedTape, base), {})
    gradtape.__class__ = cls
    gradtape._hvd_reduce = reducer
    return gradtape
