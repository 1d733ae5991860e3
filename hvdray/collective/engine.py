"""The collective engine: one background thread per worker that negotiates, fuses and runs ops.

Every op is asynchronous: ``submit`` returns a :class:`Handle` at once. Each tick the engine
allgathers what every rank has newly submitted (names and metadata, JSON encoded), so every rank
holds the same table of announced tensors and derives the same decisions from it: which tensors are
ready on all ranks, in which order they run, which mismatch (an error raised identically on every
rank), and how ready allreduces fuse. No rank ever unpickles what arrives over the socket.
"""

from __future__ import annotations

import _thread
import json
import logging
import math
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

from hvdray.collective.autotune import Autotuner, TunedParams
from hvdray.collective.errors import HorovodInternalError, HvdrayError, TensorMismatchError
from hvdray.collective.protocol import ReduceOp
from hvdray.collective.response_cache import FlagVector, ResponseCache
from hvdray.collective.timeline import Timeline
from hvdray.collective.topology import reducescatter_rows
from hvdray.collective.transport import GLOO_DTYPES, Communicator

log = logging.getLogger(__name__)

#: part of every generated op name (``allreduce.noname.3``); such names are never cached
GENERATED_NAME_MARK = ".noname."

#: over Gloo, allreduces at least this large are reduced on their own, in the caller's output tensor:
#: fusing them would save one call's latency (~0.1 ms) at the price of two full copies. Over shared
#: memory a fused batch is copied straight into the node's segment and out of it, which costs no more
#: than reducing each tensor alone and saves two barriers per tensor, so there every tensor that fits
#: one slot of the segment fuses, and batches end at that size (see Communicator.fused_message_bytes)
DIRECT_BYTES = 1 << 20



class Handle:
    """The future of one submitted op: ``done()`` polls, ``wait()`` blocks and returns or raises.

    A bare lock serves as the one-shot latch (held until the op finishes): far cheaper to create than
    a ``threading.Event``, which matters with hundreds of gradients per step.
    """

    __slots__ = ("_latch", "_done", "_result", "_error", "name", "_on_wait")

    def __init__(self, name: str) -> None:
        self.name = name
        self._on_wait: Optional[Callable[["Handle"], None]] = None  # the engine's nudge: someone now waits on this op
        self._latch = _thread.allocate_lock()
        self._latch.acquire()
        self._done = False
        self._result: Any = None
        self._error: Optional[BaseException] = None

    def done(self) -> bool:
        if not self._done and self._on_wait is not None:
            self._on_wait(self)  # someone polls: they want this op now, not at the end of a batching window
        return self._done

    def wait(self, timeout: Optional[float] = None) -> Any:
        if not self._done:
            if self._on_wait is not None:
                self._on_wait(self)
            if not self._latch.acquire(timeout=-1 if timeout is None else timeout):
                raise TimeoutError(f"op {self.name!r} did not finish within {timeout} s")
            self._latch.release()
        if self._error is not None:
            raise self._error
        return self._result

    def _finish(self, result: Any = None, error: Optional[BaseException] = None) -> None:
        self._result, self._error = result, error
        self._done = True
        self._latch.release()


class Request:
    """One op submitted on this rank: metadata every rank sees, plus the local tensors."""

    __slots__ = ("meta", "name", "tensor", "output", "handle", "submitted")

    def __init__(
        self, meta: dict[str, Any], tensor: Optional[torch.Tensor], output: Optional[torch.Tensor], handle: Handle
    ) -> None:
        self.meta = meta
        self.name: str = meta["n"]
        self.tensor = tensor
        self.output = output
        self.handle = handle
        self.submitted = 0.0  # time.perf_counter() at submission, taken only while a timeline records


@dataclass
class _Announced:
    """What each rank announced under one name; identical on every rank."""

    metas: dict[int, dict[str, Any]] = field(default_factory=dict)
    first_seen: float = 0.0
    warned: bool = False


@dataclass
class EngineStats:
    """Counters a test or a benchmark can read: rounds, ops, and fused Gloo calls."""

    rounds: int = 0
    full_rounds: int = 0
    ops: int = 0
    allreduce_calls: int = 0
    fused_tensors: int = 0
    wakeups: int = 0  # times the engine thread woke up (notified or timed out) while waiting for work


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
    ) -> None:
        self.comm = comm
        self.rank = comm.rank
        self.size = comm.size
        self.stats = EngineStats()
        self._cycle_s = cycle_time_s
        self._idle_s = idle_cycle_time_s
        self._fusion_bytes = fusion_threshold_bytes
        self._stall_warning_s = stall_warning_s
        self._stall_shutdown_s = stall_shutdown_s

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
        self._shutdown_requested = False
        self._sleeping = False  # the engine thread waits in _collect for work (under the lock)
        # while it sleeps: how many queued requests, or queued bytes, make it worth waking the engine (a
        # step's remaining tensors, the rest of a fusion buffer), so that a backward pass submitting
        # hundreds of gradients does not wake the engine thread once per gradient
        self._wake_count = 1
        self._wake_bytes = 0
        self._queued_bytes = 0
        self._error: Optional[BaseException] = None

        # replicated state: the same on every rank after each round
        self._table: dict[str, _Announced] = {}
        self._order: list[str] = []
        self._joined: set[int] = set()
        self._last_joined = -1  # the rank whose join was absorbed last (ties in one round: the highest)
        self._round = 0
        self._name_counters: dict[str, int] = {}

        # the response cache (replicated) and this rank's requests waiting on cached slots
        self._cache = ResponseCache(cache_capacity, self.rank)
        self._cache_on = cache_capacity > 0  # replicated: autotune switches it on every rank in the same round
        self._tuner = tuner if self.rank == 0 else None
        self._tick_bytes = 0  # bytes reduced in this tick (autotune's score)
        self._flags = FlagVector(cache_capacity)
        self._cached_pending: dict[int, Request] = {}
        # step-aware batching: the cached slots of this rank's last complete step and of the current one
        # (see _collect for what ends a step)
        self._expected: frozenset[int] = frozenset()
        self._step_slots: set[int] = set()
        # the step is over once nothing is in flight after it was submitted whole or a caller waited on
        # it (not when its first tensors finish before its last ones are submitted)
        self._step_closing = False
        self._unsent_bytes = 0  # cached requests sorted since the last tick
        self._plans: dict[tuple[int, ...], list[_Action]] = {}  # ready cached slots -> what to run
        self._staging: dict[torch.dtype, torch.Tensor] = {}  # fusion buffers, one per dtype, grown on demand
        self._outbox: list[Request] = []  # requests to announce by name in the next full round
        self._census: dict[int, set[int]] = {}  # slot -> ranks with it pending, from the last full round
        self._stall_since: dict[int, float] = {}  # rank 0: cached slots pending somewhere but not everywhere
        self._stall_warned: set[int] = set()
        self._drops: list[list[Any]] = []  # rank 0: stalled names to drop in the next full round

        # set from other threads (start/stop_timeline); the engine thread reads it once per step
        self.timeline: Optional[Timeline] = None
        self.timeline_pid = 0  # the trace "process" this engine's rows go to (its process set id)
        self._ready_at = 0.0

        self._thread = threading.Thread(target=self._loop, name=f"hvdray-engine-{self.rank}", daemon=True)
        self._thread.start()

    # -- submission (any thread) ------------------------------------------------------------
    def submit(self, request: Request) -> Handle:
        """Submit one request (:meth:`submit_many` of one, without its group bookkeeping: every gradient
        of every step comes this way)."""
        with self._lock:
            if self._error is not None or self._shutdown_requested:
                self._raise_if_stopped()
            local, name = self._local, request.name
            if name in local:
                self._refuse_duplicate(local[name])
            request.handle._on_wait = self._nudge
            if self.timeline is not None:
                request.submitted = time.perf_counter()
            local[name] = request
            if request.tensor is not None:
                self._queued_bytes += request.tensor.nbytes
            self._queue.append(request)
            self._wake_if_due()
        return request.handle

    def _wake_if_due(self) -> None:
        """After queueing (under the lock): wake a sleeping engine once what is queued is worth a tick."""
        if self._sleeping and (len(self._queue) >= self._wake_count or self._queued_bytes >= self._wake_bytes):
            self._wake.notify()

    def _refuse_duplicate(self, request: Request) -> None:
        raise ValueError(
            f"an op named {request.name!r} ({request.meta['o']}) is still in flight on rank {self.rank}; names "
            "of outstanding ops must be unique"
        )

    def submit_many(self, requests: Sequence[Request]) -> None:
        """Submit several requests at once (a grouped op's tensors): one lock acquisition, all or none."""
        with self._lock:
            if self._error is not None or self._shutdown_requested:
                self._raise_if_stopped()
            local = self._local
            seen: set[str] = set()
            for request in requests:
                name = request.name
                if name in local or name in seen:
                    self._refuse_duplicate(local.get(name) or request)
                seen.add(name)
            submitted = time.perf_counter() if self.timeline is not None else 0.0
            nudge = self._nudge
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

    def _nudge(self, handle: Handle) -> None:
        """A caller is about to block on an op: whatever it submitted is all that is coming for now."""
        with self._lock:
            request = self._local.get(handle.name)
            if request is None or request.handle is not handle:
                return  # already taken to run (or finished): nothing to hurry, and no step to end
            self._step_closing = True
            if self._waited is not request:
                self._waited = request
                self._wake.notify()

    def auto_name(self, op: str) -> str:
        """A generated name (``allreduce.noname.3``); equal on every rank that calls ops in the same order."""
        with self._lock:
            n = self._name_counters.get(op, 0)
            self._name_counters[op] = n + 1
        return f"{op}{GENERATED_NAME_MARK}{n}"

    def join(self) -> Handle:
        with self._lock:
            self._raise_if_stopped()
            if self._join_handle is not None:
                raise ValueError(f"rank {self.rank} has already joined")
            self._join_handle = Handle("join")
            self._join_announce = True
            self._wake.notify()
            return self._join_handle

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Tell every rank to stop after this round; wait for the thread, then drop the group."""
        with self._lock:
            self._shutdown_requested = True
            self._wake.notify()
        self._thread.join(timeout_s)
        self.comm.close()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _raise_if_stopped(self) -> None:
        if self._error is not None:
            raise self._error
        if self._shutdown_requested:
            raise HorovodInternalError("hvdray is shutting down; no new ops are accepted")

    # -- the loop (engine thread) -----------------------------------------------------------
    def _loop(self) -> None:
        # Ops write into the user's tensors in place (allreduce_, broadcast_ on parameters): never
        # record autograd history for them. Grad mode is per thread, so this affects this thread only.
        torch.set_grad_enabled(False)
        wait_s = self._cycle_s
        try:
            while True:
                wants_full = self._collect(wait_s)
                flags = self._flags.fill(list(self._cached_pending), self.rank in self._joined, wants_full)
                self.comm.and_flags(flags)
                ready_slots, pending_somewhere, full = self._flags.read()
                self._round += 1
                self.stats.rounds += 1
                busy = bool(ready_slots or pending_somewhere)
                if full:
                    self.stats.full_rounds += 1
                    messages = [json.loads(p) if p else {} for p in self.comm.allgather_bytes(self._encode())]
                    stop_ranks = [r for r, m in enumerate(messages) if m.get("x")]
                    if stop_ranks:
                        self._fail_all(HorovodInternalError(
                            f"hvdray was shut down by rank(s) {stop_ranks} while this op was pending"
                        ))
                        return
                    busy = self._absorb(messages) or busy
                if self.rank == 0:
                    self._watch_cached_stalls(pending_somewhere, ready_slots)
                timeline = self.timeline
                if timeline is not None:
                    self._ready_at = time.perf_counter()
                    if busy:
                        timeline.cycle(self.timeline_pid, self._ready_at)
                self._run_ready(ready_slots)
                if self._tuner is not None and self._tick_bytes:
                    self._tuner.record(self._tick_bytes, time.perf_counter())
                self._tick_bytes = 0
                wait_s = self._cycle_s if (busy or self._table or self._joined) else min(wait_s * 2, self._idle_s)
        except BaseException as exc:  # noqa: BLE001 - any failure here breaks the ring for everyone
            error = exc if isinstance(exc, HvdrayError) else HorovodInternalError(
                f"collective communication failed on rank {self.rank}: {exc}"
            )
            if not isinstance(exc, HvdrayError):
                error.__cause__ = exc
            log.debug("engine stopped: %s", error)
            self._fail_all(error)
            # Close at once: peers blocked on this rank then fail now instead of at their timeout.
            self.comm.close()

    def _collect(self, wait_s: float) -> bool:
        """Wait for this tick, sorting new requests into cached slots and the outbox as they come; True if
        this rank needs a full (named) negotiation round.

        When to tick: at once on shutdown, join, or when a caller blocks on (or polls) an op; otherwise new
        work with nothing older in flight goes at once, except that once this rank's steps repeat, a step
        goes when all of it has been submitted, or a fusion buffer's worth of it: one negotiation and one
        fused reduction per step instead of one per early tensor. A step is the cached tensors submitted
        until nothing is in flight any more after the step was submitted whole or a caller waited on one
        of its ops (a training step's backward pass and ``optimizer.step()``). With older work in flight
        the tick paces by the cycle time, so that tensors arriving together are negotiated and fused
        together.
        """
        started = time.monotonic()
        deadline = started + wait_s
        with self._lock:
            older = len(self._local) - len(self._queue)  # in flight from earlier ticks (constant here)
            if not older and self._step_slots and self._step_closing:  # the step is over: learn it
                self._expected, self._step_slots, self._step_closing = frozenset(self._step_slots), set(), False
            while True:
                if self._queue:
                    self._sort(self._queue)
                    self._queue = []
                    self._queued_bytes = 0
                waited = self._waited  # still in flight: a nudge from before its op finished does not count
                if self._shutdown_requested or self._join_announce or (
                    waited is not None and self._local.get(waited.name) is waited
                ):
                    break
                now = time.monotonic()
                if self._expected and not older:
                    if self._unsent_bytes and self._step_slots >= self._expected:
                        self._step_closing = True  # submitted whole
                        break
                    if self._outbox or self._unsent_bytes and self._unsent_bytes >= self._fusion_bytes:
                        break
                    limit = max(deadline, started + self._idle_s)  # the rest of the step is coming
                    # wake for the step's missing tensors or a fusion buffer's worth (a caller that
                    # blocks on an op ticks at once through the nudge, whatever it submitted)
                    wake_count = max(1, len(self._expected) - len(self._step_slots & self._expected))
                    wake_bytes = max(1, self._fusion_bytes - self._unsent_bytes)
                else:
                    if self._local and not older:
                        break
                    limit = deadline
                    # with older work in flight the tick waits for the cycle's end whatever arrives
                    wake_count, wake_bytes = (1, 0) if not older else (_NEVER, _NEVER)
                if now >= limit:
                    break
                self._wake_count, self._wake_bytes = wake_count, wake_bytes
                self._sleeping = True
                self._wake.wait(limit - now)
                self._sleeping = False
                self.stats.wakeups += 1
            self._waited = None
            self._unsent_bytes = 0
            wants_full = bool(self._join_announce or self._shutdown_requested)
        if self.rank == 0:
            wants_full = self._rank0_wants_full() or wants_full
        return wants_full or bool(self._outbox)

    def _sort(self, queue: list[Request]) -> None:
        """New requests go to their cached slot (announced by one flag bit) or to the outbox (by name)."""
        for request in queue:
            slot = None if request.meta.get("a") or not self._cache_on else self._cache.lookup(request.meta)
            if slot is None:
                self._outbox.append(request)
            else:
                self._cached_pending[slot] = request
                self._step_slots.add(slot)
                if request.tensor is not None:  # its metadata's shape and dtype: the cache matched them
                    self._unsent_bytes += request.tensor.nbytes

    def _encode(self) -> bytes:
        message: dict[str, Any] = {}
        if self._outbox:
            message["q"] = [r.meta for r in self._outbox]
            self._outbox = []
        if self._cached_pending:
            message["pc"] = sorted(self._cached_pending)  # census of cached slots pending here
        with self._lock:
            if self._join_announce:
                message["j"] = 1
                self._join_announce = False
            if self._shutdown_requested:
                message["x"] = 1
        if self.rank == 0 and self._drops:
            message["drop"], self._drops = self._drops, []
        if self._tuner is not None:
            params = self._tuner.take_pending(time.perf_counter())
            if params is not None:
                message["tune"] = [params.fusion_threshold_mb, params.cycle_time_ms, params.cache_enabled]
        return json.dumps(message, separators=(",", ":")).encode() if message else b""

    def _absorb(self, messages: list[dict[str, Any]]) -> bool:
        busy = False
        now = time.monotonic()
        self._census = {}
        for sender, message in enumerate(messages):
            for meta in message.get("q", ()):
                busy = True
                name = meta["n"]
                if self._cache.slot_of(name) is not None:
                    self._uncache(name)  # announced by name again: renegotiate it everywhere
                entry = self._table.get(name)
                if entry is None:
                    entry = self._table[name] = _Announced(first_seen=now)
                    self._order.append(name)
                entry.metas[sender] = meta
            for slot in message.get("pc", ()):
                self._census.setdefault(slot, set()).add(sender)
            if message.get("j"):
                busy = True
                self._joined.add(sender)
                self._last_joined = sender
        tune = messages[0].get("tune")
        if tune is not None:
            self._apply(TunedParams(*tune))
        for name, missing in messages[0].get("drop", ()):
            if self._table.pop(name, None) is not None:
                self._order.remove(name)
            slot = self._cache.slot_of(name)
            if slot is not None:
                self._cached_pending.pop(slot, None)
                self._stall_since.pop(slot, None)
            request = self._take_local(name)
            if request is not None:
                request.handle._finish(
                    error=HvdrayError(
                        f"{request.meta['o']} {name!r} stalled for more than {self._stall_shutdown_s} s: "
                        f"rank(s) {missing} never submitted it (stall_shutdown_s)"
                    )
                )
        return busy

    def _apply(self, params: TunedParams) -> None:
        """Autotune's parameters, applied by every rank in the same round (rank 0 sent them)."""
        self._fusion_bytes = int(params.fusion_threshold_mb * 1024 * 1024)
        self._cycle_s = params.cycle_time_ms / 1000.0
        self._cache_on = params.cache_enabled and self._cache.capacity > 0
        self._forget_plans()
        log.debug("rank %d applies autotuned %s", self.rank, params)

    @property
    def tuned(self) -> TunedParams:
        """The fusion threshold, cycle time and cache switch in force now."""
        return TunedParams(self._fusion_bytes / (1024 * 1024), self._cycle_s * 1000.0, self._cache_on)

    def _uncache(self, name: str) -> None:
        """Forget a cached name on every rank; a request pending on its slot goes out by name instead."""
        slot = self._cache.evict(name)
        self._forget_plans()
        request = self._cached_pending.pop(slot, None) if slot is not None else None
        if request is not None:
            self._outbox.append(request)
        self._stall_since.pop(slot, None)

    def _forget_plans(self) -> None:
        """Slots changed meaning or fusion changed: recompute what ready slots run as, and relearn steps."""
        self._plans.clear()
        self._expected = frozenset()
        self._step_slots = set()
        self._step_closing = False

    # -- stalls (rank 0 watches, every rank acts on its "drop" list) ---------------------------
    def _rank0_wants_full(self) -> bool:
        """Rank 0 checks named stalls and asks for a census round when a cached slot stalls."""
        self._drops.extend(self._stalled_names())
        now = time.monotonic()
        census_due = any(
            now - since >= self._stall_warning_s and slot not in self._stall_warned
            or self._stall_shutdown_s and now - since >= self._stall_shutdown_s
            for slot, since in self._stall_since.items()
        )
        tune_due = self._tuner is not None and self._tuner.pending is not None
        return bool(self._drops) or census_due or tune_due

    def _watch_cached_stalls(self, pending_somewhere: list[int], ready: list[int]) -> None:
        now = time.monotonic()
        stalled = set(pending_somewhere) - set(ready)
        for slot in list(self._stall_since):
            if slot not in stalled:
                del self._stall_since[slot]
                self._stall_warned.discard(slot)
        for slot in stalled:
            since = self._stall_since.setdefault(slot, now)
            if slot not in self._census or now - since < self._stall_warning_s:
                continue
            name = self._cache.name_of(slot)
            submitted = self._census[slot]
            missing = sorted(set(range(self.size)) - submitted - self._joined)
            if slot not in self._stall_warned:
                self._stall_warned.add(slot)
                self._warn_stall(self._cache.metas(slot)[0]["o"], name, now - since, missing, submitted)
            if self._stall_shutdown_s and now - since >= self._stall_shutdown_s:
                self._drops.append([name, missing])

    def _stalled_names(self) -> list[list[Any]]:
        """Named (uncached) tensors past ``stall_warning_s`` get a warning; past ``stall_shutdown_s``, a drop."""
        now = time.monotonic()
        dropped = []
        for name in self._order:
            entry = self._table[name]
            age = now - entry.first_seen
            if age < self._stall_warning_s:
                continue
            missing = sorted(set(range(self.size)) - set(entry.metas) - self._joined)
            if not entry.warned:
                entry.warned = True
                self._warn_stall(next(iter(entry.metas.values()))["o"], name, age, missing, entry.metas)
            if self._stall_shutdown_s and age >= self._stall_shutdown_s:
                dropped.append([name, missing])
        return dropped

    @staticmethod
    def _warn_stall(op: str, name: str, age: float, missing: list[int], submitted: Any) -> None:
        log.warning(
            "%s %r has waited %.0f s for rank(s) %s (ranks %s submitted it); a rank may be stuck or "
            "calling ops in a different order", op, name, age, missing, sorted(submitted),
        )

    # -- running ready ops ------------------------------------------------------------------
    def _run_ready(self, ready_slots: list[int]) -> None:
        """Run what is ready everywhere: cached slots in slot order, then newly negotiated names in
        announcement order (the same on every rank), fusing consecutive compatible allreduces."""
        everyone = set(range(self.size))
        for slot in ready_slots:
            self._cached_pending.pop(slot, None)  # a joined rank has none pending
            self._cache.touch(slot, self._round)
        newly = [n for n in self._order if set(self._table[n].metas) | self._joined == everyone] if self._order else []
        if ready_slots and not newly and not self._joined:
            # the steady state: the same cached tensors every step, planned once
            key = tuple(ready_slots)
            plan = self._plans.get(key)
            if plan is None:
                if len(self._plans) >= _MAX_PLANS:
                    self._plans.clear()
                plan = self._plans[key] = self._plan(
                    [(self._cache.name_of(slot), self._cache.metas(slot), True) for slot in ready_slots]
                )
        else:
            ready = [(self._cache.name_of(slot), self._cache.metas(slot), True) for slot in ready_slots]
            for name in newly:
                self._order.remove(name)
                ready.append((name, self._table.pop(name).metas, False))
            plan = self._plan(ready)
        for action in plan:
            if action.problem:
                request = self._take_local(action.names[0])
                if request is not None:
                    request.handle._finish(error=TensorMismatchError(action.problem))
            elif action.fused:
                self._flush(action)
            else:
                self._run_one(action.names[0], action.rank_metas)
        if self._joined == everyone:
            self._finish_join()

    def _plan(self, ready: list[tuple[str, dict[int, dict[str, Any]], bool]]) -> list["_Action"]:
        """What to run for these ready names, in order: mismatches become errors (identical on every
        rank), consecutive compatible allreduces fuse up to the threshold, newly agreed names are cached."""
        everyone = set(range(self.size))
        plan: list[_Action] = []
        straight = self.comm.fused_message_bytes
        batch = _FusionBatch(min(self._fusion_bytes, straight) if straight else self._fusion_bytes)
        alone_from = straight + 1 if straight else DIRECT_BYTES

        def close_batch() -> None:
            items = batch.take()
            if items:
                metas = [m for _, m in items]
                plan.append(_Action(names=[n for n, _ in items], metas=metas, fused=True, nbytes=sum(map(_nbytes, metas))))

        for name, metas, cached in ready:
            meta = metas[min(metas)]
            problem = None if cached else self._mismatch(name, metas)
            if problem is None and self._joined and meta["o"] != "allreduce":
                problem = (
                    f"{meta['o']} {name!r} cannot run after rank(s) {sorted(self._joined)} called join(); "
                    "only allreduce works with joined ranks"
                )
            if problem is not None:
                close_batch()
                plan.append(_Action(names=[name], metas=[meta], problem=problem))
                continue
            if self._cache_on and not cached and not meta.get("a") and set(metas) == everyone:
                evicted = self._cache.put(name, metas, self._round)
                if evicted is not None:
                    self._forget_plans()
                    if evicted in self._cached_pending:
                        self._outbox.append(self._cached_pending.pop(evicted))
            if meta["o"] != "allreduce":
                close_batch()
                plan.append(_Action(names=[name], metas=[meta], rank_metas=metas))
            elif meta["r"] == ReduceOp.ADASUM or _nbytes(meta) >= alone_from:
                # alone (Adasum's coefficients are per tensor); the small ones around it keep filling the batch
                plan.append(_Action(names=[name], metas=[meta], fused=True, nbytes=_nbytes(meta)))
            else:
                if not batch.fits(meta):
                    close_batch()
                batch.add(name, meta)
        close_batch()
        return plan

    def _finish_join(self) -> None:
        last = self._last_joined
        self._joined = set()
        self._last_joined = -1
        with self._lock:
            handle, self._join_handle = self._join_handle, None
        if handle is not None:
            handle._finish(result=last)

    def _take_local(self, name: str) -> Optional[Request]:
        with self._lock:
            return self._local.pop(name, None)

    def _mismatch(self, name: str, metas: dict[int, dict[str, Any]]) -> Optional[str]:
        ranks = sorted(metas)
        ref_rank = ranks[0]
        ref = metas[ref_rank]
        op = ref["o"]
        for r in ranks[1:]:
            m = metas[r]
            if m["o"] != op:
                return f"mismatched operations for {name!r}: rank {ref_rank} called {op}, rank {r} called {m['o']}"
            if m["d"] != ref["d"]:
                return (
                    f"mismatched dtypes for {op} {name!r}: rank {ref_rank} has {ref['d']}, rank {r} has {m['d']}"
                )
            same_dims = m["s"] == ref["s"] if op in ("allreduce", "broadcast", "reducescatter") else (
                len(m["s"]) == len(ref["s"]) and m["s"][1:] == ref["s"][1:]
            )
            if not same_dims:
                which = "shapes" if op in ("allreduce", "broadcast", "reducescatter") else "shapes beyond dim 0"
                return (
                    f"mismatched {which} for {op} {name!r}: rank {ref_rank} has {ref['s']}, rank {r} has {m['s']}"
                )
            for key, label in (("r", "reduction op"), ("root", "root_rank"), ("pre", "prescale_factor"),
                               ("post", "postscale_factor")):
                if m.get(key) != ref.get(key):
                    return (
                        f"mismatched {label} for {op} {name!r}: rank {ref_rank} has {ref.get(key)}, "
                        f"rank {r} has {m.get(key)}"
                    )
            if op == "alltoall" and (m.get("sp") is None) != (ref.get("sp") is None):
                return f"mismatched splits for alltoall {name!r}: some ranks passed splits and others did not"
        return None

    def _flush(self, action: "_Action") -> None:
        """One allreduce for the action's tensors: alone in its output, or fused in a staging buffer."""
        meta = action.metas[0]
        with self._lock:
            local = self._local
            requests = [local.pop(name, None) for name in action.names]
        self._running = [req for req in requests if req is not None]
        timeline = self.timeline
        t_start = time.perf_counter() if timeline is not None else 0.0
        if len(requests) == 1:
            req = requests[0]
            src = req.tensor if req is not None else torch.zeros(meta["s"], dtype=_dtype(meta["d"]))
            buf = req.output if req is not None and req.output.is_contiguous() else torch.empty_like(src)
            if buf is not src:
                buf.copy_(src)
            t_copied = time.perf_counter() if timeline is not None else 0.0
            self._reduce(buf, meta)
            t_reduced = time.perf_counter() if timeline is not None else 0.0
            self._tick_bytes += buf.numel() * buf.element_size()
            if req is not None and buf is not req.output:
                req.output.copy_(buf)
        elif (
            action.nbytes <= self.comm.fused_message_bytes and meta["pre"] == 1.0
            and all(req is not None for req in requests)
        ):
            # the transport copies the tensors straight in and the results straight out: no staging
            outputs = [req.output for req in requests]
            t_copied = t_start
            scaled = meta["r"] == "average" or meta["post"] != 1.0
            inputs = [req.tensor for req in requests]
            if action.shapes is None:  # the same every time a cached plan runs: its metadata fixed them
                action.shapes = tuple(t.shape for t in inputs)
            self.comm.allreduce_tensors(  # the scale runs on the reduced data, before it is copied out
                inputs, outputs, meta["r"],
                (lambda reduced: _postscale(reduced, meta, self.size)) if scaled else None, shapes=action.shapes,
            )
            t_reduced = time.perf_counter() if timeline is not None else 0.0
            self._tick_bytes += action.nbytes
            self.stats.fused_tensors += len(requests)
        else:
            views = self._staging_views(action)
            # one C++ call copies every tensor in and one copies every result out (a Python loop of
            # copies costs ~10 us a tensor); a joined rank contributes zeros
            if all(req is not None for req in requests):
                torch._foreach_copy_(views, [req.tensor for req in requests])
            else:
                for view, req in zip(views, requests):
                    if req is None:
                        view.zero_()
                    else:
                        view.copy_(req.tensor)
            t_copied = time.perf_counter() if timeline is not None else 0.0
            self._reduce(action.flat, meta)
            t_reduced = time.perf_counter() if timeline is not None else 0.0
            self._tick_bytes += action.flat.numel() * action.flat.element_size()
            self.stats.fused_tensors += len(requests)
            done = [(req.output, view) for req, view in zip(requests, views) if req is not None]
            torch._foreach_copy_([out for out, _ in done], [view for _, view in done])
        if timeline is not None:
            t_done = time.perf_counter()
            fused = {"tensors": len(requests), "bytes": action.nbytes}
            for req in self._running:
                self._trace_start(timeline, req, t_start)
                timeline.phase(self.timeline_pid, req.name, "FUSION-COPY", t_start, t_copied)
                timeline.phase(self.timeline_pid, req.name, "REDUCE", t_copied, t_reduced, fused)
                timeline.phase(self.timeline_pid, req.name, "COPY-OUT", t_reduced, t_done)
        self.stats.allreduce_calls += 1
        self.stats.ops += len(requests)
        for req in self._running:
            req.handle._finish(result=req.output)
        self._running = []

    def _staging_views(self, action: "_Action") -> list[torch.Tensor]:
        """The action's tensors as views of this engine's fusion buffer for their dtype (kept between
        steps, grown when a larger batch comes; plans bound to a replaced buffer are recomputed)."""
        dtype = _dtype(action.metas[0]["d"])
        staging = self._staging.get(dtype)
        if staging is not None and action.staging is staging:  # every step after the first
            return action.views
        numels = [math.prod(m["s"]) for m in action.metas]
        total = sum(numels)
        if staging is None or staging.numel() < total:
            staging = self._staging[dtype] = torch.empty(total, dtype=dtype)
            self._plans.clear()  # their views point into the old buffer
        action.staging = staging
        action.flat = staging[:total]
        action.views = [part.view(m["s"]) for part, m in zip(action.flat.split(numels), action.metas)]
        return action.views

    def _reduce(self, buf: torch.Tensor, meta: dict[str, Any]) -> None:
        if meta["pre"] != 1.0:
            buf.mul_(meta["pre"])
        self.comm.allreduce(buf, meta["r"])
        _postscale([buf], meta, self.size)

    def _run_one(self, name: str, metas: dict[int, dict[str, Any]]) -> None:
        request = self._take_local(name)
        self._running = [request] if request is not None else []
        meta = metas[min(metas)]
        op = meta["o"]
        t_start = time.perf_counter() if self.timeline is not None else 0.0
        if op == "barrier":
            result = None
        elif op == "broadcast":
            result = self._broadcast(request, meta)
        elif op == "allgather":
            result = self._allgather(request, metas)
        elif op == "alltoall":
            result = self._alltoall(request, metas)
        elif op == "reducescatter":
            result = self._reducescatter(request, meta)
        else:
            raise HvdrayError(f"unknown op {op!r} for {name!r}")
        self.stats.ops += 1
        timeline = self.timeline
        if timeline is not None:
            self._trace_start(timeline, request, t_start)
            timeline.phase(self.timeline_pid, name, op.upper(), t_start, time.perf_counter())
        request.handle._finish(result=result)
        self._running = []

    def _trace_start(self, timeline: Timeline, request: Request, started: float) -> None:
        """NEGOTIATE (submitted until ready everywhere) and QUEUE (ready until its work began)."""
        ready = min(max(self._ready_at, request.submitted) or started, started)
        if request.submitted:
            timeline.phase(self.timeline_pid, request.name, "NEGOTIATE", min(request.submitted, ready), ready)
        timeline.phase(self.timeline_pid, request.name, "QUEUE", ready, started)

    def _broadcast(self, request: Request, meta: dict[str, Any]) -> torch.Tensor:
        out = request.output
        buf = out if out.is_contiguous() else torch.empty_like(out)
        if buf is not request.tensor:
            buf.copy_(request.tensor)
        self.comm.broadcast(buf, meta["root"])
        if buf is not out:
            out.copy_(buf)
        return out

    def _allgather(self, request: Request, metas: dict[int, dict[str, Any]]) -> torch.Tensor:
        tensor = request.tensor.contiguous()
        rows = [metas[r]["s"][0] for r in range(self.size)]
        longest = max(rows)
        if all(n == longest for n in rows):
            parts = self.comm.allgather(tensor)
        else:
            padded = tensor.new_zeros((longest, *tensor.shape[1:]))
            padded[: tensor.shape[0]] = tensor
            parts = [p[:n] for p, n in zip(self.comm.allgather(padded), rows)]
        return torch.cat(parts)

    def _alltoall(self, request: Request, metas: dict[int, dict[str, Any]]) -> tuple[torch.Tensor, torch.Tensor]:
        tensor = request.tensor.contiguous()
        splits_of = [metas[r]["sp"] or _even_splits(metas[r]["s"][0], self.size) for r in range(self.size)]
        send = splits_of[self.rank]
        recv = [splits_of[r][self.rank] for r in range(self.size)]
        output = tensor.new_empty((sum(recv), *tensor.shape[1:]))
        self.comm.alltoall(output, tensor, recv, send)
        return output, torch.tensor(recv, dtype=torch.int32)

    def _reducescatter(self, request: Request, meta: dict[str, Any]) -> torch.Tensor:
        tensor = request.tensor
        rows = reducescatter_rows(tensor.shape[0], self.size)
        most = rows[0]
        padded = tensor.new_zeros((most * self.size, *tensor.shape[1:]))
        offset = 0
        for r, n in enumerate(rows):
            padded[r * most : r * most + n] = tensor[offset : offset + n]
            offset += n
        if meta["pre"] != 1.0:
            padded.mul_(meta["pre"])
        out = tensor.new_empty((most, *tensor.shape[1:]))
        self.comm.reduce_scatter(out, padded, meta["r"])
        out = out[: rows[self.rank]].clone()
        _postscale([out], meta, self.size)
        return out

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            self._error = error
            # what was executing when the error came is no longer in _local: fail it too
            pending = list(self._local.values()) + [r for r in self._running if not r.handle.done()]
            self._running = []
            self._local.clear()
            self._queue, self._outbox, self._cached_pending = [], [], {}
            self._queued_bytes = 0
            join, self._join_handle = self._join_handle, None
        for request in pending:
            request.handle._finish(error=error)
        if join is not None:
            join._finish(error=error)


@dataclass(eq=False)
class _Action:
    """One entry of a plan: a (possibly fused) allreduce, another op, or a mismatch error."""

    names: list[str]
    metas: list[dict[str, Any]]  # per name, the metadata of the lowest rank that submitted it
    fused: bool = False  # an allreduce batch (possibly of one tensor)
    nbytes: int = 0  # of the batch
    rank_metas: dict[int, dict[str, Any]] = field(default_factory=dict)  # every rank's, for other ops
    problem: str = ""  # a mismatch: raised on every rank for names[0]
    staging: Optional[torch.Tensor] = None  # the fusion buffer the views below point into
    flat: Optional[torch.Tensor] = None
    views: list[torch.Tensor] = field(default_factory=list)
    shapes: Optional[tuple[torch.Size, ...]] = None  # of a fused batch's tensors (outputs alike), once known


#: distinct sets of ready cached slots whose plans are kept (a training loop needs one or two)
_MAX_PLANS = 64
#: a wake-up threshold no submission reaches
_NEVER = sys.maxsize


class _FusionBatch:
    """Consecutive ready allreduces sharing dtype, op and scale factors, up to the fusion threshold."""

    _KEY = ("d", "r", "pre", "post")

    def __init__(self, limit_bytes: int) -> None:
        self._limit = limit_bytes
        self._items: list[tuple[str, dict[str, Any]]] = []
        self._nbytes = 0

    def fits(self, meta: dict[str, Any]) -> bool:
        if not self._items:
            return True
        first = self._items[0][1]
        return all(first[k] == meta[k] for k in self._KEY) and self._nbytes + _nbytes(meta) <= self._limit

    def add(self, name: str, meta: dict[str, Any]) -> None:
        self._items.append((name, meta))
        self._nbytes += _nbytes(meta)

    def take(self) -> list[tuple[str, dict[str, Any]]]:
        items, self._items, self._nbytes = self._items, [], 0
        return items


def _postscale(bufs: list[torch.Tensor], meta: dict[str, Any], size: int) -> None:
    """Averaging's division and ``postscale_factor``, in place on ``bufs`` (one dtype)."""
    average = meta["r"] == "average"
    if average and not bufs[0].is_floating_point():
        for buf in bufs:
            buf.floor_divide_(size)
    elif average or meta["post"] != 1.0:
        factor = meta["post"] / size if average else meta["post"]
        if bufs[0].is_floating_point():
            torch._foreach_mul_(bufs, factor)
        else:
            for buf in bufs:
                buf.mul_(factor)


def _even_splits(rows: int, size: int) -> list[int]:
    return [rows // size] * size


def _nbytes(meta: dict[str, Any]) -> int:
    return math.prod(meta["s"]) * _dtype(meta["d"]).itemsize


_DTYPES: dict[str, torch.dtype] = {str(d): d for d in GLOO_DTYPES}


def _dtype(name: str) -> torch.dtype:
    return _DTYPES[name]

