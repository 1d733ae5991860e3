"""Allreduces, reducescatters, allgathers and broadcasts of every size over the ranks' own connections
(:class:`~hvdray.collective.transport.sockets.PeerSockets`), run by the engine thread itself: it sends,
waits in ``poll`` and receives, with no other thread in between.

:class:`SocketRecursiveDoubling` runs small allreduces (log2 P exchanges of the whole message);
:class:`SocketHalvingDoubling` larger ones over the same partners: a reduce-scatter by recursive halving
and an allgather by recursive doubling, which moves as many bytes per rank as Gloo's ring in log2 P steps
instead of P - 1; :class:`SocketReducescatter` is that reduce-scatter alone, splitting along the ranks'
chunks. :class:`SocketAllgather` gathers over the same partners (each round swaps every row a
rank holds), and :class:`SocketBroadcast` sends down a binomial tree over them.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from hvdray.collective.transport.reductions import REDUCERS, TransportOp
from hvdray.collective.transport.sockets import PeerSockets
from hvdray.collective.transport.strategy import (
    AllgatherStrategy,
    AllreduceStrategy,
    BroadcastStrategy,
    ReducescatterStrategy,
    on_contiguous,
)

#: the largest allreduce (bytes of one rank's tensor) the recursive doubling takes; larger ones take the
#: halving-doubling, which does not send the whole message log2 P times. ``python benchmarks/gloo_small.py
#: --ranks 2 4 8`` (2026-11-28, loopback) had the recursive doubling ahead of Gloo's allreduce, its
#: allgather + reduce and its recursive doubling at every size from 12 B to 1 MB among 2, 4 and 8
#: processes (1 MB: 2.8x, 2.1x and 3.7x Gloo's allreduce), and at 4 MB behind Gloo's ring among 4 and 8
#: (0.86x, 0.83x).
SOCKET_ALLREDUCE_BYTES = 1 << 20

#: the halving-doubling receives what it reduces in pieces of this many bytes, reduced while in the cache
HALVING_PIECE_BYTES = 1 << 20


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """A writable flat byte view of the contiguous ``tensor`` (any dtype and shape)."""
    if not tensor.is_contiguous():
        raise ValueError("hvdray's connections move contiguous tensors only (a reshape would copy)")
    return memoryview(tensor.detach().reshape(-1).view(torch.uint8).numpy()).cast("B")


class SocketRecursiveDoubling(AllreduceStrategy):
    """Small allreduces (at most :data:`SOCKET_ALLREDUCE_BYTES`) as a recursive doubling over
    :class:`PeerSockets`: the engine's per-tick flags and small tensors, in one thread."""

    name = "socket recursive doubling"

    def __init__(self, peers: PeerSockets) -> None:
        self._peers = peers
        self._size = peers.size

    def serves(self, tensor: torch.Tensor, op: TransportOp) -> bool:
        return (
            self._size > 1 and op in REDUCERS
            and tensor.numel() * tensor.element_size() <= SOCKET_ALLREDUCE_BYTES
        )

    def reduce(self, tensor: torch.Tensor, op: TransportOp) -> None:
        if tensor.numel():
            reducer = REDUCERS[op]
            on_contiguous(tensor, lambda flat: _recursive_doubling(self._peers, flat, reducer))


def _recursive_doubling(peers: PeerSockets, flat: torch.Tensor, reducer: Callable[..., torch.Tensor]) -> None:
    """Reduce the flat contiguous ``flat`` in place across ``peers``' group with ``reducer``."""
    theirs = torch.empty_like(flat)
    _doubling(peers, _bytes_of(flat), _bytes_of(theirs), lambda: reducer(flat, theirs, out=flat))


def and_bytes(peers: PeerSockets, data: memoryview) -> None:
    """Bitwise-AND the bytes of ``data`` in place across ``peers``' group: the recursive doubling, each
    step combined as Python ints (no torch op; the engine's flags every tick)."""
    theirs = bytearray(len(data))

    def combine() -> None:
        data[:] = (int.from_bytes(data, "little") & int.from_bytes(theirs, "little")).to_bytes(len(data), "little")

    _doubling(peers, data, memoryview(theirs), combine)


def _doubling(peers: PeerSockets, mine: memoryview, received: memoryview, combine: Callable[[], object]) -> None:
    """The steps of ``peers``' recursive doubling on ``mine``: ``combine()`` folds ``received`` into it."""
    for kind, peer, _ in peers.steps:
        if kind == "send":
            peers.transfer(peer, mine, None)
        elif kind == "receive":
            peers.transfer(peer, None, mine)
        else:
            peers.transfer(peer, mine if kind == "exchange" else None, received)
            combine()


class SocketHalvingDoubling(AllreduceStrategy):
    """Large allreduces (above :data:`SOCKET_ALLREDUCE_BYTES`) over :class:`PeerSockets`: a reduce-scatter
    by recursive halving, then an allgather by recursive doubling, between the same partners as the
    small messages' recursive doubling. Each rank sends and receives about 2 S (P-1)/P bytes of an
    S-byte message, as in Gloo's ring, in 2 log2 P exchanges instead of the ring's 2 (P-1) hops, and
    in the engine's own thread."""

    name = "socket halving-doubling"

    def __init__(self, peers: PeerSockets) -> None:
        self._peers = peers
        self._size = peers.size
        self._scratch = torch.empty(HALVING_PIECE_BYTES, dtype=torch.uint8)

    def serves(self, tensor: torch.Tensor, op: TransportOp) -> bool:
        return self._size > 1 and op in REDUCERS

    def reduce(self, tensor: torch.Tensor, op: TransportOp) -> None:
        if tensor.numel():
            reducer = REDUCERS[op]
            on_contiguous(tensor, lambda flat: _halving_doubling(self._peers, flat, reducer, self._scratch))


def _halving_doubling(
    peers: PeerSockets, flat: torch.Tensor, reducer: Callable[..., torch.Tensor], scratch: torch.Tensor
) -> None:
    """Reduce the flat contiguous ``flat`` in place across ``peers``' group with ``reducer``, receiving
    what is reduced piece by piece into ``scratch`` (uint8; its bytes a multiple of every element size).

    With P the largest power of two up to the group's size, ranks from P on first fold their data into
    rank ``rank - P`` and get the result back at the end (as in :func:`~hvdray.collective.transport.gloo.
    recursive_doubling`). Among ranks 0..P-1, round k pairs each rank with the one differing in bit k:
    both hold the same block, each keeps one half (the lower for the rank whose bit is clear), sends the
    other and reduces its partner's copy of the kept half into its own. After log2 P rounds each rank
    holds one P-th of the result, reduced by that rank alone; the rounds then run backwards, each
    partner sending its part and receiving the other's, so every rank ends with the same bits."""
    rank, size = peers.rank, peers.size
    power = 1 << (size.bit_length() - 1)
    if rank >= power:
        mine = _bytes_of(flat)
        peers.transfer(rank - power, mine, None)
        peers.transfer(rank - power, None, mine)
        return
    folded = rank + power < size
    pieces = scratch.view(flat.dtype)
    if folded:
        _reduce_exchange(peers, rank + power, flat[:0], flat, pieces, reducer)
    lo, hi = 0, flat.numel()
    blocks = []
    bit = 1
    while bit < power:
        mid = lo + (hi - lo) // 2
        keep, give = ((mid, hi), (lo, mid)) if rank & bit else ((lo, mid), (mid, hi))
        blocks.append((lo, hi))
        _reduce_exchange(peers, rank ^ bit, flat[give[0]:give[1]], flat[keep[0]:keep[1]], pieces, reducer)
        lo, hi = keep
        bit <<= 1
    while blocks:
        bit >>= 1
        whole_lo, whole_hi = blocks.pop()
        other = (whole_lo, lo) if lo > whole_lo else (hi, whole_hi)
        peers.transfer(rank ^ bit, _bytes_of(flat[lo:hi]), _bytes_of(flat[other[0]:other[1]]))
        lo, hi = whole_lo, whole_hi
    if folded:
        peers.transfer(rank + power, _bytes_of(flat), None)


def _reduce_exchange(
    peers: PeerSockets, peer: int, give: torch.Tensor, keep: torch.Tensor, pieces: torch.Tensor,
    reducer: Callable[..., torch.Tensor], keep_from: Optional[torch.Tensor] = None,
) -> None:
    """Send ``give`` to ``peer`` while receiving its copy of ``keep`` and reducing it into ``keep`` (with
    ``keep_from``, of ``keep``'s length: reducing it and the copy into ``keep``), a piece of ``pieces``'
    length at a time: each piece is reduced while it is still in the cache, and while the rest of
    ``give`` keeps going out."""
    done = 0
    mine = keep if keep_from is None else keep_from

    def reduce_piece(nbytes: int) -> None:
        nonlocal done
        count = nbytes // keep.element_size()
        reducer(mine[done:done + count], pieces[:count], out=keep[done:done + count])
        done += count

    peers.transfer(peer, _bytes_of(give), _bytes_of(pieces), reduce_piece, keep.numel() * keep.element_size())


class SocketReducescatter(ReducescatterStrategy):
    """Reducescatters over :class:`PeerSockets`: the recursive halving of :class:`SocketHalvingDoubling`,
    split along the ranks' chunks so that each rank ends with its own. Each rank sends and receives
    about S (P-1)/P bytes of an S-byte tensor in log2 P exchanges, reduced piece by piece as it arrives.
    The tensor is read only: the first exchange reduces it and the partner's data into a work buffer,
    where the later ones go on; the buffer is kept for the next call (it grows to the largest tensor)."""

    name = "socket reducescatter"

    def __init__(self, peers: PeerSockets) -> None:
        self._peers = peers
        self._size = peers.size
        self._scratch = torch.empty(HALVING_PIECE_BYTES, dtype=torch.uint8)
        self._work = torch.empty(0, dtype=torch.uint8)

    def serves(self, tensor: torch.Tensor, op: TransportOp) -> bool:
        return self._size > 1 and op in REDUCERS

    def run(self, tensor: torch.Tensor, out: torch.Tensor, op: TransportOp) -> None:
        if not out.numel():
            return
        peers, size = self._peers, self._size
        chunks = tensor.view(size, -1)
        power = 1 << (size.bit_length() - 1)
        if peers.rank >= power:  # folded into rank - power: sends its tensor, receives its chunk
            peers.transfer(peers.rank - power, _bytes_of(chunks), None)
            peers.transfer(peers.rank - power, None, _bytes_of(out))
            return
        nbytes = chunks.numel() * chunks.element_size()
        if self._work.numel() < nbytes:
            self._work = torch.empty(nbytes, dtype=torch.uint8)
        work = self._work[:nbytes].view(chunks.dtype).view(chunks.shape)
        _halving_reducescatter(peers, chunks, work, REDUCERS[op], self._scratch)
        out.copy_(work[peers.rank].view(out.shape))


def _halving_reducescatter(
    peers: PeerSockets, chunks: torch.Tensor, work: torch.Tensor, reducer: Callable[..., torch.Tensor],
    scratch: torch.Tensor,
) -> None:
    """On a rank below P, the largest power of two up to the group's size: reduce row ``rank`` of
    ``chunks`` (contiguous, one row per rank; read only) across ``peers``' group with ``reducer`` into
    the same row of ``work`` (shaped as ``chunks``), receiving what is reduced piece by piece into
    ``scratch``. The first exchange reduces from ``chunks`` into ``work``, the later ones in ``work``.

    With P the largest power of two up to the group's size, rank ``r + P`` (where there is one) first
    hands all its rows to rank ``r``, which reduces them into its own and hands row r + P back at the end.
    Among ranks 0..P-1, rounds go from the highest bit down: the ranks that share their higher bits hold
    one block of rows (a contiguous run of rows below P, and the run of those rows plus P), and each rank
    keeps the half of that block its bit names (the upper for a set bit), sends the other half to its
    partner differing in that bit and reduces the partner's copy of the kept half into its own. After
    log2 P rounds rank r holds rows r and r + P, reduced across the group."""
    rank, size = peers.rank, peers.size
    power = 1 << (size.bit_length() - 1)
    pieces = scratch.view(chunks.dtype)
    folded = rank + power < size
    source = chunks
    if folded:
        _reduce_exchange(peers, rank + power, chunks[:0], work.view(-1), pieces, reducer, chunks.view(-1))
        source = work
    lo, hi = 0, power
    bit = power >> 1
    while bit:
        mid = lo + bit
        keep, give = ((mid, hi), (lo, mid)) if rank & bit else ((lo, mid), (mid, hi))
        peer = rank ^ bit
        _reduce_exchange(peers, peer, _rows(source, give), _rows(work, keep), pieces, reducer, _rows(source, keep))
        give_extra, keep_extra = _rows(source, give, power), _rows(work, keep, power)
        if give_extra.numel() or keep_extra.numel():
            _reduce_exchange(peers, peer, give_extra, keep_extra, pieces, reducer, _rows(source, keep, power))
        source = work
        lo, hi = keep
        bit >>= 1
    if folded:
        peers.transfer(rank + power, _bytes_of(work[rank + power]), None)


def _rows(chunks: torch.Tensor, bounds: tuple[int, int], offset: int = 0) -> torch.Tensor:
    """Rows ``bounds`` (shifted by ``offset``, cut at the last row) of ``chunks``, as one flat tensor."""
    return chunks[bounds[0] + offset:bounds[1] + offset].view(-1)


class SocketAllgather(AllgatherStrategy):
    """Allgathers over :class:`PeerSockets` (the lengths and messages of the engine's full rounds, tensors
    of any size): a recursive doubling, each round exchanging every row a rank holds with its partner,
    so that each rank receives each other rank's row once ((P-1)/P of the result, as Gloo's ring), in
    log2 P exchanges, on the engine thread."""

    name = "socket allgather"

    def __init__(self, peers: PeerSockets) -> None:
        self._peers = peers
        self._size = peers.size

    def serves(self, tensor: torch.Tensor) -> bool:
        return self._size > 1

    def run(self, tensor: torch.Tensor, out: torch.Tensor) -> None:
        if not tensor.numel():
            return
        rows = out.view(self._size, -1).view(torch.uint8)
        rows[self._peers.rank].copy_(tensor.contiguous().view(-1).view(torch.uint8))
        _doubling_allgather(self._peers, rows)


def _doubling_allgather(peers: PeerSockets, rows: torch.Tensor) -> None:
    """Fill every row of ``rows`` (uint8, one row per rank, this rank's own already in place) with its
    rank's bytes.

    With P the largest power of two up to the group's size, rank ``r + P`` (where there is one) first
    hands its row to rank ``r``, which then holds rows r and r + P. In round k each rank of 0..P-1 and
    its partner differing in bit k swap what they hold: the rows of the 2^k ranks sharing their higher
    bits (one contiguous block), and those ranks' rows from P on (a second block). After log2 P rounds
    ranks 0..P-1 hold every row; each sends the whole result to its rank ``r + P`` last."""
    rank, size = peers.rank, peers.size
    power = 1 << (size.bit_length() - 1)
    if rank >= power:
        peers.transfer(rank - power, _bytes_of(rows[rank]), None)
        peers.transfer(rank - power, None, _bytes_of(rows))
        return
    folded = rank + power < size
    if folded:
        peers.transfer(rank + power, None, _bytes_of(rows[rank + power]))
    bit = 1
    while bit < power:
        mine, theirs = rank & ~(bit - 1), (rank ^ bit) & ~(bit - 1)
        peers.transfer(rank ^ bit, _bytes_of(rows[mine:mine + bit]), _bytes_of(rows[theirs:theirs + bit]))
        mine_extra, theirs_extra = rows[power + mine:power + mine + bit], rows[power + theirs:power + theirs + bit]
        if mine_extra.numel() or theirs_extra.numel():
            peers.transfer(rank ^ bit, _bytes_of(mine_extra), _bytes_of(theirs_extra))
        bit <<= 1
    if folded:
        peers.transfer(rank + power, _bytes_of(rows), None)


class SocketBroadcast(BroadcastStrategy):
    """Broadcasts over :class:`PeerSockets` (parameters, objects, tensors of any size): a binomial tree over
    the recursive-doubling partners, rooted at ``root``; each rank but the root receives the tensor once."""

    name = "socket broadcast"

    def __init__(self, peers: PeerSockets) -> None:
        self._peers = peers
        self._size = peers.size

    def serves(self, tensor: torch.Tensor, root: int) -> bool:
        return self._size > 1

    def run(self, tensor: torch.Tensor, root: int) -> None:
        if tensor.numel():
            on_contiguous(tensor, lambda flat: _binomial_broadcast(self._peers, _bytes_of(flat), root))


def _binomial_broadcast(peers: PeerSockets, data: memoryview, root: int) -> None:
    """Give every rank ``root``'s ``data``, in place.

    With P the largest power of two up to the group's size, a root from P on first hands its data to
    rank ``root - P``, the tree's root then. Among ranks 0..P-1, numbered from the tree's root by XOR (so
    that partners stay partners), the rounds go from the highest bit to the lowest: each rank that holds
    the data sends it to its partner differing in that bit. Last, each rank r holds it for rank
    ``r + P`` (where there is one, and it is not the root)."""
    rank, size = peers.rank, peers.size
    power = 1 << (size.bit_length() - 1)
    top = root - power if root >= power else root
    if rank >= power:
        if rank == root:
            peers.transfer(rank - power, data, None)
        else:
            peers.transfer(rank - power, None, data)
        return
    if root >= power and rank == top:
        peers.transfer(root, None, data)
    virtual = rank ^ top
    bit = power >> 1
    while bit:
        low = virtual & (2 * bit - 1)
        if low == 0:
            peers.transfer(rank ^ bit, data, None)
        elif low == bit:
            peers.transfer(rank ^ bit, None, data)
        bit >>= 1
    if rank + power < size and rank + power != root:
        peers.transfer(rank + power, data, None)


__all__ = [
    "HALVING_PIECE_BYTES", "SOCKET_ALLREDUCE_BYTES", "SocketAllgather", "SocketBroadcast", "SocketHalvingDoubling",
    "SocketRecursiveDoubling", "SocketReducescatter",
]
