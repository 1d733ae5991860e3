"""The shared-memory entries of the communicator's lists: every rank of the job on one node.

Allreduce goes through the node's segment (:meth:`NodeCollectives.allreduce`) and takes the engine's
fused tensor lists up to one slot; reducescatter, allgather and broadcast copy through the slots. The allreduce of an
empty tensor is left to the Gloo entries after it (nothing to move).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from hvdray.collective.transport.reductions import REDUCERS, TransportOp
from hvdray.collective.transport.shm.node import NodeCollectives
from hvdray.collective.transport.strategy import (
    AllgatherStrategy,
    AllreduceStrategy,
    BroadcastStrategy,
    Finish,
    ReducescatterStrategy,
    flat_view,
    on_contiguous,
)


class SharedMemoryAllreduce(AllreduceStrategy):
    """Allreduce among the ranks of one node through its segment (see ``node.py``)."""

    name = "shared memory"

    def __init__(self, node: NodeCollectives) -> None:
        self._node = node
        self.fused_message_bytes = node.slot_bytes

    def serves(self, tensor: torch.Tensor, op: TransportOp) -> bool:
        return tensor.numel() > 0

    def run(self, tensor: torch.Tensor, op: TransportOp, finish: Optional[Finish] = None) -> None:
        node = self._node
        on_contiguous(tensor, lambda flat: node.allreduce(flat, op, finish=finish))

    def run_into(
        self, source: torch.Tensor, output: torch.Tensor, op: TransportOp, finish: Optional[Finish] = None,
    ) -> None:
        if source.is_contiguous() and output.is_contiguous():  # no copy of source into output first
            self._node.allreduce(flat_view(output), op, source=flat_view(source), finish=finish)
        else:
            super().run_into(source, output, op, finish)

    def run_tensors(
        self, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor], op: TransportOp,
        finish: Optional[Finish], shapes: Optional[tuple[torch.Size, ...]],
    ) -> None:
        self._node.allreduce_tensors(inputs, outputs, op, None, finish, shapes)


class SharedMemoryAllgather(AllgatherStrategy):
    """Allgather among the ranks of one node through its segment's slots."""

    name = "shared memory allgather"

    def __init__(self, node: NodeCollectives) -> None:
        self._node = node

    def serves(self, tensor: torch.Tensor) -> bool:
        return True

    def run(self, tensor: torch.Tensor, out: torch.Tensor) -> None:
        if tensor.numel():
            self._node.allgather(flat_view(tensor.contiguous()), flat_view(out))


class SharedMemoryBroadcast(BroadcastStrategy):
    """Broadcast among the ranks of one node through the root's slot."""

    name = "shared memory broadcast"

    def __init__(self, node: NodeCollectives) -> None:
        self._node = node

    def serves(self, tensor: torch.Tensor, root: int) -> bool:
        return True

    def run(self, tensor: torch.Tensor, root: int) -> None:
        if tensor.numel():
            node = self._node
            on_contiguous(tensor, lambda flat: node.broadcast(flat, root))


class SharedMemoryReducescatter(ReducescatterStrategy):
    """Reducescatter among the ranks of one node through its segment's slots."""

    name = "shared memory reducescatter"

    def __init__(self, node: NodeCollectives) -> None:
        self._node = node

    def serves(self, tensor: torch.Tensor, op: TransportOp) -> bool:
        return op in REDUCERS

    def run(self, tensor: torch.Tensor, out: torch.Tensor, op: TransportOp) -> None:
        if out.numel():
            self._node.reducescatter(flat_view(tensor), flat_view(out), op)
