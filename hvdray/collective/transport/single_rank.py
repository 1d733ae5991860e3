"""The strategies of a job of one rank: every collective is the identity, so nothing goes through Gloo.

A size-1 job (``RayExecutor(num_workers=1)``, a one-worker Tune trial, an elastic job shrunk to one
worker) still runs the engine, and each tick ANDs its flags and reduces its gradients "across" one rank.
Through a Gloo group of one that costs a C++ work item per call (~40 us hot, several times that between a
training step's compute); here an in-place allreduce does nothing, and an out-of-place one copies.
"""

from __future__ import annotations

import sys
from typing import Optional, Sequence

import torch

from hvdray.collective.transport.reductions import TransportOp
from hvdray.collective.transport.strategy import (
    AllgatherStrategy,
    AllreduceStrategy,
    BroadcastStrategy,
    Finish,
    ReducescatterStrategy,
)


class SingleRankAllreduce(AllreduceStrategy):
    """Every reduction (Adasum's too) of one rank's tensor is the tensor itself. It takes fused lists of
    any size, so the engine hands a step's gradients over as they are, in place, with no fusion buffer."""

    name = "single rank"
    fused_message_bytes = sys.maxsize

    def serves(self, tensor: torch.Tensor, op: TransportOp) -> bool:
        return True

    def reduce(self, tensor: torch.Tensor, op: TransportOp) -> None:
        return None

    def run_tensors(
        self, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor], op: TransportOp,
        finish: Optional[Finish], shapes: Optional[tuple[torch.Size, ...]],
    ) -> None:
        for source, output in zip(inputs, outputs):
            if output is not source:
                output.copy_(source)
        if finish is not None:
            finish(list(outputs))


class SingleRankAllgather(AllgatherStrategy):
    """The gathered result of one rank is its tensor as the only row."""

    name = "single rank allgather"

    def serves(self, tensor: torch.Tensor) -> bool:
        return True

    def run(self, tensor: torch.Tensor, out: torch.Tensor) -> None:
        out[0].copy_(tensor)


class SingleRankBroadcast(BroadcastStrategy):
    """A broadcast from the only rank leaves its tensor as it is."""

    name = "single rank broadcast"

    def serves(self, tensor: torch.Tensor, root: int) -> bool:
        return True

    def run(self, tensor: torch.Tensor, root: int) -> None:
        return None


class SingleRankReducescatter(ReducescatterStrategy):
    """The one rank's chunk is its whole tensor, reduced with nothing."""

    name = "single rank reducescatter"

    def serves(self, tensor: torch.Tensor, op: TransportOp) -> bool:
        return True

    def run(self, tensor: torch.Tensor, out: torch.Tensor, op: TransportOp) -> None:
        out.copy_(tensor.view(out.shape))
