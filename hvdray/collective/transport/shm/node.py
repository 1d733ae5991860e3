"""Allreduce, reducescatter, allgather and broadcast among the ranks of one node through a shared segment.

The data area holds two halves; each half has one slot per local rank. Every round of every op uses
the next half, and every round has a barrier between its writes and its reads, so a rank writing in
round k+2 knows that every rank has finished reading round k. Messages larger than a slot go in
several rounds, so the segment stays small whatever the tensor size.

Allreduce is a reduce-scatter then an all-gather inside one round: each rank copies the parts of its
piece that the others reduce into its slot, then reduces its own part (from its own tensor and the
peers' slots, all torch ops on tensors that view the shared memory, which run without the GIL),
optionally hands that reduced part to a cross-node allreduce, publishes it in its slot, and finally
copies the peers' reduced parts into its tensor. Every part is reduced exactly once, so every rank
ends with bit-identical results. Up to ``SMALL_ALLREDUCE_BYTES`` one round with one barrier does:
every rank reduces every slot.

Two variants live beside this module: a list of tensors that fits one slot (``fused.py``: the engine's
fused gradients, copied straight between the tensors and the slots) and tensors or blocks that every
local rank holds in torch shared memory (``shared_tensors.py``: reduced without the slots), among them
the outputs of out-of-place allreduces and the scratch blocks of in-place ones of
:data:`SCRATCH_MIN_BYTES` and more, and private tensors reduced again whose pages moved into shared
memory where they lie (``shared_pages.py``). Where the kernel lets the local ranks read and write each other's
memory (``cross_memory.py``), flat allreduces of private tensors over ``SMALL_ALLREDUCE_BYTES`` take
neither (but out of place into outputs in shared memory): each rank reads its part of the peers'
tensors and writes the sums back into them.
"""

from __future__ import annotations

import ctypes
import logging
import operator
import os
import struct
import threading
from collections import OrderedDict
from typing import Callable, Optional, Sequence

import numpy as np
import torch
from torch.distributed import ReduceOp

from hvdray.collective.topology import shared_cache_bytes, usable_cores
from hvdray.collective.transport.reductions import (
    FOREACH_REDUCERS, REDUCERS, block_operands, finish_block, reduce_in_order,
)
from hvdray.collective.transport.strategy import Finish
from hvdray.collective.transport.shm import fused
from hvdray.collective.transport.shm.barrier import NodeBarrier
from hvdray.collective.transport.shm.cross_memory import CrossMemory, allreduce_cross_memory
from hvdray.collective.transport.shm.parts import REDUCE_BLOCK_BYTES, SMALL_ALLREDUCE_BYTES, memmove, part_bounds
from hvdray.collective.transport.shm.segment import (
    CROSS_MEMORY,
    PRIVATE,
    SHARED_INPUT,
    SHARED_OUTPUT,
    SHARED_PAGES,
    SHARED_SOURCE,
    SOURCE_PAGES,
    PeerAddresses,
    Segment,
    SharedMemoryError,
)
from hvdray.collective.transport.shm.shared_storage import (
    PEER_STORAGES_PER_RANK,
    PeerTensors,
    ScratchBlocks,
    SharedMemoryAdoption,
    shared_place,
)
from hvdray.collective.transport.shm.shared_pages import SHARED_PAGES_KEPT, SharedPages
from hvdray.collective.transport.shm.pages_collectives import (
    PAGES_SLOT_BYTES,
    PagesPlans,
    allreduce_shared_pages,
    copy_edges,
    prepare_pages,
    reducescatter_shared_pages,
)
from hvdray.collective.transport.shm.shared_tensors import (
    allgather_shared_outputs,
    allreduce_shared_inputs,
    allreduce_shared_outputs,
    allreduce_shared_tensors,
    copy_peers_parts,
    reducescatter_shared_inputs,
)

log = logging.getLogger(__name__)

#: how often a barrier re-reads a peer's counter before it sleeps, when every local rank can have a core
#: of its own (then a peer usually arrives within the spin, and neither rank pays a sleep and a wake-up)
_SPIN_WHEN_CORES_FREE = 100
#: then how many times it re-reads the counter and gives its core away (sched_yield) before it sleeps: a
#: peer that is ready to run gets the core without a sleep and a wake-up (small-message latency, above all
#: with more local ranks than cores: ``python benchmarks/bench_shm.py --rows latency``)
_YIELDS_BEFORE_SLEEP = 200
#: how long it gives its core away instead inside a round a caller blocks on (``NodeBarrier.patient``), when
#: every local rank can have a core of its own: more than a training step's ranks drift apart by its end, so
#: that the first rank does not sleep at each step's flags and reduction and pay a wake-up (2 ranks on 2
#: cores, the MLP of ``benchmarks/bench.py``: 0.1-1.0 sleeps a step with 200 yields, none with this)
_YIELD_S_WHILE_A_CALLER_WAITS = 0.005
#: flat messages go through the slots in pieces of at most this much per rank: on the 2-core development
#: machine 2-4 MiB pieces reduce 64 MB fastest with 2 and 4 local ranks, 16 MiB pieces take twice as long
#: with 4 (a larger shm_buffer_mb then only lets larger lists through ``allreduce_tensors``)
PIECE_BYTES = 4 << 20
#: a broadcast goes in pieces of at most this much: the root copies piece k+1 into its slot while the
#: others copy piece k out, so a message of k pieces takes about (k+1)/k of one copy
BROADCAST_PIECE_BYTES = 1 << 20
#: an in-place allreduce of a private tensor of this size and more (not across nodes) goes through a scratch
#: block of shared memory of its size instead of the slots (``shared_tensors.allreduce_shared_outputs``): the
#: peers read its parts there and write their sums over them, with two barriers whatever the size
SCRATCH_MIN_BYTES = 4 << 20
#: the scratch blocks a rank keeps, one per message size, at most this much in all (larger messages, and
#: sizes that find no room, go through the slots: ``ScratchBlocks``)
SCRATCH_LIMIT_BYTES = 256 << 20
#: how long ``close`` waits for a running op to notice that the group is closing
_CLOSE_WAIT_S = 2.0
#: tensor-list layouts (shapes and dtype) whose slot views ``allreduce_tensors`` keeps
_LAYOUT_CACHE_SIZE = 16

#: the length word ahead of a payload in a slot (allgather_bytes)
_LENGTH_BYTES = 8
#: how many bytes of a peer's segment the cross-memory check reads
_PROBE_BYTES = 16

#: a cross-node allreduce of this rank's reduced part (hierarchical allreduce), in place
CrossReduce = Callable[[torch.Tensor], None]


class NodeCollectives:
    """Collectives of one node's ranks over a shared :class:`Segment`; used by the engine thread only."""

    def __init__(
        self, segment: Segment, local_rank: int, timeout_s: float, slot_bytes: int, adopt_tensors: bool = False,
        cross_memory: bool = False, share_pages: bool = False,
    ) -> None:
        self.segment = segment
        self.local_rank = local_rank
        self.local_size = segment.local_size
        self.slot_bytes = slot_bytes
        self.rounds = 0
        cores_free = self.local_size <= usable_cores()
        self.barrier = NodeBarrier(
            segment, local_rank, timeout_s, _SPIN_WHEN_CORES_FREE if cores_free else 0, _YIELDS_BEFORE_SLEEP,
            _YIELD_S_WHILE_A_CALLER_WAITS if cores_free else 0.0)
        self._data: Optional[torch.Tensor] = torch.frombuffer(segment.buffer(), dtype=torch.uint8)
        self._base = self._data.data_ptr()
        self._slots: dict[torch.dtype, list[list[torch.Tensor]]] = {}
        self._layouts: OrderedDict[tuple, fused.TensorsLayout] = OrderedDict()
        self.peer_tensors = PeerTensors(  # the peers' shared tensors mapped for shared_tensors.py
            (PEER_STORAGES_PER_RANK + SHARED_PAGES_KEPT) * max(1, self.local_size - 1), self.barrier.check_peer_pid)
        #: moves tensors an allreduce reduces again into shared memory, if asked (shared_storage.py)
        self.adoption = SharedMemoryAdoption(adopt_tensors, self.barrier.peer_pids)
        #: moves the pages of private tensors an allreduce or a reducescatter reduces again into shared memory,
        #: where they lie, if asked (shared_pages.py); needs room for a page from each end of a tensor in a slot
        self.shared_pages = SharedPages(share_pages and slot_bytes >= PAGES_SLOT_BYTES)
        #: the operands of the shared-pages allreduces run lately, to run again (pages_collectives.py)
        self.pages_plans = PagesPlans(self.peer_tensors)
        #: where in-place allreduces of private tensors meet their peers' (shared_storage.py)
        self.scratch = ScratchBlocks(SCRATCH_LIMIT_BYTES)
        self.scratch_min_bytes = SCRATCH_MIN_BYTES
        #: the cache the local ranks share: an in-place allreduce whose tensors and scratch blocks all fit in it
        #: takes the scratch blocks even where the kernel's copies are to be had (``_scratch_stays_cached``)
        self.cache_bytes = shared_cache_bytes()
        #: reads and writes of the peers' memory through the kernel, if asked (cross_memory.py; None: off)
        self.cross_memory = CrossMemory(self.barrier) if cross_memory else None
        self._failed: Optional[BaseException] = None
        self._op_lock = threading.Lock()

    # -- lifecycle --------------------------------------------------------------------------
    def close(self) -> None:
        """Leave the group (peers waiting on this rank fail at once) and unmap the segment.

        May be called from another thread than the ops': an op still waiting ends with an error, and
        the memory is unmapped only once no op runs (else it stays mapped until the process exits)."""
        self.barrier.leave()
        if not self._op_lock.acquire(timeout=_CLOSE_WAIT_S):
            log.warning("a shared-memory op is still running; its segment stays mapped")
            return
        try:
            self._slots.clear()
            self._layouts.clear()
            self.pages_plans.clear()
            self.peer_tensors.clear()
            self.scratch.clear()
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
                self.barrier.leave()
                raise
            if self.peer_tensors:
                self.peer_tensors.drop_released_now_and_then()
                self.pages_plans.forget_if_peers_dropped()

    def slot_views(self, dtype: torch.dtype) -> list[list[torch.Tensor]]:
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

    def next_half(self) -> int:
        """Start a round: the half of the data area it uses (the other one the previous round's)."""
        self.rounds += 1
        return self.rounds & 1

    def _pieces(self, numel: int, itemsize: int, piece_bytes: int = PIECE_BYTES) -> list[tuple[int, int]]:
        step = min(self.slot_bytes, piece_bytes) // itemsize
        return [(start, min(start + step, numel)) for start in range(0, numel, step)]

    # -- ops ----------------------------------------------------------------------------------
    # Copies go through memmove on raw addresses (glibc's large-copy path beats a torch copy_, and
    # ctypes releases the GIL for it); reductions are torch ops on views of the slots.
    def allreduce(
        self, flat: torch.Tensor, op: ReduceOp.RedOpType, cross: Optional[CrossReduce] = None,
        source: Optional[torch.Tensor] = None, finish: Optional[Finish] = None,
    ) -> None:
        """Reduce the contiguous 1-D ``flat`` in place across the local ranks (and ``cross``, if given,
        across nodes: it is called on this rank's reduced part of every piece). With ``source`` (contiguous,
        1-D, ``flat``'s size and dtype, not overlapping it) the reduction reads this rank's data from
        ``source`` and writes the result to ``flat``, without copying ``source`` into ``flat`` first.
        ``finish`` (elementwise, in place, on a list of tensors: averaging's division) runs on each part a
        rank reduced, after ``cross``, while it is still in the core's cache and before the peers copy it,
        instead of on the whole result afterwards."""
        reducer = REDUCERS.get(op)
        if reducer is None:
            raise ValueError(f"op {op} is not supported by the shared-memory transport")
        if source is None:
            source = flat
        elif source.shape != flat.shape or source.dtype != flat.dtype or not source.is_contiguous():
            raise ValueError(
                f"allreduce: source must be contiguous and shaped like flat ({flat.dtype} {tuple(flat.shape)}), "
                f"got {source.dtype} {tuple(source.shape)}"
            )
        if cross is None and flat.numel() * flat.element_size() <= min(SMALL_ALLREDUCE_BYTES, self.slot_bytes):
            self._run(lambda: self._allreduce_small(flat, source, reducer, finish))
        else:
            self._run(lambda: self._allreduce(flat, source, reducer, cross, finish))

    def _allreduce_small(
        self, flat: torch.Tensor, source: torch.Tensor, reducer: Callable[..., torch.Tensor], finish: Optional[Finish],
    ) -> None:
        """One round, one barrier: every rank publishes its whole message and reduces all of them, in
        rank order (so the results are bit-identical). Cheaper than two barriers for small messages."""
        half, nbytes, n = self.next_half(), flat.numel() * flat.element_size(), flat.numel()
        slots = self.slot_views(flat.dtype)[half]
        memmove(self._base + self._slot_offset(half, self.local_rank), source.data_ptr(), nbytes)
        self.barrier.wait()
        reduce_in_order(reducer, slots[0][:n], [slot[:n] for slot in slots[1:]], flat)
        if finish is not None:
            finish([flat])

    def _allreduce(
        self, flat: torch.Tensor, source: torch.Tensor, reducer: Callable[..., torch.Tensor],
        cross: Optional[CrossReduce], finish: Optional[Finish],
    ) -> None:
        # in place: the tensor, if it lives in shared memory; out of place: the input (not across nodes)
        place = self.adoption.place(source) if source is flat or cross is None else None
        # every rank asks for the same ops (the first such op checks the kernel with the peers)
        crossing = cross is None and self._cross_memory_ready()
        # where the peers read this rank's parts (and in place write their sums), when its input is private: its
        # input's own pages once moved into shared memory (shared_pages.py); out of place, its output if
        # in shared memory (the output pool's are, where the node's ranks share memory); in place, a scratch
        # block of shared memory when every rank's tensor and block stay in the shared cache (user-space
        # copies there outrun the kernel's, which take each page in turn), else its own tensors through the
        # kernel; else (the kernel refuses) in place a scratch block all the same
        exposed, what, published, prepare = None, SHARED_INPUT if source is flat else SHARED_SOURCE, place, None
        pieces = self._pieces(flat.numel(), flat.element_size())
        half = self.next_half()
        pages = self.shared_pages.place(source) if place is None and cross is None else None
        if pages is not None:
            what, published = SHARED_PAGES if source is flat else SOURCE_PAGES, pages
            prepare = lambda h=half: prepare_pages(  # noqa: E731
                source, flat, self.slot_views(torch.uint8)[h][self.local_rank])
        elif place is None:
            what = PRIVATE
            out_place = shared_place(flat) if cross is None and source is not flat else None
            if out_place is not None:
                exposed, what, published = flat, SHARED_OUTPUT, out_place
            else:
                if cross is None and source is flat and (not crossing or self._scratch_stays_cached(flat)):
                    exposed = self._scratch_for(flat)
                published = shared_place(exposed) if exposed is not None else None
                if published is not None:
                    what = SHARED_OUTPUT
                elif crossing:
                    exposed, what = None, CROSS_MEMORY
                    published = PeerAddresses(source.data_ptr(), flat.data_ptr(), flat.numel() * flat.element_size())
            if what == SHARED_OUTPUT:
                prepare = lambda: copy_peers_parts(self, exposed, source, pieces)  # noqa: E731
        agreed = self._agree_on_places(what, published, lambda h=half: self._expose(source, pieces[0], h), prepare)
        if agreed is not None:
            what, places = agreed
            if what == CROSS_MEMORY:
                allreduce_cross_memory(self, flat, source, places, pieces, reducer, finish)
            elif what == SHARED_PAGES or what == SOURCE_PAGES:
                allreduce_shared_pages(self, flat, source, places, half, reducer, finish)
            elif what == SHARED_OUTPUT:
                allreduce_shared_outputs(self, flat, source, places, pieces, reducer, finish, exposed)
                if exposed is not flat:  # in place: the peers' sums wait in the scratch block
                    copy_peers_parts(self, flat, exposed, pieces)
            elif source is flat:
                allreduce_shared_tensors(self, flat, places, reducer, cross, finish)
            else:
                allreduce_shared_inputs(self, flat, source, places, reducer, finish)
            return
        for i, piece in enumerate(pieces):
            if i:
                half = self.next_half()
                self._expose(source, piece, half)
                self.barrier.wait()
            self._reduce_piece(flat, source, piece, half, reducer, cross, finish)

    def _scratch_for(self, flat: torch.Tensor) -> Optional[torch.Tensor]:
        """The scratch block of ``flat``'s size, as a tensor of its dtype, for an in-place allreduce of
        :data:`SCRATCH_MIN_BYTES` or more (None below, or when no block is to be had)."""
        nbytes = flat.numel() * flat.element_size()
        if nbytes < self.scratch_min_bytes:
            return None
        block = self.scratch.get(nbytes)
        return None if block is None else torch.from_numpy(block).view(flat.dtype)

    def _scratch_stays_cached(self, flat: torch.Tensor) -> bool:
        """Whether an in-place allreduce of ``flat`` through the scratch blocks keeps every local rank's tensor
        and block in the cache the ranks share (:attr:`cache_bytes`): then it beats the kernel's copies."""
        return 2 * self.local_size * flat.numel() * flat.element_size() <= self.cache_bytes

    def _cross_memory_ready(self) -> bool:
        """Whether every local rank may read and write its peers' memory through the kernel. Checked with
        the peers at the first op that asks (every rank asks for the same ops): each rank reads the first
        bytes of every peer's mapping of the segment (which it sees too), then the ranks AND their answers."""
        memory = self.cross_memory
        if memory is None:
            return False
        if memory.usable is None:
            gathered = self._allgather_bytes(struct.pack("<QQ", os.getpid(), self.segment.address))
            assert gathered is not None  # 16 bytes fit any slot
            peers = [struct.unpack("<QQ", payload) for payload in gathered]
            memory.pids = [pid for pid, _ in peers]
            expected = ctypes.string_at(self.segment.address, _PROBE_BYTES)
            answer = ctypes.c_uint8(1)
            for rank, (_, address) in enumerate(peers):
                refusal = None if rank == self.local_rank else memory.refusal(rank, address, expected)
                if refusal is not None:
                    log.warning("local rank %d cannot reach its peers' memory through the kernel (%s); the node's "
                                "allreduces go through shared memory", self.local_rank, refusal)
                    answer.value = 0
                    break
            self._and_bytes(ctypes.addressof(answer), 1)
            memory.usable = bool(answer.value)
        return memory.usable

    def _agree_on_places(
        self, what: int, place: Optional[tuple[int, ...]], expose_first: Callable[[], None],
        prepare: Optional[Callable[[], None]] = None,
    ) -> Optional[tuple[int, list]]:
        """The first round of an op that may go straight between the ranks' tensors: publish ``what`` way
        this rank can take and ``place`` (its input in shared memory, :data:`SHARED_INPUT`, or out of place
        :data:`SHARED_SOURCE`; its output there, :data:`SHARED_OUTPUT`; its input's and output's addresses,
        :data:`CROSS_MEMORY`; its tensor's whole pages in shared memory, :data:`SHARED_PAGES`, or out of
        place :data:`SOURCE_PAGES`; None with :data:`PRIVATE`); when private,
        ``expose_first()`` its first piece into the slots, else ``prepare()`` (if given: what the direct way
        needs before the barrier); then wait for every rank. Returns what every rank published and where,
        when all published the same direct way (the caller takes it), else None once the first piece of
        every rank is in the slots (ranks that skipped it expose it now, then one more barrier)."""
        self.segment.publish_tensor(self.local_rank, place, what)
        if what == PRIVATE:
            expose_first()
        elif prepare is not None:
            prepare()
        self.barrier.wait()
        published = [self.segment.published_tensor(r) for r in range(self.local_size)]
        kinds = {kind for kind, _ in published}
        if len(kinds) == 1 and what != PRIVATE:
            return what, [p for _, p in published]
        if kinds != {PRIVATE}:  # the ranks disagree, and some did not expose: they do now
            if what != PRIVATE:
                expose_first()
            self.barrier.wait()
        return None

    def _expose(self, flat: torch.Tensor, piece: tuple[int, int], half: int) -> None:
        """Copy the parts of ``piece`` of ``flat`` that the peers reduce into this rank's slot of ``half``."""
        start, stop = piece
        isz = flat.element_size()
        bounds = part_bounds(stop - start, self.local_size, isz)
        lo, hi = bounds[self.local_rank], bounds[self.local_rank + 1]
        piece_at, own_at = flat.data_ptr() + start * isz, self._base + self._slot_offset(half, self.local_rank)
        memmove(own_at, piece_at, lo * isz)
        memmove(own_at + hi * isz, piece_at + hi * isz, (stop - start - hi) * isz)

    def _reduce_piece(
        self, flat: torch.Tensor, source: torch.Tensor, piece: tuple[int, int], half: int,
        reducer: Callable[..., torch.Tensor], cross: Optional[CrossReduce], finish: Optional[Finish],
    ) -> None:
        """After the peers exposed ``piece``: reduce this rank's part of ``source`` and the peers' slots
        into ``flat`` and publish it, then collect the others' parts. Without ``cross`` the part goes in
        blocks that stay in the core's cache between the reduction and the publishing copy."""
        start, stop = piece
        me, size, isz, data = self.local_rank, self.local_size, flat.element_size(), self._base
        slots = self.slot_views(flat.dtype)[half]
        bounds = part_bounds(stop - start, size, isz)
        lo, hi = bounds[me], bounds[me + 1]
        piece_at, own_at = flat.data_ptr() + start * isz, data + self._slot_offset(half, me)
        peers = [slots[peer] for peer in range(size) if peer != me]
        if cross is None:  # blocks that stay in the cache: numpy's calls cost less (block_operands)
            step = max(1, REDUCE_BLOCK_BYTES // isz)
            reduce, (out, source, *peers) = block_operands(
                reducer, [flat[start:stop], source[start:stop], *[peer[: stop - start] for peer in peers]])
        else:  # the part whole, for ``cross`` (an empty part: no block)
            step, reduce, out, source = max(1, hi - lo), reducer, flat[start:stop], source[start:stop]
        with np.errstate(all="ignore"):
            for a in range(lo, hi, step):
                b = min(a + step, hi)
                acc = reduce_in_order(reduce, source[a:b], [peer[a:b] for peer in peers], out[a:b])
                if cross is not None:
                    cross(acc)  # the same local rank on every node holds the same part: sizes agree
                if finish is not None:
                    finish_block(finish, acc)
                memmove(own_at + a * isz, piece_at + a * isz, (b - a) * isz)
        self.barrier.wait()
        for peer in range(size):
            if peer != me:
                at = bounds[peer] * isz
                memmove(piece_at + at, data + self._slot_offset(half, peer) + at, bounds[peer + 1] * isz - at)


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
        (2n-1)/n of the message copied instead of twice (:func:`fused.allreduce_in_place`; ranks may
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
            shapes = fused.checked_shapes(inputs, outputs)
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
            self._run(lambda: fused.allreduce_small(
                self, self._layout(dtype, shapes), inputs, outputs, reducer, finish))
        elif (
            cross is None and dtype.is_floating_point and op in FOREACH_REDUCERS
            and (outputs is inputs or all(map(operator.is_, outputs, inputs)))
        ):
            self._run(lambda: fused.allreduce_in_place(
                self, self._layout(dtype, shapes), inputs, reducer, FOREACH_REDUCERS[op], finish))
        else:
            self._run(lambda: fused.allreduce_copying(
                self, self._layout(dtype, shapes), inputs, outputs, reducer, cross, finish))


    def _layout(self, dtype: torch.dtype, shapes: tuple[torch.Size, ...]) -> fused.TensorsLayout:
        """The cached views for ``shapes`` (built on first use; only while the segment is mapped)."""
        key = (dtype, shapes)
        layout = self._layouts.get(key)
        if layout is None:
            layout = fused.TensorsLayout.build(self, dtype, shapes)
            self._layouts[key] = layout
            if len(self._layouts) > _LAYOUT_CACHE_SIZE:
                self._layouts.popitem(last=False)
        else:
            self._layouts.move_to_end(key)
        return layout


    def reducescatter(self, chunks: torch.Tensor, out: torch.Tensor, op: ReduceOp.RedOpType) -> None:
        """The flat contiguous ``out`` receives chunk ``local_rank`` of the flat contiguous ``chunks``
        (``local_size`` equal chunks) reduced across the local ranks."""
        reducer = REDUCERS.get(op)
        if reducer is None:
            raise ValueError(f"op {op} is not supported by the shared-memory transport")
        self._run(lambda: self._reducescatter(chunks, out, reducer))

    def and_bytes(self, at: int, nbytes: int) -> None:
        """Bitwise-AND the ``nbytes`` bytes at address ``at`` (at most a slot) across the local ranks, in
        place: one round and one barrier, combined as Python ints. The engine's flags go this way every
        tick, where a torch op's cost, cold between a training step's compute, is most of the round."""
        if nbytes > self.slot_bytes:
            raise ValueError(f"and_bytes: {nbytes} bytes do not fit a {self.slot_bytes}-byte slot")
        self._run(lambda: self._and_bytes(at, nbytes))

    def _and_bytes(self, at: int, nbytes: int) -> None:
        half, base = self.next_half(), self._base
        memmove(base + self._slot_offset(half, self.local_rank), at, nbytes)
        self.barrier.wait()
        combined = -1
        for rank in range(self.local_size):
            combined &= int.from_bytes(ctypes.string_at(base + self._slot_offset(half, rank), nbytes), "little")
        ctypes.memmove(at, combined.to_bytes(nbytes, "little"), nbytes)

    def allgather_bytes(self, payload: bytes) -> Optional[list[bytes]]:
        """Every local rank's ``payload`` (lengths may differ) in local-rank order, in one round and one
        barrier: each rank writes its length and, if it fits its slot, its bytes. None on every rank alike
        when some rank's payload does not fit (every rank reads every length), so that the caller takes
        another way together. The engine's full rounds (new names, joins) go this way."""
        gathered: list[Optional[list[bytes]]] = []
        payload = bytes(payload)  # ctypes copies from bytes (the same object when it is already)
        self._run(lambda: gathered.append(self._allgather_bytes(payload)))
        return gathered[0]

    def _allgather_bytes(self, payload: bytes) -> Optional[list[bytes]]:
        half, base, room = self.next_half(), self._base, self.slot_bytes - _LENGTH_BYTES
        own = base + self._slot_offset(half, self.local_rank)
        ctypes.memmove(own, len(payload).to_bytes(_LENGTH_BYTES, "little"), _LENGTH_BYTES)
        if len(payload) <= room:
            ctypes.memmove(own + _LENGTH_BYTES, payload, len(payload))
        self.barrier.wait()
        slots = [base + self._slot_offset(half, rank) for rank in range(self.local_size)]
        lengths = [int.from_bytes(ctypes.string_at(at, _LENGTH_BYTES), "little") for at in slots]
        if max(lengths) > room:
            return None
        return [payload if rank == self.local_rank else ctypes.string_at(at + _LENGTH_BYTES, n)
                for rank, (at, n) in enumerate(zip(slots, lengths))]

    def _reducescatter(self, chunks: torch.Tensor, out: torch.Tensor, reducer: Callable[..., torch.Tensor]) -> None:
        """Each round a piece of every chunk: a rank copies the pieces of the peers' chunks into its slot
        (one after another, by chunk), then reduces its own chunk's piece from its tensor and the peers'
        slots, in one pass per peer; only the peers' chunks are copied. When every local rank's ``chunks``
        lives in shared memory (or moves there, ``share_reduced_tensors``), each rank reduces its chunk
        straight from the peers' tensors (:func:`reducescatter_shared_inputs`), in the same order; so when
        their whole pages moved there (``share_reduced_pages``), the few bytes outside them through the
        slots (:func:`reducescatter_shared_pages`)."""
        me, size, isz = self.local_rank, self.local_size, chunks.element_size()
        rows = chunks.view(size, -1)
        pieces = self._pieces(rows.shape[1], isz * size)
        if not pieces:  # empty chunks on every rank alike
            return
        half = self.next_half()
        place = self.adoption.place(chunks)
        what, prepare = PRIVATE if place is None else SHARED_INPUT, None
        if place is None:
            place = self.shared_pages.place(chunks)
            if place is not None:
                what = SHARED_PAGES
                prepare = lambda: copy_edges(chunks, self.slot_views(torch.uint8)[half][me])  # noqa: E731
        agreed = self._agree_on_places(what, place, lambda h=half: self._expose_chunks(rows, pieces[0], h), prepare)
        if agreed is not None:
            if what == SHARED_PAGES:
                reducescatter_shared_pages(self, rows, out, agreed[1], half, reducer)
            else:
                reducescatter_shared_inputs(self, rows, out, agreed[1], reducer)
            return
        for i, (start, stop) in enumerate(pieces):
            if i:
                half = self.next_half()
                self._expose_chunks(rows, (start, stop), half)
                self.barrier.wait()
            length = stop - start
            slots = self.slot_views(chunks.dtype)[half]
            theirs = [slots[peer][me * length:(me + 1) * length] for peer in range(size) if peer != me]
            reduce_in_order(reducer, rows[me, start:stop], theirs, out[start:stop])

    def _expose_chunks(self, rows: torch.Tensor, piece: tuple[int, int], half: int) -> None:
        """Copy ``piece`` of every peer's chunk (a row of ``rows``) into this rank's slot of ``half``, by chunk."""
        start, stop = piece
        me, isz, length = self.local_rank, rows.element_size(), stop - start
        own_at = self._base + self._slot_offset(half, me)
        for peer in range(self.local_size):
            if peer != me:
                memmove(own_at + peer * length * isz, rows[peer].data_ptr() + start * isz, length * isz)

    def allgather(self, flat: torch.Tensor, out: torch.Tensor) -> None:
        """``out`` (``local_size * flat.numel()`` elements) receives every local rank's ``flat`` in order."""
        self._run(lambda: self._allgather(flat, out))

    def _allgather(self, flat: torch.Tensor, out: torch.Tensor) -> None:
        """Through the slots a piece at a time; when every rank's ``out`` lives in shared memory (the output
        pool's, where the node's ranks share memory), each rank writes its ``flat`` straight into every
        rank's output instead (:func:`allgather_shared_outputs`)."""
        me, isz, nbytes = self.local_rank, flat.element_size(), flat.numel() * flat.element_size()
        src, dst = flat.data_ptr(), out.data_ptr()
        memmove(dst + me * nbytes, src, nbytes)
        pieces = self._pieces(flat.numel(), isz)
        half = self.next_half()

        def expose(piece: tuple[int, int], half: int) -> None:
            memmove(self._base + self._slot_offset(half, me), src + piece[0] * isz, (piece[1] - piece[0]) * isz)

        place = shared_place(out)
        agreed = self._agree_on_places(
            PRIVATE if place is None else SHARED_OUTPUT, place, lambda: expose(pieces[0], half))
        if agreed is not None:
            allgather_shared_outputs(self, flat, out, agreed[1])
            return
        for i, (start, stop) in enumerate(pieces):
            length = (stop - start) * isz
            if i:
                half = self.next_half()
                expose((start, stop), half)
                self.barrier.wait()
            for peer in range(self.local_size):
                if peer != me:
                    memmove(dst + peer * nbytes + start * isz, self._base + self._slot_offset(half, peer), length)

    def broadcast(self, flat: torch.Tensor, root: int) -> None:
        """Every local rank's ``flat`` becomes local rank ``root``'s."""
        self._run(lambda: self._broadcast(flat, root))

    def _broadcast(self, flat: torch.Tensor, root: int) -> None:
        isz, at = flat.element_size(), flat.data_ptr()
        for start, stop in self._pieces(flat.numel(), isz, BROADCAST_PIECE_BYTES):
            slot_at = self._base + self._slot_offset(self.next_half(), root)
            length = (stop - start) * isz
            if self.local_rank == root:
                memmove(slot_at, at + start * isz, length)
            self.barrier.wait()
            if self.local_rank != root:
                memmove(at + start * isz, slot_at, length)
