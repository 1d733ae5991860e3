"""Keras 3 ``DistributedOptimizer``: gradients are averaged across ranks before the optimizer applies them.

The reduction sits in ``apply`` (which ``apply_gradients`` and Keras' train step call), so it runs
inside the compiled train step, before gradient clipping, loss-scale unscaling and accumulation.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

import keras

from hvdray.collective import ops as _c
from hvdray.tensorflow.compression import Compression
from hvdray.collective.gradient_groups import resolve_groups
from hvdray.tensorflow.gradients import GradientReducer, local_layer_variables
from hvdray.tensorflow.ops import check_common


class _DistributedOptimizer:
    """Mixed in front of the wrapped optimizer's own class."""

    _hvd_reduce: Optional[GradientReducer] = None  # set by DistributedOptimizer or load_model

    def register_local_var(self, var: Any) -> None:
        """Keep ``var``'s gradient on this rank: it is never reduced across ranks (Horovod's local variables)."""
        if self._hvd_reduce is None:
            self._hvd_reduce = GradientReducer(f"{type(self).__name__}.grads")
        self._hvd_reduce.register_local(var)

    def apply(self, grads: Any, trainable_variables: Any = None) -> Any:
        if self._hvd_reduce is None:  # deserialized by plain keras.models.load_model(custom_objects=...)
            self._hvd_reduce = GradientReducer(f"{type(self).__name__}.grads")
        grads = list(grads)
        variables = trainable_variables if trainable_variables is not None else getattr(self, "_trainable_variables", None)
        if variables is not None and len(variables) != len(grads):
            variables = None  # a Keras path that pairs them itself: groups of variables then cannot apply
        reduced = self._hvd_reduce(grads, None if variables is None else list(variables))
        return super().apply(reduced, trainable_variables)  # type: ignore[misc]


_classes: dict[type, type] = {}


def distributed_class(base: type) -> type:
    """``Distributed<Base>``: the optimizer class ``base`` with gradients reduced across ranks."""
    cls = _classes.get(base)
    if cls is None:
        cls = _classes[base] = type(f"Distributed{base.__name__}", (_DistributedOptimizer, base), {})
    return cls


def DistributedOptimizer(  # noqa: N802 - Horovod's public name
    optimizer: keras.optimizers.Optimizer,
    name: Optional[str] = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = Compression.none,
    sparse_as_dense: bool = False,
    gradient_predivide_factor: float = 1.0,
    op: Any = _c.Average,
    backward_passes_per_step: int = 1,
    average_aggregated_gradients: bool = False,
    num_groups: int = 0,
    groups: Any = None,
    process_set: Any = None,
    scale_local_gradients: bool = True,
) -> keras.optimizers.Optimizer:
    """Make a Keras 3 optimizer average (or sum) gradients across ranks, so that ``model.fit`` trains
    one model on the union of every rank's batches.

    The optimizer object itself is made distributed and returned (its variables and any references to
    it stay valid). ``name`` prefixes the names of the gradient allreduces. ``groups`` / ``num_groups``:
    Horovod's (an int, or lists of the model's variables; see hvdray/collective/gradient_groups.py).
    ``backward_passes_per_step=n``: the variables change every n-th step, by the sum of the n steps'
    reduced gradients (their mean with ``average_aggregated_gradients``), as Horovod; Keras' own gradient
    accumulation does the accumulating, so the optimizer must not have taken a step yet.
    """
    if keras.backend.backend() != "tensorflow":
        raise ValueError(
            f"hvdray.tensorflow.keras needs Keras' TensorFlow backend, but Keras runs on {keras.backend.backend()!r} "
            "(set KERAS_BACKEND=tensorflow)"
        )
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(
            f"optimizer must be a Keras 3 optimizer (keras.optimizers.*), got {type(optimizer).__name__}; "
            "TensorFlow 1 and Keras 2 optimizers are not supported"
        )
    if isinstance(optimizer, _DistributedOptimizer):
        raise ValueError("optimizer is already a DistributedOptimizer")
    if name is not None and (not isinstance(name, str) or not name):
        raise ValueError(f"name must be a non-empty string, got {name!r}")
    if isinstance(backward_passes_per_step, bool) or not isinstance(backward_passes_per_step, int) or (
        backward_passes_per_step < 1
    ):
        raise ValueError(f"backward_passes_per_step must be an int >= 1, got {backward_passes_per_step!r}")
    if not isinstance(average_aggregated_gradients, bool):
        raise TypeError(f"average_aggregated_gradients must be a bool, got {average_aggregated_gradients!r}")
    aggregate_scale = 1.0
    if backward_passes_per_step > 1:
        if optimizer.gradient_accumulation_steps not in (None, backward_passes_per_step):
            raise ValueError(
                f"backward_passes_per_step={backward_passes_per_step} but the optimizer accumulates "
                f"gradient_accumulation_steps={optimizer.gradient_accumulation_steps}; give one of them"
            )
        if optimizer.built:
            raise ValueError(
                "backward_passes_per_step needs an optimizer that has not taken a step yet (Keras creates "
                "its gradient accumulators when it builds); wrap the optimizer before training"
            )
        optimizer.gradient_accumulation_steps = backward_passes_per_step  # Keras applies the mean of n steps
        aggregate_scale = 1.0 if average_aggregated_gradients else float(backward_passes_per_step)
    if keras.config.dtype_policy().name == "mixed_float16" and not isinstance(
        optimizer, keras.optimizers.LossScaleOptimizer
    ):
        warnings.warn(
            "the mixed_float16 policy makes model.compile wrap this DistributedOptimizer in a LossScaleOptimizer, "
            "which skips the gradient allreduce on ranks whose gradients overflow while others wait for them; "
            "wrap the loss-scale optimizer instead: DistributedOptimizer(keras.optimizers.LossScaleOptimizer(opt))",
            stacklevel=2,
        )
    base = type(optimizer)
    reducer = GradientReducer(
        f"{name or 'Distributed' + base.__name__}.grads", compression, sparse_as_dense, op,
        gradient_predivide_factor, process_set, device_dense, device_sparse, resolve_groups(groups, num_groups),
        scale_local_gradients, aggregate_scale,
    )
    optimizer.__class__ = distributed_class(base)
    optimizer._hvd_reduce = reducer
    return optimizer


def PartialDistributedOptimizer(  # noqa: N802 - Horovod's public name
    optimizer: keras.optimizers.Optimizer,
    name: Optional[str] = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = Compression.none,
    sparse_as_dense: bool = False,
    gradient_predivide_factor: float = 1.0,
    op: Any = _c.Average,
    backward_passes_per_step: int = 1,
    average_aggregated_gradients: bool = False,
    groups: Any = None,
    process_set: Any = None,
    local_layers: Any = None,
    scale_local_gradients: bool = True,
) -> keras.optimizers.Optimizer:
    """:func:`DistributedOptimizer` whose ``local_layers``' (Keras layers') gradients stay on each rank."""
    local = local_layer_variables(local_layers)
    optimizer = DistributedOptimizer(
        optimizer, name, device_dense, device_sparse, compression, sparse_as_dense, gradient_predivide_factor, op,
        backward_passes_per_step, average_aggregated_gradients, groups=groups, process_set=process_set,
        scale_local_gradients=scale_local_gradients,
    )
    for var in local:
        optimizer.register_local_var(var)
    return optimizer


def load_model(
    filepath: Any,
    custom_optimizers: Optional[list[type]] = None,
    custom_objects: Optional[dict[str, Any]] = None,
    compression: Any = Compression.none,
    legacy_opts: bool = False,
) -> keras.Model:
    """Load a model saved with a ``DistributedOptimizer``; its optimizer (state included) comes back distributed.

    Keras' own optimizers are known; pass the classes of others as ``custom_optimizers``. Horovod's
    ``legacy_opts`` (Keras 2's legacy optimizers) must stay False: Keras 3 has none.
    """
    check_common(compression)
    if legacy_opts is not False:
        raise ValueError("legacy_opts=True: Keras 3 has no legacy optimizers; save and load with Keras 3 optimizers")
    if custom_optimizers is not None and (
        not isinstance(custom_optimizers, (list, tuple))
        or not all(isinstance(c, type) and issubclass(c, keras.optimizers.Optimizer) for c in custom_optimizers)
    ):
        raise TypeError(f"custom_optimizers must be a list of Keras optimizer classes, got {custom_optimizers!r}")
    known = [
        c for c in vars(keras.optimizers).values() if isinstance(c, type) and issubclass(c, keras.optimizers.Optimizer)
    ]
    objects = {f"Distributed{c.__name__}": distributed_class(c) for c in known + list(custom_optimizers or [])}
    objects.update(custom_objects or {})
    model = keras.models.load_model(filepath, custom_objects=objects)
    optimizer = getattr(model, "optimizer", None)
    if isinstance(optimizer, _DistributedOptimizer):
        optimizer._hvd_reduce = GradientReducer(f"{type(optimizer).__name__}.grads", compression)
    return model
