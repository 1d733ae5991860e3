"""``ray_logger.log(dict)``: send a record from a worker to every callback passed to ``executor.run``.

Outside an executor (a plain ``hvd.init()`` run) records go to Python logging instead.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

_sink: Optional[Callable[[dict[str, Any]], None]] = None


def set_sink(sink: Optional[Callable[[dict[str, Any]], None]]) -> None:
    """Where ``log`` sends records; the worker actor installs the coordinator channel here."""
    global _sink
    _sink = sink


def log(record: dict[str, Any]) -> None:
    """Report ``record`` (a dict of picklable values) to the driver's callbacks."""
    if not isinstance(record, dict):
        raise TypeError(f"ray_logger.log takes a dict, got {type(record).__name__}")
    if _sink is None:
        logging.getLogger("hvdray").info("%s", ", ".join(f"{k}={v}" for k, v in record.items()))
    else:
        _sink(record)
