"""``import hvdray.keras as hvd``: the same as :mod:`hvdray.tensorflow.keras` (Keras 3 is tf.keras)."""

from hvdray.tensorflow.keras import *  # noqa: F401,F403 - one implementation, two import paths
from hvdray.tensorflow.keras import __all__, callbacks, elastic  # noqa: F401
