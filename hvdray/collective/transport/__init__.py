"""How the engine's collectives move data: ordered lists of strategies, the first that serves an op runs it.

The engine hands every op to :class:`Communicator`. For each collective with a choice of algorithm the
communicator holds an ordered list of strategies (``order.py``, after Horovod's operation manager);
each entry answers ``serves(tensor, op)`` and ``run``\\ s it; the first entry that serves an op runs it:

    allreduce   1. AdasumAllreduce         hvd.Adasum only: allgather, then the Adasum tree (adasum.py)
                2. SharedMemoryAllreduce   every rank on one node: the node's segment (shm/)
                   or HierarchicalAllreduce   several nodes: the segment, then this rank's part over a
                                              Gloo group across the nodes (hierarchical.py)
                then, with peer_sockets (the default), over the ranks' own TCP connections, on the
                engine thread (socket_strategies.py over sockets.py):
                3. SocketRecursiveDoubling  messages up to 1 MiB: log2 P exchanges of the whole message
                4. SocketHalvingDoubling    larger ones: a reduce-scatter by recursive halving, then an
                                            allgather by recursive doubling
                or, with peer_sockets off, over Gloo (gloo.py):
                3. GlooRecursiveDoubling   small messages among 4 ranks or more: log2 P exchanges
                4. GlooGatherReduce        small messages: allgather + reduction in rank order
                5. GlooRing                Gloo's allreduce: serves everything else (last in both lists)
                (3-5 are also the cross-node step of HierarchicalAllreduce, over its cross-node group)
    allgather   SharedMemoryAllgather (one node), SocketAllgather, GlooAllgather
    broadcast   SharedMemoryBroadcast (one node), SocketBroadcast, GlooBroadcast
    reducescatter  SharedMemoryReducescatter (one node), SocketReducescatter (the halving alone),
                GlooReducescatter
    alltoall    Gloo only (the job's Gloo group connects its full mesh at the first op that needs
                it: gloo.GlooGroup)
    a job of one rank: SingleRankAllreduce, SingleRankAllgather, SingleRankBroadcast and
    SingleRankReducescatter alone (the identity, no Gloo call: single_rank.py)

Which entries a rank's lists hold is fixed when the communicator is built, from the plan every rank
agrees on (``plan.py``: a shared-memory segment per node? hierarchical allreduce?), so every rank picks
the same entry for the same op. The engine's fused tensor lists (``allreduce_tensors``) go to the first
allreduce entry with a nonzero ``fused_message_bytes``.

A device transport over torch's NCCL process group is one more entry: a ``NcclAllreduce``
(``AllreduceStrategy``) whose ``serves`` answers for CUDA tensors and whose ``run`` calls the NCCL
group's allreduce, put after Adasum in ``ordered_strategies`` (likewise ``NcclAllgather`` and
``NcclBroadcast`` first in their lists), with the communicator building that group on the same store
as the Gloo one. CPU tensors never match its ``serves``, so nothing else changes.

Modules: ``communicator.py`` (the facade: groups, segment, lists), ``strategy.py`` (what a strategy
is, and the walk of a list), ``order.py`` (the lists), ``plan.py`` (the pure decisions),
``reductions.py`` (how ops are named and computed), ``gloo.py``, ``hierarchical.py``, ``adasum.py``,
``single_rank.py``, ``socket_strategies.py`` (over ``sockets.py``) and ``shm/`` (the strategies and what they run on).
"""

from hvdray.collective.transport.communicator import Communicator
from hvdray.collective.transport.gloo import GLOO_DTYPES
from hvdray.collective.transport.plan import TransportOptions

__all__ = ["GLOO_DTYPES", "Communicator", "TransportOptions"]
