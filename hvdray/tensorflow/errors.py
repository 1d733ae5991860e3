"""The exception types Horovod's TensorFlow ops raise, so that code catching them keeps working.

Horovod raises ``tf.errors.FailedPreconditionError`` when ranks disagree on a tensor (shape, dtype,
root rank, op) and ``tf.errors.InvalidArgumentError`` for a bad argument found when the op runs (an
alltoall's ``splits`` that do not add up). hvdray's errors for those cases are both: the TensorFlow
type, and the hvdray type (``TensorMismatchError``) or ``ValueError`` they are elsewhere.

Inside a ``tf.function`` or a TensorFlow 1 graph the op runs as a ``tf.py_function``, and TensorFlow
turns every ``ValueError`` raised there into ``tf.errors.InvalidArgumentError`` and anything else into
``UnknownError`` (its own rule); bridge.py carries a mismatch out of the ``py_function`` and raises it as
``FailedPreconditionError`` from the graph, its message prefixed by ``/dev/null/`` (see there why).
"""

from __future__ import annotations

import re
from typing import Any

import tensorflow as tf

from hvdray.collective import errors as _errors
from hvdray.tensorflow.convert import TORCH_DTYPES


class TensorMismatchError(tf.errors.FailedPreconditionError, _errors.TensorMismatchError):
    """Ranks submitted the same tensor with different shapes, dtypes, root ranks or ops."""

    def __init__(self, message: str) -> None:
        tf.errors.FailedPreconditionError.__init__(self, None, None, message)

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.message,)


class InvalidArgumentError(tf.errors.InvalidArgumentError, ValueError):
    """An argument that only the running op can check was wrong (``splits`` against the tensor ...)."""

    def __init__(self, message: str) -> None:
        tf.errors.InvalidArgumentError.__init__(self, None, None, message)

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.message,)


def as_tensorflow_error(exc: BaseException) -> BaseException:
    """``exc`` as the type Horovod's TensorFlow op raises in its place (``exc`` itself if there is none)."""
    if isinstance(exc, (tf.errors.OpError, _errors.NotInitializedError)):
        return exc
    if isinstance(exc, _errors.TensorMismatchError):
        return TensorMismatchError(_tensorflow_dtype_names(str(exc)))
    if isinstance(exc, ValueError) and not isinstance(exc, _errors.HvdrayError):
        return InvalidArgumentError(str(exc))
    return exc


def _tensorflow_dtype_names(message: str) -> str:
    """``message`` with the engine's dtype names (``torch.int32``) as TensorFlow names them (``tf.int32``)."""
    for tf_dtype, torch_dtype in TORCH_DTYPES.items():
        message = re.sub(rf"\b{re.escape(str(torch_dtype))}\b", f"tf.{tf_dtype.name}", message)
    return message
