"""Allreduce and reducescatter of tensors whose whole pages moved into shared memory where they lie.

A private tensor that an allreduce or a reducescatter reduces again and again has its whole pages moved
into a file of shared memory at the same addresses (``share_reduced_pages``;
:class:`~hvdray.collective.transport.shm.shared_pages.SharedPages`). From then on its ranks reduce it
straight between their tensors, as between tensors in torch shared memory (``shared_tensors.py``, whose
block loops these ways share), and only the bytes outside the whole pages, less than a page at each end
that share their pages with other memory, go through the slots: each rank copies its first and last
:data:`PAGE_BYTES` into its slot before the op's first barrier (:func:`prepare_pages`, :func:`copy_edges`),
and every rank reduces them for itself.

A loop that reduces the same tensors again and again runs on a plan made once (:class:`PagesPlans`): the
numpy views of every rank's pages, of the edges and of the outputs, cut into the blocks the reduction goes
through.
"""

from __future__ import annotations

import ctypes
from collections import OrderedDict
from typing import TYPE_CHECKING, Callable, Optional

import numpy as np
import torch

from hvdray.collective.transport.reductions import (
    Operand,
    block_operands,
    finish_block,
    reduce_in_order,
    unowned,
)
from hvdray.collective.transport.shm.parts import memmove
from hvdray.collective.transport.shm.segment import (
    PAGE_BYTES,
    PLACE_WORDS,
    PagesPlace,
    TensorPlace,
    check_published_sizes,
    place_from_words,
    place_words,
)
from hvdray.collective.transport.shm.shared_storage import shared_place
from hvdray.collective.transport.shm.shared_tensors import (
    all_into_operands,
    part_blocks,
    reduce_all_into_blocks,
    reduce_part_blocks,
)

if TYPE_CHECKING:
    from hvdray.collective.transport.shm.node import NodeCollectives
    from hvdray.collective.transport.strategy import Finish

#: where in its slot a rank says where the output of an out-of-place allreduce of moved pages lives (after its
#: edges, :func:`prepare_pages`): a flag (1: in shared memory) and its :class:`TensorPlace` (:func:`place_words`)
_OUTPUT_AT, _OUTPUT_WORDS = 2 * PAGE_BYTES, 1 + PLACE_WORDS
#: the slot an allreduce of tensors whose pages moved into shared memory needs (allreduce_shared_pages)
PAGES_SLOT_BYTES = _OUTPUT_AT + 8 * _OUTPUT_WORDS
#: the plans of shared-pages allreduces a rank keeps (:class:`PagesPlans`): a tensor, output and half of the
#: slots each
PAGES_PLANS_KEPT = 16

def allreduce_shared_pages(
    node: "NodeCollectives", out: torch.Tensor, source: torch.Tensor, places: list[PagesPlace], half: int,
    reducer: Callable[..., torch.Tensor], finish: Optional["Finish"] = None,
) -> None:
    """Every local rank's input (``source``; in place, ``out`` itself) with its whole pages in shared memory
    (``shared_pages.py``: ``places``, in rank order), and its first and last :data:`PAGE_BYTES` copied to the
    start of its slot of ``half`` before the op's first barrier (:func:`prepare_pages`). The elements that lie
    in every rank's whole pages are reduced as between tensors in shared memory: in place each rank reduces
    its part and writes it into every peer's tensor (as ``shared_tensors.allreduce_shared_tensors`` does);
    out of place likewise into every rank's output when all of them are in shared memory (the output pool's:
    each rank said where in its slot), else each rank reduces all of them into its own output (as
    ``shared_tensors.allreduce_shared_inputs`` does). The few before and after them (less than a page at
    each end), which share their pages with other memory and stay private, every rank reduces for itself
    from the slots, in rank order. Every rank gets the same bits. One barrier, at the end. The operands come
    from ``node.pages_plans`` (:class:`PagesPlans`): made once for a loop that reduces the same tensors
    again and again."""
    slots = node.slot_views(torch.uint8)[half]
    outputs = None if source is out else _published_outputs(slots)
    key = (source.data_ptr(), out.data_ptr(), out.numel(), out.dtype, reducer, half, *places, *(outputs or ()))
    plan = node.pages_plans.get(key, lambda: _PagesPlan(node, out, source, places, slots, outputs, reducer))
    plan.run(finish)
    node.barrier.wait()


def prepare_pages(source: torch.Tensor, out: torch.Tensor, slot: torch.Tensor) -> None:
    """Before the first barrier of an allreduce of moved pages (:func:`allreduce_shared_pages`): put
    ``source``'s edges in ``slot`` (:func:`copy_edges`), and out of place (``out`` another tensor) say there
    where ``out`` lives if it is in shared memory, so that the ranks can write their parts into each
    other's outputs."""
    copy_edges(source, slot)
    if out is source:
        return
    record = _output_record(slot)
    place = shared_place(out)
    if place is None:
        record[0] = 0
    else:
        record[1:] = list(place_words(place))
        record[0] = 1


def _published_outputs(slots: list[torch.Tensor]) -> Optional[list[TensorPlace]]:
    """Where every local rank's output lives (``slots``: every rank's, as bytes; :func:`prepare_pages`), if
    every one is in shared memory; else None."""
    places = []
    for slot in slots:
        record = _output_record(slot)
        if not record[0]:
            return None
        places.append(place_from_words(TensorPlace, record[1:]))
    return places


def _output_record(slot: torch.Tensor) -> ctypes.Array:
    """The words in ``slot`` (a rank's, as bytes) that say where its out-of-place output lives
    (:func:`prepare_pages`)."""
    return (ctypes.c_uint64 * _OUTPUT_WORDS).from_address(slot.data_ptr() + _OUTPUT_AT)


class _PagesPlan:
    """The operands of one :func:`allreduce_shared_pages` (its tensors, output, slots and every rank's place),
    made once: numpy views of the edges in the slots, of every rank's whole pages and of the outputs, cut into
    the blocks the reduction goes through. It holds the peers' mapped tensors (their memory stays mapped while
    the plan lives) and nothing of this rank's: its own views serve only while the key that found the plan
    (the same addresses, sizes and places) says they are this op's."""

    __slots__ = ("edge_reduce", "edges", "reduce", "blocks", "whole", "_peers_mapped")

    def __init__(
        self, node: "NodeCollectives", out: torch.Tensor, source: torch.Tensor, places: list[PagesPlace],
        slots: list[torch.Tensor], outputs: Optional[list[TensorPlace]], reducer: Callable[..., torch.Tensor],
    ) -> None:
        # this rank's tensors by their addresses: where numpy has no such dtype (bfloat16), the operands are
        # torch views of them, which the plan must not keep alive (:func:`unowned`)
        in_place = source is out
        out = unowned(out)
        source = out if in_place else unowned(source)
        me, isz, numel = node.local_rank, out.element_size(), out.numel()
        lo, hi = _whole_pages_of_all(places, me, numel * isz, isz)
        page = PAGE_BYTES // isz
        tail = slice(2 * page - (numel - hi), 2 * page)  # where the elements from ``hi`` on lie in the slots
        self.edge_reduce, (mine, *edges) = block_operands(
            reducer, [out, *(slot[: 2 * PAGE_BYTES].view(out.dtype) for slot in slots)])
        self.edges = [(own, theirs) for own, theirs in ((mine[:lo], [edge[:lo] for edge in edges]),
                                                        (mine[hi:], [edge[tail] for edge in edges])) if len(own)]
        inputs = [
            source[lo:hi] if rank == me else node.peer_tensors.view(place.span(lo * isz, hi * isz), out.dtype)
            for rank, place in enumerate(places)
        ]
        mapped = [tensor for rank, tensor in enumerate(inputs) if rank != me]
        self.whole = None
        if source is out:
            self.reduce, self.blocks = part_blocks(me, inputs, reducer)
        elif outputs is not None:  # every rank's part into every rank's output
            check_published_sizes(outputs, me, numel * isz)
            results = [
                out[lo:hi] if rank == me else node.peer_tensors.view(place, out.dtype)[lo:hi]
                for rank, place in enumerate(outputs)
            ]
            mapped += [tensor for rank, tensor in enumerate(results) if rank != me]
            self.reduce, self.blocks = part_blocks(me, inputs, reducer, results)
        else:
            self.reduce, self.whole, self.blocks = all_into_operands(inputs, out[lo:hi], reducer)
        self._peers_mapped = mapped

    def run(self, finish: Optional["Finish"]) -> None:
        with np.errstate(all="ignore"):
            for own, theirs in self.edges:
                reduce_in_order(self.edge_reduce, theirs[0], theirs[1:], own)
                if finish is not None:
                    finish_block(finish, own)
        if self.whole is not None:
            reduce_all_into_blocks(self.reduce, self.whole, self.blocks, finish)
        else:
            reduce_part_blocks(self.reduce, self.blocks, finish)


class PagesPlans:
    """The plans (:class:`_PagesPlan`, :class:`_ReducescatterPlan`) of the shared-pages allreduces and
    reducescatters a rank ran last, by their key, least recently used first: a loop that reduces the same
    tensor again and again finds its operands made, where making them again (a few dozen numpy and torch
    views, each costly with the cache cold after the op before) cost about a third of a 4 MB allreduce on the
    development machine. When the peers' mapped storages change (:attr:`PeerTensors.generation`: one a peer
    let go was dropped), every plan goes, so that none keeps such memory mapped."""

    def __init__(self, peers: "PeerTensors", capacity: int = PAGES_PLANS_KEPT) -> None:
        self.capacity = capacity
        self._peers = peers
        self._generation = peers.generation
        self._plans: OrderedDict[tuple, _PagesPlan] = OrderedDict()

    def get(self, key: tuple, make: Callable[[], _PagesPlan]) -> _PagesPlan:
        """The plan of ``key``, made by ``make()`` unless kept."""
        self.forget_if_peers_dropped()
        plan = self._plans.get(key)
        if plan is not None:
            self._plans.move_to_end(key)
            return plan
        plan = make()
        self.forget_if_peers_dropped()  # making it dropped a mapping, which the others may hold
        self._plans[key] = plan
        while len(self._plans) > self.capacity:
            self._plans.popitem(last=False)
        return plan

    def forget_if_peers_dropped(self) -> None:
        """Let every plan go if a peer's mapped storage was dropped since they were made (after each op: the
        memory a peer let go goes back to ``/dev/shm`` then, not at the next such allreduce)."""
        if self._generation != self._peers.generation:
            self.clear()

    def clear(self) -> None:
        self._plans.clear()
        self._generation = self._peers.generation

    def __len__(self) -> int:
        return len(self._plans)


def reducescatter_shared_pages(
    node: "NodeCollectives", rows: torch.Tensor, out: torch.Tensor, places: list[PagesPlace], half: int,
    reducer: Callable[..., torch.Tensor],
) -> None:
    """Every local rank's chunks (``rows``, one per local rank) with their whole pages in shared memory
    (``places``) and their first and last :data:`PAGE_BYTES` in its slot of ``half`` (:func:`copy_edges`):
    each rank reduces its own chunk into ``out``, its own data first and then the peers' in local-rank order,
    as the slots' way does (so the results are the same bit for bit), reading the peers' elements that lie in
    every rank's whole pages straight from their tensors and the few outside them (at the start of chunk 0 and
    the end of the last) from their slots. The last barrier keeps every input unchanged until all ranks have
    read it. The operands come from ``node.pages_plans`` (:class:`_ReducescatterPlan`), made once for a loop
    that reduces the same tensors into the same outputs again and again, as an allreduce's."""
    key = ("reducescatter", rows.data_ptr(), rows.numel(), out.data_ptr(), out.dtype, reducer, half, *places)
    plan = node.pages_plans.get(
        key, lambda: _ReducescatterPlan(node, rows, out, places, node.slot_views(torch.uint8)[half], reducer))
    plan.run()
    node.barrier.wait()


class _ReducescatterPlan:
    """The operands of one :func:`reducescatter_shared_pages`, made once: :func:`block_operands`' views of this
    rank's chunk where it lies before every rank's whole pages, in them and after them, of the peers' same
    elements (in their slots' edges, or in their mapped pages) and of the output. As :class:`_PagesPlan`, it
    holds the peers' mapped tensors and nothing of this rank's (:func:`unowned`)."""

    __slots__ = ("parts", "_peers_mapped")

    def __init__(
        self, node: "NodeCollectives", rows: torch.Tensor, out: torch.Tensor, places: list[PagesPlace],
        slots: list[torch.Tensor], reducer: Callable[..., torch.Tensor],
    ) -> None:
        me, width = node.local_rank, rows.shape[1]
        flat, out = unowned(rows), unowned(out)
        isz, numel = flat.element_size(), flat.numel()
        lo, hi = _whole_pages_of_all(places, me, numel * isz, isz)
        page = PAGE_BYTES // isz
        edges = [slot[: 2 * PAGE_BYTES].view(flat.dtype) for slot in slots]
        start, stop = me * width, (me + 1) * width
        peers = [rank for rank in range(node.local_size) if rank != me]
        #: each part's reducer and operands: this rank's elements, the peers' (in rank order), the output's
        self.parts: list[tuple[Callable[..., Operand], Operand, list[Operand], Operand]] = []
        self._peers_mapped: list[torch.Tensor] = []
        for a, b, where in ((start, min(stop, lo), "head"), (max(start, lo), min(stop, hi), "pages"),
                            (max(start, hi), stop, "tail")):
            if a >= b:
                continue
            if where == "head":
                theirs = [edges[rank][a:b] for rank in peers]
            elif where == "tail":
                theirs = [edges[rank][a - numel + 2 * page : b - numel + 2 * page] for rank in peers]
            else:
                theirs = [node.peer_tensors.view(places[rank].span(a * isz, b * isz), flat.dtype) for rank in peers]
                self._peers_mapped += theirs
            reduce, (own, result, *operands) = block_operands(reducer, [flat[a:b], out[a - start : b - start], *theirs])
            self.parts.append((reduce, own, operands, result))

    def run(self) -> None:
        with np.errstate(all="ignore"):
            for reduce, own, theirs, result in self.parts:
                reduce_in_order(reduce, own, theirs, result)


def _whole_pages_of_all(places: list[PagesPlace], me: int, nbytes: int, isz: int) -> tuple[int, int]:
    """The elements ``lo:hi`` of every rank's tensor (of ``nbytes`` bytes, this rank's size: checked) that lie
    in the whole pages of all of them."""
    check_published_sizes(places, me, nbytes)
    return -(-max(place.head for place in places) // isz), min(place.head + place.interior for place in places) // isz


def copy_edges(source: torch.Tensor, slot: torch.Tensor) -> None:
    """Put ``source``'s first and last :data:`PAGE_BYTES` (it has at least twice that) at the start of
    ``slot`` (bytes), one after the other: what :func:`allreduce_shared_pages` reads from a rank's slot."""
    nbytes = source.numel() * source.element_size()
    memmove(slot.data_ptr(), source.data_ptr(), PAGE_BYTES)
    memmove(slot.data_ptr() + PAGE_BYTES, source.data_ptr() + nbytes - PAGE_BYTES, PAGE_BYTES)
