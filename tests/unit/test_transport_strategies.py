"""The transport's ordered strategy lists without Ray: which entries each plan builds and in what order,
that an op runs with the first entry that serves it, what each entry serves, and a one-process
communicator end to end."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed import ProcessGroupGloo, ReduceOp

from hvdray.collective.protocol import ReduceOp as Reduction
from hvdray.collective.transport import Communicator
from hvdray.collective.transport.adasum import AdasumAllreduce
from hvdray.collective.transport.gloo import (
    GATHER_REDUCE_BYTES,
    RECURSIVE_DOUBLING_BYTES,
    RECURSIVE_DOUBLING_MIN_RANKS,
    GlooAllgather,
    GlooBroadcast,
    GlooGatherReduce,
    GlooRecursiveDoubling,
    GlooReducescatter,
    GlooRing,
    group_options,
)
from hvdray.collective.transport.order import Strategies, ordered_strategies
from hvdray.collective.transport.reductions import GLOO_OPS, TRANSPORT_OPS
from hvdray.collective.transport.shm.strategies import SharedMemoryAllreduce
from hvdray.collective.transport.socket_strategies import (
    SOCKET_ALLREDUCE_BYTES,
    SocketAllgather,
    SocketBroadcast,
    SocketRecursiveDoubling,
)
from hvdray.collective.transport.strategy import AllreduceStrategy, NoStrategyError, first_serving

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gloo_threads import in_threads  # noqa: E402 - shared by the unit tests that run ranks as threads


class _Group:
    """Stands in for a ProcessGroupGloo: the strategies read only its size and rank when built."""

    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return 0


class _Peers:
    """Stands in for PeerSockets: the socket strategy reads only its size when built."""

    def __init__(self, size: int) -> None:
        self.size = size


class _Node:
    """Stands in for NodeCollectives: the strategies read only its slot size and local size when built."""

    slot_bytes = 1 << 20
    local_size = 2


def test_gloo_only_lists():
    strategies = ordered_strategies(_Group(4))
    assert strategies.names() == {
        "allreduce": ["adasum", "gloo recursive doubling", "gloo gather-reduce", "gloo ring"],
        "allgather": ["gloo allgather"],
        "broadcast": ["gloo broadcast"],
        "reducescatter": ["gloo reducescatter"],
    }
    assert strategies.fused is None


def test_network_allreduces_take_the_ranks_own_connections():
    """With peer_sockets (the default) every network allreduce list runs over the sockets (Gloo's ring
    stays last, for a reduction they do not compute): the job's list, and the cross-node step of
    hierarchical allreduce over its own connections."""
    strategies = ordered_strategies(_Group(4), peers=_Peers(4))
    assert strategies.names()["allreduce"] == [
        "adasum", "socket recursive doubling", "socket halving-doubling", "gloo ring"
    ]
    hierarchical = ordered_strategies(_Group(4), _Node(), cross=_Group(2), peers=_Peers(4), cross_peers=_Peers(2))
    assert hierarchical.names()["allreduce"] == [
        "adasum", "hierarchical", "socket recursive doubling", "socket halving-doubling", "gloo ring",
    ]
    assert strategies.names()["allgather"] == ["socket allgather", "gloo allgather"]
    assert strategies.names()["broadcast"] == ["socket broadcast", "gloo broadcast"]
    assert strategies.names()["reducescatter"] == ["socket reducescatter", "gloo reducescatter"]
    assert hierarchical.names()["allgather"] == ["socket allgather", "gloo allgather"]
    cross = hierarchical.allreduce[1]._cross
    assert [s.name for s in cross][:2] == ["socket recursive doubling", "socket halving-doubling"]
    assert cross[0]._size == 2  # the cross-node group's connections, not the job's


def test_one_node_lists_put_shared_memory_before_gloo():
    strategies = ordered_strategies(_Group(2), _Node())
    assert strategies.names() == {
        "allreduce": ["adasum", "shared memory", "gloo recursive doubling", "gloo gather-reduce", "gloo ring"],
        "allgather": ["shared memory allgather", "gloo allgather"],
        "broadcast": ["shared memory broadcast", "gloo broadcast"],
        "reducescatter": ["shared memory reducescatter", "gloo reducescatter"],
    }
    assert strategies.fused is strategies.allreduce[1] and strategies.fused.fused_message_bytes == _Node.slot_bytes


def test_several_nodes_reduce_hierarchically_and_gather_over_gloo():
    strategies = ordered_strategies(_Group(4), _Node(), cross=_Group(2))
    assert strategies.names() == {
        "allreduce": ["adasum", "hierarchical", "gloo recursive doubling", "gloo gather-reduce", "gloo ring"],
        "allgather": ["gloo allgather"],
        "broadcast": ["gloo broadcast"],
        "reducescatter": ["gloo reducescatter"],
    }
    assert strategies.fused is strategies.allreduce[1]


class _Recording(AllreduceStrategy):
    def __init__(self, name: str, serves_numel: set[int], ran: list[str]) -> None:
        self.name, self._numels, self._ran = name, serves_numel, ran

    def serves(self, tensor, op):
        return tensor.numel() in self._numels

    def reduce(self, tensor, op):
        self._ran.append(self.name)


def test_an_op_runs_with_the_first_entry_that_serves_it():
    """An entry put first (as a device transport would be) takes only what it serves; the rest falls through."""
    ran: list[str] = []
    strategies = [_Recording("device", {1}, ran), _Recording("shm", {1, 2}, ran), _Recording("ring", {1, 2, 3}, ran)]
    for numel in (1, 2, 3):
        tensor = torch.zeros(numel)
        first_serving(strategies, tensor, ReduceOp.SUM).run(tensor, ReduceOp.SUM)
    assert ran == ["device", "shm", "ring"]
    with pytest.raises(NoStrategyError, match=r"of \['device', 'shm', 'ring'\] serves"):
        first_serving(strategies, torch.zeros(4), ReduceOp.SUM)


def test_what_each_entry_serves():
    adasum, ring = AdasumAllreduce((), 4), GlooRing(_Group(4))
    assert adasum.serves(torch.ones(3), Reduction.ADASUM) and not adasum.serves(torch.ones(3), ReduceOp.SUM)
    assert ring.serves(torch.ones(1 << 20), ReduceOp.SUM)
    shm = SharedMemoryAllreduce(_Node())
    assert shm.serves(torch.ones(1), ReduceOp.SUM) and not shm.serves(torch.ones(0), ReduceOp.SUM)
    # the gather-reduce takes messages whose every-rank copies fit GATHER_REDUCE_BYTES, between several ranks
    small = GlooGatherReduce(_Group(4))
    largest = GATHER_REDUCE_BYTES // (4 * 4)
    assert small.serves(torch.ones(largest), ReduceOp.SUM) and small.serves(torch.ones(5), ReduceOp.BAND)
    assert not small.serves(torch.ones(largest + 1), ReduceOp.SUM)
    assert not small.serves(torch.ones(5), Reduction.ADASUM)
    assert not GlooGatherReduce(_Group(1)).serves(torch.ones(5), ReduceOp.SUM)
    # the recursive doubling takes messages up to RECURSIVE_DOUBLING_BYTES among enough ranks
    doubling = GlooRecursiveDoubling(_Group(RECURSIVE_DOUBLING_MIN_RANKS))
    largest = RECURSIVE_DOUBLING_BYTES // 4
    assert doubling.serves(torch.ones(largest), ReduceOp.SUM) and doubling.serves(torch.ones(257, dtype=torch.uint8),
                                                                                ReduceOp.BAND)
    assert not doubling.serves(torch.ones(largest + 1), ReduceOp.SUM)
    assert not doubling.serves(torch.ones(5), Reduction.ADASUM)
    assert not GlooRecursiveDoubling(_Group(RECURSIVE_DOUBLING_MIN_RANKS - 1)).serves(torch.ones(5), ReduceOp.SUM)
    # the sockets take messages up to SOCKET_ALLREDUCE_BYTES among any number of ranks above one
    sockets = SocketRecursiveDoubling(_Peers(2))
    largest = SOCKET_ALLREDUCE_BYTES // 4
    assert sockets.serves(torch.ones(largest), ReduceOp.SUM) and sockets.serves(torch.ones(3, dtype=torch.uint8),
                                                                              ReduceOp.BAND)
    assert not sockets.serves(torch.ones(largest + 1), ReduceOp.SUM)
    assert not sockets.serves(torch.ones(5), Reduction.ADASUM)
    assert not SocketRecursiveDoubling(_Peers(1)).serves(torch.ones(5), ReduceOp.SUM)
    gather = SocketAllgather(_Peers(4))  # any size: each rank receives each other row once
    assert gather.serves(torch.ones(4 * SOCKET_ALLREDUCE_BYTES)) and not SocketAllgather(_Peers(1)).serves(
        torch.ones(5))
    broadcast = SocketBroadcast(_Peers(4))  # any size: a binomial tree
    assert broadcast.serves(torch.ones(4 * largest), 3) and not SocketBroadcast(_Peers(1)).serves(torch.ones(5), 0)


def test_ops_reach_the_strategies_as_gloo_reductions_or_adasum():
    assert TRANSPORT_OPS[Reduction.AVERAGE] == ReduceOp.SUM  # the engine divides afterwards
    assert TRANSPORT_OPS["max"] == ReduceOp.MAX  # the engine's wire format carries plain strings
    assert TRANSPORT_OPS["adasum"] is Reduction.ADASUM
    assert Reduction.ADASUM not in GLOO_OPS


def test_a_one_process_communicator_runs_every_op_as_the_identity():
    comm = Communicator(dist.HashStore(), 0, 1, timeout_s=5.0)
    try:
        assert comm.transport == "gloo"
        assert comm.strategies.names() == {"allreduce": ["single rank"], "allgather": ["single rank allgather"],
                                           "broadcast": ["single rank broadcast"],
                                           "reducescatter": ["single rank reducescatter"]}
        t = torch.arange(6.0).view(2, 3).t()  # not contiguous
        comm.allreduce(t, Reduction.SUM)
        assert torch.equal(t, torch.arange(6.0).view(2, 3).t())
        g = torch.tensor([3.0, -4.0])
        comm.allreduce(g, "adasum")
        assert torch.equal(g, torch.tensor([3.0, -4.0]))  # one rank's Adasum is its own gradient
        out = torch.zeros(2)
        comm.allreduce_into(g, out, Reduction.MAX)
        assert torch.equal(out, g) and out.data_ptr() != g.data_ptr()
        flags = torch.tensor([1, 3], dtype=torch.uint8)
        comm.and_flags(flags)
        assert flags.tolist() == [1, 3]
        assert [p.tolist() for p in comm.allgather(torch.ones(2))] == [[1.0, 1.0]]
        assert [p.tolist() for p in comm.allgather(torch.tensor([-2, 7], dtype=torch.int16))] == [[-2, 7]]
        assert comm.allgather_bytes(b"hvdray") == [b"hvdray"]
        scattered = torch.empty(2, 2)
        comm.reduce_scatter(scattered, torch.arange(4.0).view(2, 2), Reduction.SUM)
        assert scattered.tolist() == [[0.0, 1.0], [2.0, 3.0]]
        comm.broadcast(g, 0)
        assert torch.equal(g, torch.tensor([3.0, -4.0]))
        # fused lists of any size, in place or into other tensors, with the engine's finishing scale
        assert comm.fused_message_bytes >= 1 << 40
        inputs, outputs = [torch.ones(3), torch.full((2, 2), 2.0)], [torch.empty(3), None]
        outputs[1] = inputs[1]  # in place
        comm.allreduce_tensors(inputs, outputs, Reduction.SUM, lambda reduced: torch._foreach_mul_(reduced, 0.5))
        assert outputs[0].tolist() == [0.5] * 3 and inputs[0].tolist() == [1.0] * 3
        assert outputs[1].tolist() == [[1.0, 1.0], [1.0, 1.0]]
    finally:
        comm.close()
    with pytest.raises(NoStrategyError):  # a closed communicator refuses ops loudly
        comm.allreduce(torch.ones(1), Reduction.SUM)


def test_a_communicator_without_a_fused_strategy_refuses_fused_lists():
    comm = Communicator(dist.HashStore(), 0, 1, timeout_s=5.0)
    try:
        comm._use(Strategies(
            (GlooRing(comm._pg),), (GlooAllgather(comm._pg),), (GlooBroadcast(comm._pg),),
            (GlooReducescatter(comm._pg),),
        ))
        assert comm.fused_message_bytes == 0
        g = torch.tensor([3.0, -4.0])
        comm.allreduce(g, Reduction.SUM)  # Gloo's ring over a group of one
        assert torch.equal(g, torch.tensor([3.0, -4.0]))
        with pytest.raises(RuntimeError, match="fused lists"):
            comm.allreduce_tensors([g], [g], Reduction.SUM)
    finally:
        comm.close()


def test_gloo_reducescatter_reads_its_input_only():
    """The engine hands a reducescatter the caller's own tensor when its rows split evenly: Gloo's, the
    list's last entry, must leave it as it was (the shared-memory and socket ones are tested with their
    transports)."""
    store = dist.HashStore()

    def member(rank: int):
        group = ProcessGroupGloo(store, rank, 2, group_options(10.0, "127.0.0.1"))
        x = torch.arange(8.0) * (rank + 1)
        out = torch.empty(2, 2)
        GlooReducescatter(group).run(x.view(4, 2), out, ReduceOp.SUM)
        return torch.equal(x, torch.arange(8.0) * (rank + 1)), out.tolist()

    assert in_threads(2, member) == [(True, [[0.0, 3.0], [6.0, 9.0]]), (True, [[12.0, 15.0], [18.0, 21.0]])]


def test_a_gloo_group_connects_at_its_first_op_and_never_after_an_abort():
    """``GlooGroup``: rank and size without connecting; the first op connects the whole mesh (every rank in
    the same op) and later ops reuse it; an abort before the first op leaves nothing to connect, and an op
    then fails at once instead of waiting for peers."""
    from hvdray.collective.errors import HorovodInternalError
    from hvdray.collective.transport.gloo import GlooGroup

    store = dist.HashStore()

    def member(rank: int):
        group = GlooGroup(dist.PrefixStore("g/", store), rank, 2, group_options(10.0, "127.0.0.1"))
        seen = [(group.rank(), group.size(), group.connected)]
        t = torch.tensor([rank + 1.0])
        GlooRing(group).run(t, ReduceOp.SUM)
        first = group.connect()
        GlooAllgather(group).run(t, out := torch.empty(2, 1))
        seen.append((group.connected, group.connect() is first, t.item(), out.flatten().tolist()))
        group.abort()
        return seen

    assert in_threads(2, member) == [[(r, 2, False), (True, True, 3.0, [3.0, 3.0])] for r in range(2)]
    assert store.num_keys() == 2  # each rank's record of the group's device

    untouched = dist.HashStore()

    idle = GlooGroup(untouched, 0, 2, group_options(10.0, "127.0.0.1"))
    idle.abort()
    with pytest.raises(HorovodInternalError, match="closed before it connected"):
        GlooRing(idle).run(torch.ones(1), ReduceOp.SUM)
    assert not idle.connected and untouched.num_keys() == 0  # it never published a record
