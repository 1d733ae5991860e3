"""Worker side of a distributed trial: ``report`` (``hvdray.report`` inside a trial), ``get_checkpoint``,
``distributed_checkpoint_dir``.

Every rank of a trial runs :func:`run_trial`, which sets up this process's session and calls the
user's function. Rank 0's reports (and checkpoints) are what Tune sees; the other ranks' reports keep
them in step with rank 0. Rank 0 copies each checkpoint into the trial's directory in Tune's storage
(``RunConfig(storage_path=...)``) with Ray's own ``StorageContext``, as a Ray Train worker does, and
only its location travels to the Trainable; a restored trial's ranks each copy it back to a local
directory with ``Checkpoint.to_directory``. Outside a trial these functions still work: ``hvdray.report``
goes to the executor's result (or logs), and ``get_checkpoint`` returns ``None``, so the same training function
runs in a plain executor or process.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

import ray

if TYPE_CHECKING:  # ray.tune is imported when first needed: workers start a second faster without it
    from ray.tune import Checkpoint

log = logging.getLogger(__name__)


@dataclass
class _Session:
    rank: int
    channel: Any  # the trial's ReportChannel actor
    generation: int  # which run of the function this is, for the channel
    pickled_storage: bytes  # the trial's ray.train StorageContext (see :meth:`storage`)
    restored_dir: Optional[str]  # local copy of the checkpoint the trial resumes from
    reports: int = 0
    pending_dir: Optional[str] = None  # from distributed_checkpoint_dir: persisted with the next report
    _storage: Any = None

    def storage(self) -> Any:
        """Where rank 0 persists checkpoints, and their numbering. It travels pickled and is unpickled when
        first used: unpickling imports ray.train (pyarrow, pandas), ~0.7 s of CPU that every worker of every
        new trial would pay, where only rank 0 of a checkpointing trial needs it."""
        if self._storage is None:
            self._storage = ray.cloudpickle.loads(self.pickled_storage)
        return self._storage


_session: Optional[_Session] = None


class TrialStopped(BaseException):
    """Raised by ``report`` on every rank when Tune stops the trial and keeps its workers for another one.

    A ``BaseException``, so that ``except Exception`` in training code lets it through; ``run_trial``
    catches it, and the workers are then idle and ready for the next trial.
    """


def in_trial() -> bool:
    """True inside a distributed trial's function (where ``hvdray.report`` goes to Tune)."""
    return _session is not None


def report_to_trial(metrics: dict[str, Any], checkpoint: Optional["Checkpoint"] = None) -> None:
    """``hvdray.report`` inside a trial: one result (rank 0's metrics and checkpoint count).

    Blocks until Tune asks for the next result, as ``ray.tune.report`` does. A checkpoint from
    ``distributed_checkpoint_dir`` since the last report goes with this one unless ``checkpoint`` is given.
    """
    session = _session
    assert session is not None, "called inside a trial"
    persisted_ref = None
    if session.rank == 0:
        pending, session.pending_dir = session.pending_dir, None
        try:
            if checkpoint is None and pending is not None:
                checkpoint = _checkpoint_class().from_directory(pending)
            if checkpoint is not None:
                storage = session.storage()
                storage._update_checkpoint_index(metrics)  # checkpoint_<n>, numbered as Tune numbers them
                persisted = storage.persist_current_checkpoint(checkpoint)
                persisted_ref = [ray.put(persisted)]  # wrapped: the channel passes it on without importing ray.train
        finally:
            if pending is not None:
                shutil.rmtree(pending, ignore_errors=True)
    payload = dict(metrics) if session.rank == 0 else None
    go_on = ray.get(
        session.channel.report.remote(session.generation, session.rank, session.reports, payload, persisted_ref)
    )
    session.reports += 1
    if not go_on:
        raise TrialStopped()


def get_checkpoint() -> Optional["Checkpoint"]:
    """The checkpoint this trial was restored from (a local copy on every rank), or ``None``."""
    session = _session
    if session is None or session.restored_dir is None:
        return None
    return _checkpoint_class().from_directory(session.restored_dir)


def _checkpoint_class() -> type:
    from ray.tune import Checkpoint

    return Checkpoint


@contextlib.contextmanager
def distributed_checkpoint_dir(step: int, disable: bool = False) -> Iterator[str]:
    """A directory to write a checkpoint into; on rank 0 it is kept and persisted with the next ``report``.

    Other ranks (and ``disable=True``) get a scratch directory that is thrown away, so every rank may
    run the same code while only rank 0 writes a checkpoint.
    """
    if isinstance(step, bool) or not isinstance(step, int):
        raise TypeError(f"step must be an int, got {type(step).__name__}")
    path = tempfile.mkdtemp(prefix=f"hvdray-checkpoint-{step:06d}-")
    kept = False
    try:
        yield path
        session = _session
        if session is not None and session.rank == 0 and not disable:
            if session.pending_dir is not None:  # two directories before one report: the newer one counts
                shutil.rmtree(session.pending_dir, ignore_errors=True)
            session.pending_dir, kept = path, True
    finally:
        if not kept:
            shutil.rmtree(path, ignore_errors=True)


def run_trial(
    func: Callable[..., Any],
    config: dict[str, Any],
    channel: Any,
    generation: int,
    pickled_storage: bytes,
    checkpoint: Optional["Checkpoint"],
    pass_checkpoint_dir: bool,
) -> bool:
    """Runs on every worker of a trial: copy the checkpoint to restore from (in the trial's storage)
    to a local directory, then ``func(config[, checkpoint_dir])``.

    Returns ``True`` if the function returned, ``False`` if Tune stopped it (``TrialStopped``)."""
    global _session
    rank = int(os.environ.get("HOROVOD_RANK", "0"))
    restored_dir = None
    if checkpoint is not None:
        restored_dir = checkpoint.to_directory(tempfile.mkdtemp(prefix="hvdray-restored-"))
    _session = _Session(rank=rank, channel=channel, generation=generation, pickled_storage=pickled_storage,
                        restored_dir=restored_dir)
    try:
        if pass_checkpoint_dir:
            func(config, checkpoint_dir=restored_dir)
        else:
            func(config)
        return True
    except TrialStopped:
        return False
    finally:
        pending = _session.pending_dir
        _session = None
        for path in (restored_dir, pending):
            if path is not None:
                shutil.rmtree(path, ignore_errors=True)
