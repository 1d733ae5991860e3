"""Gloo's own collectives against hvdray's network-path strategies, per message size, without Ray or the
engine: why hvdray's network path (jobs across nodes, ``shm_transport=False``, process sets) runs its
allreduces, reducescatters, allgathers and broadcasts as it does.

``n`` fresh processes on one ``ProcessGroupGloo`` (a FileStore group, loopback TCP) alternate, round by
round, for each message size (bytes of one rank's tensor):

- ``--op allreduce`` (the default): raw ``allreduce``; ``allgather`` + ``torch.add`` of the rows (what
  the Gloo path does up to ``GATHER_REDUCE_BYTES``); hvdray's ``GlooRecursiveDoubling`` (log2 n
  exchanges of the whole message over Gloo's point-to-point sends); ``SocketRecursiveDoubling`` (the
  same schedule over ``PeerSockets``, sent and received by the calling thread: what ``peer_sockets``
  runs up to ``SOCKET_ALLREDUCE_BYTES``); and ``SocketHalvingDoubling`` (a reduce-scatter by halving
  and an allgather by doubling over the same connections: what ``peer_sockets`` runs above that). The
  first four run up to 4 MB, the halving-doubling from 256 KB.
- ``--op reducescatter``: raw ``_reduce_scatter_base`` (a sum; one rank's tensor holds one chunk per rank)
  and ``SocketReducescatter`` (a reduce-scatter by halving over the ranks' own connections: what
  ``peer_sockets`` runs).
- ``--op allgather``: raw ``allgather`` and ``SocketAllgather`` (a recursive doubling over the ranks'
  own connections, each round swapping every row a rank holds with its partner: what ``peer_sockets``
  runs).
- ``--op broadcast``: raw ``broadcast`` from rank 0 and ``SocketBroadcast`` (a binomial tree over the
  same connections: what ``peer_sockets`` runs).

Prints the median microseconds per call (the slowest rank's) and each one's speed against Gloo's own.

    python benchmarks/gloo_small.py --ranks 2 4 8 --rounds 5
    python benchmarks/gloo_small.py --ranks 2 4 --rounds 3 --sizes 1048576 4194304 16777216 67108864
    python benchmarks/gloo_small.py --op reducescatter --ranks 2 4 8 --rounds 3 --sizes 65536 1048576 16777216
    python benchmarks/gloo_small.py --op allgather --ranks 2 4 8 --rounds 3 --sizes 65536 1048576 16777216
    python benchmarks/gloo_small.py --op broadcast --ranks 2 4 8 --rounds 3 --sizes 256 65536 1048576 16777216
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing
import os
import statistics
import sys
import tempfile
import time

SIZES = [12, 256, 4096, 16384, 65536, 262144, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
#: per op: Gloo's own (runs at every size), then each other implementation's sizes (bytes, inclusive)
RANGES = {
    "allreduce": {
        "allgather + reduce": (0, 4 << 20), "recursive doubling": (0, 4 << 20), "sockets": (0, 4 << 20),
        "socket halving-doubling": (256 << 10, 1 << 62),
    },
    "allgather": {"socket allgather": (0, 1 << 62)},
    "reducescatter": {"socket reducescatter": (0, 1 << 62)},
    "broadcast": {"socket broadcast": (0, 1 << 62)},
}


def _implementations(op: str, pg, peers, tensor, rows) -> dict:
    """Each implementation of ``op`` on ``tensor`` (``rows``: a ``(ranks, numel)`` buffer for the gathers)."""
    import torch
    import torch.distributed as dist
    from torch.distributed import ReduceOp

    from hvdray.collective.transport.gloo import GlooRecursiveDoubling
    from hvdray.collective.transport.socket_strategies import (
        SocketAllgather, SocketBroadcast, SocketHalvingDoubling, SocketRecursiveDoubling, SocketReducescatter,
    )

    if op == "broadcast":
        tree, opts = SocketBroadcast(peers), dist.BroadcastOptions()
        opts.rootRank = 0
        return {
            "broadcast": lambda: pg.broadcast([tensor], opts).wait(),
            "socket broadcast": lambda: tree.run(tensor, 0),
        }
    if op == "reducescatter":
        scatter, opts = SocketReducescatter(peers), dist.ReduceScatterOptions()
        opts.reduceOp = ReduceOp.SUM
        chunk = tensor[: max(1, tensor.numel() // rows.shape[0])]
        whole = torch.ones(rows.shape[0] * chunk.numel())  # the socket strategy overwrites it (scratch)
        return {
            "reducescatter": lambda: pg._reduce_scatter_base(chunk, whole, opts).wait(),
            "socket reducescatter": lambda: scatter.run(whole, chunk, ReduceOp.SUM),
        }
    if op == "allgather":
        gathered = SocketAllgather(peers)
        return {
            "allgather": lambda: pg.allgather([list(rows.unbind(0))], [tensor]).wait(),
            "socket allgather": lambda: gathered.run(tensor, rows),
        }
    opts = dist.AllreduceOptions()
    opts.reduceOp = ReduceOp.SUM
    gloo_doubling = GlooRecursiveDoubling(pg)
    sockets, halving = SocketRecursiveDoubling(peers), SocketHalvingDoubling(peers)

    def gather_reduce() -> None:
        pg.allgather([list(rows.unbind(0))], [tensor]).wait()
        torch.add(rows[0], rows[1], out=tensor)
        for row in rows[2:]:
            tensor.add_(row)

    return {
        "allreduce": lambda: pg.allreduce([tensor], opts).wait(),
        "allgather + reduce": gather_reduce,
        "recursive doubling": lambda: gloo_doubling.run(tensor, ReduceOp.SUM),
        "sockets": lambda: sockets.run(tensor, ReduceOp.SUM),
        "socket halving-doubling": lambda: halving.run(tensor, ReduceOp.SUM),
    }


def _worker(rank: int, n: int, store_path: str, op: str, rounds: int, sizes: list[int], queue) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed import ProcessGroupGloo

    from hvdray.collective.transport.sockets import PeerSockets

    torch.set_num_threads(1)
    options = ProcessGroupGloo._Options()
    options._timeout = datetime.timedelta(seconds=120)
    options._devices = [ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    options._threads = 2
    store = dist.FileStore(store_path, n)
    pg = ProcessGroupGloo(store, rank, n, options)
    peers = PeerSockets.connect(dist.PrefixStore("sockets/", store), rank, n, "127.0.0.1", 120)
    times: dict[tuple[int, str], list[float]] = {}
    for nbytes in sizes:
        tensor = torch.ones(max(1, nbytes // 4))
        rows = torch.empty((n, tensor.numel()))
        implementations = [
            (label, fn) for label, fn in _implementations(op, pg, peers, tensor, rows).items()
            if label == op or RANGES[op][label][0] <= nbytes <= RANGES[op][label][1]
        ]
        calls = 100 if nbytes <= 65536 else 20 if nbytes <= 4 << 20 else 5
        for _, fn in implementations:
            for _ in range(5):
                fn()
        for _ in range(rounds):
            for label, fn in implementations:
                pg.barrier().wait()
                started = time.perf_counter()
                for _ in range(calls):
                    fn()
                times.setdefault((nbytes, label), []).append((time.perf_counter() - started) / calls)
    queue.put((rank, times))


def measure(n: int, op: str, rounds: int, sizes: list[int]) -> dict[tuple[int, str], float]:
    """Median seconds per call, per (message bytes, implementation), the slowest rank's per round."""
    store = os.path.join(tempfile.mkdtemp(), "store")
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, n, store, op, rounds, sizes, queue)) for r in range(n)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=900)[1] for _ in procs]
    for p in procs:
        p.join()
    return {k: statistics.median(max(r[k][i] for r in results) for i in range(rounds)) for k in results[0]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--op", choices=sorted(RANGES), default="allreduce")
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--sizes", type=int, nargs="+", default=SIZES, help="bytes of one rank's tensor")
    args = parser.parse_args(argv)
    for n in args.ranks:
        seconds = measure(n, args.op, args.rounds, args.sizes)
        for nbytes in args.sizes:
            base = seconds[(nbytes, args.op)]
            line = f"{n} ranks {nbytes:9d} B  {args.op} {base * 1e6:9.0f} us"
            for label in RANGES[args.op]:
                if (nbytes, label) in seconds:
                    took = seconds[(nbytes, label)]
                    line += f"  {label} {took * 1e6:9.0f} us ({base / took:5.2f}x raw's speed)"
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
