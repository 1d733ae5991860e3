"""Adasum: combine gradients so that orthogonal parts add and parallel parts are averaged.

For two gradients ``a`` and ``b`` the pairwise operator is

    adasum(a, b) = (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b

so orthogonal vectors add (``a.b = 0``) and identical vectors give the vector itself. Ranks are
combined along a binary tree, as Horovod's recursive doubling does: level 1 combines ranks
(0, 1), (2, 3), ...; level 2 combines those results pairwise, and so on. With a number of ranks that
is not a power of two, the last node of an odd-sized level has no partner and moves up a level
unchanged (so with 3 ranks the result is ``adasum(adasum(g0, g1), g2)``). Dot products and norms are
computed in float64 whatever the tensor's dtype; every rank evaluates the same tree over the same
gathered inputs, so every rank gets bit-identical results.

:class:`AdasumAllreduce` is the first entry of the communicator's allreduce list: it serves
``hvd.Adasum`` and nothing else, gathering every rank's tensor with the allgather list.
"""

from __future__ import annotations

from typing import Sequence

import torch

from hvdray.collective.protocol import ReduceOp as Reduction
from hvdray.collective.transport.reductions import TransportOp
from hvdray.collective.transport.strategy import AllgatherStrategy, AllreduceStrategy, first_serving

_ADASUM = Reduction.ADASUM  # a module constant: an enum member's attribute lookup costs more, every op


def adasum_pair(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The Adasum of two gradients (float64 arithmetic); a zero gradient leaves the other unchanged."""
    a64, b64 = a.reshape(-1).double(), b.reshape(-1).double()
    dot = torch.dot(a64, b64)
    aa = torch.dot(a64, a64)
    bb = torch.dot(b64, b64)
    ca = 1.0 - dot / (2.0 * aa) if aa > 0 else torch.tensor(1.0, dtype=torch.float64)
    cb = 1.0 - dot / (2.0 * bb) if bb > 0 else torch.tensor(1.0, dtype=torch.float64)
    return (ca * a64 + cb * b64).reshape(a.shape)


def adasum_tree(gradients: Sequence[torch.Tensor]) -> torch.Tensor:
    """Combine one gradient per rank (in rank order) along the binary tree described above (float64)."""
    if not gradients:
        raise ValueError("adasum_tree needs at least one gradient")
    level = [g.double() for g in gradients]
    while len(level) > 1:
        nxt = [adasum_pair(level[i], level[i + 1]) for i in range(0, len(level) - 1, 2)]
        if len(level) % 2:
            nxt.append(level[-1])
        level = nxt
    return level[0]


class AdasumAllreduce(AllreduceStrategy):
    """Adasum: every rank's tensor gathered (by the first of ``allgather`` that serves it), then combined
    along the tree above on every rank."""

    name = "adasum"

    def __init__(self, allgather: Sequence[AllgatherStrategy], size: int) -> None:
        self._allgather = tuple(allgather)
        self._size = size

    def serves(self, tensor: torch.Tensor, op: TransportOp) -> bool:
        return op is _ADASUM

    def reduce(self, tensor: torch.Tensor, op: TransportOp) -> None:
        gathered = torch.empty((self._size, *tensor.shape), dtype=tensor.dtype)
        first_serving(self._allgather, tensor).run(tensor, gathered)
        tensor.copy_(adasum_tree(list(gathered.unbind(0))))
