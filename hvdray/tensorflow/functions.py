"""Broadcasting variables (a model's weights, an optimizer's slots) from one rank to all: all at once
(``broadcast_variables``), in place returning their values (``broadcast_``), or a TF1 graph's globals."""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

import tensorflow as tf

from hvdray.collective import ops as _c
from hvdray.tensorflow import ops as _ops
from hvdray.tensorflow.convert import as_tensor


def broadcast_object_fn(
    root_rank: int = 0, session: Any = None, name: Optional[str] = None, process_set: Any = None
) -> Callable[[Any], Any]:
    """A function that broadcasts a picklable object from ``root_rank`` each time it is called (Horovod's
    TensorFlow 1 helper; here each call is one :func:`broadcast_object`, in eager mode)."""
    _ops.check_session(session)
    ps = _ops.check_common(process_set=process_set)
    _c.check_root(root_rank, ps)
    base = _c.check_name(name, "op") if name is not None else "broadcast_object_fn"

    def broadcast(obj: Any) -> Any:
        return _ops.broadcast_object(obj, root_rank, name=base, process_set=ps)

    return broadcast


def broadcast_(variables: Iterable[Any], root_rank: int, name: Optional[str] = None, process_set: Any = None) -> list[tf.Tensor]:
    """Assign root's value to every variable in ``variables``, in place; returns their new values."""
    variables = list(variables) if isinstance(variables, Iterable) and not isinstance(variables, (str, bytes)) else variables
    assign = broadcast_variables(variables, root_rank, process_set=process_set, name=name)
    with tf.control_dependencies([assign] if assign is not None else []):
        return [var.read_value() for var in variables]


def broadcast_global_variables(root_rank: int) -> tf.Operation:
    """Broadcast every global variable of the TensorFlow 1 graph being built (``tf.compat.v1``); in eager
    mode there are none, and Horovod's ``RuntimeError`` says what to call instead."""
    if tf.executing_eagerly():
        raise RuntimeError(
            "hvd.broadcast_global_variables() does not support eager execution; use "
            "hvd.broadcast_variables(model.variables + optimizer.variables, root_rank) instead"
        )
    assign = broadcast_variables(tf.compat.v1.global_variables(), root_rank, name="broadcast_global_variables")
    return assign if assign is not None else tf.no_op(name="broadcast_global_variables")


def broadcast_variables(
    variables: Iterable[Any], root_rank: int, process_set: Any = None, inplace: bool = False, name: Optional[str] = None
) -> Optional[tf.Operation]:
    """Assign root's value to every variable in ``variables`` (``tf.Variable`` or ``keras.Variable``).

    All values travel in one exchange (one ``py_function`` inside ``tf.function``, where the grouped
    assign op is returned). ``inplace`` is accepted for Horovod; the assignment is always in place.
    """
    ps = _ops.check_common(process_set=process_set)
    if isinstance(variables, (str, bytes, dict)) or not isinstance(variables, Iterable):
        raise TypeError(f"variables must be a list of variables, got {type(variables).__name__}")
    variables = list(variables)
    for i, var in enumerate(variables):
        if not hasattr(var, "assign"):
            raise TypeError(f"variables[{i}] must be a tf.Variable or keras.Variable, got {type(var).__name__}")
    if not variables:  # nothing to exchange: a graph may be built before hvd.init(), as in Horovod
        return None
    _c.check_root(root_rank, ps)
    base = _c.check_name(name, "op") if name is not None else "broadcast_variables"
    values = [as_tensor(var, f"variables[{i}]") for i, var in enumerate(variables)]
    received = _ops.broadcast_tensors(values, root_rank, [f"{base}.{i}" for i in range(len(values))], ps)
    assigns = [var.assign(value) for var, value in zip(variables, received)]
    if tf.executing_eagerly():
        return None
    return tf.group(*[a for a in assigns if a is not None])
