"""``hvd.DistributedOptimizer`` of ``hvdray.tensorflow``: a TensorFlow 1 optimizer
(``tf.compat.v1.train.Optimizer``) whose ``compute_gradients`` returns gradients reduced across ranks;
a Keras optimizer goes to :func:`hvdray.tensorflow.keras.DistributedOptimizer`, as in Horovod.

``backward_passes_per_step=n`` (graph mode, as Horovod's): each run adds this rank's gradients to local
accumulators; every n-th run reduces the accumulated sum (its mean with ``average_aggregated_gradients``)
and applies it, the other runs only advance ``global_step``.
"""

from __future__ import annotations

from typing import Any, Optional

import tensorflow as tf

from hvdray.collective import ops as _c
from hvdray.collective.gradient_groups import resolve_groups
from hvdray.tensorflow.compression import Compression
from hvdray.tensorflow.gradients import GradientReducer


class _DistributedLegacyOptimizer(tf.compat.v1.train.Optimizer):
    """Wraps a ``tf.compat.v1.train.Optimizer``; everything but ``compute_gradients`` is the wrapped one's."""

    def __init__(
        self, optimizer: Any, name: str, use_locking: bool, reducer: GradientReducer, passes: int,
        average_aggregated: bool,
    ) -> None:
        super().__init__(name=name, use_locking=use_locking)
        self._optimizer = optimizer
        self._reduce = reducer
        self._passes = passes
        self._average_aggregated = average_aggregated
        self._counter: Optional[tf.Variable] = None

    def register_local_var(self, var: Any) -> None:
        """Keep ``var``'s gradient on this rank: it is never reduced across ranks."""
        self._reduce.register_local(var)

    def compute_gradients(self, *args: Any, **kwargs: Any) -> list[tuple[Any, Any]]:
        """The wrapped optimizer's (gradient, variable) pairs, gradients reduced across ranks."""
        pairs = self._optimizer.compute_gradients(*args, **kwargs)
        grads, variables = [g for g, _ in pairs], [v for _, v in pairs]
        if self._passes == 1:
            return list(zip(self._reduce(grads, variables), variables))
        return list(zip(self._aggregate(grads, variables), variables))

    def _aggregate(self, grads: list[Any], variables: list[Any]) -> list[Any]:
        local = [tf.compat.v1.GraphKeys.LOCAL_VARIABLES]
        with tf.compat.v1.variable_scope(self.get_name() + "_aggregation", reuse=tf.compat.v1.AUTO_REUSE):
            self._counter = tf.compat.v1.get_variable(
                "counter", initializer=tf.constant(0, tf.int64), trainable=False, collections=local
            )
            self._accumulators = [
                None if g is None else tf.compat.v1.get_variable(
                    f"accumulator_{i}", initializer=tf.zeros(v.shape, v.dtype.base_dtype), trainable=False,
                    collections=local,
                )
                for i, (g, v) in enumerate(zip(grads, variables))
            ]
        adds = [acc.assign_add(tf.convert_to_tensor(g)) for g, acc in zip(grads, self._accumulators) if g is not None]
        with tf.control_dependencies(adds):
            count = self._counter.assign_add(1)
        self._is_apply_step = tf.equal(count % self._passes, 0)
        present = [i for i, g in enumerate(grads) if g is not None]
        divisor = float(self._passes) if self._average_aggregated else 1.0

        def reduced() -> list[tf.Tensor]:
            summed = [self._accumulators[i].read_value() / divisor for i in present]
            return [tf.convert_to_tensor(g) for g in self._reduce(summed, [variables[i] for i in present])]

        def unreduced() -> list[tf.Tensor]:
            return [self._accumulators[i].read_value() for i in present]

        outputs = tf.cond(self._is_apply_step, reduced, unreduced) if present else []
        out: list[Any] = [None] * len(grads)
        for i, value in zip(present, outputs):
            out[i] = value
        return out

    def apply_gradients(self, grads_and_vars: Any, global_step: Any = None, name: Optional[str] = None) -> Any:
        """The wrapped optimizer's ``apply_gradients`` (every n-th run with ``backward_passes_per_step``)."""
        if self._passes == 1:
            return self._optimizer.apply_gradients(grads_and_vars, global_step=global_step, name=name)
        if self._counter is None:
            raise ValueError("with backward_passes_per_step > 1, pass the result of this optimizer's compute_gradients")
        grads_and_vars = list(grads_and_vars)

        def apply() -> tf.Tensor:
            applied = self._optimizer.apply_gradients(grads_and_vars, global_step=global_step, name=name)
            with tf.control_dependencies([applied]):
                resets = [acc.assign(tf.zeros_like(acc)) for acc in self._accumulators if acc is not None]
            with tf.control_dependencies(resets):
                return tf.constant(True)

        def skip() -> tf.Tensor:
            steps = [] if global_step is None else [tf.compat.v1.assign_add(global_step, 1)]
            with tf.control_dependencies(steps):
                return tf.constant(False)

        return tf.cond(self._is_apply_step, apply, skip).op

    def get_slot(self, *args: Any, **kwargs: Any) -> Any:
        return self._optimizer.get_slot(*args, **kwargs)

    def get_slot_names(self, *args: Any, **kwargs: Any) -> Any:
        return self._optimizer.get_slot_names(*args, **kwargs)

    def variables(self, *args: Any, **kwargs: Any) -> Any:
        return self._optimizer.variables(*args, **kwargs)


def DistributedOptimizer(  # noqa: N802 - Horovod's public name
    optimizer: Any,
    name: Optional[str] = None,
    use_locking: bool = False,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = Compression.none,
    sparse_as_dense: bool = False,
    backward_passes_per_step: int = 1,
    op: Any = _c.Average,
    gradient_predivide_factor: float = 1.0,
    average_aggregated_gradients: bool = False,
    num_groups: int = 0,
    groups: Any = None,
    process_set: Any = None,
    scale_local_gradients: bool = True,
) -> Any:
    """Make ``optimizer`` average (or sum) its gradients across ranks: a TensorFlow 1 optimizer is wrapped
    (graph mode), a Keras optimizer becomes :func:`hvdray.tensorflow.keras.DistributedOptimizer`'s."""
    import keras

    if isinstance(optimizer, keras.optimizers.Optimizer):
        from hvdray.tensorflow.keras.optimizer import DistributedOptimizer as keras_distributed

        return keras_distributed(
            optimizer, name=name, device_dense=device_dense, device_sparse=device_sparse, compression=compression,
            sparse_as_dense=sparse_as_dense, gradient_predivide_factor=gradient_predivide_factor, op=op,
            backward_passes_per_step=backward_passes_per_step,
            average_aggregated_gradients=average_aggregated_gradients, num_groups=num_groups, groups=groups,
            process_set=process_set, scale_local_gradients=scale_local_gradients,
        )
    if not isinstance(optimizer, tf.compat.v1.train.Optimizer):
        raise TypeError(
            f"optimizer must be a tf.compat.v1.train.Optimizer or a Keras optimizer, got {type(optimizer).__name__}"
        )
    if isinstance(backward_passes_per_step, bool) or not isinstance(backward_passes_per_step, int) or (
        backward_passes_per_step < 1
    ):
        raise ValueError(f"backward_passes_per_step must be an int >= 1, got {backward_passes_per_step!r}")
    if backward_passes_per_step > 1 and tf.executing_eagerly():
        raise ValueError("backward_passes_per_step > 1 needs graph mode with a TensorFlow 1 optimizer (as Horovod)")
    if not isinstance(average_aggregated_gradients, bool):
        raise TypeError(f"average_aggregated_gradients must be a bool, got {average_aggregated_gradients!r}")
    name = name or f"Distributed{type(optimizer).__name__}"
    reducer = GradientReducer(
        name, compression, sparse_as_dense, op, gradient_predivide_factor, process_set, device_dense, device_sparse,
        resolve_groups(groups, num_groups), scale_local_gradients,
    )
    return _DistributedLegacyOptimizer(
        optimizer, name, use_locking, reducer, backward_passes_per_step, average_aggregated_gradients
    )
