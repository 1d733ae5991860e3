"""One job's coordination table: rank assignment, the rendezvous keys, and the worker record channel.

Rank assignment happens here and nowhere else. Every assignment starts a new membership epoch; the
rendezvous keys of an older epoch are dropped, and a worker still waiting on one is answered at once
(``superseded``) instead of at its timeout. The elastic driver may also *abandon* the current epoch (a
member died while it formed or ran): its rendezvous waits are answered ``superseded`` at once, and no
worker is handed that epoch any more. In an elastic job workers wait here for the epoch that includes them and
poll the host-update counter the driver bumps.

Every call presents the job's token. A table lives on an asyncio loop, so that many workers can wait at
once, in a small fixed job's first worker or in the driver's one actor for all its other jobs
(:mod:`hvdray.driver.coordinator_host`); it needs no CPU.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import itertools
import time
from typing import Any, Optional, Sequence

from hvdray.collective import gloo_record
from hvdray.collective.topology import RankInfo, WorkerSlot, assign_ranks, visible_devices

#: how long a worker's record waits for one its sender numbered before it (see ``Coordinator._add_record``)
RECORD_GAP_S = 2.0

#: one worker record as ``(record, report)``: ``report`` is ``(metrics, checkpoint_path)`` for rank 0's
#: ``hvdray.report`` and None for a ``ray_logger.log`` record
Record = tuple[dict[str, Any], Optional[tuple[dict[str, Any], Optional[str]]]]


def token_digest(token: Any) -> bytes:
    """The SHA-256 of a caller's token (empty for anything that is not bytes, which matches no job)."""
    return hashlib.sha256(token).digest() if isinstance(token, bytes) else b""


class Coordinator:
    """One job's table: membership (an epoch that grows with every assignment), the rendezvous keys and
    the record channel. Every call presents the job's token."""

    def __init__(self, token_digest: bytes) -> None:
        self._token_digest = token_digest
        self._epoch = 0
        self._kv: dict[str, bytes] = {}
        self._record_cuts = gloo_record.RecordCuts()  # a Gloo group's records cut once for all their readers
        self._key_waits: dict[str, list[_KeyWait]] = {}  # key -> the rendezvous waits it is missing from
        self._shared_waits: dict[tuple[str, ...], _KeyWait] = {}  # the keys waited for -> their readers' one wait
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
        self._closed = False  # the job is over (close): a wait for records ends at once
        # Ray Data (driver/datasets.py): the call whose datasets are offered, their names, and the current
        # epoch's shards (one {name: DataIterator} per rank); older epochs' splits are dropped
        self._data_call = 0
        self._data_names: tuple[str, ...] = ()
        self._shards: Optional[tuple[int, list[dict[str, Any]]]] = None

    async def close(self) -> None:
        """The job is over: no epoch can be joined any more, and every rendezvous wait and the driver's
        wait for records end at once (a worker holding the table can then exit)."""
        async with self._changed:
            self._abandoned = self._epoch
            self._clear_kv()
            self._changed.notify_all()
        async with self._new_record:
            self._closed = True
            self._new_record.notify_all()

    def _admit(self, token: Any) -> None:
        """Refuse a caller that does not present the job's rendezvous token."""
        if not hmac.compare_digest(token_digest(token), self._token_digest):
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
        if not self._live([key]):
            return  # a key of an epoch that is over would never be read
        self._kv[key] = value
        self._arrived(key)

    async def kv_get(self, token: bytes, key: str, timeout_s: float) -> tuple[str, Optional[bytes]]:
        """``("ok", value)``, or ``("timeout"|"superseded", None)`` as :meth:`kv_wait` says."""
        status, values = await self.kv_read(token, [key], timeout_s)
        return status, values[0] if values is not None else None

    async def kv_read(
        self, token: bytes, keys: list[str], timeout_s: float, reader: Optional[tuple[int, int]] = None
    ) -> tuple[str, Any]:
        """Wait for ``keys`` as :meth:`kv_wait` does and answer ``("ok", their values)`` in one reply, or
        ``("timeout"|"superseded", None)``: a Gloo group's connect reads all its ranks' keys in one call.
        With ``reader=(rank, size)`` the answer is each value as that rank of a Gloo group of ``size``
        reads it, ``(heads, ids)`` (:meth:`hvdray.collective.gloo_record.RecordCuts.parts_for`): O(1)
        bytes a key instead of O(size)."""
        status = await self.kv_wait(token, keys, timeout_s)
        if status != "ok":
            return status, None
        values = list(map(self._kv.__getitem__, keys))
        if reader is not None:
            values = self._record_cuts.parts_for(values, *reader)
        return status, values

    async def kv_add(self, token: bytes, key: str, amount: int) -> int:
        self._admit(token)
        value = int(self._kv.get(key, b"0")) + amount
        self._kv[key] = str(value).encode()
        self._arrived(key)
        return value

    def _live(self, keys: Sequence[str]) -> bool:
        """``keys`` belong to the current epoch, and the driver has not abandoned it."""
        epoch = f"e{self._epoch}/"
        return self._joinable() and all(map(str.startswith, keys, itertools.repeat(epoch)))  # in C: N keys per reader

    async def kv_wait(self, token: bytes, keys: list[str], timeout_s: float) -> str:
        """``"ok"`` once all ``keys`` exist; ``"superseded"`` as soon as their epoch is over (a newer one
        formed, or the driver abandoned it); ``"timeout"`` after ``timeout_s``."""
        self._admit(token)
        if not keys:
            return "ok"
        if not self._live(keys):
            return "superseded"
        missing = list(itertools.filterfalse(self._kv.__contains__, keys))
        if missing:
            wait = self._join_wait(tuple(keys), missing)
            deadline = time.monotonic() + timeout_s
            try:
                await asyncio.wait_for(wait.complete.wait(), timeout=timeout_s)
            except asyncio.TimeoutError:
                return "timeout"
            finally:  # done, timed out or cancelled
                self._leave_wait(wait)
            if not self._live(keys[:1]):
                return "superseded"
            if not all(map(self._kv.__contains__, keys)):  # one was deleted meanwhile: wait for it again
                return await self.kv_wait(token, keys, max(deadline - time.monotonic(), 0.0))
        return "ok"

    def _join_wait(self, keys: tuple[str, ...], missing: list[str]) -> "_KeyWait":
        """The wait for ``keys``, shared by every reader of the same keys: the N ranks of a Gloo group
        each read all N records, and the first of them registers one wait on the keys missing then
        (woken once, when its last key arrives); the others join it. N readers of N keys cost O(N)
        Python steps, not O(N^2) registrations and counter updates."""
        wait = self._shared_waits.get(keys)
        if wait is None or wait.complete.is_set():  # none yet, or it ended while a key was deleted again
            wait = self._shared_waits[keys] = _KeyWait(keys, missing)
            for key in missing:
                self._key_waits.setdefault(key, []).append(wait)
        wait.readers += 1
        return wait

    def _leave_wait(self, wait: "_KeyWait") -> None:
        """A reader is done with ``wait``; the last one forgets it (the keys still missing drop it)."""
        wait.readers -= 1
        if wait.readers:
            return
        if self._shared_waits.get(wait.keys) is wait:
            del self._shared_waits[wait.keys]
        if wait.missing <= 0:
            return  # every key arrived: none holds it any more
        for key in wait.missing_keys:
            waits = self._key_waits.get(key)
            if waits is not None and wait in waits:
                waits.remove(wait)
                if not waits:
                    del self._key_waits[key]

    def _arrived(self, key: str) -> None:
        """``key`` was written: count it off every wait missing it, and wake those it completes."""
        for wait in self._key_waits.pop(key, ()):
            wait.missing -= 1
            if wait.missing <= 0:
                wait.complete.set()

    def _clear_kv(self) -> None:
        """Drop every key (the epoch is over) and wake every rendezvous wait, which then answers ``superseded``."""
        self._kv.clear()
        self._record_cuts.clear()
        self._shared_waits.clear()
        key_waits, self._key_waits = self._key_waits, {}
        for waits in key_waits.values():
            for wait in waits:
                wait.complete.set()

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
                        self._new_record.wait_for(
                            lambda: self._closed or self._first_record + len(self._records) > first
                        ),
                        timeout_s,
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


class _KeyWait:
    """One rendezvous wait for ``keys``, shared by their readers: how many of the keys missing when it began
    (``missing_keys``) have still not arrived, the event set when none has, and how many readers wait."""

    __slots__ = ("keys", "missing_keys", "missing", "complete", "readers")

    def __init__(self, keys: tuple[str, ...], missing_keys: list[str]) -> None:
        self.keys = keys
        self.missing_keys = missing_keys
        self.missing = len(missing_keys)
        self.complete = asyncio.Event()
        self.readers = 0
