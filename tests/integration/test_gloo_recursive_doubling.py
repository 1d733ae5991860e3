"""The recursive-doubling allreduce over real Gloo groups of 2 to 7 processes (no Ray), the same schedule
over the ranks' own TCP connections (``PeerSockets``) in the same processes, and the halving-doubling
over those connections: every op and dtype against a reduction in torch, the same bits on every rank,
and the message count of the schedule."""

from __future__ import annotations

import datetime
import math
import multiprocessing

import pytest
import torch

from hvdray.collective.transport.gloo import recursive_doubling, recursive_doubling_messages

SIZES = range(2, 8)
CASES = [  # (dtype, op); float sums of values chosen so that any order gives the same bits
    ("float32", "SUM"), ("float64", "MAX"), ("float32", "MIN"), ("int64", "PRODUCT"), ("int32", "SUM"),
    ("uint8", "BAND"), ("bool", "MAX"),
]


def _inputs(rank: int, dtype: str, numel: int = 37) -> torch.Tensor:
    values = (torch.arange(numel) * (rank + 3)) % 7 + (rank if dtype != "bool" else 0)
    if dtype == "uint8":
        values = torch.full((numel,), 0xFF) ^ (1 << (rank % 8))  # every bit but one, one rank each
    return (values % 2 if dtype == "bool" else values).to(getattr(torch, dtype))


def _reference(size: int, dtype: str, op: str) -> torch.Tensor:
    reducer = {"SUM": torch.add, "MAX": torch.maximum, "MIN": torch.minimum, "PRODUCT": torch.mul,
               "BAND": torch.bitwise_and}[op]
    out = _inputs(0, dtype)
    for rank in range(1, size):
        out = reducer(out, _inputs(rank, dtype))
    return out


def _member(rank: int, paths: dict[int, str], queue) -> None:
    from torch.distributed import FileStore, PrefixStore, ProcessGroupGloo, ReduceOp

    from hvdray.collective.transport.gloo import GlooRecursiveDoubling, group_options
    from hvdray.collective.transport.socket_strategies import SocketHalvingDoubling, SocketRecursiveDoubling
    from hvdray.collective.transport.sockets import PeerSockets

    torch.set_num_threads(1)
    results = {}
    for size, path in paths.items():
        if rank >= size:
            continue
        options = group_options(60.0, hostname="127.0.0.1")
        store = FileStore(path, size)
        group = ProcessGroupGloo(store, rank, size, options)
        peers = PeerSockets.connect(PrefixStore("sockets/", store), rank, size, "127.0.0.1", 60.0)
        for strategy in (GlooRecursiveDoubling(group), SocketRecursiveDoubling(peers), SocketHalvingDoubling(peers)):
            for dtype, op in CASES:
                tensor = _inputs(rank, dtype)
                strategy.run(tensor, getattr(ReduceOp, op))
                # plain data through the queue
                results[(strategy.name, size, dtype, op)] = (str(tensor.dtype), tensor.tolist())
            strided = torch.arange(20.0).reshape(4, 5).t() * (rank + 1)  # not contiguous: reduced in place still
            strategy.run(strided, ReduceOp.SUM)
            results[(strategy.name, size, "strided", "SUM")] = strided.tolist()
        peers.close()
    queue.put((rank, results))


STRATEGIES = ("gloo recursive doubling", "socket recursive doubling", "socket halving-doubling")


def test_every_rank_gets_the_reduction_of_all_for_2_to_7_ranks(tmp_path):
    paths = {size: str(tmp_path / f"store{size}") for size in SIZES}
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    members = [context.Process(target=_member, args=(rank, paths, queue)) for rank in range(max(SIZES))]
    for member in members:
        member.start()
    try:
        results = dict(queue.get(timeout=120) for _ in members)
    finally:
        for member in members:
            member.join(timeout=30)
            if member.is_alive():
                member.kill()
    for name in STRATEGIES:
        for size in SIZES:
            for dtype, op in CASES:
                want = _reference(size, dtype, op)
                for rank in range(size):
                    got = results[rank][(name, size, dtype, op)]
                    assert got == (str(want.dtype), want.tolist()), (name, size, dtype, op, rank, got, want)
            strided_sum = torch.arange(20.0).reshape(4, 5).t() * sum(r + 1 for r in range(size))
            for rank in range(size):
                assert results[rank][(name, size, "strided", "SUM")] == strided_sum.tolist(), (name, size, rank)


@pytest.mark.parametrize("size", range(1, 70))
def test_the_schedule_pairs_every_message_and_costs_p_log_p(size):
    steps = {rank: list(recursive_doubling(rank, size)) for rank in range(size)}
    sent = sorted((rank, peer, tag) for rank, s in steps.items() for kind, peer, tag in s
                  if kind in ("send", "exchange"))
    received = sorted((peer, rank, tag) for rank, s in steps.items() for kind, peer, tag in s
                      if kind in ("reduce", "exchange", "receive"))
    assert sent == received  # each message has its receive, with the same tag
    assert recursive_doubling_messages(size) == len(sent)
    power = 1 << (size.bit_length() - 1)
    assert len(sent) == power * int(math.log2(power)) + 2 * (size - power)
    assert max((len(s) for s in steps.values()), default=0) <= int(math.log2(power)) + 2  # hops per rank
