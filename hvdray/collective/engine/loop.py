"""The engine: one background thread per worker (per process set) that ticks, negotiates and runs ops.

Every op is asynchronous: ``submit`` returns a :class:`Handle` at once. Each tick every rank raises
one flag bit per cached op it has pending and the ranks AND the flags together (one tiny collective);
when a rank has something new to say (a new name, a join, a shutdown) the tick also has a full round,
in which every rank sends a JSON message and receives everyone's, so that every rank holds the same
table of announced ops and derives the same decisions from it. Then every rank runs what is ready
everywhere, in the same order, fused where it can be.

The Engine composes the parts: the negotiation table (negotiation.py), the response cache
(cache.py), the learned step (steps.py), the stall inspector (stall.py), the fusion planner
(fusion.py) and the executor (execute.py). It alone holds the lock shared with submitting threads.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from typing import Any, Callable, Optional, Sequence, TypeVar

import torch

from hvdray.collective.autotune import Autotuner, TunedParams
from hvdray.collective.transport import Communicator
from hvdray.collective.engine.agreement import Agreement
from hvdray.collective.engine.execute import EngineStats, Executor
from hvdray.collective.engine.fusion import Action
from hvdray.collective.engine.handle import Handle, Request, open_settled
from hvdray.collective.engine.interrupts import INTERRUPTS
from hvdray.collective.engine.negotiation import Finished, RoundMessage, leavers
from hvdray.collective.errors import HorovodInternalError, HvdrayError, PeerFinishedError, TensorMismatchError
from hvdray.collective.output_pool import OutputPool
from hvdray.collective.protocol import GENERATED_NAME_MARK
from hvdray.collective.timeline import Timeline

log = logging.getLogger(__name__)

#: a wake-up threshold no submission reaches
_NEVER = sys.maxsize
#: the most ticks a waiting caller runs before it leaves its op to the engine thread: a round can meet a
#: peer's idle round (the peer had not submitted the op yet), and the next one its op; an op that is still
#: not everywhere then is left to the engine thread's pace (the cycle time), not ticked at full speed
CALLER_TICKS = 3
#: the grad and inference modes a caller's tick keeps when the caller is not in inference mode (and a tick's
#: barrier waits when no caller blocks on it)
_SAME_MODE = contextlib.nullcontext()


class _CallerWaits(threading.local):
    """Set on a thread while it submits the op of a blocking call (``hvdray.collective.ops.call_blocking``,
    :meth:`Engine.submit_and_wait`): its own wait on the op comes next, so the submission does not wake
    the engine thread; the wait runs the tick on this thread if the engine thread sleeps, or wakes it."""

    next = False


#: per thread: whether the op being submitted is waited on at once (see :class:`_CallerWaits`)
CALLER_WAITS = _CallerWaits()

_T = TypeVar("_T")


def submit_to_wait(submit: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
    """``submit(*args, **kwargs)`` (whatever submits a blocking call's op: ``Engine.submit``, an
    ``*_async`` function) with :data:`CALLER_WAITS` set: the caller waits on what it returns at once."""
    waits = CALLER_WAITS
    waits.next = True
    try:
        return submit(*args, **kwargs)
    finally:
        waits.next = False


class Engine:
    """Runs one rank's collectives on a background thread. Create after the Communicator exists."""

    def __init__(
        self,
        comm: Communicator,
        cycle_time_s: float,
        idle_cycle_time_s: float,
        fusion_threshold_bytes: int,
        stall_warning_s: float,
        stall_shutdown_s: float,
        cache_capacity: int = 1024,
        tuner: Optional[Autotuner] = None,
        call: int = 0,
        output_pool_bytes: int = 0,
        steps_on_waiting_thread: bool = False,
    ) -> None:
        self.comm = comm
        self.rank = comm.rank
        self.size = comm.size
        self.stats = EngineStats()
        self._cycle_s = cycle_time_s
        self._idle_s = idle_cycle_time_s

        # the fields below are shared with submitting threads; ``with self._lock`` takes the lock itself,
        # since a Condition's with-statement costs two Python calls on every op's submission
        self._lock = threading.RLock()
        self._wake = threading.Condition(self._lock)  # the engine thread sleeps on it between ticks
        self._queue: list[Request] = []
        self._local: dict[str, Request] = {}  # submitted here, not finished yet
        self._running: list[Request] = []  # taken out of _local, executing now (engine thread only)
        self._join_handle: Optional[Handle] = None
        self._join_announce = False
        self._waited: Optional[Request] = None  # a caller blocks on this op: tick now, not at the cycle's end
        self._blocked_on: list[Request] = []  # ops callers have waited on (or polled) since they were submitted
        self._blocked = False  # this tick: a caller waits on an op still in flight (read by the engine thread)
        self._shutdown_requested = False
        self._sleeping = False  # the engine thread waits in _collect for work (under the lock)
        self._notified = False  # it was woken and has not taken the lock back yet (a caller then leaves it be)
        # a caller that waits on an op runs the ticks itself while the engine thread sleeps (see _tick_for):
        # no hand-off to the engine thread and back on a synchronous op's path
        self._caller_ticking = False
        # a learned step, once whole, waits for a caller that blocks on one of its ops and runs on that
        # thread (as a blocking op does), instead of waking the engine thread (settings.steps_on_waiting_thread)
        self._steps_on_waiting_thread = steps_on_waiting_thread
        self._parked = False  # the engine thread waits for a caller's tick to end (under the lock)
        self._stopped = False  # a tick ended the engine (a shutdown round, an error): the thread returns
        self._wait_s = cycle_time_s  # how long the next tick waits for work (doubles while every rank idles)
        # while it sleeps: how many queued requests, or queued bytes, make it worth waking the engine (a
        # step's remaining tensors, the rest of a fusion buffer), so that a backward pass submitting
        # hundreds of gradients does not wake the engine thread once per gradient
        self._wake_count = 1
        self._wake_bytes = 0
        self._queued_bytes = 0
        self._error: Optional[BaseException] = None
        self._name_counters: dict[str, int] = {}
        # the executor call this rank's function runs in (0: none), and the highest call any rank has left:
        # once some rank has left the function of this rank's call, nothing submitted in it can complete
        self._call = call
        self._left_call = 0
        # the latest call each rank has left, and how, as of the last full round (the engine thread's table
        # changes outside the lock; a caller's error reads this copy, against the call it runs in then)
        self._finished: dict[int, Finished] = {}
        self._finish_announce: Optional[Finished] = None
        self._finish_handle: Optional[Handle] = None

        # engine thread only (its learned step is shared with _nudge, under the lock)
        self._agreement = Agreement(
            self.rank, self.size, fusion_threshold_bytes, stall_warning_s, stall_shutdown_s, cache_capacity, tuner
        )
        self._step = self._agreement.step
        #: the memory of the tensors collectives return (out of place), used again once dropped; in shared
        #: memory where the ranks are one node's, so that the peers read each other's outputs
        self.outputs = OutputPool(output_pool_bytes, shared=comm.transport == "shm")
        self._executor = Executor(comm, self._agreement.planner, self.stats, self.outputs)

        # set from other threads (start/stop_timeline); the engine thread reads it once per tick
        self.timeline: Optional[Timeline] = None
        self.timeline_pid = 0  # the trace "process" this engine's rows go to (its process set id)

        self._thread = threading.Thread(target=self._loop, name=f"hvdray-engine-{self.rank}", daemon=True)
        self._thread.start()

    # -- submission (any thread) ------------------------------------------------------------
    def submit(self, request: Request) -> Handle:
        """Submit one request (:meth:`submit_many` of one, without its group bookkeeping: every gradient
        of every step comes this way). An interrupt comes after the request is queued, not halfway."""
        with INTERRUPTS, self._lock:
            if self._error is not None or self._shutdown_requested or self._left_call >= self._call > 0:
                self._raise_if_stopped(request)
            local, name = self._local, request.name
            if name in local:
                self._refuse_duplicate(local[name])
            request.handle._on_wait = (
                self._nudge_or_tick if CALLER_WAITS.next or self._steps_on_waiting_thread else self._nudge
            )
            if self.timeline is not None:
                request.submitted = time.perf_counter()
            local[name] = request
            if request.tensor is not None:
                self._queued_bytes += request.tensor.nbytes
            self._queue.append(request)
            self._wake_if_due()
        return request.handle

    def submit_and_wait(self, request: Request) -> Any:
        """Submit ``request`` and wait for its result (a blocking op's whole life: see :data:`CALLER_WAITS`)."""
        return submit_to_wait(self.submit, request).wait()

    def _wake_if_due(self) -> None:
        """After queueing (under the lock): wake a sleeping engine once what is queued is worth a tick,
        unless this thread waits on it next (its wait ticks)."""
        if self._sleeping and not CALLER_WAITS.next and (
            len(self._queue) >= self._wake_count or self._queued_bytes >= self._wake_bytes
        ):
            self._notify()

    def _notify(self) -> None:
        """Wake the engine thread (under the lock)."""
        self._notified = self._sleeping
        self._wake.notify()

    def _refuse_duplicate(self, request: Request) -> None:
        raise ValueError(
            f"an op named {request.name!r} ({request.desc.kind}) is still in flight on rank {self.rank}; names "
            "of outstanding ops must be unique"
        )

    def submit_many(self, requests: Sequence[Request]) -> None:
        """Submit several requests at once (a grouped op's tensors): one lock acquisition, all or none."""
        with INTERRUPTS, self._lock:
            if self._error is not None or self._shutdown_requested or self._left_call >= self._call > 0:
                self._raise_if_stopped(requests[0] if requests else None)
            local = self._local
            seen: set[str] = set()
            for request in requests:
                name = request.name
                if name in local or name in seen:
                    self._refuse_duplicate(local.get(name) or request)
                seen.add(name)
            submitted = time.perf_counter() if self.timeline is not None else 0.0
            nudge = self._nudge_or_tick if CALLER_WAITS.next or self._steps_on_waiting_thread else self._nudge
            nbytes = self._queued_bytes
            for request in requests:
                request.submitted = submitted
                request.handle._on_wait = nudge
                local[request.name] = request
                if request.tensor is not None:
                    nbytes += request.tensor.nbytes
            self._queued_bytes = nbytes
            self._queue.extend(requests)
            self._wake_if_due()  # a busy engine looks at the queue before it sleeps again

    def _nudge(self, handle: Handle, blocking: bool = False) -> None:
        """A caller waits on (``blocking``) or polls an op submitted asynchronously: whatever it submitted
        is all that is coming for now."""
        self._hurry(handle, False)

    def _nudge_or_tick(self, handle: Handle, blocking: bool) -> None:
        """A caller waits on (``blocking``) or polls the op of its blocking call: as :meth:`_nudge`, and if
        it blocks and the engine thread sleeps (and nothing has woken it), it runs the tick itself."""
        self._hurry(handle, blocking)

    def _hurry(self, handle: Handle, may_tick: bool) -> None:
        if handle._done and not self._step.is_open:
            # finished, and no step open to end: every wait of a step's synchronize but the first comes
            # here, so it skips the lock (read without it, a step that opens meanwhile is ended later)
            return
        with INTERRUPTS:  # a caller's tick stopped halfway would break the ring: an interrupt waits for its end
            self._hurry_pending(handle, may_tick)

    def _hurry_pending(self, handle: Handle, may_tick: bool) -> None:
        with self._lock:
            self._step.close()
            request = self._local.get(handle.name)
            if request is None or request.handle is not handle:
                # already taken to run or finished: nothing to hurry. With nothing left in flight the step
                # is over now (an idle engine's tick began before this wait, and would count the next
                # step's first gradients into this one)
                if not self._local:
                    self._step.learn_if_over()
                return
            tick_here = (
                may_tick and self._sleeping and not self._notified and not self._caller_ticking and not self._stopped
            )
            if tick_here:
                self._caller_ticking = True
                if self._waited is not request:
                    self._blocked_on.append(request)
                self._waited = request
            elif self._waited is not request:
                self._waited = request
                self._blocked_on.append(request)
                self._notify()
        if tick_here:
            self._tick_for(request)

    def _tick_for(self, request: Request) -> None:
        """Run the ticks of ``request`` on this (the waiting caller's) thread while the engine thread
        sleeps: the op is negotiated and run without waking the engine thread, and the caller returns
        without being woken by it. An op still not done after :data:`CALLER_TICKS` ticks (a peer has not
        submitted it yet) goes back to the engine thread."""
        grad_enabled = torch.is_grad_enabled()
        torch.set_grad_enabled(False)
        try:
            # buffers a tick makes outlive it: never as inference tensors, whatever mode the caller is in
            with torch.inference_mode(False) if torch.is_inference_mode_enabled() else _SAME_MODE:
                for _ in range(CALLER_TICKS):
                    self.stats.caller_ticks += 1
                    self._tick(self._collect(0.0, caller=True))
                    if request.handle._done or self._stopped:
                        break
                    with self._lock:
                        self._waited = request
        except BaseException as exc:  # noqa: BLE001 - as in the engine thread: the ring is broken
            self._break(exc)
        finally:
            torch.set_grad_enabled(grad_enabled)
            with self._lock:
                self._caller_ticking = False
                if not request.handle._done and not self._stopped:
                    self._waited = request  # the engine thread takes over at once
                    self._notify()
                elif self._parked or self._stopped:
                    self._notify()

    def auto_name(self, op: str) -> str:
        """A generated name, equal on every rank that calls ops in the same order: ``allreduce.noname.3``
        outside executor calls, ``allreduce.noname.2.3`` in executor call 2. Each call counts from 0, so
        that a call in which the ranks submitted different ops (one left early, and its peers caught the
        error and returned) leaves no difference in the next call's names, and its names never meet an
        op of an earlier call that is still in flight."""
        with self._lock:
            n = self._name_counters.get(op, 0)
            self._name_counters[op] = n + 1
            call = self._call
        return f"{op}{GENERATED_NAME_MARK}{call}.{n}" if call else f"{op}{GENERATED_NAME_MARK}{n}"

    def join(self) -> Handle:
        """This rank is done: it contributes zeros to allreduces until every rank has joined."""
        with self._lock:
            self._raise_if_stopped()
            if self._join_handle is not None:
                raise ValueError(f"rank {self.rank} has already joined")
            self._join_handle = Handle("join")
            self._join_announce = True
            self._notify()
            return self._join_handle

    def begin_call(self, call: int) -> None:
        """This rank's function of executor call ``call`` starts (calls count up from 1 on every rank alike);
        its generated names count from 0."""
        with self._lock:
            self._call = call
            self._name_counters.clear()

    def finish_call(self, how: str) -> Optional[Handle]:
        """This rank has left its call's function (``how``: "returned" or "raised"). Every rank hears it in the
        next full round: ops of that call that this rank never submitted then fail on the ranks waiting
        for them, naming this rank, instead of waiting forever. The handle finishes once the round has
        gone out (None when there is no call, or the engine has stopped)."""
        with self._lock:
            if not self._call or self._error is not None or self._shutdown_requested:
                return None
            self._finish_announce = Finished(self._call, how)
            handle = self._finish_handle = Handle("finish")
            self._notify()
            return handle

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Tell every rank to stop after this round; wait for the thread, then drop the group."""
        with self._lock:
            self._shutdown_requested = True
            self._notify()
        self._thread.join(timeout_s)
        self.comm.close()
        self.outputs.close()
        INTERRUPTS.release()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def broken(self) -> bool:
        """Whether the engine has stopped with an error (a ring that broke, a peer that shut down): its ops
        keep raising it until ``hvd.shutdown()``."""
        return self._error is not None or not self._thread.is_alive()

    @property
    def tuned(self) -> TunedParams:
        """The fusion threshold, cycle time and cache switch in force now."""
        agreement = self._agreement
        return TunedParams(
            agreement.planner.fusion_bytes / (1024 * 1024), self._cycle_s * 1000.0, agreement.cache.enabled
        )

    def _raise_if_stopped(self, request: Optional[Request] = None) -> None:
        if self._error is not None:
            raise self._error
        if self._shutdown_requested:
            raise HorovodInternalError("hvdray is shutting down; no new ops are accepted")
        if self._left_call >= self._call > 0:
            raise self._left_behind_error(request)

    def _left_behind_error(self, request: Optional[Request]) -> PeerFinishedError:
        """The error of an op of this rank's call after some rank has left that call's function."""
        what = f"{request.desc.kind} {request.name!r}" if request is not None else "join()"
        who = "; ".join(
            f"rank {r} {'returned from' if f.how == 'returned' else 'raised an exception in'} its function"
            for r, f in leavers(self._finished, self._call)
        )
        return PeerFinishedError(
            f"{what} cannot complete on rank {self.rank}: {who} without submitting it, so it never will "
            "(every rank must call the same collectives)"
        )

    # -- the loop (engine thread) -----------------------------------------------------------
    def _loop(self) -> None:
        # Ops write into the user's tensors in place (allreduce_, broadcast_ on parameters): never
        # record autograd history for them. Grad mode is per thread, so this affects this thread only.
        torch.set_grad_enabled(False)
        table = self._agreement.table
        wait_s = self._cycle_s
        try:
            while not self._stopped:
                wants_full = self._collect(wait_s)
                if wants_full is not None:
                    self._tick(wants_full)
                    wait_s = self._wait_s
                elif self._local or table.announced or table.joined:  # a waiting caller ran the tick meanwhile
                    wait_s = self._cycle_s
                else:
                    # nothing in flight here: while callers keep ticking, the engine thread wakes ever less
                    # often (each of its wake-ups takes the GIL from a caller in the middle of its round)
                    wait_s = min(wait_s * 2, self._idle_s)
        except BaseException as exc:  # noqa: BLE001 - any failure here breaks the ring for everyone
            self._break(exc)

    def _tick(self, wants_full: bool) -> None:
        """One round with every rank: AND the flags, say and hear the full round's messages if anyone
        asked for one, then run what is ready everywhere. On the engine thread, or on a waiting caller's
        while the engine thread sleeps (never both at once). While a caller blocks on an op of it, the
        round's waits for the peers give the core away longer before they sleep (``Communicator.patient``):
        the caller has nothing else to do, and a peer a little behind then costs no sleep and wake-up."""
        with self.comm.patient() if self._blocked else _SAME_MODE:
            self._round(wants_full)

    def _round(self, wants_full: bool) -> None:
        """:meth:`_tick`'s work."""
        agreement, executor = self._agreement, self._executor
        table = agreement.table
        self.comm.and_flags(agreement.fill_flags(wants_full, self._blocked))
        ready_slots, pending_somewhere, full = agreement.read_flags()
        self.stats.rounds += 1
        busy = bool(ready_slots or pending_somewhere)
        if full:
            self.stats.full_rounds += 1
            new_work = self._full_round()
            if new_work is None:
                self._stopped = True
                return
            busy = new_work or busy
        if self.rank == 0:
            agreement.stall.watch_cached(pending_somewhere, ready_slots, agreement.cache, table.joined)
        timeline = self.timeline
        ready_at = executor.start_tick(timeline, self.timeline_pid)
        if busy and timeline is not None:
            timeline.cycle(self.timeline_pid, ready_at)
        actions = agreement.ready_plan(ready_slots, self.comm.fused_message_bytes)
        for action in actions:
            open_settled(self._run(action))  # once nothing of the action's requests is left on this thread
        if self.rank == 0:
            agreement.stall.watch_blocked(agreement.flags.everyone_blocked, ran=bool(actions))
        if self._left_call >= self._call > 0:
            self._fail_left_behind()
        if table.everyone_joined:
            self._finish_join(table.finish_join())
        if agreement.tuner is not None and executor.tick_bytes:
            agreement.tuner.record(executor.tick_bytes, time.perf_counter())
        executor.tick_bytes = 0
        idle = not (busy or table.announced or table.joined)
        self._wait_s = min(self._wait_s * 2, self._idle_s) if idle else self._cycle_s

    def _break(self, exc: BaseException) -> None:
        """A tick failed: every op fails with the error, and the engine stops."""
        error = exc if isinstance(exc, HvdrayError) else HorovodInternalError(
            f"collective communication failed on rank {self.rank}: {exc}"
        )
        if not isinstance(exc, HvdrayError):
            error.__cause__ = exc
        log.debug("engine stopped: %s", error)
        self._stopped = True
        self._fail_all(error)
        # Close at once: peers blocked on this rank then fail now instead of at their timeout.
        self.comm.close()

    def _collect(self, wait_s: float, caller: bool = False) -> Optional[bool]:
        """Wait for this tick, sorting new requests into cached slots and the outbox as they come; True if
        this rank needs a full (named) negotiation round, None if a waiting caller ran the tick while the
        engine thread slept (or the engine has stopped): the engine thread starts over then. A ``caller``
        (that waits on an op, see :meth:`_tick_for`) never sleeps here.

        When to tick: at once on shutdown, join, or when a caller blocks on (or polls) an op; otherwise new
        work with nothing older in flight goes at once, except that once this rank's steps repeat, a step
        goes when all of it has been submitted, or a fusion buffer's worth of it: one negotiation and one
        fused reduction per step instead of one per early tensor (see steps.py). With older work in
        flight the tick paces by the cycle time, so that tensors arriving together are negotiated and
        fused together.
        """
        started = time.monotonic()
        deadline = started + wait_s
        step, agreement = self._step, self._agreement
        fusion_bytes = agreement.planner.fusion_bytes
        with self._lock:
            rounds = self.stats.rounds
            older = len(self._local) - len(self._queue)  # in flight from earlier ticks (constant here)
            if not older:
                step.learn_if_over()
            arrived = started  # when this tick last found new requests
            while True:
                if self._queue:
                    agreement.sort(self._queue)
                    self._queue = []
                    self._queued_bytes = 0
                    arrived = time.monotonic()
                waited = self._waited  # still in flight: a nudge from before its op finished does not count
                if self._shutdown_requested or self._join_announce or self._finish_announce or (
                    waited is not None and self._local.get(waited.name) is waited
                ):
                    break
                now = time.monotonic()
                if step.learned and not older:
                    if step.submitted_whole():
                        step.close()
                        break
                    if agreement.outbox or step.unsent_bytes and step.unsent_bytes >= fusion_bytes:
                        break
                    # the rest of the step is coming: wait while it keeps arriving (an idle tick in the
                    # middle of a slow backward pass would split the step)
                    limit = max(deadline, arrived + self._idle_s)
                    # wake for the step's missing tensors or a fusion buffer's worth (a caller that
                    # blocks on an op ticks at once through the nudge, whatever it submitted); with
                    # steps on the waiting thread, for a fusion buffer only: the caller that waits for the
                    # whole step runs it (a poll still wakes this thread, and the limit ends the wait)
                    wake_count = _NEVER if self._steps_on_waiting_thread else step.missing()
                    wake_bytes = max(1, fusion_bytes - step.unsent_bytes)
                else:
                    if self._local and not older:
                        break
                    limit = deadline
                    # with older work in flight the tick waits for the cycle's end whatever arrives
                    wake_count, wake_bytes = (1, 0) if not older else (_NEVER, _NEVER)
                if now >= limit or caller:
                    break
                self._wake_count, self._wake_bytes = wake_count, wake_bytes
                self._sleeping = True
                self._wake.wait(limit - now)
                self._sleeping = self._notified = False
                self.stats.wakeups += 1
                if self._caller_ticking or self.stats.rounds != rounds or self._stopped:
                    while self._caller_ticking:
                        self._parked = True
                        self._wake.wait()
                    self._parked = self._notified = False
                    return None
            self._waited = None
            local = self._local
            self._blocked_on = [r for r in self._blocked_on if local.get(r.name) is r]
            self._blocked = bool(self._blocked_on)
            step.unsent_bytes = 0
            wants_full = bool(self._join_announce or self._shutdown_requested or self._finish_announce)
        if self.rank == 0:
            wants_full = agreement.rank0_wants_full() or wants_full
        return wants_full or bool(agreement.outbox)

    # -- a full round ------------------------------------------------------------------------
    def _full_round(self) -> Optional[bool]:
        """Say this rank's message and absorb everyone's: whether they brought new work, or None when a
        rank shuts down (every op here has failed then)."""
        with self._lock:
            join, self._join_announce = self._join_announce, False
            finished, self._finish_announce = self._finish_announce, None
            finish_handle, self._finish_handle = self._finish_handle, None
            stop, call = self._shutdown_requested, self._call
        payload = self._agreement.message(join, stop, call, finished).encode()
        messages = [RoundMessage.decode(p) for p in self.comm.allgather_bytes(payload)]
        if finish_handle is not None:
            finish_handle._finish()
        stop_ranks = [r for r, m in enumerate(messages) if m.stop]
        if stop_ranks:
            self._fail_all(HorovodInternalError(
                f"hvdray was shut down by rank(s) {stop_ranks} while this op was pending"
            ))
            return None
        new_work, drops = self._agreement.absorb(messages)
        if any(m.finished is not None for m in messages):
            table = self._agreement.table
            with self._lock:
                self._finished = dict(table.finished)
                self._left_call = max(f.call for f in self._finished.values())
        if messages[0].tune is not None:
            self._cycle_s = messages[0].tune.cycle_time_ms / 1000.0
        for drop in drops:  # stalled past stall_shutdown_s, or deadlocked: fail it where it was submitted
            request = self._take_local(drop.name)
            if request is not None:
                request.handle._finish(error=self._agreement.stall.dropped_error(request.desc.kind, drop))
        return new_work

    # -- running ready ops ------------------------------------------------------------------
    def _run(self, action: Action) -> list[Handle]:
        """Run one planned action; its requests leave ``_local`` as it starts. Returns the handles it settled,
        for :func:`open_settled` (a caller that sees its op done may drop the result at once: this frame's
        references to the requests must be gone by then)."""
        renamed = self._agreement.renamed  # an unnamed op on its family's slot: its own name here
        names = [renamed.get(name, name) for name in action.names] if renamed else action.names
        with self._lock:
            local = self._local
            requests = [local.pop(name, None) for name in names]
            # an op that runs is no longer one a caller waits on; kept until the next tick's collect, it
            # would keep its output alive past the caller's use, and an out-of-place op's next output
            # would then come from a second block of the pool instead of this one, warm
            if self._blocked_on:
                self._blocked_on = [r for r in self._blocked_on if local.get(r.name) is r]
            waited = self._waited  # set when the caller's wait came after this tick's collect
            if waited is not None and local.get(waited.name) is not waited:
                self._waited = None
        if action.problem:
            if requests[0] is not None:
                requests[0].handle._finish(error=TensorMismatchError(action.problem))
            return []
        running = self._running = [req for req in requests if req is not None]
        if action.fused:
            self._executor.allreduce(action, requests)
        else:
            self._executor.run_one(action, requests[0])
        self._running = []
        return [req.handle for req in running]

    def _finish_join(self, last: int) -> None:
        """Every rank has joined: join() returns the last rank to join."""
        with self._lock:
            handle, self._join_handle = self._join_handle, None
        if handle is not None:
            handle._finish(result=last)

    def _take_local(self, name: str) -> Optional[Request]:
        with self._lock:
            return self._local.pop(name, None)

    def _fail_left_behind(self) -> None:
        """Some rank has left the function of this rank's call: fail what this rank still waits for in it."""
        with self._lock:
            if not self._local and self._join_handle is None:
                return
            self._step.forget()  # the step was cut short: learn it again
            pending = list(self._local.values())
            self._local.clear()
            self._queue, self._agreement.outbox, self._agreement.slot_requests = [], [], {}
            self._queued_bytes = 0
            join, self._join_handle = self._join_handle, None
            errors = [(request, self._left_behind_error(request)) for request in pending]
            join_error = self._left_behind_error(None) if join is not None else None
        for request, error in errors:
            request.handle._finish(error=error)
        if join is not None:
            join._finish(error=join_error)

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            self._error = error
            # what was executing when the error came is no longer in _local: fail it too
            pending = list(self._local.values()) + [r for r in self._running if not r.handle.done()]
            self._running = []
            self._local.clear()
            self._queue, self._agreement.outbox, self._agreement.slot_requests = [], [], {}
            self._queued_bytes = 0
            join, self._join_handle = self._join_handle, None
        for request in pending:
            request.handle._finish(error=error)
        if join is not None:
            join._finish(error=error)
