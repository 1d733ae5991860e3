"""What a worker knows about its job: ranks (or the elastic membership that hands them out), settings,
the job's secret and its private rendezvous store. Built inside the worker, never sent over the wire."""

from __future__ import annotations

import secrets as _secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Protocol, Union

from hvdray.collective.topology import RankInfo

if TYPE_CHECKING:
    import torch.distributed as dist

    from hvdray.settings import Settings


class JobSettings:
    """The job's settings as its workers read them: the values of the driver's ``Settings``, read-only
    attributes, and no pydantic (the driver validated them; importing pydantic and building the model
    cost every worker ~85 ms of CPU at start). Made by ``Settings.for_workers()``."""

    __slots__ = ("_values",)

    def __init__(self, values: Mapping[str, Any]) -> None:
        object.__setattr__(self, "_values", dict(values))

    def __getattr__(self, name: str) -> Any:
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(f"no setting {name!r}") from None

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("a job's settings are read-only in its workers")

    def replace(self, **changes: Any) -> "JobSettings":
        """A copy with ``changes`` applied (the driver validated the values; these are taken as given)."""
        unknown = sorted(set(changes) - set(self._values))
        if unknown:
            raise AttributeError(f"no setting {', '.join(map(repr, unknown))}")
        return JobSettings({**self._values, **changes})

    def __reduce__(self) -> tuple[Any, ...]:
        return JobSettings, (self._values,)

    def __repr__(self) -> str:
        return f"JobSettings({self._values!r})"


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
    settings: Union["Settings", JobSettings]
    secret: bytes
    store_factory: Callable[[str], dist.Store]  # key prefix -> the job's private store
    host_ip: str
    epoch: int = 1
    membership: Optional[Membership] = None


def single_process_job() -> JobConfig:
    """A size-1 job on an in-memory store: what ``hvd.init()`` joins outside any executor."""
    import torch.distributed as dist

    from hvdray.settings import make_settings  # the environment's HVDRAY_* and HOROVOD_* knobs, validated

    store = dist.HashStore()
    return JobConfig(
        rank_info=RankInfo(rank=0, size=1, local_rank=0, local_size=1, cross_rank=0, cross_size=1),
        settings=make_settings(),
        secret=_secrets.token_bytes(32),
        store_factory=lambda prefix: dist.PrefixStore(prefix, store),
        host_ip="127.0.0.1",
    )
