"""The coordinator: rank assignment, each job's rendezvous table, and the worker record channel.

Rank assignment happens here and nowhere else. Every assignment starts a new membership epoch; the
rendezvous keys of an older epoch are dropped, and a worker still waiting on one is answered at once
(``superseded``) instead of at its timeout. The elastic driver may also *abandon* the current epoch (a
member died while it formed or ran): its rendezvous waits are answered ``superseded`` at once, and no
worker is handed that epoch any more. In an elastic job workers wait here for the epoch that includes them and
poll the host-update counter the driver bumps.

One :class:`Coordinator` holds one job's state. They live in a :class:`CoordinatorHost` actor, one per
driver process and Ray session, shared by the executors that driver runs (one after another or at
once): a job's coordination costs a table in a process that is already up, not a process of its own
(starting one took a third of a 2-worker job's start here, see docs/performance_start_and_scale.md).
Each job has its own token; a call is answered from the table of the job whose token it presents, and
a job's table is dropped when its executor shuts down. The actor is asynchronous so that many workers
can wait at once; it needs no CPU.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import inspect
import itertools
import os
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from hvdray.collective.topology import RankInfo, WorkerSlot, assign_ranks, visible_devices

#: how long a driver waits for its coordinator host to take a new job before it starts another host
HOST_ANSWER_S = 30.0
#: how long a worker's record waits for one its sender numbered before it (see ``Coordinator._add_record``)
RECORD_GAP_S = 2.0

#: one worker record as ``(record, report)``: ``report`` is ``(metrics, checkpoint_path)`` for rank 0's
#: ``hvdray.report`` and None for a ``ray_logger.log`` record
Record = tuple[dict[str, Any], Optional[tuple[dict[str, Any], Optional[str]]]]


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
    """A job's coordinator (its client, holding the token) and the secret its workers share."""

    client: CoordinatorClient
    secret: bytes

    def close(self) -> None:
        """Drop the job's table from the host (its token is refused from now on); does not wait."""
        try:
            self.client.close_job()
        except Exception:  # noqa: BLE001 - the host (or Ray) is gone already: nothing is left to drop
            pass


_host_lock = threading.Lock()
#: this process's coordinator host: ``((Ray job id, node id), handle)``; a new Ray session starts another
_host: Optional[tuple[tuple[str, str], Any]] = None
_host_names = itertools.count()


def start_job_coordinator(answer_s: float = HOST_ANSWER_S) -> JobCoordinator:
    """A new job's coordinator, with a fresh token and secret, in this driver's coordinator host.

    The host is started by the first job of this process in this Ray session, on the driver's node and
    never spilled elsewhere (losing another node must not lose it), and kept for the next jobs. A host
    that died, or that does not take the job within ``answer_s``, is replaced by a new one."""
    global _host
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from hvdray.driver.cluster import actor_class

    token = secrets.token_bytes(32)
    digest = hashlib.sha256(token).digest()
    context = ray.get_runtime_context()
    where = (context.get_job_id(), context.get_node_id())
    with _host_lock:
        handle = _host[1] if _host is not None and _host[0] == where else None
        if handle is not None:
            try:
                ray.get(handle.open_job.remote(digest), timeout=answer_s)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                ray.kill(handle, no_restart=True)
                handle = None
        if handle is None:
            handle = actor_class(CoordinatorHost).options(
                num_cpus=0,
                name=f"hvdray-coordinator-{os.getpid()}-{next(_host_names)}",
                scheduling_strategy=NodeAffinitySchedulingStrategy(where[1], soft=False),
            ).remote(digest)
            _host = (where, handle)
    return JobCoordinator(CoordinatorClient(handle, token), secrets.token_bytes(32))


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
        job = self._jobs.pop(self._digest(token), None)
        if job is not None:
            await job.close()

    async def call(self, token: bytes, method: str, *args: Any, **kwargs: Any) -> Any:
        """``Coordinator.<method>(token, *args, **kwargs)`` on the table of the job holding ``token``."""
        job = self._jobs.get(self._digest(token))
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

    @staticmethod
    def _digest(token: Any) -> bytes:
        return hashlib.sha256(token).digest() if isinstance(token, bytes) else b""


class Coordinator:
    """One job's table: membership (an epoch that grows with every assignment), the rendezvous keys and
    the record channel. Every call presents the job's token."""

    def __init__(self, token_digest: bytes) -> None:
        self._token_digest = token_digest
        self._epoch = 0
        self._kv: dict[str, bytes] = {}
        self._arrivals: dict[str, asyncio.Event] = {}  # key -> set when it is written (rendezvous waits)
        self._changed = asyncio.Condition()  # membership changes
        self._records: list[Record] = []  # worker records the driver has not acknowledged, in order
        self._first_record = 0  # the number of self._records[0]
        self._new_record = asyncio.Condition()
        self._held: dict[str, dict[int, tuple[float, Record]]] = {}  # sender -> number -> (arrived at, record)
        self._next_record: dict[str, int] = {}  # sender -> the number of its next record to keep
        self._next_checkpoint = 0
        # elastic membership: worker id -> (RankInfo, node GPU ids) in the current epoch
        self._members: dict[str, tuple[RankInfo, tuple[str, ...]]] = {}
        self._waiting: dict[str, int] = {}  # worker id -> the epoch it has left (0: never joined)
        self._waiting_since: dict[str, int] = {}  # worker id -> the epoch current when it began waiting
        self._host_updates = 0
        self._host_updates_at_epoch = 0
        self._abandoned = 0  # the newest epoch the driver gave up on (0: none)
        # Ray Data (driver/datasets.py): the call whose datasets are offered, their names, and the current
        # epoch's shards (one {name: DataIterator} per rank); older epochs' splits are dropped
        self._data_call = 0
        self._data_names: tuple[str, ...] = ()
        self._shards: Optional[tuple[int, list[dict[str, Any]]]] = None

    async def close(self) -> None:
        """The job is over: no epoch can be joined any more, and every rendezvous wait ends at once."""
        async with self._changed:
            self._abandoned = self._epoch
            self._clear_kv()
            self._changed.notify_all()

    def _admit(self, token: Any) -> None:
        """Refuse a caller that does not present the job's rendezvous token."""
        if not isinstance(token, bytes) or not hmac.compare_digest(hashlib.sha256(token).digest(), self._token_digest):
            raise PermissionError("this hvdray job's coordinator only answers callers that hold the job's token")

    # -- membership ------------------------------------------------------------------------
    async def assign(
        self, token: bytes, slots: Sequence[WorkerSlot], worker_ids: Optional[Sequence[str]] = None
    ) -> tuple[int, list[RankInfo], list[tuple[str, ...]]]:
        """New membership epoch: each slot's RankInfo and the GPU ids its node's workers share.

        With ``worker_ids`` (elastic jobs) the workers waiting in :meth:`await_membership` get theirs."""
        self._admit(token)
        infos, gpus = assign_ranks(slots), visible_devices(slots)
        async with self._changed:
            self._epoch += 1
            self._clear_kv()  # keys of the previous membership are never read again
            self._members = dict(zip(worker_ids, zip(infos, gpus))) if worker_ids is not None else {}
            self._host_updates_at_epoch = self._host_updates  # the new members know every host announced
            for worker_id in self._members:
                self._waiting.pop(worker_id, None)
                self._waiting_since.pop(worker_id, None)
            self._changed.notify_all()
        return self._epoch, infos, gpus

    def epoch(self, token: bytes) -> int:
        self._admit(token)
        return self._epoch

    async def abandon(self, token: bytes, epoch: int) -> None:
        """The driver gave up on ``epoch`` (one of its members is gone): whoever waits in its rendezvous
        is answered ``superseded`` at once, and workers wait for the next epoch instead of joining it."""
        self._admit(token)
        async with self._changed:
            if epoch == self._epoch and self._abandoned < epoch:
                self._abandoned = epoch
                self._clear_kv()
                self._changed.notify_all()

    def _joinable(self) -> bool:
        """The current epoch exists and was not abandoned."""
        return self._epoch > self._abandoned

    async def await_membership(
        self, token: bytes, worker_id: str, left_epoch: int, timeout_s: float
    ) -> tuple[str, Optional[tuple[int, RankInfo, tuple[str, ...]]]]:
        """A worker that left epoch ``left_epoch`` (0: a new worker) waits for the next one.

        Returns ``("member", (epoch, rank_info, node_gpu_ids))``, ``("removed", None)`` when a newer
        epoch was formed without this worker, or ``("wait", None)`` after ``timeout_s`` (ask again)."""
        self._admit(token)
        async with self._changed:
            if worker_id in self._members and self._epoch > left_epoch and self._joinable():
                return "member", self._member(worker_id)
            # a new worker waits for an epoch formed after it arrived, never for the one already running
            since = self._waiting_since.setdefault(worker_id, self._epoch)
            self._waiting[worker_id] = left_epoch
            target = max(left_epoch, since)
            try:
                await asyncio.wait_for(
                    self._changed.wait_for(lambda: self._epoch > target and self._joinable()), timeout=timeout_s
                )
            except asyncio.TimeoutError:
                return "wait", None
            if worker_id not in self._members:
                return "removed", None
            return "member", self._member(worker_id)

    def _member(self, worker_id: str) -> tuple[int, RankInfo, tuple[str, ...]]:
        info, gpus = self._members[worker_id]
        return self._epoch, info, gpus

    def waiting(self, token: bytes) -> dict[str, int]:
        """Workers waiting for a new epoch, with the epoch each has left (read by the elastic driver)."""
        self._admit(token)
        return dict(self._waiting)

    def forget(self, token: bytes, worker_ids: Sequence[str]) -> None:
        """Stop reporting workers the driver has dropped as waiting."""
        self._admit(token)
        for worker_id in worker_ids:
            self._waiting.pop(worker_id, None)
            self._waiting_since.pop(worker_id, None)

    def notify_hosts_updated(self, token: bytes) -> None:
        """The driver started workers on new hosts: members raise HostsUpdatedInterrupt at their next commit."""
        self._admit(token)
        self._host_updates += 1

    def host_updates(self, token: bytes) -> int:
        """Host updates announced since the current epoch was formed (0: nothing to react to)."""
        self._admit(token)
        return self._host_updates - self._host_updates_at_epoch

    # -- rendezvous key-value table ----------------------------------------------------------
    async def kv_set(self, token: bytes, key: str, value: bytes) -> None:
        self._admit(token)
        if not self._live(key):
            return  # a key of an epoch that is over would never be read
        self._kv[key] = value
        self._arrived(key)

    async def kv_get(self, token: bytes, key: str, timeout_s: float) -> tuple[str, Optional[bytes]]:
        """``("ok", value)``, or ``("timeout"|"superseded", None)`` as :meth:`kv_wait` says."""
        status, values = await self.kv_read(token, [key], timeout_s)
        return status, values[0] if values is not None else None

    async def kv_read(self, token: bytes, keys: list[str], timeout_s: float) -> tuple[str, Optional[list[bytes]]]:
        """Wait for ``keys`` as :meth:`kv_wait` does and answer ``("ok", their values)`` in one reply, or
        ``("timeout"|"superseded", None)``: a Gloo group's connect reads all its ranks' keys in one call."""
        status = await self.kv_wait(token, keys, timeout_s)
        return status, [self._kv[k] for k in keys] if status == "ok" else None

    async def kv_add(self, token: bytes, key: str, amount: int) -> int:
        self._admit(token)
        value = int(self._kv.get(key, b"0")) + amount
        self._kv[key] = str(value).encode()
        self._arrived(key)
        return value

    def _live(self, key: str) -> bool:
        """``key`` belongs to the current epoch, and the driver has not abandoned it."""
        return key.startswith(f"e{self._epoch}/") and self._joinable()

    async def kv_wait(self, token: bytes, keys: list[str], timeout_s: float) -> str:
        """``"ok"`` once all ``keys`` exist; ``"superseded"`` as soon as their epoch is over (a newer one
        formed, or the driver abandoned it); ``"timeout"`` after ``timeout_s``."""
        self._admit(token)
        if not keys:
            return "ok"
        if not all(self._live(k) for k in keys):
            return "superseded"
        deadline = time.monotonic() + timeout_s
        for key in keys:  # woken only by the key awaited now (or the epoch's end): O(len(keys)) wake-ups at most
            while key not in self._kv:
                if not self._live(key):
                    return "superseded"
                arrival = self._arrivals.setdefault(key, asyncio.Event())
                try:
                    await asyncio.wait_for(arrival.wait(), timeout=max(deadline - time.monotonic(), 0.0))
                except asyncio.TimeoutError:
                    return "timeout"
        if not self._live(keys[0]):
            return "superseded"
        if not all(k in self._kv for k in keys):  # one was deleted meanwhile: wait for it again
            return await self.kv_wait(token, keys, max(deadline - time.monotonic(), 0.0))
        return "ok"

    def _arrived(self, key: str) -> None:
        """``key`` was written: wake whoever waits for it."""
        arrival = self._arrivals.pop(key, None)
        if arrival is not None:
            arrival.set()

    def _clear_kv(self) -> None:
        """Drop every key (the epoch is over) and wake every rendezvous wait, which then answers ``superseded``."""
        self._kv.clear()
        arrivals, self._arrivals = self._arrivals, {}
        for arrival in arrivals.values():
            arrival.set()

    def kv_check(self, token: bytes, keys: list[str]) -> bool:
        self._admit(token)
        return all(k in self._kv for k in keys)

    def kv_delete(self, token: bytes, key: str) -> bool:
        self._admit(token)
        return self._kv.pop(key, None) is not None

    # -- Ray Data shards ------------------------------------------------------------------------
    async def offer_datasets(self, token: bytes, call: int, names: Sequence[str]) -> None:
        """Executor call ``call`` runs with these datasets (none: ``names`` empty); shards follow per epoch."""
        self._admit(token)
        async with self._changed:
            self._data_call, self._data_names, self._shards = call, tuple(names), None
            self._changed.notify_all()

    async def publish_shards(self, token: bytes, call: int, epoch: int, shards: list[dict[str, Any]]) -> None:
        """The shards of membership ``epoch`` for call ``call``, one per rank."""
        self._admit(token)
        async with self._changed:
            if call == self._data_call:
                self._shards = (epoch, shards)
                self._changed.notify_all()

    async def dataset_shard(
        self, token: bytes, call: int, epoch: int, rank: int, timeout_s: float
    ) -> tuple[str, Any]:
        """Rank ``rank``'s shards in ``epoch`` of call ``call``: ``("ok", {name: iterator})``,
        ``("none", None)`` when the call has no datasets (or a newer call runs), ``("superseded", None)`` once a newer epoch formed or the epoch was abandoned, or
        ``("timeout", None)``; waits for the driver to publish the epoch's split."""
        self._admit(token)

        def answered() -> bool:
            return (call != self._data_call or not self._data_names or epoch != self._epoch
                    or not self._joinable() or (self._shards is not None and self._shards[0] == epoch))

        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait_for(answered), timeout=timeout_s)
            except asyncio.TimeoutError:
                return "timeout", None
            if call != self._data_call or not self._data_names:
                return "none", None
            if epoch != self._epoch or not self._joinable():
                return "superseded", None
            assert self._shards is not None
            return "ok", self._shards[1][rank]

    # -- the worker record channel: ray_logger.log and hvdray.report ------------------------
    async def push_log(
        self, token: bytes, rank: int, record: dict[str, Any], origin: Optional[tuple[str, int]] = None
    ) -> None:
        """A worker's ``ray_logger.log``; ``origin``: see :meth:`_add_record`."""
        self._admit(token)
        await self._add_record(({"rank": rank, **record}, None), origin)

    async def push_report(
        self, token: bytes, rank: int, metrics: dict[str, Any], checkpoint_path: Optional[str],
        origin: Optional[tuple[str, int]] = None,
    ) -> None:
        """Rank 0's ``hvdray.report``: its callbacks see the metrics as a record, the run's result keeps
        them with the path of the checkpoint rank 0 persisted (or None)."""
        self._admit(token)
        await self._add_record(({"rank": rank, **metrics}, (dict(metrics), checkpoint_path)), origin)

    async def _add_record(self, record: Record, origin: Optional[tuple[str, int]] = None) -> None:
        """Keep ``record`` for the driver. ``origin`` is ``(sender, number)``, numbered from 0 by each
        worker process: Ray may run an async actor's calls out of the order one caller sent them, so a
        record waits here until those sent before it arrived (or for :data:`RECORD_GAP_S` at most)."""
        async with self._new_record:
            if origin is None:
                self._records.append(record)
            else:
                sender, number = origin
                self._held.setdefault(sender, {})[number] = (time.monotonic(), record)
                self._release(sender)
            self._new_record.notify_all()

    def _release(self, sender: str) -> None:
        """Move ``sender``'s held records that are next in its order to the kept ones; past a gap that
        stayed open for :data:`RECORD_GAP_S` (a record lost with its sender), go on after it."""
        held, number = self._held.get(sender, {}), self._next_record.get(sender, 0)
        while held:
            if number not in held:
                if min(arrived for arrived, _ in held.values()) > time.monotonic() - RECORD_GAP_S:
                    break
                number = min(held)
            self._records.append(held.pop(number)[1])
            number += 1
        self._next_record[sender] = number

    async def records(self, token: bytes, after: Optional[int], timeout_s: float) -> tuple[int, list[Record]]:
        """``(first, records)``: the records numbered ``first`` on, ``first`` being ``after`` (None: the
        oldest one kept). Those before ``after`` are dropped: the driver has them. With none there yet,
        waits up to ``timeout_s`` for one, so that the driver's ``ray.wait`` wakes when a record arrives."""
        self._admit(token)
        async with self._new_record:
            for sender in [sender for sender, held in self._held.items() if held]:
                self._release(sender)
            if after is not None and after > self._first_record:
                del self._records[: after - self._first_record]
                self._first_record = after
            first = max(after or 0, self._first_record)
            if timeout_s > 0:
                try:
                    await asyncio.wait_for(
                        self._new_record.wait_for(lambda: self._first_record + len(self._records) > first), timeout_s
                    )
                except asyncio.TimeoutError:
                    pass
            first = max(first, self._first_record)  # another call may have dropped some meanwhile
            return first, self._records[first - self._first_record:]

    def begin_checkpoints(self, token: bytes, first: int) -> None:
        """The driver starts a run whose first checkpoint is ``checkpoint_<first>`` (past those in storage)."""
        self._admit(token)
        self._next_checkpoint = first

    def next_checkpoint(self, token: bytes) -> int:
        """The number of the next checkpoint rank 0 persists: counted here, so that a new rank 0 after an
        elastic reset goes on counting and never overwrites one."""
        self._admit(token)
        self._next_checkpoint += 1
        return self._next_checkpoint - 1


#: what a job's callers may ask of its table (through ``CoordinatorHost.call``)
_JOB_CALLS = frozenset(
    name for name, member in vars(Coordinator).items() if not name.startswith("_") and callable(member)
) - {"close"}
