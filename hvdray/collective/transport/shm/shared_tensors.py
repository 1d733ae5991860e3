"""Allreduce straight between the local ranks' tensors when every one lives in torch shared memory.

When every local rank's tensor of a flat allreduce lives in torch shared memory (``share_memory_()``),
the ranks say where in their control blocks (:meth:`Segment.publish_tensor`), map each other's
tensors (through ``/proc/<pid>/fd``) and skip the slots: each rank sums its part from every rank's
tensor and writes the sum into all of them.
"""

from __future__ import annotations

import mmap
import os
from collections import OrderedDict
from typing import TYPE_CHECKING, Callable, Optional

import torch
import torch.multiprocessing

from hvdray.collective.transport.shm.parts import REDUCE_BLOCK_BYTES, memmove, part_bounds
from hvdray.collective.transport.shm.segment import SharedMemoryError, TensorPlace, map_file

if TYPE_CHECKING:
    from hvdray.collective.transport.shm.node import CrossReduce, NodeCollectives

#: how many shared tensor storages of each peer stay mapped between ops (a training loop's few buffers)
PEER_STORAGES_PER_RANK = 4


def allreduce_shared_tensors(
    node: "NodeCollectives", flat: torch.Tensor, places: list[TensorPlace], reducer: Callable[..., torch.Tensor],
    cross: Optional["CrossReduce"],
) -> None:
    """Every local rank's tensor lives in shared memory: no slots, no second barrier. Each rank
    reduces its part block by block (its own block plus that block of every peer's tensor) and
    writes the sum, still in the core's cache, into every peer's tensor; the ranks touch disjoint
    parts, so the only wait is the last barrier, after which every tensor holds the whole result.
    With ``cross`` the part is reduced whole, handed to it, then written to the peers."""
    me, size, isz = node.local_rank, node.local_size, flat.element_size()
    nbytes = flat.numel() * isz
    peers = []
    for rank, place in enumerate(places):
        if place.nbytes != nbytes:
            raise SharedMemoryError(
                f"local rank {rank}'s tensor has {place.nbytes} bytes, local rank {me}'s {nbytes}"
            )
        if rank != me:
            peers.append(node.peer_tensors.view(place, flat.dtype))
    bounds = part_bounds(flat.numel(), size, isz)
    lo, hi = bounds[me], bounds[me + 1]
    acc = flat[lo:hi]
    others = [peer[lo:hi] for peer in peers]
    step = max(1, REDUCE_BLOCK_BYTES // isz)
    for a in range(0, hi - lo, step):
        block = acc[a : a + step]
        for other in others:
            reducer(block, other[a : a + step], out=block)
        if cross is None:
            for other in others:
                memmove(other.data_ptr() + a * isz, block.data_ptr(), block.numel() * isz)
    if cross is not None and hi > lo:
        cross(acc)
        for other in others:
            memmove(other.data_ptr(), acc.data_ptr(), (hi - lo) * isz)
    node.barrier.wait()


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
        return map_file(fd, info.st_size)
    finally:
        os.close(fd)



class PeerTensors:
    """The local peers' shared tensor storages this rank has mapped, by (pid, inode), least recently
    used first. A mapping keeps its memory alive after the peer frees the tensor, so entries whose
    peer no longer holds that storage are dropped whenever a new one is mapped, and at most
    ``capacity`` stay."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._maps: OrderedDict[tuple[int, int], tuple[TensorPlace, torch.Tensor]] = OrderedDict()

    def view(self, place: TensorPlace, dtype: torch.dtype) -> torch.Tensor:
        """The peer's tensor described by ``place``, as a 1-D tensor of ``dtype`` on the mapped memory."""
        key = (place.pid, place.inode)
        entry = self._maps.get(key)
        if entry is None:
            self._drop_released()
            storage = torch.frombuffer(map_peer_storage(place), dtype=torch.uint8)
            entry = self._maps[key] = (place, storage)
            while len(self._maps) > self.capacity:
                self._maps.popitem(last=False)
        else:
            self._maps.move_to_end(key)
        return entry[1][place.offset : place.offset + place.nbytes].view(dtype)

    def _drop_released(self) -> None:
        for key, (place, _) in list(self._maps.items()):
            try:
                held = os.stat(f"/proc/{place.pid}/fd/{place.fd}").st_ino == place.inode
            except OSError:
                held = False
            if not held:
                del self._maps[key]

    def __len__(self) -> int:
        return len(self._maps)

    def clear(self) -> None:
        self._maps.clear()


def shared_place(flat: torch.Tensor) -> Optional[TensorPlace]:
    """Where ``flat`` lives when its storage is in torch's shared memory (``share_memory_()``, torch's
    default ``file_descriptor`` sharing strategy), else None. Under the ``file_system`` strategy asking
    for a descriptor would make torch move the storage, so those tensors take the copies."""
    storage = flat.untyped_storage()
    if not flat.numel() or not storage.is_shared():
        return None
    if torch.multiprocessing.get_sharing_strategy() != "file_descriptor":
        return None
    try:
        fd, _ = storage._share_fd_cpu_()
        inode = os.fstat(fd).st_ino
    except (RuntimeError, OSError):
        return None
    return TensorPlace(os.getpid(), fd, inode, flat.data_ptr() - storage.data_ptr(), flat.numel() * flat.element_size())


