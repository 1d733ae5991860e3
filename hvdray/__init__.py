"""hvdray: Horovod's programming model, native on Ray.

``from hvdray import RayExecutor`` on the driver, ``import hvdray.torch as hvd`` in the workers.
"""

from hvdray import ray_logger
from hvdray.elastic.driver import ElasticJobError
from hvdray.executor import ElasticRayExecutor, RayExecutor, WorkerLostError
from hvdray.settings import Settings

__version__ = "0.1.0"

__all__ = [
    "ElasticJobError", "ElasticRayExecutor", "RayExecutor", "Settings", "WorkerLostError", "ray_logger", "__version__",
]
