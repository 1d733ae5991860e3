"""Real ``ProcessGroupGloo``s of several ranks in one process, one thread per rank (for unit tests)."""

from __future__ import annotations

import datetime
import threading
from typing import Any, Callable

import torch.distributed as dist


def in_threads(size: int, fn: Callable[[int], Any]) -> list[Any]:
    """``fn(rank)`` for every rank at once, each in its own thread; their results in rank order."""
    errors, results = [], [None] * size

    def run(rank: int) -> None:
        try:
            results[rank] = fn(rank)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors
    return results


def gloo_group(store: dist.Store, rank: int, size: int) -> dist.ProcessGroupGloo:
    """A real Gloo group on loopback, connected through ``store``."""
    options = dist.ProcessGroupGloo._Options()
    options._timeout = datetime.timedelta(seconds=30)
    options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    return dist.ProcessGroupGloo(store, rank, size, options)
