"""``horovod.tensorflow.util``'s helper that Horovod's scripts and tests call: whether TensorFlow runs eagerly."""

import tensorflow as tf


def _executing_eagerly() -> bool:
    """True outside a graph being built (TensorFlow 2's default), as ``tf.executing_eagerly()``."""
    return tf.executing_eagerly()
