"""The shared-memory segment of one node's ranks: its name, creation, mapping and cleanup.

A segment lives in ``/dev/shm`` under ``hvdray-<job tag>-<creator pid>-<random token>``: the job tag
is an HMAC of the job's secret, the token comes from the creator and reaches the other local ranks
through the job's private store, so no other process can guess the name. The file is created with
mode 0600 and unlinked as soon as every local rank has mapped it, so it disappears with the last
mapping even when every worker is killed; only a creator killed inside that short window can leave a
file behind, which :func:`remove_dead_creators_segments` (run by the next segment creation on the node)
deletes: at once in the same job, after an hour untouched for another job's.

Layout: a header (magic and sizes), one control block per local rank (the barrier's words, see
``barrier.py``, then where the rank's tensor lives when it is in shared memory, see
:meth:`Segment.publish_tensor`), then the data area (``node.py``'s slots).
"""

from __future__ import annotations

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
from typing import NamedTuple, Optional, Union

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
NAME_PREFIX = "hvdray-"
#: the per-rank control block: counter, pid and state words, one cache line per rank
CONTROL_STRIDE_BYTES = 64
#: how long another job's segment whose creator is gone must lie untouched before a sweep deletes it
OTHER_JOBS_STALE_S = 3600.0
HEADER_BYTES = 4096
#: what a rank publishes for its op (:meth:`Segment.publish_tensor`): nothing in shared memory, its input
#: there, only its output there, or where its input and output lie in its own memory (for the peers to
#: read and write through the kernel: ``cross_memory.py``), or where its tensor's whole pages lie in shared
#: memory (``shared_pages.py``). An allreduce's input in shared memory, or its whole pages there, is
#: published as one the peers write into (in place: ``SHARED_INPUT``, ``SHARED_PAGES``) or one they only read
#: (an out-of-place input: ``SHARED_SOURCE``, ``SOURCE_PAGES``), so that ranks that run one op in place and
#: out of place never meet on a way that would write into an out-of-place input
PRIVATE, SHARED_INPUT, SHARED_OUTPUT, CROSS_MEMORY, SHARED_PAGES, SHARED_SOURCE, SOURCE_PAGES = range(7)
PAGE_BYTES = mmap.PAGESIZE
_MAGIC = 0x68766472  # "hvdr"
#: syscall numbers of futex(2); the counters' memory ordering also relies on x86-64's total store order
SYS_FUTEX = {"x86_64": 202, "amd64": 202}


class SharedMemoryError(RuntimeError):
    """A local peer died, left or timed out while the node's ranks synchronised through shared memory."""


def unsupported_reason() -> Optional[str]:
    """Why this process cannot use the shared-memory transport, or None when it can."""
    if not sys.platform.startswith("linux"):
        return f"platform {sys.platform} is not Linux"
    if platform.machine().lower() not in SYS_FUTEX:
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


def remove_dead_creators_segments(tag: str) -> list[str]:
    """Delete segment files on this node whose creating process no longer runs: this job's at once,
    another job's once nothing has written to it for :data:`OTHER_JOBS_STALE_S` (a job that ended, or
    whose creator died, before its local ranks had mapped it would otherwise leave it in memory for good;
    the age keeps a live job's file safe where its creator's pid cannot be seen from here)."""
    stale = []
    now = time.time()
    for path in glob.glob(segment_path(f"{NAME_PREFIX}*")):
        parts = os.path.basename(path).split("-")
        try:
            pid = int(parts[2])
        except (IndexError, ValueError):
            continue
        if process_alive(pid):
            continue
        try:
            idle_s = now - os.stat(path).st_mtime
        except FileNotFoundError:
            continue
        if parts[1] == tag or idle_s > OTHER_JOBS_STALE_S:
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
            mapping = map_file(fd, cls.total_bytes(data_bytes))
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
            mapping = map_file(fd, cls.total_bytes(data_bytes))
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

    def publish_tensor(
        self, local_rank: int, place: Optional[Union["TensorPlace", "PeerAddresses", "PagesPlace"]], what: int,
    ) -> None:
        """Say in ``local_rank``'s control block where its next op's tensor lives: ``place`` is its input
        (:data:`SHARED_INPUT`; out of place :data:`SHARED_SOURCE`) or its output (:data:`SHARED_OUTPUT`)
        in shared memory, the addresses of its input and output in its own memory (:data:`CROSS_MEMORY`),
        or where its tensor's whole pages lie in shared memory (:data:`SHARED_PAGES`; out of place
        :data:`SOURCE_PAGES`); None: private, and neither.
        Peers read it after the op's first barrier (:meth:`published_tensor`)."""
        at = _token_qword(local_rank)
        if place is None:
            self._qwords[at] = PRIVATE
        else:
            words = tuple(place) if isinstance(place, PeerAddresses) else place_words(place)
            self._qwords[at + 1 : at + 1 + len(words)] = array.array("Q", words)
            self._qwords[at] = what

    def published_tensor(
        self, local_rank: int,
    ) -> tuple[int, Optional[Union["TensorPlace", "PeerAddresses", "PagesPlace"]]]:
        """What ``local_rank`` last published with :meth:`publish_tensor`: which tensor, and where."""
        at = _token_qword(local_rank)
        what = self._qwords[at]
        if what == PRIVATE:
            return PRIVATE, None
        if what == CROSS_MEMORY:
            return what, PeerAddresses(*self._qwords[at + 1 : at + 4])
        return what, place_from_words(PagesPlace if what == SHARED_PAGES or what == SOURCE_PAGES else TensorPlace,
                                      self._qwords[at + 1 : at + 1 + PLACE_WORDS])

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
    file descriptor in that process and the file's device and inode (its identity: a reused descriptor is
    never taken for the storage, nor a file of another file system whose inode has the same number, as
    ``/dev/shm``'s and ``memfd_create``'s files often do), the tensor's byte offset in it and its size in
    bytes."""

    pid: int
    fd: int
    device: int
    inode: int
    offset: int
    nbytes: int


class PeerAddresses(NamedTuple):
    """Where a rank's allreduce reads its data and writes its result in its own address space, and the
    message's size in bytes: what the peers read and write through the kernel (``cross_memory.py``)."""

    source: int
    output: int
    nbytes: int


class PagesPlace(NamedTuple):
    """Where a rank's private tensor's whole pages lie in shared memory (``shared_pages.py``): the owner's
    pid, the file's descriptor in that process, device and inode (as in :class:`TensorPlace`), ``head``: how
    many bytes of the tensor lie before its first page boundary (where the file starts), and the tensor's
    size in bytes."""

    pid: int
    fd: int
    device: int
    inode: int
    head: int
    nbytes: int

    @property
    def interior(self) -> int:
        """How many bytes of the tensor lie in the file: its whole pages."""
        return max(0, (self.nbytes - self.head) // PAGE_BYTES * PAGE_BYTES)

    def span(self, start: int, stop: int) -> TensorPlace:
        """The tensor's bytes ``start:stop``, which must lie in its whole pages, as a place in the file."""
        if not self.head <= start <= stop <= self.head + self.interior:
            raise ValueError(f"bytes {start}:{stop} do not lie in the whole pages of the tensor ({self})")
        return TensorPlace(self.pid, self.fd, self.device, self.inode, start - self.head, stop - start)


#: the 64-bit words a :class:`TensorPlace` or a :class:`PagesPlace` takes where a rank publishes it (its pid and
#: descriptor share one: a pid is below 2**32 and a descriptor below 2**31)
PLACE_WORDS = 5


def place_words(place: "TensorPlace | PagesPlace") -> tuple[int, ...]:
    """``place`` as its :data:`PLACE_WORDS` words (:func:`place_from_words` reads them back)."""
    return (place.pid << 32 | place.fd, *place[2:])


def place_from_words(kind: "type[TensorPlace] | type[PagesPlace]", words) -> "TensorPlace | PagesPlace":
    """The ``kind`` of place that :func:`place_words` wrote as ``words``."""
    return kind(words[0] >> 32, words[0] & 0xFFFFFFFF, *words[1:PLACE_WORDS])


def is_place_of(place: "TensorPlace | PagesPlace", info: os.stat_result) -> bool:
    """Whether ``info`` (an ``fstat`` of the file a place's descriptor opens now) is the place's file: its
    device and inode."""
    return info.st_dev == place.device and info.st_ino == place.inode


def check_published_sizes(
    published: "list[TensorPlace] | list[PeerAddresses] | list[PagesPlace]", local_rank: int, nbytes: int,
) -> None:
    """Raise :class:`SharedMemoryError` unless every local rank published a tensor of ``nbytes`` bytes,
    this rank's (``local_rank``) size: a direct way between the ranks' tensors must not read or write past one."""
    for rank, place in enumerate(published):
        if place.nbytes != nbytes:
            raise SharedMemoryError(
                f"local rank {rank}'s tensor has {place.nbytes} bytes, local rank {local_rank}'s {nbytes}")


def _token_qword(local_rank: int) -> int:
    """Index (in 8-byte words) of the tensor token in ``local_rank``'s control block: bytes 16-63 (the
    barrier's words take bytes 0-15)."""
    return (CONTROL_STRIDE_BYTES * (1 + local_rank) + 16) // 8


def map_file(fd: int, length: int) -> mmap.mmap:
    """Map ``length`` bytes of the open file ``fd`` shared and read-write, populated up front."""
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    return mmap.mmap(fd, length, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
