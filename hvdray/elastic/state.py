"""Elastic state on the workers: what is committed, rolled back after a failure, and synced to new workers.

``commit()`` saves a copy in memory (and, with the ``storage_path`` setting, rank 0 writes it to
storage: see storage.py) and then checks, with every rank agreeing, whether the driver has announced new
hosts; if so every rank raises :class:`HostsUpdatedInterrupt` at the same commit. After a reset,
``sync()`` copies the state from the rank holding the most recent commit (a survivor) to all; when no
rank holds one (a new job, or every worker was lost) it is the newest commit in storage, if any.
"""

from __future__ import annotations

import abc
import copy
import logging
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional

import torch

from hvdray.collective import session
from hvdray.collective import ops as _c
from hvdray.testing import faults

if TYPE_CHECKING:
    from hvdray.elastic.storage import CommitStorage

log = logging.getLogger(__name__)


class HostsUpdatedInterrupt(RuntimeError):
    """Raised by ``commit``/``check_host_updates`` on every rank when the job's hosts changed."""

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__("the elastic job's hosts changed; resetting to the new membership")
        self.skip_sync = skip_sync


class State(abc.ABC):
    """Base of every elastic state: reset callbacks, commits and host-update checks."""

    def __init__(self) -> None:
        self._reset_callbacks: list[Callable[[], None]] = []
        self._commits = 0

    def register_reset_callbacks(self, callbacks: Iterable[Callable[[], None]]) -> None:
        """Functions called (no arguments) after every reset, e.g. to rescale the learning rate by size."""
        callbacks = list(callbacks)
        for cb in callbacks:
            if not callable(cb):
                raise TypeError(f"callbacks must be callables, got {type(cb).__name__}")
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """Called by ``hvd.elastic.run`` after the ring was re-formed."""
        for cb in self._reset_callbacks:
            cb()

    def commit(self) -> None:
        """Save the state in memory (a failure rolls back to here) and, with ``storage_path``, in storage
        (rank 0 writes it before it returns), then check for host updates."""
        self.save()
        self._commits += 1
        storage = _storage()
        if storage is not None and session.is_initialized() and session.rank_info("commit()").rank == 0:
            storage.write(self._commits, self._saved_copy())
        faults.reached("commit")
        self.check_host_updates()
        faults.reached("after_commit")

    def check_host_updates(self) -> None:
        """Raise :class:`HostsUpdatedInterrupt` on every rank if the driver announced new hosts."""
        if not session.is_initialized():
            return
        pending = torch.tensor([session.host_updates()], dtype=torch.int64)
        pending = _c.call_blocking(_c.allreduce_async, pending, op=_c.Max, name="hvdray.elastic.host_updates")
        if int(pending.item()) > 0:  # every rank sees the same maximum, so every rank raises here
            raise HostsUpdatedInterrupt(skip_sync=False)

    def sync(self) -> None:
        """Make every rank's state equal to that of the rank with the most recent commit."""
        faults.reached("sync")
        counts = _c.call_blocking(
            _c.allgather_async, torch.tensor([self._commits], dtype=torch.int64), name="hvdray.elastic.commits"
        ).tolist()
        storage = _storage()
        if max(counts) == 0 and storage is not None:  # no rank has committed: resume from storage, if it can
            loaded = self._resume_from(storage) if session.rank_info("sync()").rank == 0 else 0
            resumed = _c.call_blocking(
                _c.broadcast_async, torch.tensor([loaded], dtype=torch.int64), 0, name="hvdray.elastic.resumed"
            )
            counts[0] = int(resumed.item())
        root = counts.index(max(counts))
        self._sync_from(root)
        self._commits = max(counts)
        self.save()

    def _resume_from(self, storage: CommitStorage) -> int:
        """Load the newest commit in storage into this rank's state; its number (0: none there)."""
        newest = storage.latest()
        if newest is None:
            return 0
        self._commits, saved = newest
        self._load_copy(saved)
        self.restore()
        log.info("hvdray elastic: resumed from commit %d in %s", self._commits, storage.path)
        return self._commits

    @abc.abstractmethod
    def save(self) -> None:
        """Keep an in-memory copy of the state."""

    @abc.abstractmethod
    def _saved_copy(self) -> dict[str, Any]:
        """The copy ``save`` keeps, as one picklable dict (what storage holds)."""

    @abc.abstractmethod
    def _load_copy(self, saved: dict[str, Any]) -> None:
        """Make ``saved`` (a ``_saved_copy`` read back) the copy that ``restore`` goes back to."""

    @abc.abstractmethod
    def restore(self) -> None:
        """Go back to the last saved copy."""

    @abc.abstractmethod
    def _sync_from(self, root_rank: int) -> None:
        """Overwrite this rank's live state with ``root_rank``'s."""


class ObjectState(State):
    """Picklable attributes (``state.epoch``, ``state.batch``, ...) committed, restored and synced.

    ``bcast_object`` and ``get_rank`` are accepted for Horovod compatibility; hvdray's own are used.
    """

    def __init__(self, bcast_object: Optional[Callable[..., Any]] = None, get_rank: Optional[Callable[[], int]] = None,
                 **kwargs: Any) -> None:
        self._saved_state = dict(kwargs)
        for name, value in kwargs.items():
            setattr(self, name, value)
        super().__init__()
        self.save()

    def save(self) -> None:
        self._saved_state = {name: copy.deepcopy(getattr(self, name)) for name in self._saved_state}

    def restore(self) -> None:
        for name, value in self._saved_state.items():
            setattr(self, name, copy.deepcopy(value))

    def _saved_copy(self) -> dict[str, Any]:
        return {"objects": self._saved_state}

    def _load_copy(self, saved: dict[str, Any]) -> None:
        self._saved_state = dict(saved["objects"])

    def _sync_from(self, root_rank: int) -> None:
        current = {name: getattr(self, name) for name in self._saved_state}
        for name, value in _c.broadcast_object(current, root_rank, name="hvdray.elastic.objects").items():
            setattr(self, name, value)


_storages: dict[str, CommitStorage] = {}


def _storage() -> Optional[CommitStorage]:
    """The job's commit storage (the ``storage_path`` setting), or None."""
    path = session.settings().storage_path
    if path is None:
        return None
    if path not in _storages:
        from hvdray.elastic.storage import CommitStorage  # pyarrow: imported by the jobs that commit to storage

        _storages[path] = CommitStorage(path)
    return _storages[path]
