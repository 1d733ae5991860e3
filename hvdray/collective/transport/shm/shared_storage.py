"""Where tensors live in torch shared memory, for the collectives that go straight between them
(``shared_tensors.py``).

- :func:`shared_place`: where a tensor lives, when its storage is in torch shared memory
  (``share_memory_()``) or it starts a block of :data:`SHARED_BLOCKS`; what a rank publishes in its
  control block (:meth:`Segment.publish_tensor`) so that its peers can find it.
- :class:`SharedBlocks`: blocks of torch shared memory that the output pool hands out as the results
  of out-of-place collectives, and that :class:`ScratchBlocks` keeps for in-place allreduces.
- :func:`map_peer_storage` and :class:`PeerTensors`: a local peer's storage mapped through
  ``/proc/<pid>/fd``, and the few that stay mapped between ops.
- :class:`SharedMemoryAdoption`: moving a private tensor that is reduced again and again into shared
  memory (``share_reduced_tensors``); :class:`RecentStorages`: noticing a storage's second reduction
  (for it and ``shared_pages.py``).
- :func:`room_in_shared_memory`: whether ``/dev/shm`` keeps room for more.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from collections import OrderedDict
from typing import Callable, Optional

import numpy as np
import torch
import torch.multiprocessing
from torch.multiprocessing.reductions import StorageWeakRef

from hvdray.collective.transport.shm.segment import SharedMemoryError, TensorPlace, is_place_of, map_file

#: how many shared tensor storages of each peer stay mapped between ops (a training loop's few buffers:
#: two pooled outputs of a size, a scratch block or two, a shared tensor)
PEER_STORAGES_PER_RANK = 6
#: how often, at most, the mapped storages are checked for ones their peers have freed
RELEASE_CHECK_S = 1.0
#: a tensor of this many bytes or more moves into shared memory when reduced again (share_reduced_tensors)
ADOPT_MIN_BYTES = 4 << 20
#: /dev/shm must keep this much free beside a tensor moved into it
SHM_HEADROOM_BYTES = 256 << 20
#: how many recently reduced storages are remembered to notice the second reduction of one (a loop over more
#: large tensors than this never reduces one a second time while it is remembered)
_RECENT_STORAGES = 64


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
        if not is_place_of(place, info) or info.st_size < place.offset + place.nbytes:
            raise SharedMemoryError(f"local peer pid {place.pid} replaced its shared tensor during the op")
        return map_file(fd, info.st_size)
    finally:
        os.close(fd)


class PeerTensors:
    """The local peers' shared tensor storages this rank has mapped, by (pid, device, inode), least recently
    used first. A mapping keeps its memory alive after the peer frees the tensor, so entries whose
    peer no longer holds that storage are dropped whenever a new one is mapped and, between ops, within
    :data:`RELEASE_CHECK_S` (:meth:`drop_released_now_and_then`); at most ``capacity`` stay. ``generation``
    counts the drops: what holds a view of a mapping to use it again lets it go when that moves, so that the
    memory goes back to ``/dev/shm``."""

    def __init__(self, capacity: int, check_peer_pid: Callable[[int], None]) -> None:
        self.capacity = capacity
        self.generation = 0
        #: raises the error that names the cause when the peer of that pid (or another) left or died
        self._check_peer_pid = check_peer_pid
        self._maps: OrderedDict[tuple[int, int], tuple[TensorPlace, torch.Tensor]] = OrderedDict()
        self._next_check = 0.0

    def view(self, place: TensorPlace, dtype: torch.dtype) -> torch.Tensor:
        """The peer's tensor described by ``place``, as a 1-D tensor of ``dtype`` on the mapped memory."""
        key = (place.pid, place.device, place.inode)
        entry = self._maps.get(key)
        if entry is None:
            self._drop_released()
            try:
                mapping = map_peer_storage(place)
            except SharedMemoryError:
                self._check_peer_pid(place.pid)  # a peer that left (its descriptor closed) or died: name it
                raise
            storage = torch.frombuffer(mapping, dtype=torch.uint8)
            entry = self._maps[key] = (place, storage)
            while len(self._maps) > self.capacity:
                self._maps.popitem(last=False)
                self.generation += 1
        else:
            self._maps.move_to_end(key)
        return entry[1][place.offset : place.offset + place.nbytes].view(dtype)

    def drop_released_now_and_then(self) -> None:
        """After an op, while storages are mapped: drop those their peers no longer hold, at most once per
        :data:`RELEASE_CHECK_S` (a ``stat`` per mapping), so that a block a peer has freed (an output the
        pool let go, a tensor deleted) gives its memory back to ``/dev/shm`` soon even when no new mapping
        comes: the engine's ticks, idle ones too, run an op at least every ``idle_cycle_time_ms``."""
        now = time.monotonic()
        if now >= self._next_check:
            self._next_check = now + RELEASE_CHECK_S
            self._drop_released()

    def _drop_released(self) -> None:
        for key, (place, _) in list(self._maps.items()):
            try:
                held = is_place_of(place, os.stat(f"/proc/{place.pid}/fd/{place.fd}"))
            except OSError:
                held = False
            if not held:
                del self._maps[key]
                self.generation += 1

    def __len__(self) -> int:
        return len(self._maps)

    def clear(self) -> None:
        self._maps.clear()
        self.generation += 1


class SharedMemoryAdoption:
    """Moves a private tensor that an allreduce reduces a second time (in place, or as an out-of-place
    input), or that a reducescatter reduces a second time (its input), into torch shared memory, when
    ``share_reduced_tensors`` asks for it.

    ``Tensor.share_memory_()`` copies the storage into shared memory once and keeps every tensor and
    view on it valid; from the next reduction on, the local ranks reduce straight between each other's
    tensors (:func:`allreduce_shared_tensors`). Only a tensor that is its whole storage, allocated by
    torch (not memory that numpy, DLPack or a buffer also sees), of :data:`ADOPT_MIN_BYTES` or more,
    under torch's ``file_descriptor`` sharing strategy, while ``/dev/shm`` has room for it and
    :data:`SHM_HEADROOM_BYTES` more, and where this rank can open its local peers' descriptors. Each
    rank decides for itself; an op where some ranks' tensors are shared and some not takes the copies,
    as before. As when torch.multiprocessing sends a tensor, a raw alias taken before the move (an
    array from ``tensor.numpy()``, a ``data_ptr()``) keeps the old memory, and torch 2.x crashes when a
    tensor in shared memory is grown (``resize_``): hence the ``share_reduced_tensors`` setting, off by
    default."""

    def __init__(self, enabled: bool, peer_pids: Callable[[], list[int]], shm_dir: str = "/dev/shm") -> None:
        self.enabled = enabled
        self.adopted = 0  # tensors moved into shared memory (for tests and benchmarks)
        self._peer_pids = peer_pids
        self._shm_dir = shm_dir
        self._recent = RecentStorages()
        self._peers_open: Optional[bool] = None

    def place(self, flat: torch.Tensor) -> Optional[TensorPlace]:
        """Where ``flat`` lives in shared memory, after moving it there if it is worth it; None if private."""
        place = shared_place(flat)
        if place is not None or not self.enabled or not self._second_reduction(flat):
            return place
        if not self._room_for(flat.numel() * flat.element_size()) or not self._can_open_peers():
            return None
        flat.share_memory_()
        self.adopted += 1
        return shared_place(flat)

    def _second_reduction(self, flat: torch.Tensor) -> bool:
        nbytes = flat.numel() * flat.element_size()
        storage = flat.untyped_storage()
        if nbytes < ADOPT_MIN_BYTES or storage.nbytes() != nbytes or storage.data_ptr() != flat.data_ptr():
            return False
        if not storage.resizable():  # memory torch did not allocate (numpy, DLPack, a buffer): aliased elsewhere
            return False
        if torch.multiprocessing.get_sharing_strategy() != "file_descriptor":
            return False
        return self._recent.seen_before(flat)

    def _room_for(self, nbytes: int) -> bool:
        return room_in_shared_memory(nbytes, self._shm_dir)

    def _can_open_peers(self) -> bool:
        if self._peers_open is None:
            pids = self._peer_pids()
            if not all(pids):  # a peer that has not joined yet: ask again at the next reduction
                return False
            try:
                for pid in pids:
                    os.listdir(f"/proc/{pid}/fd")
                self._peers_open = True
            except OSError:
                self._peers_open = False
        return self._peers_open


class RecentStorages:
    """The storages reduced lately, to notice a storage's second reduction: by the tensor's address and
    size, and the storage itself (weakly), so that a new tensor at a freed one's address is not taken
    for it. The last :data:`_RECENT_STORAGES` are kept."""

    def __init__(self) -> None:
        self._seen: OrderedDict[tuple[int, int], StorageWeakRef] = OrderedDict()

    def seen_before(self, flat: torch.Tensor) -> bool:
        """True at the second reduction of ``flat``'s storage (as a tensor of this address and size), which
        starts the count again; else remembers this one."""
        key = (flat.data_ptr(), flat.numel() * flat.element_size())
        storage = StorageWeakRef(flat.untyped_storage())
        seen = self._seen.pop(key, None)
        if seen is not None and seen == storage and not seen.expired():
            return True
        self._seen[key] = storage
        while len(self._seen) > _RECENT_STORAGES:
            self._seen.popitem(last=False)
        return False


def room_in_shared_memory(nbytes: int, shm_dir: str = "/dev/shm") -> bool:
    """Whether ``shm_dir`` keeps room for ``nbytes`` more and :data:`SHM_HEADROOM_BYTES` beside them."""
    try:
        fs = os.statvfs(shm_dir)
    except OSError:
        return False
    return fs.f_bavail * fs.f_frsize >= nbytes + SHM_HEADROOM_BYTES


class SharedBlocks:
    """Blocks of torch shared memory that this process hands out as ordinary tensors (the output pool's
    outputs, over numpy arrays), by address: :func:`shared_place` finds a tensor that starts at one, so
    that the node's ranks read each other's outputs directly although torch does not count those
    tensors' storages as shared. Any thread may allocate and release."""

    def __init__(self) -> None:
        self._places: dict[int, TensorPlace] = {}
        self._lock = threading.Lock()

    def allocate(self, nbytes: int, shm_dir: str = "/dev/shm") -> Optional[np.ndarray]:
        """A new block of ``nbytes`` in torch shared memory, as a byte array that keeps it alive, and
        registered until :meth:`release`; None under the ``file_system`` sharing strategy, or while
        ``shm_dir`` lacks room for it and :data:`SHM_HEADROOM_BYTES` more."""
        if torch.multiprocessing.get_sharing_strategy() != "file_descriptor" or not room_in_shared_memory(
            nbytes, shm_dir
        ):
            return None
        try:
            tensor = torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_shared(nbytes))
        except RuntimeError:  # /dev/shm filled up meanwhile, or no descriptor left
            return None
        place = shared_place(tensor)
        if place is None:
            return None
        block = tensor.numpy()  # holds the tensor, and so the storage and its descriptor
        with self._lock:
            self._places[block.ctypes.data] = place
        return block

    def release(self, block: np.ndarray) -> None:
        """Forget ``block`` (before it is freed): its memory may come back as anything."""
        with self._lock:
            self._places.pop(block.ctypes.data, None)

    def place(self, flat: torch.Tensor) -> Optional[TensorPlace]:
        """Where ``flat`` lives, when it starts at a registered block and lies inside it."""
        place = self._places.get(flat.data_ptr())
        if place is None:
            return None
        nbytes = flat.numel() * flat.element_size()
        if nbytes == place.nbytes:  # a whole block: an output of the pool, every op
            return place
        return None if nbytes > place.nbytes else place._replace(nbytes=nbytes)

    def __len__(self) -> int:
        return len(self._places)


#: this process's registered blocks (one address space, one registry)
SHARED_BLOCKS = SharedBlocks()


class ScratchBlocks:
    """Blocks of shared memory (:data:`SHARED_BLOCKS`) in which an in-place allreduce of a private
    tensor exposes the parts its peers reduce, and receives their sums: one block per message size, up
    to ``limit_bytes`` in all. A size that does not fit gets no block (its ops take the slots) unless
    blocks unused for ``stale_after`` requests make room: a loop of more sizes than fit keeps the blocks
    it has instead of making and mapping fresh ones at every op. Used by one thread at a time (the
    node's ops)."""

    def __init__(self, limit_bytes: int, stale_after: int = 64) -> None:
        self.limit_bytes = limit_bytes
        self.stale_after = stale_after
        self._blocks: dict[int, tuple[np.ndarray, int]] = {}  # size -> its block, the request it last served
        self._bytes = 0
        self._requests = 0

    def get(self, nbytes: int) -> Optional[np.ndarray]:
        """This size's block (made on first use), or None when it does not fit (above), or ``/dev/shm``
        lacks room for it (:meth:`SharedBlocks.allocate`)."""
        self._requests += 1
        entry = self._blocks.get(nbytes)
        if entry is not None:
            self._blocks[nbytes] = (entry[0], self._requests)
            return entry[0]
        if nbytes > self.limit_bytes:
            return None
        for size, (_, last) in list(self._blocks.items()):
            if self._bytes + nbytes <= self.limit_bytes:
                break
            if self._requests - last > self.stale_after:
                self._drop(size)
        if self._bytes + nbytes > self.limit_bytes:
            return None
        block = SHARED_BLOCKS.allocate(nbytes)
        if block is not None:
            self._blocks[nbytes] = (block, self._requests)
            self._bytes += nbytes
        return block

    def _drop(self, nbytes: int) -> None:
        block, _ = self._blocks.pop(nbytes)
        SHARED_BLOCKS.release(block)
        self._bytes -= nbytes

    def clear(self) -> None:
        """Give every block back (its descriptor closes once nothing views it)."""
        for size in list(self._blocks):
            self._drop(size)

    def __len__(self) -> int:
        return len(self._blocks)


def shared_place(flat: torch.Tensor) -> Optional[TensorPlace]:
    """Where ``flat`` lives when its storage is in torch's shared memory (``share_memory_()``, torch's
    default ``file_descriptor`` sharing strategy) or it starts a block of :data:`SHARED_BLOCKS`, else
    None. Under the ``file_system`` strategy asking for a descriptor would make torch move the storage,
    so those tensors take the copies."""
    if not flat.numel():
        return None
    if SHARED_BLOCKS:  # first: an output of the pool, every out-of-place op (its storage is not torch's shared one)
        place = SHARED_BLOCKS.place(flat)
        if place is not None:
            return place
    storage = flat.untyped_storage()
    if not storage.is_shared():
        return None
    if torch.multiprocessing.get_sharing_strategy() != "file_descriptor":
        return None
    try:
        fd, _ = storage._share_fd_cpu_()
        info = os.fstat(fd)
    except (RuntimeError, OSError):
        return None
    return TensorPlace(os.getpid(), fd, info.st_dev, info.st_ino, flat.data_ptr() - storage.data_ptr(),
                       flat.numel() * flat.element_size())


