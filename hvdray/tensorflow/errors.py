"""The exception types Horovod's TensorFlow ops raise, so that code catching them keeps working.

Horovod raises ``tf.errors.FailedPreconditionError`` when ranks disagree on a tensor (shape, dtype,
root rank, op) and ``tf.errors.InvalidArgumentError`` for a bad argument found when the op runs (an
alltoall's ``splits`` that do not add up). hvdray's errors for those cases are both: the TensorFlow
type, and the hvdray type (``TensorMismatchError``) or ``ValueError`` they are elsewhere.

Inside a ``tf.function`` the op runs as a ``tf.py_function``, and TensorFlow turns every ``ValueError``
raised there into ``tf.errors.InvalidArgumentError`` (its own rule); so there a mismatch, too, surfaces
as ``InvalidArgumentError``, with hvdray's message.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from hvdray.collective import errors as _errors


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
        return TensorMismatchError(str(exc))
    if isinstance(exc, ValueError) and not isinstance(exc, _errors.HvdrayError):
        return InvalidArgumentError(str(exc))
    return exc
