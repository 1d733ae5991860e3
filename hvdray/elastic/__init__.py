"""Elastic training, worker side: ``hvd.elastic.run``, states, and the errors that drive resets.

The driver side (discovery, the state machine) lives in :mod:`hvdray.driver` and is used through
``RayExecutor(min_workers=..., max_workers=...)``. The names are imported on first use, so that a
process that only needs ``HorovodInternalError`` does not import torch and the collective engine.
"""

from __future__ import annotations

import importlib
from typing import Any

from hvdray.collective.errors import HorovodInternalError

_WORKER_API = {
    "run": "hvdray.elastic.loop",
    "State": "hvdray.elastic.state",
    "ObjectState": "hvdray.elastic.state",
    "HostsUpdatedInterrupt": "hvdray.elastic.state",
}

__all__ = ["HorovodInternalError", "HostsUpdatedInterrupt", "ObjectState", "State", "run"]


def __getattr__(name: str) -> Any:
    if name in _WORKER_API:
        return getattr(importlib.import_module(_WORKER_API[name]), name)
    raise AttributeError(f"module 'hvdray.elastic' has no attribute {name!r}")
