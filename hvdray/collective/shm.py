"""Shared-memory segments for the ranks of one node, and the barrier they synchronise on.

A segment lives in ``/dev/shm`` under ``hvdray-<job tag>-<creator pid>-<random token>``: the job tag
is an HMAC of the job's secret, the token comes from the creator and reaches the other local ranks
through the job's private store, so no other process can guess the name. The file is created with
mode 0600 and unlinked as soon as every local rank has mapped it, so it disappears with the last
mapping even when every worker is killed; only a creator killed inside that short window can leave a
file behind, which :func:`remove_dead_creators_segments` (run by the next segment creation on the node)
and :func:`remove_job_segments` (for the executor, after the job's workers are gone) delete.

Ranks synchronise through per-rank sequence counters in the segment: a short spin, then a few hundred
checks that each give the core away (``sched_yield``: a peer or another thread of this process that is
ready to run gets the core at once, which matters when local ranks outnumber cores), then a Linux futex
wait on the counter word (the kernel wakes the waiter the moment the counter moves). A rank about to
sleep says so in its control block, and a rank that moves its counter makes the wake-up system call
only when a peer sleeps on it (waking a sleeping thread costs tens of microseconds in a VM). A peer
that died, left or failed turns into :class:`SharedMemoryError` within the timeout, never a hang.
"""

from __future__ import annotations

import _thread
import array
import ctypes
import glob
import hashlib
import hmac
import logging
import mmap
import os
import platform
import secrets
import sys
import time
from typing import NamedTuple, Optional

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
NAME_PREFIX = "hvdray-"
#: the per-rank control block: counter, pid and state words, one cache line per rank
CONTROL_STRIDE_BYTES = 64
HEADER_BYTES = 4096
_MAGIC = 0x68766472  # "hvdr"
_SEQ_MASK = 0xFFFFFFFF
_HALF_RANGE = 1 << 31
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
#: syscall numbers of futex(2); the counters' memory ordering also relies on x86-64's total store order
_SYS_FUTEX = {"x86_64": 202, "amd64": 202}
_LIVENESS_CHECK_S = 0.05


class SharedMemoryError(RuntimeError):
    """A local peer died, left or timed out while the node's ranks synchronised through shared memory."""


def unsupported_reason() -> Optional[str]:
    """Why this process cannot use the shared-memory transport, or None when it can."""
    if not sys.platform.startswith("linux"):
        return f"platform {sys.platform} is not Linux"
    if platform.machine().lower() not in _SYS_FUTEX:
        return f"CPU architecture {platform.machine()} is not x86-64"
    if not os.path.isdir(SHM_DIR) or not os.access(SHM_DIR, os.W_OK):
        return f"{SHM_DIR} is missing or not writable"
    return None


def job_tag(secret: bytes) -> str:
    """The part of every segment name that only holders of the job's secret can compute."""
    return hmac.new(secret, b"hvdray-shm-segment", hashlib.sha256).hexdigest()[:16]


def segment_path(name: str) -> str:
    """Where the segment called ``name`` lives in the file system."""
    return os.path.join(SHM_DIR, name)


def remove_job_segments(secret: bytes) -> list[str]:
    """Delete every segment file of the job with ``secret`` left on this node; returns the removed names.

    Segments are unlinked once mapped, so this only finds files whose creator died while the node's
    ranks were still attaching. The executor may call it on each node after the job's workers are gone.
    """
    return _remove(glob.glob(segment_path(f"{NAME_PREFIX}{job_tag(secret)}-*")))


def remove_dead_creators_segments(tag: str) -> list[str]:
    """Delete this job's segment files on this node whose creating process no longer runs."""
    stale = []
    for path in glob.glob(segment_path(f"{NAME_PREFIX}{tag}-*")):
        try:
            pid = int(os.path.basename(path).split("-")[2])
        except (IndexError, ValueError):
            continue
        if not process_alive(pid):
            stale.append(path)
    return _remove(stale)


def _remove(paths: list[str]) -> list[str]:
    removed = []
    for path in paths:
        try:
            os.unlink(path)
            removed.append(os.path.basename(path))
        except FileNotFoundError:
            pass
    if removed:
        log.info("removed stale shared-memory segment(s) %s", removed)
    return removed


def process_alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            state = stat.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    except OSError:
        return True  # cannot tell (another pid namespace's /proc): assume alive, the timeout still applies


class Segment:
    """A mapped shared-memory file: a header, one control block per local rank, then the data area."""

    def __init__(self, name: str, mapping: mmap.mmap, local_size: int, data_bytes: int, owner: bool) -> None:
        self.name = name
        self.local_size = local_size
        self.data_bytes = data_bytes
        self._map = mapping
        self._owner = owner
        self._linked = owner
        self.words = memoryview(mapping).cast("I")
        self._qwords = memoryview(mapping).cast("Q")
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(mapping))

    @staticmethod
    def total_bytes(data_bytes: int) -> int:
        """The segment's size: the header and control blocks, then ``data_bytes`` of data."""
        return HEADER_BYTES + data_bytes

    @classmethod
    def create(cls, tag: str, local_size: int, data_bytes: int) -> "Segment":
        """Create and map a fresh segment under an unguessable name (mode 0600, O_EXCL)."""
        if CONTROL_STRIDE_BYTES * (local_size + 1) > HEADER_BYTES:
            raise ValueError(f"local_size {local_size} does not fit in a shared-memory header")
        remove_dead_creators_segments(tag)
        name = f"{NAME_PREFIX}{tag}-{os.getpid()}-{secrets.token_hex(8)}"
        path = segment_path(name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.fchmod(fd, 0o600)
            os.ftruncate(fd, cls.total_bytes(data_bytes))
            os.posix_fallocate(fd, 0, cls.total_bytes(data_bytes))  # ENOSPC now, not SIGBUS on first touch
            mapping = _map(fd, cls.total_bytes(data_bytes))
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        segment = cls(name, mapping, local_size, data_bytes, owner=True)
        segment.words[1] = local_size
        segment.words[2] = data_bytes // 4096
        segment.words[0] = _MAGIC
        return segment

    @classmethod
    def attach(cls, name: str, local_size: int, data_bytes: int) -> "Segment":
        """Map the segment another local rank created; checks it was made for this group."""
        if not name.startswith(NAME_PREFIX) or "/" in name:
            raise ValueError(f"not an hvdray segment name: {name!r}")
        fd = os.open(segment_path(name), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            if os.fstat(fd).st_size != cls.total_bytes(data_bytes):
                raise SharedMemoryError(f"shared-memory segment {name} has an unexpected size")
            mapping = _map(fd, cls.total_bytes(data_bytes))
        finally:
            os.close(fd)
        segment = cls(name, mapping, local_size, data_bytes, owner=False)
        if tuple(segment.words[0:3]) != (_MAGIC, local_size, data_bytes // 4096):
            segment.close()
            raise SharedMemoryError(f"shared-memory segment {name} was made for another group")
        return segment

    def unlink(self) -> None:
        """Remove the name from /dev/shm; the memory lives on until the last rank unmaps it."""
        if self._linked:
            self._linked = False
            try:
                os.unlink(segment_path(self.name))
            except FileNotFoundError:
                pass

    def publish_tensor(self, local_rank: int, place: Optional["TensorPlace"]) -> None:
        """Say in ``local_rank``'s control block where its next op's tensor lives (None: private memory).
        Peers read it after the op's first barrier (:meth:`published_tensor`)."""
        at = _token_qword(local_rank)
        if place is None:
            self._qwords[at] = 0
        else:
            self._qwords[at + 1 : at + 6] = array.array("Q", place)
            self._qwords[at] = 1

    def published_tensor(self, local_rank: int) -> Optional["TensorPlace"]:
        """What ``local_rank`` last published with :meth:`publish_tensor`."""
        at = _token_qword(local_rank)
        if not self._qwords[at]:
            return None
        return TensorPlace(*self._qwords[at + 1 : at + 6])

    def buffer(self) -> memoryview:
        """The data area (after the header), for tensors that view the shared memory."""
        return memoryview(self._map)[HEADER_BYTES:]

    def close(self) -> None:
        """Unmap (and, for the creator, unlink if still linked). Views into the data must be gone."""
        if self._owner:
            self.unlink()
        if self._map is None:
            return
        self.words.release()
        self._qwords.release()
        self.address = 0
        mapping, self._map = self._map, None
        try:
            mapping.close()
        except BufferError:  # a tensor still views the memory: the mapping goes with the last reference
            log.debug("shared-memory segment %s still viewed; unmapped when released", self.name)


class TensorPlace(NamedTuple):
    """Where a rank's tensor lives in a torch shared-memory storage: the owner's pid, the storage's
    file descriptor in that process and the file's inode (so that a reused descriptor is never taken
    for the storage), the tensor's byte offset in it and its size in bytes."""

    pid: int
    fd: int
    inode: int
    offset: int
    nbytes: int


def _token_qword(local_rank: int) -> int:
    """Index (in 8-byte words) of the tensor token in ``local_rank``'s control block: bytes 16-63 (the
    barrier's words take bytes 0-15)."""
    return (CONTROL_STRIDE_BYTES * (1 + local_rank) + 16) // 8


def map_peer_storage(place: TensorPlace) -> mmap.mmap:
    """Map the shared-memory storage a local peer described with ``place`` (through its descriptor in
    ``/proc/<pid>/fd``, which the kernel opens only for the same user). The mapping keeps the memory
    alive after the peer frees it; the caller drops it when the peer moves to another storage."""
    path = f"/proc/{place.pid}/fd/{place.fd}"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        raise SharedMemoryError(
            f"cannot open a local peer's shared tensor ({path}: {exc.strerror}); tensors in shared memory "
            "need every local rank to run as the same user with /proc readable"
        ) from exc
    try:
        info = os.fstat(fd)
        if info.st_ino != place.inode or info.st_size < place.offset + place.nbytes:
            raise SharedMemoryError(f"local peer pid {place.pid} replaced its shared tensor during the op")
        return _map(fd, info.st_size)
    finally:
        os.close(fd)


def _map(fd: int, length: int) -> mmap.mmap:
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    return mmap.mmap(fd, length, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)


class _Futex:
    """futex(2) on 32-bit words of a shared mapping (process-shared, so no FUTEX_PRIVATE_FLAG)."""

    def __init__(self) -> None:
        self._syscall = ctypes.CDLL(None, use_errno=True).syscall
        self._syscall.restype = ctypes.c_long
        self._number = ctypes.c_long(_SYS_FUTEX[platform.machine().lower()])

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


class NodeBarrier:
    """A reusable barrier of the local ranks over their counters in one :class:`Segment`.

    Sleeping and waking is a Dekker handshake on two words: a sleeper publishes whose counter it
    sleeps on, fences, then re-reads that counter (the futex call checks it once more in the kernel);
    a waker stores its counter, fences, then reads who sleeps on it. One of the two always sees the
    other's store, so either the sleeper does not sleep or the waker wakes it."""

    def __init__(self, segment: Segment, local_rank: int, timeout_s: float, spin: int, yields: int = 0) -> None:
        self._seg = segment
        self._words = segment.words
        self._me = local_rank
        self._size = segment.local_size
        self._timeout_s = timeout_s
        self._spin = spin
        self._yields = yields
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

    def _check_peer(self, peer: int, now: float, deadline: float) -> None:
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
            if not process_alive(pid):
                self._cause = peer
                raise SharedMemoryError(f"local rank {peer} (pid {pid}) died")
        if now >= deadline:
            raise SharedMemoryError(
                f"local rank {peer} did not reach the shared-memory barrier within {self._timeout_s} s"
            )

    def leave(self) -> None:
        """Mark this rank gone and wake every waiter, so peers fail at once instead of timing out."""
        if self._closed or self._seg.address == 0:
            return
        self._closed = True
        self._words[self._word(self._me, _STATE)] = _STATE_LEFT if self._cause is None else 2 + self._cause
        for rank in range(self._size):
            self._futex.wake(self._seg.address + 4 * self._word(rank, _COUNTER))
