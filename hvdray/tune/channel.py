"""The report channel: a small actor that hands each trial's reports from its workers to its Trainable.

Tune drives a trial one ``train()`` call at a time, and a function-style trial must stand still
between calls (Tune may save it, stop it or move it then). So ``report`` blocks every rank until the
Trainable asks for the next result: report ``i`` of any rank returns once step ``i + 2`` has begun.
Between ``train()`` calls every rank waits here, outside any collective, so a slow Tune loop can never
trip a collective timeout. Only rank 0's metrics are kept; the other ranks just keep in step.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any, Optional


class ReportChannel:
    """One per running trial function; asynchronous, needs no CPU."""

    def __init__(self) -> None:
        self._released = 0  # reports with an index below this may return to their rank
        self._results: dict[int, tuple[dict[str, Any], Optional[list[Any]]]] = {}
        self._changed = asyncio.Condition()

    async def report(self, rank: int, index: int, metrics: Optional[dict[str, Any]], checkpoint: Optional[list[Any]]) -> None:
        """Called by every rank for its ``index``-th report; returns when the Trainable wants the next one."""
        async with self._changed:
            if rank == 0:
                self._results[index] = (metrics or {}, checkpoint)
                self._changed.notify_all()
            await self._changed.wait_for(lambda: self._released > index)

    async def next(self, index: int) -> tuple[dict[str, Any], Optional[list[Any]]]:
        """Release every report before ``index`` and wait for rank 0's report ``index``."""
        async with self._changed:
            self._released = max(self._released, index)
            self._changed.notify_all()
            await self._changed.wait_for(lambda: index in self._results)
            return self._results.pop(index)

    async def release_all(self) -> None:
        """Let every waiting and future report return (the function finished or is being stopped)."""
        async with self._changed:
            self._released = math.inf
            self._changed.notify_all()
