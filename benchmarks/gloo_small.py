"""Gloo's allreduce vs an allgather plus a local reduction vs a recursive doubling (over Gloo, and over
the ranks' own TCP connections), for small messages, without Ray or the engine.

Why hvdray's Gloo path (jobs across nodes, ``shm_transport=False``, process sets) sends an allreduce
whose every-rank copies total at most ``GATHER_REDUCE_BYTES`` as an allgather and a reduction of the
rows in rank order. ``n`` fresh processes on one ``ProcessGroupGloo`` (a FileStore group, loopback TCP)
alternate, round by round: raw ``allreduce``, ``allgather`` + ``torch.add`` of the rows, and hvdray's
``GlooRecursiveDoubling`` (log2 n exchanges of the whole message over Gloo's point-to-point sends), and
``SocketRecursiveDoubling`` (the same schedule over ``PeerSockets``, sent and received by the calling
thread: what ``small_message_sockets`` runs up to ``SOCKET_ALLREDUCE_BYTES``), for each message size.
Prints the median microseconds per call (the slowest rank's) and the ratios; the Gloo recursive
doubling serves small messages among ``RECURSIVE_DOUBLING_MIN_RANKS`` ranks or more when the sockets
are off.

    python benchmarks/gloo_small.py --ranks 2 4 8 --rounds 5
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

SIZES = [12, 256, 4096, 16384, 65536, 262144, 1 << 20, 4 << 20]


def _worker(rank: int, n: int, store_path: str, rounds: int, queue) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed import ProcessGroupGloo, ReduceOp

    from hvdray.collective.transport.gloo import GlooRecursiveDoubling
    from hvdray.collective.transport.sockets import PeerSockets, SocketRecursiveDoubling

    torch.set_num_threads(1)
    options = ProcessGroupGloo._Options()
    options._timeout = datetime.timedelta(seconds=120)
    options._devices = [ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    options._threads = 2
    store = dist.FileStore(store_path, n)
    pg = ProcessGroupGloo(store, rank, n, options)
    sockets = SocketRecursiveDoubling(PeerSockets.connect(dist.PrefixStore("sockets/", store), rank, n, "127.0.0.1", 120))
    opts = dist.AllreduceOptions()
    opts.reduceOp = ReduceOp.SUM
    doubling = GlooRecursiveDoubling(pg)
    times: dict[tuple[int, str], list[float]] = {}
    for nbytes in SIZES:
        tensor = torch.ones(max(1, nbytes // 4))
        rows = torch.empty((n, tensor.numel()))

        def allreduce() -> None:
            pg.allreduce([tensor], opts).wait()

        def gather_reduce() -> None:
            pg.allgather([list(rows.unbind(0))], [tensor]).wait()
            torch.add(rows[0], rows[1], out=tensor)
            for row in rows[2:]:
                tensor.add_(row)

        def recursive_doubling() -> None:
            doubling.run(tensor, ReduceOp.SUM)

        def socket_doubling() -> None:
            sockets.run(tensor, ReduceOp.SUM)

        calls = 100 if nbytes <= 65536 else 20
        implementations = (("allreduce", allreduce), ("allgather + reduce", gather_reduce),
                           ("recursive doubling", recursive_doubling), ("sockets", socket_doubling))
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


def measure(n: int, rounds: int) -> dict[tuple[int, str], float]:
    """Median seconds per call, per (message bytes, implementation), the slowest rank's per round."""
    store = os.path.join(tempfile.mkdtemp(), "store")
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, n, store, rounds, queue)) for r in range(n)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=900)[1] for _ in procs]
    for p in procs:
        p.join()
    return {k: statistics.median(max(r[k][i] for r in results) for i in range(rounds)) for k in results[0]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    for n in args.ranks:
        seconds = measure(n, args.rounds)
        for nbytes in SIZES:
            base, gathered = seconds[(nbytes, "allreduce")], seconds[(nbytes, "allgather + reduce")]
            doubled, sockets = seconds[(nbytes, "recursive doubling")], seconds[(nbytes, "sockets")]
            print(f"{n} ranks {nbytes:8d} B  allreduce {base * 1e6:8.0f} us  allgather + reduce "
                  f"{gathered * 1e6:8.0f} us ({base / gathered:5.2f}x raw's speed)  recursive doubling "
                  f"{doubled * 1e6:8.0f} us ({base / doubled:5.2f}x raw's, {gathered / doubled:5.2f}x "
                  f"gather-reduce's)  sockets {sockets * 1e6:8.0f} us ({base / sockets:5.2f}x raw's, "
                  f"{gathered / sockets:5.2f}x gather-reduce's)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
