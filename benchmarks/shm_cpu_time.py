"""CPU time per rank of the shared-memory transport's ops, without Ray or the engine, beside one core's
copy and add: what a rank really spends when the machine is too loaded for wall-clock numbers to mean
anything (every rank's engine thread is timed with ``time.thread_time``; the slower rank counts).

Two fresh processes share one segment (``NodeCollectives``) and alternate, round by round: a copy and an
add of the message, allreduce in place and out of place (into a fresh output tensor, as
``hvd.allreduce`` returns one), allreduce of tensors every rank holds in torch shared memory (reduced
straight between them), allgather into a fresh result, and broadcast. On a tree whose
``NodeCollectives.allreduce`` has no ``source`` argument (before out-of-place allreduce reached the
transport) out of place is what that tree's engine did: copy the input into the output, then reduce in
place; and its allgather is followed by the ``torch.cat`` that engine made.

    PYTHONPATH=. python benchmarks/shm_cpu_time.py --size-mb 64 --rounds 7
"""

from __future__ import annotations

import argparse
import inspect
import multiprocessing
import secrets
import statistics
import sys
import time


def _worker(rank: int, n: int, segment: str, data_bytes: int, slot_bytes: int, numel: int, rounds: int, queue) -> None:
    import torch
    from torch.distributed import ReduceOp

    from hvdray.collective.transport import shm
    from hvdray.collective.transport.shm import NodeCollectives

    torch.set_num_threads(1)
    node = NodeCollectives(shm.Segment.attach(segment, n, data_bytes), rank, 60.0, slot_bytes)
    reads_source = "source" in inspect.signature(node.allreduce).parameters
    tensor, other = torch.ones(numel), torch.ones(numel)
    shared = torch.ones(numel).share_memory_()  # every rank's in torch shared memory: reduced in place

    def out_of_place() -> None:
        out = torch.empty_like(tensor)
        if reads_source:
            node.allreduce(out, ReduceOp.SUM, source=tensor)
        else:
            out.copy_(tensor)
            node.allreduce(out, ReduceOp.SUM)

    def allgather() -> None:
        out = torch.empty(n * numel)
        node.allgather(tensor, out)
        if not reads_source:
            torch.cat(list(out.view(n, numel).unbind(0)))

    impls = {
        "copy (one core)": lambda: other.copy_(tensor),
        "add (one core)": lambda: torch.add(tensor, other, out=other),
        "allreduce in place": lambda: node.allreduce(tensor, ReduceOp.SUM),
        "allreduce, shared tensor": lambda: node.allreduce(shared, ReduceOp.SUM),
        "allreduce out of place": out_of_place,
        "allgather": allgather,
        "broadcast": lambda: node.broadcast(tensor, 0),
    }
    cpu: dict[str, list[float]] = {k: [] for k in impls}
    wall: dict[str, list[float]] = {k: [] for k in impls}
    for fn in impls.values():
        fn()
    for _ in range(rounds):
        for name, fn in impls.items():
            node.barrier.wait()
            cpu_started, started = time.thread_time(), time.perf_counter()
            fn()
            cpu[name].append(time.thread_time() - cpu_started)
            wall[name].append(time.perf_counter() - started)
    node.close()
    queue.put((rank, cpu, wall))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mb", type=float, default=64)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--local-ranks", type=int, default=2)
    args = parser.parse_args(argv)
    if args.local_ranks < 2:
        parser.error("--local-ranks must be at least 2")
    from hvdray.collective.transport import shm
    from hvdray.collective.transport.shm import slot_bytes_for

    n, numel = args.local_ranks, int(args.size_mb * (1 << 20)) // 4
    slot_bytes = slot_bytes_for(32 << 20, n)
    data_bytes = 2 * n * slot_bytes
    segment = shm.Segment.create(shm.job_tag(secrets.token_bytes(32)), n, data_bytes)
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, n, segment.name, data_bytes, slot_bytes, numel, args.rounds, queue))
             for r in range(n)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=900) for _ in procs]
    for p in procs:
        p.join()
    segment.close()
    for name in results[0][1]:
        cpu = statistics.median(max(r[1][name][i] for r in results) for i in range(args.rounds))
        wall = statistics.median(max(r[2][name][i] for r in results) for i in range(args.rounds))
        print(f"{name:24s} cpu {cpu * 1e3:8.1f} ms   wall {wall * 1e3:8.1f} ms", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
