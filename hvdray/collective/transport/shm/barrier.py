"""The barrier the local ranks of one node synchronise on, over per-rank counters in their segment.

A short spin, then a few hundred checks that each give the core away (``sched_yield``: a peer or
another thread of this process that is ready to run gets the core at once, which matters when local
ranks outnumber cores), then a Linux futex wait on the counter word (the kernel wakes the waiter the
moment the counter moves). A thread whose caller blocks on the op anyway (:meth:`NodeBarrier.patient`)
gives its core away for a few milliseconds before it sleeps: a peer still finishing its backward pass
then arrives while it yields, and neither pays a sleep and a wake-up in the middle of a training step.
A rank about to sleep says so in its control block, and a rank that moves its counter makes the wake-up
system call only when a peer sleeps on it (waking a sleeping thread costs tens of microseconds in a VM).
A peer that died, left or failed turns into :class:`SharedMemoryError` within the timeout, never a hang.
"""

from __future__ import annotations

import _thread
import ctypes
import os
import platform
import threading
import time
from typing import Optional

from hvdray.collective.transport.shm.segment import (
    CONTROL_STRIDE_BYTES,
    SYS_FUTEX,
    Segment,
    SharedMemoryError,
    process_alive,
)

_SEQ_MASK = 0xFFFFFFFF
_HALF_RANGE = 1 << 31
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
_LIVENESS_CHECK_S = 0.05


class _Futex:
    """futex(2) on 32-bit words of a shared mapping (process-shared, so no FUTEX_PRIVATE_FLAG)."""

    def __init__(self) -> None:
        self._syscall = ctypes.CDLL(None, use_errno=True).syscall
        self._syscall.restype = ctypes.c_long
        self._number = ctypes.c_long(SYS_FUTEX[platform.machine().lower()])

    def wait(self, address: int, expected: int, timeout_s: float) -> None:
        """Sleep while the word at ``address`` equals ``expected``, at most ``timeout_s`` (GIL released)."""
        seconds = int(timeout_s)
        spec = _Timespec(seconds, int((timeout_s - seconds) * 1e9))
        self._syscall(
            self._number, ctypes.c_void_p(address), ctypes.c_int(_FUTEX_WAIT), ctypes.c_uint32(expected),
            ctypes.byref(spec), None, ctypes.c_int(0),
        )

    def wake(self, address: int) -> None:
        self._syscall(
            self._number, ctypes.c_void_p(address), ctypes.c_int(_FUTEX_WAKE), ctypes.c_int(0x7FFFFFFF),
            None, None, ctypes.c_int(0),
        )


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


#: word offsets inside a rank's control block; _SLEEPS_ON holds 1 + the local rank whose counter this
#: rank sleeps on (0: not sleeping)
_COUNTER, _PID, _STATE, _SLEEPS_ON = 0, 1, 2, 3
_STATE_LEFT = 1  # failed or shut down itself; 2 + k: left because local rank k died or left
_WORDS_PER_RANK = CONTROL_STRIDE_BYTES // 4
_CONTROL_BASE_WORDS = CONTROL_STRIDE_BYTES // 4  # block 0 of the header holds magic and sizes


class Patience(threading.local):
    """The context of :meth:`NodeBarrier.patient`: how many such blocks the current thread is in (re-entrant;
    per thread)."""

    depth = 0

    def __enter__(self) -> None:
        self.depth += 1

    def __exit__(self, *exc: object) -> None:
        self.depth -= 1


class NodeBarrier:
    """A reusable barrier of the local ranks over their counters in one :class:`Segment`.

    Sleeping and waking is a Dekker handshake on two words: a sleeper publishes whose counter it
    sleeps on, fences, then re-reads that counter (the futex call checks it once more in the kernel);
    a waker stores its counter, fences, then reads who sleeps on it. One of the two always sees the
    other's store, so either the sleeper does not sleep or the waker wakes it.

    ``yields`` is how many times a waiter gives its core away before it sleeps; ``patient_yield_s``, for how long
    it does inside :meth:`patient`, on a thread whose caller waits for the op anyway (0: ``yields`` times
    there too). A time, not a count: on a starved core each yield may cost a time slice, and the peer's
    liveness is checked only once the waiter sleeps."""

    def __init__(
        self, segment: Segment, local_rank: int, timeout_s: float, spin: int, yields: int = 0,
        patient_yield_s: float = 0.0,
    ) -> None:
        self._seg = segment
        self._words = segment.words
        self._me = local_rank
        self._size = segment.local_size
        self._timeout_s = timeout_s
        self._spin = spin
        self._yields = yields
        self._patient_yield_s = patient_yield_s
        self._patience = Patience()
        self._futex = _Futex()
        self._seq = 0
        self._pids: dict[int, int] = {}
        self._cause: Optional[int] = None  # the local rank whose death or leaving made this one fail
        self._closed = False
        # for _full_fence: one lock per barrier, whose ops run one at a time, so taking it never fails
        self._fence_lock = _thread.allocate_lock()
        self._words[self._word(local_rank, _PID)] = os.getpid()

    def _full_fence(self) -> None:
        """A full memory barrier: stores before it are visible to every core before loads after it.

        x86-64 may let a load pass an earlier store to another address (the store-buffer case that the
        sleeper/waker handshake must exclude); an uncontended lock's acquire and release are atomic
        read-modify-write instructions, which drain the store buffer. (A contended acquire fails
        without one, hence a lock of this barrier's own, not one shared by every thread.)"""
        self._fence_lock.acquire(False)
        self._fence_lock.release()

    def _word(self, local_rank: int, field: int) -> int:
        return _CONTROL_BASE_WORDS + local_rank * _WORDS_PER_RANK + field

    def patient(self) -> Patience:
        """A context in which this thread's waits give the core away for ``patient_yield_s`` before they sleep
        (instead of ``yields`` times): for the rounds a caller blocks on, which would otherwise sleep whenever
        a peer arrives a little later (the end of its backward pass), and pay a wake-up each time."""
        return self._patience

    def wait(self) -> None:
        """Return once every local rank has reached this barrier; raise if one died or left."""
        if self._closed:
            raise SharedMemoryError(f"local rank {self._me} already left the shared-memory group")
        self._seq = (self._seq + 1) & _SEQ_MASK
        counter = self._word(self._me, _COUNTER)
        words = self._words
        words[counter] = self._seq
        self._full_fence()
        mark = self._me + 1
        for peer in range(self._size):
            if words[self._word(peer, _SLEEPS_ON)] == mark:
                self._futex.wake(self._seg.address + 4 * counter)
                break
        for peer in range(self._size):
            if peer != self._me:
                self._await(peer)

    def _await(self, peer: int) -> None:
        words, seq, index = self._words, self._seq, self._word(peer, _COUNTER)
        for _ in range(self._spin):
            if (words[index] - seq) & _SEQ_MASK < _HALF_RANGE:
                return
        if self._patience.depth and self._patient_yield_s > 0:
            until = time.monotonic() + self._patient_yield_s
            while time.monotonic() < until:
                if (words[index] - seq) & _SEQ_MASK < _HALF_RANGE:
                    return
                os.sched_yield()
        else:
            for _ in range(self._yields):
                if (words[index] - seq) & _SEQ_MASK < _HALF_RANGE:
                    return
                os.sched_yield()
        deadline = time.monotonic() + self._timeout_s
        next_check = deadline - self._timeout_s + _LIVENESS_CHECK_S
        address = self._seg.address + 4 * index
        sleeps_on = self._word(self._me, _SLEEPS_ON)
        words[sleeps_on] = peer + 1
        self._full_fence()
        try:
            while True:
                value = words[index]
                if (value - seq) & _SEQ_MASK < _HALF_RANGE:
                    return
                if self._closed:
                    raise SharedMemoryError(f"local rank {self._me} left the shared-memory group while waiting")
                now = time.monotonic()
                if now >= next_check:
                    self._check_peer(peer, now, deadline)
                    next_check = now + _LIVENESS_CHECK_S
                self._futex.wait(address, value, min(_LIVENESS_CHECK_S, max(deadline - now, 0.001)))
        finally:
            words[sleeps_on] = 0  # the segment stays mapped while an op runs (NodeCollectives.close)

    def _check_peer(self, peer: int, now: float, deadline: float, exited: bool = False) -> None:
        states = {rank: self._words[self._word(rank, _STATE)] for rank in range(self._size) if rank != self._me}
        # name a rank that failed by itself first: the others that left did so because of it
        for rank in [r for r, state in states.items() if state == _STATE_LEFT] + list(states):
            state = states[rank]
            if state == _STATE_LEFT:
                self._cause = rank
                raise SharedMemoryError(f"local rank {rank} left the shared-memory group (it failed or shut down)")
            if state:
                self._cause = state - 2
                raise SharedMemoryError(f"local rank {rank} left the shared-memory group (local rank {state - 2} died)")
        pid = self._pids.get(peer) or self._words[self._word(peer, _PID)]
        if pid:
            self._pids[peer] = pid
            if exited or not process_alive(pid):
                self._cause = peer
                raise SharedMemoryError(f"local rank {peer} (pid {pid}) died")
        if now >= deadline:
            raise SharedMemoryError(
                f"local rank {peer} did not reach the shared-memory barrier within {self._timeout_s} s"
            )

    def check_peer(self, peer: int, exited: bool = False) -> None:
        """Raise :class:`SharedMemoryError` naming the rank to blame if some local rank left (failed or shut
        down) or local rank ``peer`` died (``exited``: the caller knows it has, e.g. its memory is gone); the
        rank blamed is what this rank's leaving then tells the others."""
        self._check_peer(peer, time.monotonic(), float("inf"), exited)

    def check_peer_pid(self, pid: int) -> None:
        """:meth:`check_peer` for the local peer whose process is ``pid``, if one is: what a rank that cannot
        reach a peer's memory calls first, so that a peer that left or died is named as the cause."""
        for rank in range(self._size):
            if rank != self._me and self._words[self._word(rank, _PID)] == pid:
                self.check_peer(rank)
                return

    def peer_pids(self) -> list[int]:
        """The local peers' process ids (each rank writes its own when it joins; 0 for one not joined yet)."""
        return [self._words[self._word(rank, _PID)] for rank in range(self._size) if rank != self._me]

    def leave(self) -> None:
        """Mark this rank gone and wake every waiter, so peers fail at once instead of timing out."""
        if self._closed or self._seg.address == 0:
            return
        self._closed = True
        self._words[self._word(self._me, _STATE)] = _STATE_LEFT if self._cause is None else 2 + self._cause
        for rank in range(self._size):
            self._futex.wake(self._seg.address + 4 * self._word(rank, _COUNTER))
