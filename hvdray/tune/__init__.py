"""Ray Tune integration: every trial is a distributed hvdray job (Ray 1.x's ``DistributedTrainableCreator``).

Driver side: ``DistributedTrainableCreator(func, num_hosts=1, num_slots=2)`` -> a Trainable class for
``tune.run`` / ``tune.Tuner``. Worker side, inside ``func``: ``report``, ``get_checkpoint``,
``distributed_checkpoint_dir``.
"""

from typing import Any

from hvdray.tune.session import distributed_checkpoint_dir, get_checkpoint
from hvdray.worker.reporting import report  # the same function as hvdray.report

__all__ = [
    "DistributedTrainable",
    "DistributedTrainableCreator",
    "distributed_checkpoint_dir",
    "get_checkpoint",
    "report",
]


def __getattr__(name: str) -> Any:
    # The driver-side names import ray.tune; workers, which only need the session functions, never do.
    if name in ("DistributedTrainable", "DistributedTrainableCreator"):
        from hvdray.tune import trainable

        return getattr(trainable, name)
    raise AttributeError(f"module 'hvdray.tune' has no attribute {name!r}")
