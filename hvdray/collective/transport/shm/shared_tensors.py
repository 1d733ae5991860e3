"""Allreduce, reducescatter and allgather straight between the local ranks' tensors when every one
lives in torch shared memory.

When every local rank's tensor of a flat allreduce or a reducescatter lives in torch shared memory
(``share_memory_()``), the ranks say where in their control blocks (:meth:`Segment.publish_tensor`),
map each other's tensors (through ``/proc/<pid>/fd``) and skip the slots: in an allreduce each rank
sums its part from every rank's tensor and writes the sum into all of them (out of place: into its own
output); in a reducescatter each rank sums its own chunk from every rank's tensor into its output.

With ``share_reduced_tensors`` a private tensor that an allreduce or a reducescatter reduces again and
again (a gradient bucket, a metrics buffer, a sharded optimizer's gradients) gets there by itself
(:class:`~hvdray.collective.transport.shm.shared_storage.SharedMemoryAdoption` moves its storage into
shared memory the second time it is reduced), so from then on it takes this path instead of three
copies through the slots.

Outputs in shared memory help too, whatever the inputs: the output pool places the results of
out-of-place collectives in blocks of shared memory
(:class:`~hvdray.collective.transport.shm.shared_storage.SharedBlocks`), so that an out-of-place
allreduce exposes what the peers reduce in each rank's own output and writes each reduced part over
it in every rank's output (:func:`allreduce_shared_outputs`), and an allgather writes each rank's
tensor straight into every rank's output (:func:`allgather_shared_outputs`). An in-place allreduce of
private tensors takes the allreduce's way through a scratch block of shared memory per rank
(:class:`~hvdray.collective.transport.shm.shared_storage.ScratchBlocks`) and copies the peers' sums
out of it at the end, until it is reduced a second time: then (``share_reduced_pages``, on by default)
its whole pages move into shared memory where they lie
(:class:`~hvdray.collective.transport.shm.shared_pages.SharedPages`), and from then on it is reduced
straight between the ranks' tensors, only the bytes outside those pages going through the slots
(``pages_collectives.py``, on this module's block loops); so is an out-of-place input, and a
reducescatter's. Where tensors live, and how a rank maps its peers', is ``shared_storage.py``'s and
``shared_pages.py``'s.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

import numpy as np
import torch

from hvdray.collective.transport.reductions import Operand, block_operands, finish_block, reduce_in_order
from hvdray.collective.transport.shm.parts import REDUCE_BLOCK_BYTES, memmove, part_bounds
from hvdray.collective.transport.shm.segment import TensorPlace, check_published_sizes

if TYPE_CHECKING:
    from hvdray.collective.transport.shm.node import CrossReduce, NodeCollectives
    from hvdray.collective.transport.strategy import Finish


def allreduce_shared_tensors(
    node: "NodeCollectives", flat: torch.Tensor, places: list[TensorPlace], reducer: Callable[..., torch.Tensor],
    cross: Optional["CrossReduce"], finish: Optional["Finish"] = None,
) -> None:
    """Every local rank's tensor lives in shared memory: no slots, no second barrier
    (:func:`_reduce_parts_into_every_tensor`)."""
    _reduce_parts_into_every_tensor(node, _every_ranks_tensor(node, flat, places), reducer, cross, finish)


def _reduce_parts_into_every_tensor(
    node: "NodeCollectives", views: list[torch.Tensor], reducer: Callable[..., torch.Tensor],
    cross: Optional["CrossReduce"], finish: Optional["Finish"],
) -> None:
    """``views``: every local rank's tensor (of one size), in rank order, this rank's its own. Each rank
    reduces its part block by block (its own block plus that block of every peer's tensor) and writes the
    sum, still in the core's cache, into every peer's tensor (:func:`part_blocks`); the ranks touch disjoint
    parts, so the only wait is the last barrier, after which every tensor holds the whole result. With
    ``cross`` the part is reduced whole, handed to it, then written to the peers. ``finish`` runs on each
    reduced block (after ``cross``) before it is written to the peers."""
    me = node.local_rank
    if cross is None:
        reduce_part_blocks(*part_blocks(me, views, reducer), finish)
        node.barrier.wait()
        return
    flat = views[me]
    isz = flat.element_size()
    bounds = part_bounds(flat.numel(), node.local_size, isz)
    lo, hi = bounds[me], bounds[me + 1]
    if hi > lo:
        part = flat[lo:hi]
        reduce_in_order(reducer, part, [view[lo:hi] for rank, view in enumerate(views) if rank != me], part)
        cross(part)
        if finish is not None:
            finish([part])
        for rank, view in enumerate(views):
            if rank != me:
                memmove(view.data_ptr() + lo * isz, part.data_ptr(), (hi - lo) * isz)
    node.barrier.wait()


#: one block of a rank's part (:func:`part_blocks`): the block of its output, those of its own input and of every
#: peer's, where the output's block goes in each peer's output, where it lies and its size in bytes
PartBlock = tuple[Operand, Operand, list[Operand], list[int], int, int]


def part_blocks(
    me: int, views: list[torch.Tensor], reducer: Callable[..., torch.Tensor],
    outputs: Optional[list[torch.Tensor]] = None,
) -> tuple[Callable[..., Operand], list[PartBlock]]:
    """This rank's (``me``) part of every local rank's tensor (``views``, rank order, one size), cut into
    blocks of :data:`REDUCE_BLOCK_BYTES` that stay in the core's cache between their reduction and the writes
    into the peers' outputs (``outputs``: every rank's, rank order, ``views``' size; the tensors themselves
    when None, in place): the reducer and the blocks (:func:`block_operands`' operands). A block is reduced
    from this rank's own input first, then the peers' in rank order, as the slots' way does."""
    flat = views[me]
    isz = flat.element_size()
    bounds = part_bounds(flat.numel(), len(views), isz)
    lo, hi = bounds[me], bounds[me + 1]
    in_place = outputs is None
    outputs = views if outputs is None else outputs
    peers_out = [output for rank, output in enumerate(outputs) if rank != me]
    own_at, peers_at = outputs[me].data_ptr() + lo * isz, [peer.data_ptr() + lo * isz for peer in peers_out]
    reduce, (acc, *others) = block_operands(
        reducer, [outputs[me][lo:hi], *([] if in_place else [flat[lo:hi]]),
                  *(view[lo:hi] for rank, view in enumerate(views) if rank != me)])
    mine = acc if in_place else others.pop(0)
    step = max(1, REDUCE_BLOCK_BYTES // isz)
    blocks = []
    for a in range(0, hi - lo, step):
        b = min(a + step, hi - lo)
        blocks.append((acc[a:b], mine[a:b], [other[a:b] for other in others], [at + a * isz for at in peers_at],
                       own_at + a * isz, (b - a) * isz))
    return reduce, blocks


def reduce_part_blocks(reduce: Callable[..., Operand], blocks: list[PartBlock], finish: Optional["Finish"]) -> None:
    """Reduce each block of :func:`part_blocks` with ``reduce`` (its reducer) into the output's, finish it and
    write it into every peer's output while it is in the core's cache."""
    with np.errstate(all="ignore"):
        for out, first, others, peers_at, own_at, nbytes in blocks:
            reduce_in_order(reduce, first, others, out)
            if finish is not None:
                finish_block(finish, out)
            for peer_at in peers_at:
                memmove(peer_at, own_at, nbytes)


def allreduce_shared_inputs(
    node: "NodeCollectives", out: torch.Tensor, source: torch.Tensor, places: list[TensorPlace],
    reducer: Callable[..., torch.Tensor], finish: Optional["Finish"] = None,
) -> None:
    """Out of place, every local rank's input in shared memory: each rank reduces the whole message
    straight from every rank's input into its own output, in local-rank order (so every rank's result
    is bit-identical), and writes nothing to the peers. With two ranks that is one add of the message,
    what the memory ideal costs when copy and add run at one speed; the last barrier keeps every input
    unchanged until all ranks have read it."""
    _reduce_all_into(_every_ranks_tensor(node, source, places), out, reducer, finish)
    node.barrier.wait()


def _reduce_all_into(
    inputs: list[torch.Tensor], out: torch.Tensor, reducer: Callable[..., torch.Tensor], finish: Optional["Finish"],
) -> None:
    """``out`` = every rank's input (``inputs``, in rank order) reduced in that order; with ``finish``, block by
    block, each block finished while it is in the core's cache (:func:`finish_block`), instead of a second
    pass over the whole output."""
    if finish is None:
        reduce_in_order(reducer, inputs[0], inputs[1:], out)
        return
    reduce_all_into_blocks(*all_into_operands(inputs, out, reducer), finish)


#: the operands of :func:`reduce_all_into_blocks`: the output and every rank's input, whole or one block of each
AllIntoOperands = list[Operand]


def all_into_operands(
    inputs: list[torch.Tensor], out: torch.Tensor, reducer: Callable[..., torch.Tensor],
) -> tuple[Callable[..., Operand], AllIntoOperands, list[AllIntoOperands]]:
    """The reducer and operands of ``out`` = every rank's input reduced (:func:`_reduce_all_into`), whole and in
    blocks of :data:`REDUCE_BLOCK_BYTES`, for :func:`reduce_all_into_blocks` (:func:`block_operands`' reducer
    and operands)."""
    reduce, whole = block_operands(reducer, [out, *inputs])
    step = max(1, REDUCE_BLOCK_BYTES // out.element_size())
    return reduce, whole, [[operand[a : a + step] for operand in whole] for a in range(0, len(whole[0]), step)]


def reduce_all_into_blocks(
    reduce: Callable[..., Operand], whole: AllIntoOperands, blocks: list[AllIntoOperands], finish: Optional["Finish"],
) -> None:
    """Reduce every rank's input into the output with ``reduce``: at once (``whole``) without ``finish``, else
    block by block (``blocks``), each finished while it is in the core's cache."""
    with np.errstate(all="ignore"):
        if finish is None:
            out, first, *others = whole
            reduce_in_order(reduce, first, others, out)
            return
        for out, first, *others in blocks:
            reduce_in_order(reduce, first, others, out)
            finish_block(finish, out)


def copy_peers_parts(
    node: "NodeCollectives", dst: torch.Tensor, src: torch.Tensor, pieces: list[tuple[int, int]],
) -> None:
    """Copy from ``src`` to ``dst`` (contiguous, 1-D, of one size and dtype) every piece's parts but this
    rank's: before an allreduce through blocks in shared memory, the parts of the input that the peers
    reduce (into the block they read: the output, or an in-place allreduce's scratch block); after it,
    the peers' sums from the scratch block into the tensor."""
    me, size, isz = node.local_rank, node.local_size, dst.element_size()
    src_at, dst_at, done = src.data_ptr(), dst.data_ptr(), 0
    for start, stop in pieces:
        bounds = part_bounds(stop - start, size, isz)
        lo, hi = start + bounds[me], start + bounds[me + 1]
        memmove(dst_at + done * isz, src_at + done * isz, (lo - done) * isz)  # up to this rank's part of the piece
        done = hi
    if pieces:
        memmove(dst_at + done * isz, src_at + done * isz, (pieces[-1][1] - done) * isz)


def allreduce_shared_outputs(
    node: "NodeCollectives", out: torch.Tensor, source: torch.Tensor, places: list[TensorPlace],
    pieces: list[tuple[int, int]], reducer: Callable[..., torch.Tensor], finish: Optional["Finish"],
    exposed: torch.Tensor,
) -> None:
    """Every local rank's block in shared memory (``exposed``: this rank's; the output pool's output
    ``out`` out of place, where the node's ranks share memory; a scratch block in place, ``source`` being
    ``out``), after every rank copied into it the parts of its input that the peers reduce
    (:func:`copy_peers_parts`) and passed the op's first barrier: each rank reduces its part of every
    piece from its ``source`` and the peers' blocks into ``out``, block by block (``finish`` on each
    while in the core's cache), and writes each block of the sum over the block it has just read in
    every peer's. Nothing goes through the slots, whatever the size: one copy, one reduction and one
    write from the cache per part (in place, one more copy: the peers' sums out of the scratch block),
    and two barriers per op. The parts and the reduction order are the copying way's (pieces of a slot,
    this rank's data first, then the peers' in rank order), so the results are the same bit for bit."""
    me, size, isz = node.local_rank, node.local_size, out.element_size()
    others = [tensor for rank, tensor in enumerate(_every_ranks_tensor(node, exposed, places)) if rank != me]
    addresses, out_at = [other.data_ptr() for other in others], out.data_ptr()
    reduce, (out, source, *others) = block_operands(reducer, [out, source, *others])
    step = max(1, REDUCE_BLOCK_BYTES // isz)
    with np.errstate(all="ignore"):
        for start, stop in pieces:
            bounds = part_bounds(stop - start, size, isz)
            lo, hi = start + bounds[me], start + bounds[me + 1]
            for a in range(lo, hi, step):
                b = min(a + step, hi)
                acc = reduce_in_order(reduce, source[a:b], [other[a:b] for other in others], out[a:b])
                if finish is not None:
                    finish_block(finish, acc)
                for address in addresses:
                    memmove(address + a * isz, out_at + a * isz, (b - a) * isz)
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
    me = node.local_rank
    check_published_sizes(places, me, mine.numel() * mine.element_size())
    return [mine if rank == me else node.peer_tensors.view(place, mine.dtype) for rank, place in enumerate(places)]
