"""``hvdray.keras.elastic``: the same as :mod:`hvdray.tensorflow.keras.elastic`."""

from hvdray.tensorflow.keras.elastic import *  # noqa: F401,F403 - one implementation, two import paths
from hvdray.tensorflow.keras.elastic import __all__  # noqa: F401
