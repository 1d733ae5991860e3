"""Allreduce, allgather and broadcast among the ranks of one node through a shared segment.

The data area holds two halves; each half has one slot per local rank. Every round of every op uses
the next half, and every round has a barrier between its writes and its reads, so a rank writing in
round k+2 knows that every rank has finished reading round k. Messages larger than a slot go in
several rounds, so the segment stays small whatever the tensor size.

Allreduce is a reduce-scatter then an all-gather inside one round: each rank copies the parts of its
piece that the others reduce into its slot, then reduces its own part (from its own tensor and the
peers' slots, all torch ops on tensors that view the shared memory, which run without the GIL),
optionally hands that reduced part to a cross-node allreduce, publishes it in its slot, and finally
copies the peers' reduced parts into its tensor. Every part is reduced exactly once, so every rank
ends with bit-identical results.

``allreduce_tensors`` does the same for a list of tensors that fits one slot (the engine's fused
gradients), without a staging buffer: the tensors are copied straight into views of the rank's slot,
each rank reduces its part in place in its own slot, and the results are copied straight from the
slots into the outputs. The views are built once per list of shapes and reused every step. When the
outputs are the inputs, a rank copies in only what its peers reduce and reduces its own part in place.

When every local rank's tensor of a flat allreduce lives in torch shared memory (``share_memory_()``),
the ranks say where in their control blocks, map each other's tensors (through ``/proc/<pid>/fd``) and
skip the slots: each rank sums its part from every rank's tensor and writes the sum into all of them.
"""

from __future__ import annotations

import ctypes
import logging
import operator
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional, Sequence

import torch
import torch.multiprocessing
from torch.distributed import ReduceOp

from hvdray.collective.shm import NodeBarrier, Segment, SharedMemoryError, TensorPlace, map_peer_storage

log = logging.getLogger(__name__)

#: parts start on 64-byte boundaries (whole cache lines) where the piece is large enough
_ALIGN_BYTES = 64
#: how often a barrier re-reads a peer's counter before it sleeps, when every local rank can have a core
#: of its own (then a peer usually arrives within the spin, and neither rank pays a sleep and a wake-up)
_SPIN_WHEN_CORES_FREE = 100
#: allreduces up to this size take the one-barrier path (each rank reduces the whole message)
SMALL_ALLREDUCE_BYTES = 32 << 10
#: then how many times it re-reads the counter and gives its core away (sched_yield) before it sleeps: a
#: peer that is ready to run gets the core without a sleep and a wake-up (small-message latency, above all
#: with more local ranks than cores: ``python -m hvdray.bench_shm --rows latency``)
_YIELDS_BEFORE_SLEEP = 200
#: flat messages go through the slots in pieces of at most this much per rank: on the 2-core development
#: machine 2-4 MiB pieces reduce 64 MB fastest with 2 and 4 local ranks, 16 MiB pieces take twice as long
#: with 4 (a larger shm_buffer_mb then only lets larger lists through ``allreduce_tensors``)
PIECE_BYTES = 4 << 20
#: in-place allreduce: a rank's part is reduced in blocks of this size, which stay in the core's cache
#: while the peers' blocks are added and the sum is written back to every peer
_REDUCE_BLOCK_BYTES = 512 << 10
#: how many shared tensor storages of each peer stay mapped between ops (a training loop's few buffers)
_PEER_STORAGES_PER_RANK = 4
#: how long ``close`` waits for a running op to notice that the group is closing
_CLOSE_WAIT_S = 2.0
#: tensor-list layouts (shapes and dtype) whose slot views ``allreduce_tensors`` keeps
_LAYOUT_CACHE_SIZE = 16

#: the elementwise torch op of each reduction (also the Gloo path's gather-then-reduce in communicator.py)
REDUCERS: dict[ReduceOp.RedOpType, Callable[..., torch.Tensor]] = {
    ReduceOp.SUM: torch.add,
    ReduceOp.PRODUCT: torch.mul,
    ReduceOp.MIN: torch.minimum,
    ReduceOp.MAX: torch.maximum,
    ReduceOp.BAND: torch.bitwise_and,
}

#: the in-place list form of each reduction, for fused tensors reduced straight in the caller's tensors
FOREACH_REDUCERS: dict[ReduceOp.RedOpType, Callable[..., None]] = {
    ReduceOp.SUM: torch._foreach_add_,
    ReduceOp.PRODUCT: torch._foreach_mul_,
    ReduceOp.MIN: torch._foreach_minimum_,
    ReduceOp.MAX: torch._foreach_maximum_,
}

CrossReduce = Callable[[torch.Tensor], None]
#: an elementwise in-place op on reduced data (averaging's scale), given a list of tensors
Finish = Callable[[list[torch.Tensor]], None]


def slot_bytes_for(buffer_bytes: int, local_size: int) -> int:
    """Bytes per rank slot when a node's segment may use ``buffer_bytes`` for data (two halves)."""
    return max(4096, (buffer_bytes // (2 * local_size)) // 4096 * 4096)


class NodeCollectives:
    """Collectives of one node's ranks over a shared :class:`Segment`; used by the engine thread only."""

    def __init__(self, segment: Segment, local_rank: int, timeout_s: float, slot_bytes: int) -> None:
        self.segment = segment
        self.local_rank = local_rank
        self.local_size = segment.local_size
        self.slot_bytes = slot_bytes
        self.rounds = 0
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        spin = _SPIN_WHEN_CORES_FREE if self.local_size <= cores else 0
        self._barrier = NodeBarrier(segment, local_rank, timeout_s, spin, _YIELDS_BEFORE_SLEEP)
        self._data: Optional[torch.Tensor] = torch.frombuffer(segment.buffer(), dtype=torch.uint8)
        self._base = self._data.data_ptr()
        self._slots: dict[torch.dtype, list[list[torch.Tensor]]] = {}
        self._layouts: OrderedDict[tuple, _TensorsLayout] = OrderedDict()
        self._peer_tensors = _PeerTensors(_PEER_STORAGES_PER_RANK * max(1, self.local_size - 1))
        self._failed: Optional[BaseException] = None
        self._op_lock = threading.Lock()

    # -- lifecycle --------------------------------------------------------------------------
    def close(self) -> None:
        """Leave the group (peers waiting on this rank fail at once) and unmap the segment.

        May be called from another thread than the ops': an op still waiting ends with an error, and
        the memory is unmapped only once no op runs (else it stays mapped until the process exits)."""
        self._barrier.leave()
        if not self._op_lock.acquire(timeout=_CLOSE_WAIT_S):
            log.warning("a shared-memory op is still running; its segment stays mapped")
            return
        try:
            self._slots.clear()
            self._layouts.clear()
            self._peer_tensors.clear()
            self._data = None
            self._base = 0
            self.segment.close()
        finally:
            self._op_lock.release()

    def _run(self, body: Callable[[], None]) -> None:
        """Run one op; any failure leaves the group so that the local peers fail fast too."""
        with self._op_lock:
            if self._failed is not None:
                raise SharedMemoryError(f"the node's shared-memory group failed earlier: {self._failed}")
            if self._data is None:
                raise SharedMemoryError("the node's shared-memory group was closed")
            try:
                body()
            except BaseException as exc:
                self._failed = exc
                self._barrier.leave()
                raise

    def _views(self, dtype: torch.dtype) -> list[list[torch.Tensor]]:
        """``[half][local_rank]`` -> that slot as a 1-D tensor of ``dtype`` (for the reductions)."""
        views = self._slots.get(dtype)
        if views is None:
            assert self._data is not None
            views = [
                [self._data[self._slot_offset(h, r) : self._slot_offset(h, r) + self.slot_bytes].view(dtype)
                 for r in range(self.local_size)]
                for h in range(2)
            ]
            self._slots[dtype] = views
        return views

    def _slot_offset(self, half: int, local_rank: int) -> int:
        return (half * self.local_size + local_rank) * self.slot_bytes

    def _next_half(self) -> int:
        self.rounds += 1
        return self.rounds & 1

    def _pieces(self, numel: int, itemsize: int) -> list[tuple[int, int]]:
        step = min(self.slot_bytes, PIECE_BYTES) // itemsize
        return [(start, min(start + step, numel)) for start in range(0, numel, step)]

    # -- ops ----------------------------------------------------------------------------------
    # Copies go through memmove on raw addresses (glibc's large-copy path beats a torch copy_, and
    # ctypes releases the GIL for it); reductions are torch ops on views of the slots.
    def allreduce(self, flat: torch.Tensor, op: ReduceOp.RedOpType, cross: Optional[CrossReduce] = None) -> None:
        """Reduce the contiguous 1-D ``flat`` in place across the local ranks (and ``cross``, if given,
        across nodes: it is called on this rank's reduced part of every piece)."""
        reducer = REDUCERS.get(op)
        if reducer is None:
            raise ValueError(f"op {op} is not supported by the shared-memory transport")
        if cross is None and flat.numel() * flat.element_size() <= min(SMALL_ALLREDUCE_BYTES, self.slot_bytes):
            self._run(lambda: self._allreduce_small(flat, reducer))
        else:
            self._run(lambda: self._allreduce(flat, reducer, cross))

    def _allreduce_small(self, flat: torch.Tensor, reducer: Callable[..., torch.Tensor]) -> None:
        """One round, one barrier: every rank publishes its whole message and reduces all of them, in
        rank order (so the results are bit-identical). Cheaper than two barriers for small messages."""
        half, nbytes, n = self._next_half(), flat.numel() * flat.element_size(), flat.numel()
        slots = self._views(flat.dtype)[half]
        _memmove(self._base + self._slot_offset(half, self.local_rank), flat.data_ptr(), nbytes)
        self._barrier.wait()
        _memmove(flat.data_ptr(), self._base + self._slot_offset(half, 0), nbytes)
        for peer in range(1, self.local_size):
            reducer(flat, slots[peer][:n], out=flat)

    def _allreduce(self, flat: torch.Tensor, reducer: Callable[..., torch.Tensor], cross: Optional[CrossReduce]) -> None:
        place = _shared_place(flat)
        self.segment.publish_tensor(self.local_rank, place)
        pieces = self._pieces(flat.numel(), flat.element_size())
        half = self._next_half()
        if place is None:
            self._expose(flat, pieces[0], half)
        self._barrier.wait()
        places = [self.segment.published_tensor(r) for r in range(self.local_size)]
        if all(p is not None for p in places):
            self._allreduce_in_place(flat, places, reducer, cross)
            return
        if any(p is not None for p in places):  # some ranks' tensors are shared, not all: copy them in too
            if place is not None:
                self._expose(flat, pieces[0], half)
            self._barrier.wait()
        for i, piece in enumerate(pieces):
            if i:
                half = self._next_half()
                self._expose(flat, piece, half)
                self._barrier.wait()
            self._reduce_piece(flat, piece, half, reducer, cross)

    def _expose(self, flat: torch.Tensor, piece: tuple[int, int], half: int) -> None:
        """Copy the parts of ``piece`` that the peers reduce into this rank's slot of ``half``."""
        start, stop = piece
        isz = flat.element_size()
        bounds = _part_bounds(stop - start, self.local_size, isz)
        lo, hi = bounds[self.local_rank], bounds[self.local_rank + 1]
        piece_at, own_at = flat.data_ptr() + start * isz, self._base + self._slot_offset(half, self.local_rank)
        _memmove(own_at, piece_at, lo * isz)
        _memmove(own_at + hi * isz, piece_at + hi * isz, (stop - start - hi) * isz)

    def _reduce_piece(
        self, flat: torch.Tensor, piece: tuple[int, int], half: int, reducer: Callable[..., torch.Tensor],
        cross: Optional[CrossReduce],
    ) -> None:
        """After the peers exposed ``piece``: reduce and publish this rank's part, collect the others'."""
        start, stop = piece
        me, size, isz, data = self.local_rank, self.local_size, flat.element_size(), self._base
        slots = self._views(flat.dtype)[half]
        bounds = _part_bounds(stop - start, size, isz)
        lo, hi = bounds[me], bounds[me + 1]
        piece_at, own_at = flat.data_ptr() + start * isz, data + self._slot_offset(half, me)
        if hi > lo:
            acc = flat[start + lo : start + hi]
            for peer in range(size):
                if peer != me:
                    reducer(acc, slots[peer][lo:hi], out=acc)
            if cross is not None:
                cross(acc)  # the same local rank on every node holds the same part: sizes agree
            _memmove(own_at + lo * isz, piece_at + lo * isz, (hi - lo) * isz)
        self._barrier.wait()
        for peer in range(size):
            if peer != me:
                at = bounds[peer] * isz
                _memmove(piece_at + at, data + self._slot_offset(half, peer) + at, bounds[peer + 1] * isz - at)

    def _allreduce_in_place(
        self, flat: torch.Tensor, places: list[TensorPlace], reducer: Callable[..., torch.Tensor],
        cross: Optional[CrossReduce],
    ) -> None:
        """Every local rank's tensor lives in shared memory: no slots, no second barrier. Each rank
        reduces its part block by block (its own block plus that block of every peer's tensor) and
        writes the sum, still in the core's cache, into every peer's tensor; the ranks touch disjoint
        parts, so the only wait is the last barrier, after which every tensor holds the whole result.
        With ``cross`` the part is reduced whole, handed to it, then written to the peers."""
        me, size, isz = self.local_rank, self.local_size, flat.element_size()
        nbytes = flat.numel() * isz
        peers = []
        for rank, place in enumerate(places):
            if place.nbytes != nbytes:
                raise SharedMemoryError(
                    f"local rank {rank}'s tensor has {place.nbytes} bytes, local rank {me}'s {nbytes}"
                )
            if rank != me:
                peers.append(self._peer_tensors.view(place, flat.dtype))
        bounds = _part_bounds(flat.numel(), size, isz)
        lo, hi = bounds[me], bounds[me + 1]
        acc = flat[lo:hi]
        others = [peer[lo:hi] for peer in peers]
        step = max(1, _REDUCE_BLOCK_BYTES // isz)
        for a in range(0, hi - lo, step):
            block = acc[a : a + step]
            for other in others:
                reducer(block, other[a : a + step], out=block)
            if cross is None:
                for other in others:
                    _memmove(other.data_ptr() + a * isz, block.data_ptr(), block.numel() * isz)
        if cross is not None and hi > lo:
            cross(acc)
            for other in others:
                _memmove(other.data_ptr(), acc.data_ptr(), (hi - lo) * isz)
        self._barrier.wait()

    def fits(self, nbytes: int) -> bool:
        """True when a message of ``nbytes`` goes through :meth:`allreduce_tensors` (one slot's worth)."""
        return nbytes <= self.slot_bytes

    def allreduce_tensors(
        self, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor], op: ReduceOp.RedOpType,
        cross: Optional[CrossReduce] = None, finish: Optional[Finish] = None,
        shapes: Optional[tuple[torch.Size, ...]] = None,
    ) -> None:
        """Reduce ``inputs`` (one dtype, any shapes and strides) across the local ranks as one message
        and write the results to ``outputs`` (same shapes; may be the inputs), without a staging buffer:
        the inputs are copied straight into this rank's slot and the reduced parts straight out of the
        slots. Every local rank must pass the same shapes and dtype; the total must :meth:`fits`.
        When the outputs are the inputs (floating point, no ``cross``), a rank copies only the parts the
        peers reduce into its slot, reduces its own part straight in its tensors and publishes that:
        (2n-1)/n of the message copied instead of twice (:meth:`_allreduce_tensors_in_place`; ranks may
        take either way in the same op).
        ``finish`` (an elementwise in-place op on a list of tensors, e.g. averaging's scale) runs on the
        reduced data before it is copied out, after ``cross``. A caller that knows
        the inputs' ``shapes`` and that the outputs match them in shape and dtype (the engine's cached
        plans, every step with hundreds of tensors) passes them, and the per-tensor checks are skipped."""
        reducer = REDUCERS.get(op)
        if reducer is None:
            raise ValueError(f"op {op} is not supported by the shared-memory transport")
        if len(inputs) != len(outputs):
            raise ValueError(f"allreduce_tensors got {len(inputs)} inputs but {len(outputs)} outputs")
        if not inputs:
            return
        dtype = inputs[0].dtype
        if shapes is None:
            shapes = self._checked_shapes(inputs, outputs)
        cached = self._layouts.get((dtype, shapes))
        nbytes = cached.nbytes if cached is not None else sum(s.numel() for s in shapes) * inputs[0].element_size()
        if not self.fits(nbytes):
            raise ValueError(
                f"allreduce_tensors: {nbytes} bytes do not fit a {self.slot_bytes}-byte slot; "
                "use allreduce on a flat tensor"
            )
        if nbytes == 0:
            return
        if cross is None and nbytes <= SMALL_ALLREDUCE_BYTES:
            self._run(lambda: self._allreduce_tensors_small(self._layout(dtype, shapes), inputs, outputs, reducer, finish))
        elif (
            cross is None and dtype.is_floating_point and op in FOREACH_REDUCERS
            and (outputs is inputs or all(map(operator.is_, outputs, inputs)))
        ):
            self._run(lambda: self._allreduce_tensors_in_place(
                self._layout(dtype, shapes), inputs, reducer, FOREACH_REDUCERS[op], finish))
        else:
            self._run(
                lambda: self._allreduce_tensors(self._layout(dtype, shapes), inputs, outputs, reducer, cross, finish)
            )

    @staticmethod
    def _checked_shapes(inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]) -> tuple[torch.Size, ...]:
        """The inputs' shapes, after checking that the outputs match them and all share one dtype."""
        shapes = tuple(t.shape for t in inputs)  # one pass per attribute, not one check per tensor
        if outputs is not inputs and tuple(t.shape for t in outputs) != shapes:
            i = next(i for i, (src, dst) in enumerate(zip(inputs, outputs)) if src.shape != dst.shape)
            raise ValueError(
                f"allreduce_tensors: output {i} has shape {tuple(outputs[i].shape)}, input {tuple(shapes[i])}"
            )
        dtype = inputs[0].dtype
        dtypes = {t.dtype for t in inputs} | ({t.dtype for t in outputs} if outputs is not inputs else set())
        if len(dtypes) > 1:
            i = next(i for i, (src, dst) in enumerate(zip(inputs, outputs)) if src.dtype != dtype or dst.dtype != dtype)
            raise TypeError(
                f"allreduce_tensors: tensor {i} is {inputs[i].dtype} -> {outputs[i].dtype}, tensor 0 is {dtype}"
            )
        return shapes

    def _layout(self, dtype: torch.dtype, shapes: tuple[torch.Size, ...]) -> "_TensorsLayout":
        """The cached views for ``shapes`` (built on first use; only while the segment is mapped)."""
        key = (dtype, shapes)
        layout = self._layouts.get(key)
        if layout is None:
            layout = _TensorsLayout.build(self, dtype, shapes)
            self._layouts[key] = layout
            if len(self._layouts) > _LAYOUT_CACHE_SIZE:
                self._layouts.popitem(last=False)
        else:
            self._layouts.move_to_end(key)
        return layout

    def _allreduce_tensors(
        self, layout: "_TensorsLayout", inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor],
        reducer: Callable[..., torch.Tensor], cross: Optional[CrossReduce], finish: Optional[Finish],
    ) -> None:
        half = self._next_half()
        torch._foreach_copy_(layout.inputs[half], list(inputs))
        self._barrier.wait()
        # reduce my part in place in my slot: nobody else reads it until the next barrier
        acc, peers = layout.own_part[half], layout.peer_parts[half]
        for peer in peers:
            reducer(acc, peer, out=acc)
        if cross is not None and acc.numel():
            cross(acc)
        if finish is not None and acc.numel():
            finish([acc])
        self._barrier.wait()
        layout.copy_out(half, outputs)

    def _allreduce_tensors_small(
        self, layout: "_TensorsLayout", inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor],
        reducer: Callable[..., torch.Tensor], finish: Optional[Finish],
    ) -> None:
        """One barrier: every rank reduces every slot in rank order into its scratch, then scatters it."""
        half = self._next_half()
        torch._foreach_copy_(layout.inputs[half], list(inputs))
        self._barrier.wait()
        slots, acc = layout.whole[half], layout.scratch
        acc.copy_(slots[0])
        for slot in slots[1:]:
            reducer(acc, slot, out=acc)
        if finish is not None:
            finish([acc])
        torch._foreach_copy_(list(outputs), layout.scratch_views)

    def _allreduce_tensors_in_place(
        self, layout: "_TensorsLayout", tensors: Sequence[torch.Tensor], reducer: Callable[..., torch.Tensor],
        foreach_reducer: Callable[..., None], finish: Optional[Finish],
    ) -> None:
        """Reduce ``tensors`` in place: expose only the parts the peers reduce, reduce this rank's part
        straight in its tensors (one list op per peer), publish it, then collect the peers' parts."""
        plan = layout.in_place(self)
        flats = {}
        for i in plan.straddlers:
            if not tensors[i].is_contiguous():  # no flat view of it: the copying way
                self._allreduce_tensors(layout, tensors, tensors, reducer, None, finish)
                return
            flats[i] = tensors[i].view(-1)
        others = [tensors[i] for i in plan.other_whole] + [flats[i][a:b] for i, a, b in plan.other_pieces]
        mine = [tensors[i] for i in plan.own_whole] + [flats[i][a:b] for i, a, b in plan.own_pieces]
        half = self._next_half()
        if others:
            torch._foreach_copy_(plan.expose[half], others)
        self._barrier.wait()
        if mine:
            for peer_views in plan.peers_own[half]:
                foreach_reducer(mine, peer_views)
            if finish is not None:
                finish(mine)
            torch._foreach_copy_(plan.publish[half], mine)
        self._barrier.wait()
        if others:
            torch._foreach_copy_(others, plan.collect[half])

    def allgather(self, flat: torch.Tensor, out: torch.Tensor) -> None:
        """``out`` (``local_size * flat.numel()`` elements) receives every local rank's ``flat`` in order."""
        self._run(lambda: self._allgather(flat, out))

    def _allgather(self, flat: torch.Tensor, out: torch.Tensor) -> None:
        me, isz, nbytes = self.local_rank, flat.element_size(), flat.numel() * flat.element_size()
        src, dst = flat.data_ptr(), out.data_ptr()
        _memmove(dst + me * nbytes, src, nbytes)
        for start, stop in self._pieces(flat.numel(), isz):
            half = self._next_half()
            length = (stop - start) * isz
            _memmove(self._base + self._slot_offset(half, me), src + start * isz, length)
            self._barrier.wait()
            for peer in range(self.local_size):
                if peer != me:
                    _memmove(dst + peer * nbytes + start * isz, self._base + self._slot_offset(half, peer), length)

    def broadcast(self, flat: torch.Tensor, root: int) -> None:
        """Every local rank's ``flat`` becomes local rank ``root``'s."""
        self._run(lambda: self._broadcast(flat, root))

    def _broadcast(self, flat: torch.Tensor, root: int) -> None:
        isz, at = flat.element_size(), flat.data_ptr()
        for start, stop in self._pieces(flat.numel(), isz):
            slot_at = self._base + self._slot_offset(self._next_half(), root)
            length = (stop - start) * isz
            if self.local_rank == root:
                _memmove(slot_at, at + start * isz, length)
            self._barrier.wait()
            if self.local_rank != root:
                _memmove(at + start * isz, slot_at, length)


@dataclass
class _TensorsLayout:
    """The slot views one list of tensor shapes takes in ``allreduce_tensors``, for both halves."""

    nbytes: int
    inputs: list[list[torch.Tensor]]  # [half]: one view of my slot per tensor, shaped like it
    own_part: list[torch.Tensor]  # [half]: my part of my slot (reduced in place)
    peer_parts: list[list[torch.Tensor]]  # [half]: my part of every peer's slot
    whole: list[list[torch.Tensor]]  # [half][rank]: the message in every slot (small path)
    out_src: list[list[torch.Tensor]]  # [half]: reduced sources: whole tensors, then straddling pieces
    out_whole: list[int]  # tensors that lie in one rank's part: their index
    out_pieces: list[tuple[int, int, int]]  # pieces of tensors that straddle parts: (index, start, stop)
    all_whole: bool  # no tensor straddles parts (out_whole is every index in order)
    scratch: torch.Tensor  # small path: the reduced message
    scratch_views: list[torch.Tensor]  # small path: one view of the scratch per tensor, shaped like it
    dtype: torch.dtype
    shapes: tuple[torch.Size, ...]
    _in_place: Optional["_InPlacePlan"] = None

    def in_place(self, node: "NodeCollectives") -> "_InPlacePlan":
        """The views :meth:`NodeCollectives._allreduce_tensors_in_place` uses (built on first use)."""
        if self._in_place is None:
            self._in_place = _InPlacePlan.build(node, self.dtype, self.shapes)
        return self._in_place

    @classmethod
    def build(cls, node: NodeCollectives, dtype: torch.dtype, shapes: tuple[torch.Size, ...]) -> "_TensorsLayout":
        sizes = [shape.numel() for shape in shapes]
        numel, isz, me, size = sum(sizes), torch.empty((), dtype=dtype).element_size(), node.local_rank, node.local_size
        nbytes = numel * isz
        slots = node._views(dtype)
        bounds = _part_bounds(numel, size, isz)
        starts = [0]
        for n in sizes:
            starts.append(starts[-1] + n)
        whole, pieces = _spans(shapes, bounds)  # the copy-out's sources: whole tensors, then straddling pieces
        lo, hi = bounds[me], bounds[me + 1]
        scratch = torch.empty(numel if nbytes <= SMALL_ALLREDUCE_BYTES else 0, dtype=dtype)
        return cls(
            nbytes,
            inputs=[[slots[h][me][a:b].view(shape) for a, b, shape in zip(starts, starts[1:], shapes)]
                    for h in range(2)],
            own_part=[slots[h][me][lo:hi] for h in range(2)],
            peer_parts=[[slots[h][p][lo:hi] for p in range(size) if p != me] for h in range(2)],
            whole=[[slots[h][r][:numel] for r in range(size)] for h in range(2)],
            out_src=[[_span_view(slots, h, span.owner, span) for span in whole + pieces] for h in range(2)],
            out_whole=[span.tensor for span in whole], out_pieces=[span.piece for span in pieces],
            all_whole=not pieces, scratch=scratch,
            scratch_views=[scratch[a:b].view(shape) for a, b, shape in zip(starts, starts[1:], shapes)]
            if scratch.numel() else [],
            dtype=dtype, shapes=shapes,
        )

    def copy_out(self, half: int, outputs: Sequence[torch.Tensor]) -> None:
        """Copy the reduced message from the slots into ``outputs`` (one ``_foreach_copy_`` call)."""
        targets = list(outputs) if self.all_whole else [outputs[i] for i in self.out_whole]
        staged: list[tuple[torch.Tensor, torch.Tensor]] = []  # non-contiguous straddlers: (output, flat copy)
        for i, a, b in self.out_pieces:
            out = outputs[i]
            if not out.is_contiguous():
                if not staged or staged[-1][0] is not out:
                    staged.append((out, torch.empty(out.numel(), dtype=out.dtype)))
                targets.append(staged[-1][1][a:b])
            else:
                targets.append(out.view(-1)[a:b])
        torch._foreach_copy_(targets, self.out_src[half])
        for out, flat in staged:
            out.copy_(flat.view(out.shape))


class _PeerTensors:
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


def _shared_place(flat: torch.Tensor) -> Optional[TensorPlace]:
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


@dataclass
class _InPlacePlan:
    """Which tensors (or pieces of the few that straddle two parts) are this rank's to reduce and which
    are the peers', with the slot views each step of the in-place fused allreduce copies to or from."""

    straddlers: list[int]  # tensors split between parts (need a flat view)
    own_whole: list[int]  # tensors inside this rank's part
    own_pieces: list[tuple[int, int, int]]  # (tensor, start, stop) of straddlers inside this rank's part
    other_whole: list[int]
    other_pieces: list[tuple[int, int, int]]
    expose: list[list[torch.Tensor]]  # [half]: this rank's slot where the others' tensors go
    peers_own: list[list[list[torch.Tensor]]]  # [half][peer]: that peer's slot at this rank's tensors
    publish: list[list[torch.Tensor]]  # [half]: this rank's slot at its own tensors
    collect: list[list[torch.Tensor]]  # [half]: the owner's slot at each of the others' tensors

    @classmethod
    def build(cls, node: NodeCollectives, dtype: torch.dtype, shapes: tuple[torch.Size, ...]) -> "_InPlacePlan":
        me, size, slots = node.local_rank, node.local_size, node._views(dtype)
        isz = torch.empty((), dtype=dtype).element_size()
        whole, pieces = _spans(shapes, _part_bounds(sum(shape.numel() for shape in shapes), size, isz))
        # whole tensors first, then pieces, as the per-step lists are built
        own = [span for span in whole + pieces if span.owner == me]
        other = [span for span in whole + pieces if span.owner != me]
        return cls(
            straddlers=list(dict.fromkeys(span.tensor for span in pieces)),
            own_whole=[span.tensor for span in whole if span.owner == me],
            own_pieces=[span.piece for span in pieces if span.owner == me],
            other_whole=[span.tensor for span in whole if span.owner != me],
            other_pieces=[span.piece for span in pieces if span.owner != me],
            expose=[[_span_view(slots, h, me, span) for span in other] for h in range(2)],
            peers_own=[[[_span_view(slots, h, p, span) for span in own] for p in range(size) if p != me]
                       for h in range(2)],
            publish=[[_span_view(slots, h, me, span) for span in own] for h in range(2)],
            collect=[[_span_view(slots, h, span.owner, span) for span in other] for h in range(2)],
        )


class _Span(NamedTuple):
    """A tensor of a fused message, or the piece of one that straddles two ranks' parts, and the local
    rank whose part holds it."""

    tensor: int  # its index in the list
    owner: int
    start: int  # its place in the message, in elements
    stop: int
    shape: Optional[torch.Size]  # the tensor's shape when whole; None for a piece
    tensor_start: int = 0  # where the whole tensor starts in the message (pieces)

    @property
    def piece(self) -> tuple[int, int, int]:
        """(tensor, start, stop) of a piece, in elements of the flattened tensor."""
        offset = self.start - self.tensor_start
        return self.tensor, offset, offset + self.stop - self.start


def _spans(shapes: Sequence[torch.Size], bounds: list[int]) -> tuple[list[_Span], list[_Span]]:
    """The message's tensors that lie in one rank's part (in order), then the pieces of those that
    straddle parts; ``bounds`` are the parts' offsets (:func:`_part_bounds`). A zero-size tensor is
    rank 0's."""
    whole: list[_Span] = []
    pieces: list[_Span] = []
    start = 0
    for i, shape in enumerate(shapes):
        stop = start + shape.numel()
        owners = [p for p in range(len(bounds) - 1) if bounds[p] < stop and start < bounds[p + 1]] or [0]
        if len(owners) == 1:
            whole.append(_Span(i, owners[0], start, stop, shape))
        else:
            pieces.extend(_Span(i, p, max(start, bounds[p]), min(stop, bounds[p + 1]), None, start) for p in owners)
        start = stop
    return whole, pieces


def _span_view(slots: list[list[torch.Tensor]], half: int, rank: int, span: _Span) -> torch.Tensor:
    """Where ``span`` lies in ``rank``'s slot of ``half``: shaped like the tensor when whole, flat for a piece."""
    flat = slots[half][rank][span.start : span.stop]
    return flat if span.shape is None else flat.view(span.shape)


def _memmove(dst: int, src: int, nbytes: int) -> None:
    if nbytes > 0:
        ctypes.memmove(dst, src, nbytes)


def _part_bounds(numel: int, parts: int, itemsize: int) -> list[int]:
    """``parts + 1`` offsets splitting ``numel`` elements as evenly as whole cache lines allow."""
    unit = max(1, _ALIGN_BYTES // itemsize)
    units = -(-numel // unit)
    base, extra = divmod(units, parts)
    bounds = [0]
    for p in range(parts):
        bounds.append(min(numel, bounds[-1] + (base + (1 if p < extra else 0)) * unit))
    return bounds
