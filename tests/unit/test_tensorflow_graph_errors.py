"""The error types of hvdray's TensorFlow ops inside graphs (``tf.function`` and ``Session.run``).

TensorFlow maps an exception raised inside a ``py_function`` to an error by its Python class alone;
bridge.py raises a mismatch as Horovod's ``FailedPreconditionError`` from the graph instead. These run
``bridge.run`` with kernels that raise or return directly (no job needed), under TensorFlow's default
graph optimizations (Grappler would turn a read that nothing consumes into a NoOp).
"""

from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from hvdray.collective import errors as collective_errors  # noqa: E402
from hvdray.tensorflow import bridge  # noqa: E402


def _kernel(error: Exception | None):
    def kernel(inputs):
        if error is not None:
            raise error
        return [inputs[0] * 2, tf.reduce_sum(inputs[0])]

    return kernel


def _build(error: Exception | None):
    x = tf.constant([1.0, 2.0, 3.0])
    return bridge.run(_kernel(error), [x], [tf.float32, tf.float32], [x.shape, tf.TensorShape([])], "allreduce")


def _in_function(error):
    return tf.function(lambda: _build(error))()


def _in_session(error):
    with tf.Graph().as_default():
        outputs = _build(error)
        assert [o.shape.as_list() for o in outputs] == [[3], []]  # the static shapes the graph was told
        with tf.compat.v1.Session() as sess:
            return sess.run(outputs)


@pytest.mark.parametrize("run", [_in_function, _in_session], ids=["tf.function", "Session"])
def test_results_pass_through_unchanged(run):
    doubled, total = run(None)
    np.testing.assert_array_equal(np.asarray(doubled), [2.0, 4.0, 6.0])
    assert float(total) == 6.0


@pytest.mark.parametrize("run", [_in_function, _in_session], ids=["tf.function", "Session"])
def test_a_mismatch_is_failed_precondition_with_its_message(run):
    error = collective_errors.TensorMismatchError("mismatched shapes for allreduce 'grads/dense/../kernel': rank 1 has [2]")
    with pytest.raises(tf.errors.FailedPreconditionError) as info:
        run(error)
    # the name's ".." (a path component TensorFlow would resolve) is shown as look-alike dots
    assert "mismatched shapes for allreduce 'grads/dense/\u2024\u2024/kernel': rank 1 has [2]" in info.value.message


@pytest.mark.parametrize("run", [_in_function, _in_session], ids=["tf.function", "Session"])
def test_other_errors_keep_tensorflow_s_mapping(run):
    with pytest.raises(tf.errors.InvalidArgumentError, match="splits must add up"):  # Horovod's type too
        run(ValueError("splits must add up to the first dimension"))
    with pytest.raises(tf.errors.UnknownError, match="peer left"):
        run(RuntimeError("peer left"))


def test_a_long_or_odd_message_still_raises_failed_precondition():
    message = "rank 1 has [2] " + "x" * 300 + "/./" + "y/" * 3000 + "\0end"
    with pytest.raises(tf.errors.FailedPreconditionError) as info:
        _in_session(collective_errors.TensorMismatchError(message))
    text = info.value.message
    assert "rank 1 has [2] " + "x" * 300 + "/\u2024/y/y/" in text  # kept, beyond one path component's 255 bytes
    assert "\u2026" in text and "end" not in text  # cut below Linux's PATH_MAX, and says so
