"""Allreduce of a list of tensors that fits one slot (the engine's fused gradients), without staging.

The tensors are copied straight into views of the rank's slot, each rank reduces its part in place in
its own slot, and the results are copied straight from the slots into the outputs
(:func:`allreduce_copying`; one barrier and every slot reduced by every rank up to
``SMALL_ALLREDUCE_BYTES``: :func:`allreduce_small`). The views are built once per list of shapes
(:class:`TensorsLayout`) and reused every step. When the outputs are the inputs, a rank copies in only
what its peers reduce and reduces its own part in place (:func:`allreduce_in_place`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, NamedTuple, Optional, Sequence

import torch

from hvdray.collective.transport.reductions import reduce_in_order
from hvdray.collective.transport.shm.parts import SMALL_ALLREDUCE_BYTES, part_bounds
from hvdray.collective.transport.strategy import Finish

if TYPE_CHECKING:
    from hvdray.collective.transport.shm.node import CrossReduce, NodeCollectives

def checked_shapes(inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]) -> tuple[torch.Size, ...]:
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


def allreduce_copying(
    node: "NodeCollectives", layout: "TensorsLayout", inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor],
    reducer: Callable[..., torch.Tensor], cross: Optional["CrossReduce"], finish: Optional[Finish],
) -> None:
    """Two barriers: copy the inputs into this rank's slot, reduce this rank's part of every slot in
    place, then copy every part out of its owner's slot."""
    half = node.next_half()
    torch._foreach_copy_(layout.inputs[half], list(inputs))
    node.barrier.wait()
    # reduce my part in place in my slot: nobody else reads it until the next barrier
    acc = reduce_in_order(reducer, layout.own_part[half], layout.peer_parts[half], layout.own_part[half])
    if cross is not None and acc.numel():
        cross(acc)
    if finish is not None and acc.numel():
        finish([acc])
    node.barrier.wait()
    layout.copy_out(half, outputs)


def allreduce_small(
    node: "NodeCollectives", layout: "TensorsLayout", inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor],
    reducer: Callable[..., torch.Tensor], finish: Optional[Finish],
) -> None:
    """One barrier: every rank reduces every slot in rank order into its scratch, then scatters it."""
    half = node.next_half()
    torch._foreach_copy_(layout.inputs[half], list(inputs))
    node.barrier.wait()
    slots, acc = layout.whole[half], layout.scratch
    reduce_in_order(reducer, slots[0], slots[1:], acc)
    if finish is not None:
        finish([acc])
    torch._foreach_copy_(list(outputs), layout.scratch_views)


def allreduce_in_place(
    node: "NodeCollectives", layout: "TensorsLayout", tensors: Sequence[torch.Tensor],
    reducer: Callable[..., torch.Tensor], foreach_reducer: Callable[..., None], finish: Optional[Finish],
) -> None:
    """Reduce ``tensors`` in place: expose only the parts the peers reduce, reduce this rank's part
    straight in its tensors (one list op per peer), publish it, then collect the peers' parts."""
    plan = layout.in_place(node)
    flats = {}
    for i in plan.straddlers:
        if not tensors[i].is_contiguous():  # no flat view of it: the copying way
            allreduce_copying(node, layout, tensors, tensors, reducer, None, finish)
            return
        flats[i] = tensors[i].view(-1)
    others = [tensors[i] for i in plan.other_whole] + [flats[i][a:b] for i, a, b in plan.other_pieces]
    mine = [tensors[i] for i in plan.own_whole] + [flats[i][a:b] for i, a, b in plan.own_pieces]
    half = node.next_half()
    if others:
        torch._foreach_copy_(plan.expose[half], others)
    node.barrier.wait()
    if mine:
        for peer_views in plan.peers_own[half]:
            foreach_reducer(mine, peer_views)
        if finish is not None:
            finish(mine)
        torch._foreach_copy_(plan.publish[half], mine)
    node.barrier.wait()
    if others:
        torch._foreach_copy_(others, plan.collect[half])


@dataclass
class TensorsLayout:
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
    _in_place: Optional["InPlacePlan"] = None

    def in_place(self, node: "NodeCollectives") -> "InPlacePlan":
        """The views :func:`allreduce_in_place` uses (built on first use)."""
        if self._in_place is None:
            self._in_place = InPlacePlan.build(node, self.dtype, self.shapes)
        return self._in_place

    @classmethod
    def build(cls, node: "NodeCollectives", dtype: torch.dtype, shapes: tuple[torch.Size, ...]) -> "TensorsLayout":
        sizes = [shape.numel() for shape in shapes]
        numel, isz, me, size = sum(sizes), torch.empty((), dtype=dtype).element_size(), node.local_rank, node.local_size
        nbytes = numel * isz
        slots = node.slot_views(dtype)
        bounds = part_bounds(numel, size, isz)
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


@dataclass
class InPlacePlan:
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
    def build(cls, node: "NodeCollectives", dtype: torch.dtype, shapes: tuple[torch.Size, ...]) -> "InPlacePlan":
        me, size, slots = node.local_rank, node.local_size, node.slot_views(dtype)
        isz = torch.empty((), dtype=dtype).element_size()
        whole, pieces = _spans(shapes, part_bounds(sum(shape.numel() for shape in shapes), size, isz))
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
    straddle parts; ``bounds`` are the parts' offsets (:func:`part_bounds`). A zero-size tensor is
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
