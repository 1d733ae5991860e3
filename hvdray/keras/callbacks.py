"""``hvdray.keras.callbacks``: the callbacks of :mod:`hvdray.tensorflow.keras.callbacks`."""

from hvdray.tensorflow.keras.callbacks import (  # noqa: F401 - one implementation, two import paths
    BroadcastGlobalVariablesCallback,
    LearningRateScheduleCallback,
    LearningRateWarmupCallback,
    MetricAverageCallback,
)
