"""hvdray: Horovod's programming model, native on Ray.

``from hvdray import RayExecutor`` on the driver, ``import hvdray.torch as hvd`` in the workers. The
driver-side names are imported on first use, so that processes which only need a part of hvdray (the
coordinator actor, a Tune trial's driver) do not pay for importing torch.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

__version__ = "0.1.0"

_PUBLIC = {
    "ElasticJobError": "hvdray.driver.controller",
    "ElasticRayExecutor": "hvdray.driver.executor",
    "MLflowCallback": "hvdray.driver.tracking",
    "MetricsHistory": "hvdray.driver.callbacks",
    "NetworkDeviceError": "hvdray.collective.errors",
    "PeerFinishedError": "hvdray.collective.errors",
    "ProgressBar": "hvdray.driver.callbacks",
    "RayExecutor": "hvdray.driver.executor",
    "Settings": "hvdray.settings",
    "TensorBoardCallback": "hvdray.driver.tracking",
    "WandbCallback": "hvdray.driver.tracking",
    "WorkerLostError": "hvdray.driver.failures",
    "get_dataset_shard": "hvdray.worker.datasets",
    "init_ray": "hvdray.driver.cluster",
    "report": "hvdray.worker.reporting",
}

__all__ = [*sorted(_PUBLIC), "ray_logger", "__version__"]

if os.environ.get("HVDRAY_HOROVOD_ALIAS"):  # opt-in: `import horovod.torch` gets hvdray.torch (hvdray/alias.py)
    from hvdray import alias as _alias

    if _alias.enabled_by_environment():
        _alias.install()


def __getattr__(name: str) -> Any:
    if name == "ray_logger":  # a module
        return importlib.import_module("hvdray.ray_logger")
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'hvdray' has no attribute {name!r}")
