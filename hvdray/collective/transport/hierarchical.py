"""Hierarchical allreduce: shared memory inside each node, Gloo between the nodes.

Each node's ranks reduce through their segment; the ranks that hold the same local rank on every node
form a Gloo group of their own (one per local rank) and allreduce, each for its own part of the data,
the part their node reduced; the nodes' segments then give every rank the whole result. The cross-node
step runs over that group's own connections (``peer_sockets``), or with ``peer_sockets`` off over its
Gloo group (gather-reduce for small parts, else the ring), which connects when first used.
Needs the same number of ranks on every node (``plan.plan_transport`` decides).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroupGloo

from hvdray.collective.transport.gloo import GlooGroup
from hvdray.collective.transport.mesh_store import prefixed
from hvdray.collective.transport.reductions import TransportOp
from hvdray.collective.transport.shm.node import CrossReduce, NodeCollectives
from hvdray.collective.transport.shm.strategies import SharedMemoryAllreduce
from hvdray.collective.transport.strategy import AllreduceStrategy, Finish, first_serving, on_contiguous


def cross_node_group(
    store: dist.Store, local_rank: int, node: int, num_nodes: int, options: "ProcessGroupGloo._Options"
) -> GlooGroup:
    """The Gloo group of the ranks with ``local_rank`` on every node (this rank is number ``node``),
    connected when a cross-node step first runs over it."""
    return GlooGroup(prefixed(store, f"hvdray-cross/{local_rank}/"), node, num_nodes, options)


class HierarchicalAllreduce(SharedMemoryAllreduce):
    """The shared-memory allreduce of this node, with this rank's reduced part allreduced across nodes
    by the first of ``cross`` (strategies over the cross-node group) that serves it."""

    name = "hierarchical"

    def __init__(self, node: NodeCollectives, cross: Sequence[AllreduceStrategy]) -> None:
        super().__init__(node)
        self._cross = tuple(cross)

    def run(self, tensor: torch.Tensor, op: TransportOp, finish: Optional[Finish] = None) -> None:
        node, cross = self._node, self._cross_step(op)
        on_contiguous(tensor, lambda flat: node.allreduce(flat, op, cross, finish=finish))

    def run_into(
        self, source: torch.Tensor, output: torch.Tensor, op: TransportOp, finish: Optional[Finish] = None,
    ) -> None:
        # the shared-memory parent reads ``source`` directly but has no cross-node step: copy, then run
        AllreduceStrategy.run_into(self, source, output, op, finish)

    def run_tensors(
        self, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor], op: TransportOp,
        finish: Optional[Finish], shapes: Optional[tuple[torch.Size, ...]],
    ) -> None:
        self._node.allreduce_tensors(inputs, outputs, op, self._cross_step(op), finish, shapes)

    def _cross_step(self, op: TransportOp) -> CrossReduce:
        """Allreduce a part this node reduced across the nodes, with the first cross strategy that serves it."""
        cross = self._cross
        return lambda part: first_serving(cross, part, op).run(part, op)
