"""What a worker knows about its job: ranks (or the elastic membership that hands them out), settings,
the job's secret and its private rendezvous store. Built inside the worker, never sent over the wire."""

from __future__ import annotations

import secrets as _secrets
from dataclasses import dataclass
from typing import Callable, Optional, Protocol

import torch.distributed as dist

from hvdray.collective.topology import RankInfo
from hvdray.settings import Settings, make_settings


class Membership(Protocol):
    """Where an elastic worker learns its place in each membership epoch (the worker actor provides it)."""

    def next_epoch(self, left_epoch: int) -> tuple[int, RankInfo]:
        """Block until an epoch newer than ``left_epoch`` includes this worker; its number and our ranks."""

    def host_updates(self) -> int:
        """Host updates the driver announced since this worker's epoch was formed."""


@dataclass
class JobConfig:
    """What a worker knows about its job; built inside the worker, never sent over the wire."""

    rank_info: Optional[RankInfo]  # None: an elastic worker between epochs
    settings: Settings
    secret: bytes
    store_factory: Callable[[str], dist.Store]  # key prefix -> the job's private store
    host_ip: str
    epoch: int = 1
    membership: Optional[Membership] = None


def single_process_job() -> JobConfig:
    """A size-1 job on an in-memory store: what ``hvd.init()`` joins outside any executor."""
    store = dist.HashStore()
    return JobConfig(
        rank_info=RankInfo(rank=0, size=1, local_rank=0, local_size=1, cross_rank=0, cross_size=1),
        settings=make_settings(),
        secret=_secrets.token_bytes(32),
        store_factory=lambda prefix: dist.PrefixStore(prefix, store),
        host_ip="127.0.0.1",
    )
