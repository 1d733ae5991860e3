"""The coordinator actor: rank assignment, the job's rendezvous table, and the worker log channel.

Rank assignment happens here and nowhere else. The actor is asynchronous so that many workers can
wait on rendezvous keys at once; it needs no CPU.
"""

from __future__ import annotations

import asyncio
from typing import Any, Optional, Sequence

from hvdray.collective.topology import RankInfo, WorkerSlot, assign_ranks, visible_devices


class Coordinator:
    """One per executor. Holds membership (an epoch that grows with every assignment) and the KV table."""

    def __init__(self) -> None:
        self._epoch = 0
        self._kv: dict[str, bytes] = {}
        self._changed = asyncio.Condition()
        self._logs: list[dict[str, Any]] = []

    # -- membership ------------------------------------------------------------------------
    def assign(self, slots: Sequence[WorkerSlot]) -> tuple[int, list[RankInfo], list[tuple[str, ...]]]:
        """New membership epoch: each slot's RankInfo and the GPU ids its node's workers share."""
        self._epoch += 1
        self._kv.clear()  # keys of the previous membership are never read again
        return self._epoch, assign_ranks(slots), visible_devices(slots)

    def epoch(self) -> int:
        return self._epoch

    # -- rendezvous key-value table ----------------------------------------------------------
    async def kv_set(self, key: str, value: bytes) -> None:
        async with self._changed:
            self._kv[key] = value
            self._changed.notify_all()

    async def kv_get(self, key: str, timeout_s: float) -> Optional[bytes]:
        if await self.kv_wait([key], timeout_s):
            return self._kv[key]
        return None

    async def kv_add(self, key: str, amount: int) -> int:
        async with self._changed:
            value = int(self._kv.get(key, b"0")) + amount
            self._kv[key] = str(value).encode()
            self._changed.notify_all()
            return value

    async def kv_wait(self, keys: list[str], timeout_s: float) -> bool:
        async with self._changed:
            try:
                await asyncio.wait_for(
                    self._changed.wait_for(lambda: all(k in self._kv for k in keys)), timeout=timeout_s
                )
            except asyncio.TimeoutError:
                return False
            return True

    def kv_check(self, keys: list[str]) -> bool:
        return all(k in self._kv for k in keys)

    def kv_delete(self, key: str) -> bool:
        return self._kv.pop(key, None) is not None

    # -- ray_logger channel ------------------------------------------------------------------
    def push_log(self, rank: int, record: dict[str, Any]) -> None:
        self._logs.append({"rank": rank, **record})

    def drain_logs(self) -> list[dict[str, Any]]:
        logs, self._logs = self._logs, []
        return logs
