"""Averaging gradients across ranks: the reducer shared by ``DistributedGradientTape`` and Keras'
``DistributedOptimizer``, and the tape itself."""

from __future__ import annotations

from typing import Any, Iterable, Optional, Sequence

import tensorflow as tf

from hvdray.collective import ops as _c
from hvdray.tensorflow.compression import Compression
from hvdray.collective.gradient_groups import GroupSpec, consecutive_runs, group_of_positions, resolve_groups
from hvdray.tensorflow import ops as _ops


def variable_key(variable: Any, argument: Optional[str] = "var") -> Any:
    """What identifies a variable in a set: ``ref()`` for TensorFlow's, the object for Keras 3's (which
    has no ``ref``); None for anything else."""
    if hasattr(variable, "ref"):
        return variable.ref()
    import keras

    if isinstance(variable, keras.Variable):
        return id(variable)
    if argument is None:
        return None
    raise TypeError(f"{argument} must be a tf.Variable, keras.Variable or tf.Tensor, got {type(variable).__name__}")


class GradientReducer:
    """Reduces a list of gradients: dense ones in one grouped allreduce (fused by the engine, one
    ``py_function`` in a graph), or one per group with Horovod's ``groups`` (see gradient_groups.py;
    listed variables' gradients per group, the others in one more), ``tf.IndexedSlices`` by allgather
    (or densified with ``sparse_as_dense``); ``None`` stays ``None``. Names are stable, so every step
    negotiates the same tensors.

    Gradients of variables registered with :meth:`register_local` are not reduced: they stay this rank's
    own, divided by the number of ranks with ``scale_local_gradients`` (as Horovod). ``scale`` multiplies
    every reduced gradient (``backward_passes_per_step``'s sum of accumulated gradients)."""

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
        groups: GroupSpec = 0,
        scale_local_gradients: bool = True,
        scale: float = 1.0,
    ) -> None:
        if not isinstance(scale_local_gradients, bool):
            raise TypeError(f"scale_local_gradients must be a bool, got {scale_local_gradients!r}")
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
        self.prescale, self.postscale = (1.0 / factor, factor * scale) if op == _c.Average else (1.0, float(scale))
        self.groups = groups
        self.local: dict[Any, Any] = {}  # variable_key -> the variable (kept alive: Keras' keys are ids)
        self.scale_local = scale_local_gradients

    def register_local(self, variable: Any, argument: str = "var") -> None:
        """Keep ``variable``'s gradient on this rank: it is never reduced across ranks."""
        self.local[variable_key(variable, argument)] = variable

    @tf.autograph.experimental.do_not_convert  # plain Python over lists: autograph would rewrite its returns
    def __call__(self, grads: Sequence[Any], variables: Optional[Sequence[Any]] = None) -> list[Any]:
        """``grads`` reduced across ranks; ``variables`` (in the same order) place them in their groups."""
        grads = list(grads)
        if variables is not None and len(variables) != len(grads):
            raise ValueError(f"{len(grads)} gradients but {len(variables)} variables")
        if self.local and variables is not None:
            local = {i for i, v in enumerate(variables) if variable_key(v, None) in self.local}
            if local:
                return self._with_local(grads, list(variables), local)
        if self.process_set.size() == 1 and self.prescale * self.postscale == 1.0:
            return grads
        if self.sparse_as_dense:
            grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]
        out = list(grads)
        dense = [i for i, g in enumerate(grads) if g is not None and not isinstance(g, tf.IndexedSlices)]
        for name, members in self._dense_groups(dense, variables):
            reduced = _ops.grouped_allreduce(
                [grads[i] for i in members], compression=self.compression, op=self.op,
                prescale_factor=self.prescale, postscale_factor=self.postscale, name=name,
                process_set=self.process_set,
            )
            for i, value in zip(members, reduced):
                out[i] = value
        sparse = [i for i, g in enumerate(grads) if isinstance(g, tf.IndexedSlices)]
        if sparse:
            _ops.check_sparse(self.op, 1.0, 1.0)
            reduced = _ops.sparse_allreduce(
                [grads[i] for i in sparse], self.op, self.prescale * self.postscale, self.name, self.process_set
            )
            for i, value in zip(sparse, reduced):
                out[i] = value
        return out


    def _with_local(self, grads: list[Any], variables: list[Any], local: set[int]) -> list[Any]:
        shared = [i for i in range(len(grads)) if i not in local]
        out = list(grads)
        for i, g in zip(shared, self([grads[i] for i in shared], [variables[i] for i in shared])):
            out[i] = g
        size = self.process_set.size()
        for i in local:
            g = out[i]
            if self.scale_local and g is not None:
                out[i] = tf.IndexedSlices(g.values / size, g.indices, g.dense_shape) if isinstance(
                    g, tf.IndexedSlices) else g / size
        return out

    def _dense_groups(self, dense: list[int], variables: Optional[Sequence[Any]]) -> list[tuple[str, list[int]]]:
        """(allreduce name, gradient indices) of each group of the ``dense`` gradients, empty ones left out."""
        if isinstance(self.groups, int):
            if not self.groups:
                return [(self.name, dense)] if dense else []
            return [(f"{self.name}.group{g}", dense[a:b]) for g, (a, b) in enumerate(consecutive_runs(len(dense), self.groups))]
        if variables is None:
            raise ValueError("groups= lists variables, but the gradients came without their variables")
        group_of = group_of_positions(self.groups, variables, "one of the variables whose gradients are reduced")
        members: list[list[int]] = [[] for _ in self.groups]
        rest = []
        for i in dense:
            (members[group_of[i]] if i in group_of else rest).append(i)
        named = [(f"{self.name}.group{g}", m) for g, m in enumerate(members) if m]
        return named + ([(self.name, rest)] if rest else [])


class _DistributedTape:
    """Mixed in front of the tape's own class: ``gradient`` returns gradients reduced across ranks, except
    those of sources registered as local (``register_local_source``; see :class:`GradientReducer`)."""

    _hvd_reduce: GradientReducer

    def register_local_source(self, source: Any) -> None:
        """Keep ``source``'s gradient on this rank: it is never reduced across ranks."""
        self._hvd_reduce.register_local(source, "source")

    @tf.autograph.experimental.do_not_convert
    def gradient(  # type: ignore[override]
        self,
        target: Any,
        sources: Any,
        output_gradients: Any = None,
        unconnected_gradients: tf.UnconnectedGradients = tf.UnconnectedGradients.NONE,
    ) -> Any:
        grads = super().gradient(target, sources, output_gradients, unconnected_gradients)  # type: ignore[misc]
        flat = tf.nest.flatten(grads)  # None and IndexedSlices are leaves
        return tf.nest.pack_sequence_as(grads, self._hvd_reduce(flat, tf.nest.flatten(sources)))

    def get_local_and_global_gradients(
        self, target: Any, sources: Sequence[Any], output_gradients: Any = None
    ) -> tuple[list[tuple[Any, Any]], list[tuple[Any, Any]]]:
        """``gradient``'s results split: ([(local source, gradient)], [(other source, reduced gradient)])."""
        grads = self.gradient(target, list(sources), output_gradients)
        pairs = list(zip(sources, grads))
        is_local = [variable_key(s, None) in self._hvd_reduce.local for s in sources]
        return [p for p, l in zip(pairs, is_local) if l], [p for p, l in zip(pairs, is_local) if not l]


_tape_classes: dict[type, type] = {}


def DistributedGradientTape(  # noqa: N802 - Horovod's public name
    gradtape: tf.GradientTape,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = Compression.none,
    sparse_as_dense: bool = False,
    op: Any = _c.Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: Any = None,
    process_set: Any = None,
    scale_local_gradients: bool = True,
    name: Optional[str] = None,
) -> tf.GradientTape:
    """Make ``gradtape.gradient(...)`` average (or sum) the gradients across ranks.

    The tape itself is turned into its distributed form and returned, so it may be wrapped inside
    or after its ``with`` block. ``groups`` / ``num_groups``: see gradient_groups.py.
    """
    if not isinstance(gradtape, tf.GradientTape):
        raise TypeError(f"gradtape must be a tf.GradientTape, got {type(gradtape).__name__}")
    if isinstance(gradtape, _DistributedTape):
        raise ValueError("gradtape is already a DistributedGradientTape")
    reducer = GradientReducer(
        name or "DistributedGradientTape", compression, sparse_as_dense, op, gradient_predivide_factor,
        process_set, device_dense, device_sparse, resolve_groups(groups, num_groups), scale_local_gradients,
    )
    base = type(gradtape)
    cls = _tape_classes.get(base)
    if cls is None:
        cls = _tape_classes[base] = type(f"Distributed{base.__name__}", (_DistributedTape, base), {})
    gradtape.__class__ = cls
    gradtape._hvd_reduce = reducer
    return gradtape


def local_layer_variables(local_layers: Any) -> list[Any]:
    """The trainable variables of ``local_layers`` (one Keras layer, a list of them, or None)."""
    import keras

    if local_layers is None:
        return []
    layers = [local_layers] if isinstance(local_layers, keras.layers.Layer) else local_layers
    if isinstance(layers, (str, bytes)) or not isinstance(layers, Iterable):
        raise TypeError(f"local_layers must be a Keras layer or a list of them, got {type(local_layers).__name__}")
    layers = list(layers)
    for i, layer in enumerate(layers):
        if not isinstance(layer, keras.layers.Layer):
            raise ValueError(f"local_layers[{i}] must be a Keras layer, got {type(layer).__name__}")
    return [var for layer in layers for var in layer.trainable_weights]


def PartialDistributedGradientTape(  # noqa: N802 - Horovod's public name
    gradtape: tf.GradientTape,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = Compression.none,
    sparse_as_dense: bool = False,
    op: Any = _c.Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: Any = None,
    process_set: Any = None,
    local_layers: Any = None,
    scale_local_gradients: bool = True,
) -> tf.GradientTape:
    """:func:`DistributedGradientTape` whose ``local_layers``' (Keras layers') gradients stay local."""
    local = local_layer_variables(local_layers)
    tape = DistributedGradientTape(
        gradtape, device_dense, device_sparse, compression, sparse_as_dense, op, gradient_predivide_factor,
        num_groups, groups, process_set, scale_local_gradients,
    )
    for var in local:
        tape.register_local_source(var)
    return tape
