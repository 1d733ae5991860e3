"""The ordered lists of strategies: the one place that says which algorithm runs each collective.

Every rank builds the same lists from the same plan, so every rank picks the same strategy for an op.
An op runs with the first entry whose ``serves`` answers yes; the last entry of each list serves
everything, so a list never runs dry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, TypeVar

from torch.distributed import ProcessGroupGloo

from hvdray.collective.transport.adasum import AdasumAllreduce
from hvdray.collective.transport.gloo import (
    GlooAllgather,
    GlooBroadcast,
    GlooGatherReduce,
    GlooRecursiveDoubling,
    GlooReducescatter,
    GlooRing,
)
from hvdray.collective.transport.hierarchical import HierarchicalAllreduce
from hvdray.collective.transport.shm.node import NodeCollectives
from hvdray.collective.transport.shm.strategies import (
    SharedMemoryAllgather,
    SharedMemoryAllreduce,
    SharedMemoryBroadcast,
    SharedMemoryReducescatter,
)
from hvdray.collective.transport.socket_strategies import (
    SocketAllgather,
    SocketBroadcast,
    SocketHalvingDoubling,
    SocketRecursiveDoubling,
    SocketReducescatter,
)
from hvdray.collective.transport.sockets import PeerSockets
from hvdray.collective.transport.single_rank import (
    SingleRankAllgather,
    SingleRankAllreduce,
    SingleRankBroadcast,
    SingleRankReducescatter,
)
from hvdray.collective.transport.strategy import (
    AllgatherStrategy,
    AllreduceStrategy,
    BroadcastStrategy,
    ReducescatterStrategy,
)

_Strategy = TypeVar("_Strategy")


@dataclass(frozen=True)
class Strategies:
    """One ordered list per collective that has a choice (alltoall is Gloo's only)."""

    allreduce: tuple[AllreduceStrategy, ...]
    allgather: tuple[AllgatherStrategy, ...]
    broadcast: tuple[BroadcastStrategy, ...]
    reducescatter: tuple[ReducescatterStrategy, ...]

    @property
    def fused(self) -> Optional[AllreduceStrategy]:
        """The first allreduce entry that takes fused tensor lists (the engine sizes its batches by it)."""
        return next((s for s in self.allreduce if s.fused_message_bytes), None)

    def names(self) -> dict[str, list[str]]:
        """Each list's entries by name, in order (for logs and tests)."""
        return {
            kind: [s.name for s in getattr(self, kind)]
            for kind in ("allreduce", "allgather", "broadcast", "reducescatter")
        }


def ordered_strategies(
    world: ProcessGroupGloo, node: Optional[NodeCollectives] = None, cross: Optional[ProcessGroupGloo] = None,
    peers: Optional[PeerSockets] = None, cross_peers: Optional[PeerSockets] = None,
) -> Strategies:
    """The lists for a job whose ranks share the Gloo group ``world``; ``node``: this node's shared-memory
    group, when the plan maps one; ``cross``: the Gloo group of this local rank across the nodes, when
    allreduce is hierarchical (allgather and broadcast then take Gloo, as the segment holds one node);
    ``peers`` and ``cross_peers``: the ranks' own connections among the ranks of ``world`` and of
    ``cross`` (``peer_sockets``). A job of one rank gets the identity strategies of
    ``single_rank.py`` alone."""
    if world.size() == 1:
        return Strategies(
            (SingleRankAllreduce(),), (SingleRankAllgather(),), (SingleRankBroadcast(),), (SingleRankReducescatter(),)
        )
    one_node = node if cross is None else None
    allgather = _present(
        SharedMemoryAllgather(one_node) if one_node is not None else None,
        SocketAllgather(peers) if peers is not None else None,
        GlooAllgather(world),
    )
    broadcast = _present(
        SharedMemoryBroadcast(one_node) if one_node is not None else None,
        SocketBroadcast(peers) if peers is not None else None,
        GlooBroadcast(world),
    )
    allreduce = _present(
        AdasumAllreduce(allgather, world.size()),
        SharedMemoryAllreduce(one_node) if one_node is not None else None,
        HierarchicalAllreduce(node, _network_allreduces(cross, cross_peers))
        if node is not None and cross is not None else None,
        *_network_allreduces(world, peers),
    )
    reducescatter = _present(
        SharedMemoryReducescatter(one_node) if one_node is not None else None,
        SocketReducescatter(peers) if peers is not None else None,
        GlooReducescatter(world),
    )
    return Strategies(allreduce, allgather, broadcast, reducescatter)


def _network_allreduces(group: ProcessGroupGloo, peers: Optional[PeerSockets]) -> tuple[AllreduceStrategy, ...]:
    """The allreduce strategies among ranks that do not share memory: over the ranks' own connections
    (``peers``, when there are: small messages by recursive doubling, the rest by halving-doubling), else
    over the Gloo ``group``; Gloo's ring last, for any reduction the others do not compute."""
    if peers is not None:
        return SocketRecursiveDoubling(peers), SocketHalvingDoubling(peers), GlooRing(group)
    return GlooRecursiveDoubling(group), GlooGatherReduce(group), GlooRing(group)


def _present(*entries: Optional[_Strategy]) -> tuple[_Strategy, ...]:
    return tuple(entry for entry in entries if entry is not None)
