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

A :class:`RecordStore` (the coordinator's) also hands the rank only its part of each peer's record
(``hvdray.collective.gloo_record``): O(size) bytes per rank instead of O(size**2).
"""

from __future__ import annotations

import datetime
import re
from typing import Optional

import torch.distributed as dist

_GLOO_KEY = re.compile(r"(\d+)/(\d+)")  # "<device index>/<rank>": what Gloo's full-mesh connect reads


class RecordStore(dist.Store):
    """A store that can wait for a Gloo group's records and bring back only one reader's part of each."""

    def read_records(self, keys: list[str], reader: int, size: int, timeout: Optional[datetime.timedelta]) -> None:
        """Wait for ``keys`` (every rank's record of one device); their next ``get`` answers each as rank
        ``reader`` of a group of ``size`` reads it (:func:`hvdray.collective.gloo_record.as_read_by`)."""
        raise NotImplementedError

    def prefixed(self, prefix: str) -> "RecordStore":
        """This store with ``prefix`` before every key, as ``torch.distributed.PrefixStore`` (which would
        hide :meth:`read_records`) does."""
        raise NotImplementedError


def prefixed(store: dist.Store, prefix: str) -> dist.Store:
    """``store`` with ``prefix`` before every key, keeping a :class:`RecordStore` one."""
    return store.prefixed(prefix) if isinstance(store, RecordStore) else dist.PrefixStore(prefix, store)


class FullMeshStore(dist.Store):
    """``store`` as rank ``rank`` of a Gloo group of ``size`` ranks should use it (see the module's docstring)."""

    def __init__(self, store: dist.Store, rank: int, size: int) -> None:
        super().__init__()
        if size < 1:
            raise ValueError(f"size must be at least 1, got {size}")
        if not 0 <= rank < size:
            raise ValueError(f"rank must be in [0, {size}), got {rank}")
        self._store = store
        self._rank = rank
        self._size = size
        self._complete: set[str] = set()  # devices whose every rank's key was waited for already

    def _widened(self, keys: list[str]) -> Optional[list[str]]:
        """One rank's key of a device not yet waited for: every rank's key of that device (else None)."""
        if len(keys) != 1:
            return None
        match = _GLOO_KEY.fullmatch(keys[0])
        if match is None or int(match.group(2)) >= self._size:
            return None
        device = match.group(1)
        if device in self._complete:
            return None
        self._complete.add(device)
        return [f"{device}/{rank}" for rank in range(self._size)]

    def set(self, key: str, value: bytes) -> None:
        self._store.set(key, value)

    def get(self, key: str) -> bytes:
        return self._store.get(key)

    def add(self, key: str, amount: int) -> int:
        return self._store.add(key, amount)

    def wait(self, keys: list[str], timeout: Optional[datetime.timedelta] = None) -> None:
        records = self._widened(list(keys))
        if records is not None and isinstance(self._store, RecordStore):
            self._store.read_records(records, self._rank, self._size, timeout)
            return
        keys = records or list(keys)
        if timeout is None:
            self._store.wait(keys)
        else:
            self._store.wait(keys, timeout)

    def check(self, keys: list[str]) -> bool:
        return self._store.check(keys)

    def delete_key(self, key: str) -> bool:
        return self._store.delete_key(key)
