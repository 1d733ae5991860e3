"""Where a job's coordinator lives, and the driver's view of it.

A job's :class:`~hvdray.driver.coordinator.Coordinator` table lives in one of two places, and is found
there by the token each call presents; neither costs the job a process of its own (starting one took a
third of a 2-worker job's start here, see docs/performance_start_and_scale.md):

- **in the job's first worker** (:class:`CoordinatingWorker`), for a fixed-size job of at most
  :data:`HOSTED_BY_WORKER_UP_TO` workers: losing any worker ends such a job anyway, and its first start
  then starts no process beyond its workers;
- **in the driver's coordinator host** (:class:`CoordinatorHost`, one actor per driver process) for
  elastic jobs (whose workers come and go while the table must stay) and larger fixed ones (whose
  coordinator work would slow a rank down). The driver's first such job starts it (on the driver's
  node), later jobs open a table in it, and a job's table is dropped when its executor shuts down. A
  host that died or stopped answering is replaced at the next start.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import os
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional

import ray

from hvdray.driver.cluster import actor_class
from hvdray.driver.coordinator import Coordinator, token_digest
from hvdray.worker.actor import Worker

#: how long a driver waits for its coordinator host to take a new job before it starts another host
HOST_ANSWER_S = 30.0

#: how the Ray name of a driver's coordinator host begins (then the driver's pid and a count)
HOST_NAME_PREFIX = "hvdray-coordinator-"

#: fixed-size jobs of at most this many workers keep their coordinator in their first worker
HOSTED_BY_WORKER_UP_TO = 16

#: the worker concurrency group that answers coordinator calls while the user's function runs
COORDINATION_GROUP = "coordination"

#: threads of a coordinating worker's coordination group: every call that waits (a rank's rendezvous
#: read, its dataset shard, the driver's wait for records) holds one, so two per rank and a few for the
#: driver's calls leave one free for the call that ends the waits
COORDINATION_THREADS = 2 * HOSTED_BY_WORKER_UP_TO + 8


#: what a job's callers may ask of its table (through ``CoordinatorHost.call``)
_JOB_CALLS = frozenset(
    name for name, member in vars(Coordinator).items() if not name.startswith("_") and callable(member)
) - {"close"}


class CoordinatorClient:
    """A job's view of its coordinator: the host's actor handle plus the job's token, presented on every call.

    ``client.kv_get.remote(key, timeout_s)`` runs ``Coordinator.kv_get(token, key, timeout_s)`` on the
    job's table in the host. The driver makes one with :func:`start_job_coordinator` and hands it to
    the job's workers."""

    def __init__(self, handle: Any, token: bytes) -> None:
        self.handle = handle
        self._token = token

    def __getattr__(self, method: str) -> "_TokenCall":
        if method.startswith("_"):
            raise AttributeError(method)
        return _TokenCall(self.handle, self._token, method)

    def close_job(self) -> Any:
        """Drop the job's table from the host: its waits end, its token is refused from then on."""
        return self.handle.close_job.remote(self._token)


class _TokenCall:
    __slots__ = ("_handle", "_token", "_method")

    def __init__(self, handle: Any, token: bytes, method: str) -> None:
        self._handle, self._token, self._method = handle, token, method

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        return self._handle.call.remote(self._token, self._method, *args, **kwargs)


@dataclass(frozen=True)
class JobCoordinator:
    """A job's coordinator (its client, holding the token) and the secret its workers share. A host
    started for the job may still be starting (importing, on a busy node) until ``starts_by``
    (``time.monotonic()``), its start budget; one that was running already has none (0)."""

    client: CoordinatorClient
    secret: bytes
    starts_by: float = 0.0

    def close(self) -> Optional[ray.ObjectRef]:
        """Drop the job's table from the host (its token is refused from now on); does not wait, but
        returns the call (None: the host or Ray was gone already, and nothing is left to drop)."""
        try:
            return self.client.close_job()
        except Exception:  # noqa: BLE001 - the host (or Ray) is gone already: nothing is left to drop
            return None


_host_lock = threading.Lock()
#: this process's coordinator host: ``((Ray job id, node id), handle)``; a new Ray session starts another
_host: Optional[tuple[tuple[str, str], Any]] = None
_host_names = itertools.count()


def _host_here() -> tuple[tuple[str, str], Optional[Any]]:
    """Where this driver's host belongs, ``(Ray job id, node id)``, and the host kept for it (None if
    there is none, or the one kept is of an earlier Ray session, whose handle is no longer valid).
    Called under ``_host_lock``."""
    context = ray.get_runtime_context()
    where = (context.get_job_id(), context.get_node_id())
    return where, _host[1] if _host is not None and _host[0] == where else None


def start_job_coordinator(answer_s: float = HOST_ANSWER_S, start_s: float = HOST_ANSWER_S) -> JobCoordinator:
    """A new job's coordinator, with a fresh token and secret, in this driver's coordinator host.

    The host is started by the first job of this process in this Ray session, on the driver's node and
    never spilled elsewhere (losing another node must not lose it), and kept for the next jobs. A host
    that died, or that does not take the job within ``answer_s``, is replaced by a new one, which has
    ``start_s`` to answer its first call (``JobCoordinator.starts_by``), as a worker has to start."""
    global _host
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    token = secrets.token_bytes(32)
    digest = token_digest(token)
    starts_by = 0.0
    with _host_lock:
        where, handle = _host_here()
        if handle is not None:
            try:
                ray.get(handle.open_job.remote(digest), timeout=answer_s)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                ray.kill(handle, no_restart=True)
                handle = None
        if handle is None:
            handle = actor_class(CoordinatorHost).options(
                num_cpus=0,
                name=f"{HOST_NAME_PREFIX}{os.getpid()}-{next(_host_names)}",
                scheduling_strategy=NodeAffinitySchedulingStrategy(where[1], soft=False),
            ).remote(digest)
            _host = (where, handle)
            starts_by = time.monotonic() + start_s
    return _job_coordinator(handle, token, starts_by)


def _job_coordinator(handle: Any, token: bytes, starts_by: float = 0.0) -> JobCoordinator:
    """A job whose table the actor ``handle`` holds for callers presenting ``token``; with a new secret."""
    return JobCoordinator(CoordinatorClient(handle, token), secrets.token_bytes(32), starts_by)


def fixed_worker_class(hosts_coordinator: bool) -> Any:
    """The Ray actor class of a fixed job's worker: every one has the coordination group (so that all
    ranks run the user's function alike, on the actor's task thread); the first worker of a job whose
    coordinator it holds has enough threads in it to answer every rank's waiting call at once."""
    threads = COORDINATION_THREADS if hosts_coordinator else 1
    return actor_class(CoordinatingWorker, ((COORDINATION_GROUP, threads),))


def start_coordinating_worker(options: dict[str, Any]) -> tuple[Any, JobCoordinator]:
    """A fixed job's first worker (created with the Ray actor ``options``), holding a new job's
    coordinator, and that coordinator."""
    token = secrets.token_bytes(32)
    actor = fixed_worker_class(hosts_coordinator=True).options(**options).remote(token_digest(token))
    return actor, _job_coordinator(actor, token)


class CoordinatorHost:
    """The actor: the :class:`Coordinator` of every open job of one driver, found by the caller's token."""

    def __init__(self, first_job_digest: bytes) -> None:
        self._jobs: dict[bytes, Coordinator] = {}
        self.open_job(first_job_digest)

    def open_job(self, token_digest: bytes) -> None:
        """A new job whose callers present the token with this SHA-256 digest."""
        self._jobs[token_digest] = Coordinator(token_digest)

    async def close_job(self, token: bytes) -> None:
        """Drop the job's table: its waits end, and its token is refused from now on."""
        job = self._jobs.pop(token_digest(token), None)
        if job is not None:
            await job.close()

    async def call(self, token: bytes, method: str, *args: Any, **kwargs: Any) -> Any:
        """``Coordinator.<method>(token, *args, **kwargs)`` on the table of the job holding ``token``."""
        job = self._jobs.get(token_digest(token))
        if job is None:
            raise PermissionError("this hvdray job's coordinator only answers callers that hold the job's token"
                                  " (or the job was shut down)")
        if method not in _JOB_CALLS:
            raise AttributeError(f"the coordinator has no call {method!r}")
        answer = getattr(job, method)(token, *args, **kwargs)
        return await answer if inspect.isawaitable(answer) else answer

    def jobs(self) -> int:
        """How many jobs are open here."""
        return len(self._jobs)


class _LoopHost:
    """A :class:`CoordinatorHost` on an asyncio loop of its own thread, for a process whose actor runs
    other work: its calls are made from any thread and answered there."""

    def __init__(self, first_job_digest: bytes) -> None:
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, name="hvdray-coordinator", daemon=True).start()
        self._host = CoordinatorHost(first_job_digest)

    def answer(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """``CoordinatorHost.<method>(*args, **kwargs)``, run on the loop; blocks the calling thread."""
        return asyncio.run_coroutine_threadsafe(getattr(self._host, method)(*args, **kwargs), self._loop).result()


class CoordinatingWorker(Worker):
    """A fixed job's worker that may also hold the job's coordinator: its table answers on a thread of
    the coordination group while the user's function runs on the actor's task thread."""

    def __init__(self, first_job_digest: Optional[bytes] = None) -> None:
        super().__init__()
        self._table = _LoopHost(first_job_digest) if first_job_digest is not None else None

    def _hosting(self) -> _LoopHost:
        if self._table is None:
            raise PermissionError("this hvdray worker holds no job's coordinator")
        return self._table

    @ray.method(concurrency_group=COORDINATION_GROUP)
    def call(self, token: bytes, method: str, *args: Any, **kwargs: Any) -> Any:
        """As :meth:`CoordinatorHost.call`."""
        return self._hosting().answer("call", token, method, *args, **kwargs)

    @ray.method(concurrency_group=COORDINATION_GROUP)
    def close_job(self, token: bytes) -> None:
        """As :meth:`CoordinatorHost.close_job`."""
        self._hosting().answer("close_job", token)
