"""Ray Tune integration: every trial is a distributed hvdray job (Ray 1.x's ``DistributedTrainableCreator``).

Driver side: ``DistributedTrainableCreator(func, num_hosts=1, num_slots=2)`` -> a Trainable class for
``tune.run`` / ``tune.Tuner``. Worker side, inside ``func``: ``report``, ``get_checkpoint``,
``distributed_checkpoint_dir``.
"""

from hvdray.tune.session import distributed_checkpoint_dir, get_checkpoint, report
from hvdray.tune.trainable import DistributedTrainable, DistributedTrainableCreator

__all__ = [
    "DistributedTrainable",
    "DistributedTrainableCreator",
    "distributed_checkpoint_dir",
    "get_checkpoint",
    "report",
]
