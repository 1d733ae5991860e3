"""The report channel: a small actor that hands a trial's reports from its workers to its Trainable.

Tune drives a trial one ``train()`` call at a time, and a function-style trial must stand still
between calls (Tune may save it, stop it or move it then). So ``report`` blocks every rank until the
Trainable asks for the next result: report ``i`` of any rank returns once step ``i + 2`` has begun.
Between ``train()`` calls every rank waits here, outside any collective, so a slow Tune loop can never
trip a collective timeout. Only rank 0's metrics are kept; the other ranks just keep in step.

Each run of the function is one *generation*. ``stop`` (Tune stops the trial but keeps its actor for
another one) and a new generation make every waiting report return ``False``, so the worker unwinds
the function and stays ready for the next run; a late report of an old generation is ignored.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any, Optional


def report_channel_class() -> type:
    """The ``ReportChannel`` actor class, to pass to ``ray.remote``.

    Defined inside this function so that cloudpickle ships it to its actor by value: the channel's
    process then imports neither hvdray nor torch, which saves about two seconds of CPU per trial.
    """

    class ReportChannel:
        """One per Trainable actor; asynchronous, needs no CPU."""

        def __init__(self) -> None:
            self._generation = 0
            self._released = 0.0  # reports with an index below this may go on
            self._stopping = False
            self._results: dict[int, tuple[dict[str, Any], Optional[list[Any]]]] = {}
            self._changed = asyncio.Condition()

        async def begin(self, generation: int) -> None:
            """A new run of the function starts; anything still waiting from an older one is let go."""
            async with self._changed:
                self._generation, self._released, self._stopping = generation, 0.0, False
                self._results.clear()
                self._changed.notify_all()

        async def report(
            self, generation: int, rank: int, index: int, metrics: Optional[dict[str, Any]], checkpoint: Optional[list[Any]]
        ) -> bool:
            """Every rank's ``index``-th report. ``True``: go on to the next result; ``False``: stop the function."""
            async with self._changed:
                if generation != self._generation:
                    return False
                if rank == 0 and not self._stopping:
                    self._results[index] = (metrics or {}, checkpoint)
                    self._changed.notify_all()
                await self._changed.wait_for(
                    lambda: self._released > index or self._stopping or generation != self._generation
                )
                return self._released > index and generation == self._generation

        async def next(self, index: int) -> tuple[dict[str, Any], Optional[list[Any]]]:
            """Let every report before ``index`` go on, then wait for rank 0's report ``index``."""
            async with self._changed:
                self._released = max(self._released, index)
                self._changed.notify_all()
                await self._changed.wait_for(lambda: index in self._results)
                return self._results.pop(index)

        async def stop(self) -> None:
            """Every waiting and future report of this generation returns ``False``."""
            async with self._changed:
                self._stopping = True
                self._changed.notify_all()

        async def release_all(self) -> None:
            """Every waiting and future report of this generation returns ``True`` (rank 0 has finished)."""
            async with self._changed:
                self._released = math.inf
                self._changed.notify_all()

    return ReportChannel
