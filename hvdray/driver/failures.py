"""What the driver raises when a job fails: a lost actor, or a rank's own error named.

A worker that died becomes :class:`WorkerLostError` naming its rank; the user's exception comes back
as an instance of its own class whose ``str()`` starts with the rank. When several ranks fail at once,
:func:`consequence_level` tells the root cause from the failures it caused in its peers.
"""

from __future__ import annotations

from typing import Any, Optional

import ray

from hvdray.collective.errors import HorovodInternalError, caused_by_peer


#: how long the driver waits, after a rank failed because of a peer (an op it never got, a ring that
#: broke), for the failure that caused it (the peer's own error, or its loss) before it reports the rank's
ROOT_CAUSE_GRACE_S = 5.0


class WorkerLostError(RuntimeError):
    """A worker actor died (its process exited, was killed, or its node went away)."""


class CoordinatorLostError(RuntimeError):
    """The job's coordinator actor died or did not answer within ``timeout_s``: the job cannot go on."""


def failure_error(
    exc: BaseException,
    rank: Optional[int],
    size: Optional[int] = None,
    worker_id: Optional[str] = None,
    aftermath: str = "the other workers were stopped",
) -> BaseException:
    """The error to raise for a worker whose call failed with ``exc``: a lost worker becomes a
    :class:`WorkerLostError` naming its rank; the user's exception comes back as an instance of its
    own class whose ``str()`` starts with the rank (``"rank 1 of 2: bad batch"``), followed by the
    worker's traceback, plus a note saying what happened to the others (on the exception and on Ray's
    copy of it, which Tune reads)."""
    if size is not None:
        where = f"rank {rank} of {size}"
    else:
        where = f"rank {rank}" if rank is not None else "a worker not yet in the ring"
    if worker_id is not None:
        where += f" (worker {worker_id})"
    if isinstance(exc, (ray.exceptions.OutOfMemoryError, ray.exceptions.RayActorError)):
        who = f"the worker of {where}" if size is None else f"the worker of rank {rank} (of {size})"
        if isinstance(exc, ray.exceptions.OutOfMemoryError):
            first_lines = " ".join(str(exc).strip().splitlines()[:2])
            lost = WorkerLostError(f"{who} was killed because its node ran out of memory "
                                   f"(Ray's memory monitor): {first_lines}")
        else:
            lost = WorkerLostError(f"{who} died: {exc}")
        lost.__cause__ = exc
        return lost
    note = f"hvdray: raised on {where}; {aftermath}"
    error = exc
    if isinstance(exc, ray.exceptions.RayTaskError):
        add_note(exc.cause, note)
        # an instance of both RayTaskError and the user's class; its str() is the worker's traceback
        error = exc.as_instanceof_cause()
        headline = f"{where}: {exc.cause}\n\n{error}"
    else:
        headline = f"{where}: {exc}"
    error = _with_headline(error, headline)
    add_note(error, note)
    return error


def consequence_level(exc: BaseException) -> int:
    """How likely a rank's error is to be another's consequence: 0, its own failure; 1, a call of its
    to another actor that died (such as the job's coordinator, held by a worker that died); 2, an op a
    leaving peer never submitted (PeerFinishedError) or a ring a dead one broke (HorovodInternalError)."""
    cause = exc.cause if isinstance(exc, ray.exceptions.RayTaskError) else exc
    if caused_by_peer(cause):
        return 2
    return 1 if isinstance(exc, ray.exceptions.RayTaskError) and isinstance(cause, ray.exceptions.RayActorError) else 0


def ring_broke(exc: BaseException) -> bool:
    """True when a rank's call failed because its ring broke (a peer died, left the job or timed out)."""
    cause = exc.cause if isinstance(exc, ray.exceptions.RayTaskError) else exc
    return isinstance(cause, HorovodInternalError)


def _with_headline(error: BaseException, headline: str) -> BaseException:
    """A copy of ``error`` of a subclass of its own class (so ``except ValueError`` still catches it)
    whose ``str()`` is ``headline``. The copy is made without calling the class's ``__init__`` (a
    user's exception may take other arguments than its ``args``); a class that cannot be subclassed or
    copied leaves ``error`` as it is (its note still names the rank)."""
    base = type(error)
    try:
        cls = type(base.__name__, (base,), {
            "__module__": base.__module__,
            "__qualname__": base.__qualname__,
            "__str__": lambda self: headline,
            "__reduce__": lambda self: (_restore, (type(self), self.args, dict(self.__dict__))),
        })
        copy = _restore(cls, error.args, getattr(error, "__dict__", {}))
    except Exception:  # noqa: BLE001 - final classes, exotic __new__ signatures: keep the original
        return error
    copy.__cause__, copy.__context__ = error.__cause__, error.__context__
    copy.__suppress_context__ = error.__suppress_context__
    return copy.with_traceback(error.__traceback__)


def _restore(cls: type, args: tuple, state: dict[str, Any]) -> BaseException:
    """Build an exception of ``cls`` from its ``args`` and attributes without running ``__init__``
    (also how such a copy is unpickled, e.g. when a Tune trial's actor reports it)."""
    error = cls.__new__(cls, *args)
    error.args = args
    error.__dict__.update(state)
    return error


def add_note(exc: BaseException, note: str) -> None:
    """Add ``note`` to ``exc`` once. Ray's copy of a user exception reads missing attributes from the
    original, notes included."""
    if hasattr(exc, "add_note") and note not in getattr(exc, "__notes__", ()):
        exc.add_note(note)
