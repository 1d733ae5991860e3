"""The store a Gloo group connects through: Gloo's per-peer waits collapsed into one wait for every rank.

A ``ProcessGroupGloo`` of ``size`` ranks connects its full mesh like this (torch 2.x's Gloo, for each
of its devices ``d``): every rank writes its pairs' addresses under ``"d/<rank>"``, then for every rank
``i`` waits for ``"d/i"`` and reads it: ``1 + 2 * size`` store operations per rank, ``O(size**2)`` in
all. On the job's rendezvous each operation is a Ray call to the coordinator.

:class:`FullMeshStore` turns the first of those waits into one wait for all ``size`` keys of that
device (Gloo waits for every one of them anyway, in rank order). A store whose ``wait`` hands back
the values it waited for (the coordinator's, ``hvdray.worker.rendezvous``) then answers Gloo's reads
from what that one call brought: two calls per rank (its ``set`` and one wait), ``O(size)`` in all.
Other stores (the in-memory one of a size-1 job) see the same operations as before, one wait wider.
"""

from __future__ import annotations

import datetime
import re
from typing import Optional

import torch.distributed as dist

_GLOO_KEY = re.compile(r"(\d+)/(\d+)")  # "<device index>/<rank>": what Gloo's full-mesh connect reads


class FullMeshStore(dist.Store):
    """``store`` as a Gloo group of ``size`` ranks should use it (see the module's docstring)."""

    def __init__(self, store: dist.Store, size: int) -> None:
        super().__init__()
        if size < 1:
            raise ValueError(f"size must be at least 1, got {size}")
        self._store = store
        self._size = size
        self._complete: set[str] = set()  # devices whose every rank's key was waited for already

    def _widened(self, keys: list[str]) -> list[str]:
        """One rank's key of a device not yet waited for: every rank's key of that device."""
        if len(keys) != 1:
            return keys
        match = _GLOO_KEY.fullmatch(keys[0])
        if match is None or int(match.group(2)) >= self._size:
            return keys
        device = match.group(1)
        if device in self._complete:
            return keys
        self._complete.add(device)
        return [f"{device}/{rank}" for rank in range(self._size)]

    def set(self, key: str, value: bytes) -> None:
        self._store.set(key, value)

    def get(self, key: str) -> bytes:
        return self._store.get(key)

    def add(self, key: str, amount: int) -> int:
        return self._store.add(key, amount)

    def wait(self, keys: list[str], timeout: Optional[datetime.timedelta] = None) -> None:
        widened = self._widened(list(keys))
        if timeout is None:
            self._store.wait(widened)
        else:
            self._store.wait(widened, timeout)

    def check(self, keys: list[str]) -> bool:
        return self._store.check(keys)

    def delete_key(self, key: str) -> bool:
        return self._store.delete_key(key)
