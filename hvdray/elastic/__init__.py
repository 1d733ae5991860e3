"""Elastic training, worker side: ``hvd.elastic.run``, states, and the errors that drive resets.

The driver side (discovery, the state machine) lives in :mod:`hvdray.elastic.driver` and
:mod:`hvdray.elastic.discovery` and is used through ``RayExecutor(min_workers=..., max_workers=...)``.
"""

from hvdray.collective.errors import HorovodInternalError
from hvdray.elastic.run import run
from hvdray.elastic.state import HostsUpdatedInterrupt, ObjectState, State

__all__ = ["HorovodInternalError", "HostsUpdatedInterrupt", "ObjectState", "State", "run"]
