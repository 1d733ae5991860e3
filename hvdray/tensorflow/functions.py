"""Broadcasting variables (a model's weights, an optimizer's slots) from one rank to all."""

from __future__ import annotations

from typing import Any, Iterable, Optional

import tensorflow as tf

from hvdray.collective import ops as _c
from hvdray.tensorflow import ops as _ops
from hvdray.tensorflow.convert import as_tensor


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
    _c.check_root(root_rank, ps)
    if not variables:
        return None
    base = _c.check_name(name, "op") if name is not None else "broadcast_variables"
    values = [as_tensor(var, f"variables[{i}]") for i, var in enumerate(variables)]
    received = _ops.broadcast_tensors(values, root_rank, [f"{base}.{i}" for i in range(len(values))], ps)
    assigns = [var.assign(value) for var, value in zip(variables, received)]
    if tf.executing_eagerly():
        return None
    return tf.group(*[a for a in assigns if a is not None])
