"""Allreduce and reducescatter straight between the local ranks' tensors when every one lives in torch
shared memory.

When every local rank's tensor of a flat allreduce or a reducescatter lives in torch shared memory
(``share_memory_()``), the ranks say where in their control blocks (:meth:`Segment.publish_tensor`),
map each other's tensors (through ``/proc/<pid>/fd``) and skip the slots: in an allreduce each rank
sums its part from every rank's tensor and writes the sum into all of them (out of place: into its own
output); in a reducescatter each rank sums its own chunk from every rank's tensor into its output.

With ``share_reduced_tensors`` a private tensor that an allreduce or a reducescatter reduces again and
again (a gradient bucket, a metrics buffer, a sharded optimizer's gradients) gets there by itself: :class:`SharedMemoryAdoption` moves its storage into
shared memory the second time it is reduced, so from then on it takes this path instead of three
copies through the slots.

Outputs in shared memory help too, whatever the inputs: the output pool places the results of
out-of-place collectives in blocks of shared memory (:class:`SharedBlocks`), so that an out-of-place
allreduce writes each reduced part straight into every rank's output (:func:`allreduce_shared_outputs`)
and an allgather each rank's tensor (:func:`allgather_shared_outputs`).
"""

from __future__ import annotations

import mmap
import os
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Callable, Optional

import numpy as np
import torch
import torch.multiprocessing

from hvdray.collective.transport.reductions import reduce_in_order
from hvdray.collective.transport.shm.parts import REDUCE_BLOCK_BYTES, memmove, part_bounds
from hvdray.collective.transport.shm.segment import SharedMemoryError, TensorPlace, map_file

if TYPE_CHECKING:
    from hvdray.collective.transport.shm.node import CrossReduce, NodeCollectives
    from hvdray.collective.transport.strategy import Finish

#: how many shared tensor storages of each peer stay mapped between ops (a training loop's few buffers)
PEER_STORAGES_PER_RANK = 4
#: a tensor of this many bytes or more moves into shared memory when reduced again (share_reduced_tensors)
ADOPT_MIN_BYTES = 4 << 20
#: /dev/shm must keep this much free beside a tensor moved into it
SHM_HEADROOM_BYTES = 256 << 20
#: how many recently reduced storages are remembered to notice the second reduction of one
_RECENT_STORAGES = 16


def allreduce_shared_tensors(
    node: "NodeCollectives", flat: torch.Tensor, places: list[TensorPlace], reducer: Callable[..., torch.Tensor],
    cross: Optional["CrossReduce"], finish: Optional["Finish"] = None,
) -> None:
    """Every local rank's tensor lives in shared memory: no slots, no second barrier. Each rank
    reduces its part block by block (its own block plus that block of every peer's tensor) and
    writes the sum, still in the core's cache, into every peer's tensor; the ranks touch disjoint
    parts, so the only wait is the last barrier, after which every tensor holds the whole result.
    With ``cross`` the part is reduced whole, handed to it, then written to the peers. ``finish`` runs
    on each reduced block (after ``cross``) before it is written to the peers."""
    me, size, isz = node.local_rank, node.local_size, flat.element_size()
    views = _every_ranks_tensor(node, flat, places)
    peers = [view for rank, view in enumerate(views) if rank != me]
    bounds = part_bounds(flat.numel(), size, isz)
    lo, hi = bounds[me], bounds[me + 1]
    acc = flat[lo:hi]
    others = [peer[lo:hi] for peer in peers]
    step = max(1, REDUCE_BLOCK_BYTES // isz)
    for a in range(0, hi - lo, step):
        block = acc[a : a + step]
        reduce_in_order(reducer, block, [other[a : a + step] for other in others], block)
        if cross is None:
            if finish is not None:
                finish([block])
            for other in others:
                memmove(other.data_ptr() + a * isz, block.data_ptr(), block.numel() * isz)
    if cross is not None and hi > lo:
        cross(acc)
        if finish is not None:
            finish([acc])
        for other in others:
            memmove(other.data_ptr(), acc.data_ptr(), (hi - lo) * isz)
    node.barrier.wait()


def allreduce_shared_inputs(
    node: "NodeCollectives", out: torch.Tensor, source: torch.Tensor, places: list[TensorPlace],
    reducer: Callable[..., torch.Tensor], finish: Optional["Finish"] = None,
) -> None:
    """Out of place, every local rank's input in shared memory: each rank reduces the whole message
    straight from every rank's input into its own output, in local-rank order (so every rank's result
    is bit-identical), and writes nothing to the peers. With two ranks that is one add of the message,
    what the memory ideal costs when copy and add run at one speed; the last barrier keeps every input
    unchanged until all ranks have read it."""
    inputs = _every_ranks_tensor(node, source, places)
    reduce_in_order(reducer, inputs[0], inputs[1:], out)
    if finish is not None:
        finish([out])
    node.barrier.wait()


def allreduce_shared_outputs(
    node: "NodeCollectives", out: torch.Tensor, source: torch.Tensor, places: list[TensorPlace],
    pieces: list[tuple[int, int]], half: int, expose: Callable[[tuple[int, int], int], None],
    reducer: Callable[..., torch.Tensor], finish: Optional["Finish"] = None,
) -> None:
    """Out of place, the inputs private but every local rank's output in shared memory (the output pool's
    outputs, when the node's ranks share memory). The inputs go through the slots as on the copying way
    (``expose(piece, half)``: the parts the peers reduce; the first piece's is in the slots already, in
    ``half``), but each rank reduces its part straight into its own output, block by block (``finish`` on
    each while in the core's cache), and writes each block into the peers' outputs from there: no copy
    into the slot to publish it, nothing to collect afterwards, and one barrier per piece (the next
    piece's exposing barrier is the last one's end) plus the last. The reduction order is the copying
    way's, so the results are the same bit for bit."""
    me, size, isz = node.local_rank, node.local_size, out.element_size()
    others = [tensor for rank, tensor in enumerate(_every_ranks_tensor(node, out, places)) if rank != me]
    step = max(1, REDUCE_BLOCK_BYTES // isz)
    for i, (start, stop) in enumerate(pieces):
        if i:
            half = node.next_half()
            expose((start, stop), half)
            node.barrier.wait()
        slots = node.slot_views(out.dtype)[half]
        peers = [slots[peer] for peer in range(size) if peer != me]
        bounds = part_bounds(stop - start, size, isz)
        for a in range(bounds[me], bounds[me + 1], step):  # in the piece: the slots hold pieces
            b = min(a + step, bounds[me + 1])
            acc = reduce_in_order(reducer, source[start + a : start + b], [peer[a:b] for peer in peers],
                                  out[start + a : start + b])
            if finish is not None:
                finish([acc])
            for other in others:
                memmove(other.data_ptr() + (start + a) * isz, acc.data_ptr(), (b - a) * isz)
    node.barrier.wait()


def allgather_shared_outputs(
    node: "NodeCollectives", flat: torch.Tensor, out: torch.Tensor, places: list[TensorPlace],
) -> None:
    """Every local rank's allgather output in shared memory: each rank writes its ``flat`` (already in
    its own ``out``) straight into every peer's output, the one write of the result the memory ideal
    counts, with no slots; the last barrier: every output is whole."""
    me, nbytes = node.local_rank, flat.numel() * flat.element_size()
    for rank, other in enumerate(_every_ranks_tensor(node, out, places)):
        if rank != me:
            memmove(other.data_ptr() + me * nbytes, flat.data_ptr(), nbytes)
    node.barrier.wait()


def reducescatter_shared_inputs(
    node: "NodeCollectives", rows: torch.Tensor, out: torch.Tensor, places: list[TensorPlace],
    reducer: Callable[..., torch.Tensor],
) -> None:
    """Every local rank's chunks in shared memory (``rows``: one chunk per local rank): each rank
    reduces its own chunk straight from every rank's tensor into ``out``, its own chunk first and then
    the peers' in local-rank order, as the slots' way does (so a tensor that moves into shared memory
    gives bit-identical results). One read of every copy of its chunk and one write of it: the memory
    ideal. The last barrier keeps every input unchanged until all ranks have read it."""
    me = node.local_rank
    inputs = _every_ranks_tensor(node, rows.view(-1), places)
    theirs = [tensor.view(rows.shape)[me] for rank, tensor in enumerate(inputs) if rank != me]
    reduce_in_order(reducer, rows[me], theirs, out)
    node.barrier.wait()


def _every_ranks_tensor(node: "NodeCollectives", mine: torch.Tensor, places: list[TensorPlace]) -> list[torch.Tensor]:
    """Every local rank's shared tensor in rank order (``mine`` for this rank, the peers' mapped), after
    checking that all have ``mine``'s size."""
    me, nbytes = node.local_rank, mine.numel() * mine.element_size()
    tensors = []
    for rank, place in enumerate(places):
        if place.nbytes != nbytes:
            raise SharedMemoryError(
                f"local rank {rank}'s tensor has {place.nbytes} bytes, local rank {me}'s {nbytes}"
            )
        tensors.append(mine if rank == me else node.peer_tensors.view(place, mine.dtype))
    return tensors


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
        self._recent: OrderedDict[tuple[int, int], None] = OrderedDict()
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
        key = (flat.data_ptr(), nbytes)
        if key in self._recent:
            del self._recent[key]
            return True
        self._recent[key] = None
        while len(self._recent) > _RECENT_STORAGES:
            self._recent.popitem(last=False)
        return False

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
        nbytes = flat.numel() * flat.element_size()
        if place is None or nbytes > place.nbytes:
            return None
        return place._replace(nbytes=nbytes)

    def __len__(self) -> int:
        return len(self._places)


#: this process's registered blocks (one address space, one registry)
SHARED_BLOCKS = SharedBlocks()


def shared_place(flat: torch.Tensor) -> Optional[TensorPlace]:
    """Where ``flat`` lives when its storage is in torch's shared memory (``share_memory_()``, torch's
    default ``file_descriptor`` sharing strategy) or it starts a block of :data:`SHARED_BLOCKS`, else
    None. Under the ``file_system`` strategy asking for a descriptor would make torch move the storage,
    so those tensors take the copies."""
    if not flat.numel():
        return None
    storage = flat.untyped_storage()
    if not storage.is_shared():
        return SHARED_BLOCKS.place(flat) if SHARED_BLOCKS else None
    if torch.multiprocessing.get_sharing_strategy() != "file_descriptor":
        return None
    try:
        fd, _ = storage._share_fd_cpu_()
        inode = os.fstat(fd).st_ino
    except (RuntimeError, OSError):
        return None
    return TensorPlace(os.getpid(), fd, inode, flat.data_ptr() - storage.data_ptr(), flat.numel() * flat.element_size())


