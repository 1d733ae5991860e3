"""How close the shared-memory transport is to this machine's memory floor, without Ray or the engine.

For each number of local ranks, ``n`` fresh processes run, alternating A B C in the same processes:
raw ``torch.distributed`` Gloo (a FileStore group), hvdray's ``NodeCollectives.allreduce`` over one
segment, and the floor: the same copies and in-place adds the transport does per rank (copy in the
part the peers reduce, add the peers' parts into the rank's own, publish it, copy the peers' parts
out), on private buffers, with no synchronisation at all. Prints 64 MB allreduce bus bandwidth and
ratios vs raw Gloo (medians over rounds).

    python benchmarks/shm_floor.py --local-ranks 2 4 --rounds 5
"""

from __future__ import annotations

import argparse
import ctypes
import multiprocessing
import os
import secrets
import statistics
import sys
import tempfile
import time

SIZE = 64 << 20


def _worker(rank: int, n: int, segment: str, data_bytes: int, slot_bytes: int, store_path: str, rounds: int, queue) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed import ReduceOp

    from hvdray.collective.transport import shm
    from hvdray.collective.transport.shm import NodeCollectives

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, n), rank=rank, world_size=n)
    node = NodeCollectives(shm.Segment.attach(segment, n, data_bytes), rank, 60.0, slot_bytes)
    tensor, private = torch.ones(SIZE // 4), torch.ones(2 * n * slot_bytes // 4)
    piece = node.slot_bytes // 4

    def floor() -> None:  # the transport's own copies and adds, on private memory, without barriers
        for half, start in enumerate(range(0, SIZE // 4, piece)):
            stop = min(start + piece, SIZE // 4)
            part = (stop - start) // n
            base = (half & 1) * n * slot_bytes // 4
            at, slots = tensor.data_ptr() + start * 4, private.data_ptr() + base * 4
            ctypes.memmove(slots + part * 4, at + part * 4, (stop - start - part) * 4)
            own = tensor[start : start + part]
            for peer in range(1, n):
                own.add_(private[base + peer * slot_bytes // 4 : base + peer * slot_bytes // 4 + part])
            ctypes.memmove(slots, at, part * 4)
            for peer in range(1, n):
                ctypes.memmove(at + peer * part * 4, slots + peer * slot_bytes + peer * part * 4, part * 4)

    impls = {
        "raw gloo": lambda: dist.all_reduce(tensor),
        "hvdray shm transport": lambda: node.allreduce(tensor, ReduceOp.SUM),
        "floor (its copies and adds, no sync)": floor,
    }
    times: dict[str, list[float]] = {k: [] for k in impls}
    for fn in impls.values():
        fn()
    for _ in range(rounds):
        for name, fn in impls.items():
            dist.barrier()
            started = time.perf_counter()
            fn()
            dist.barrier()  # every rank done: the slowest rank counts, for all three alike
            times[name].append(time.perf_counter() - started)
    node.close()
    dist.destroy_process_group()
    queue.put((rank, times))


def measure(n: int, rounds: int, buffer_mb: float = 32) -> dict[str, float]:
    """Median seconds per 64 MB allreduce for each implementation, with ``n`` local ranks."""
    from hvdray.collective.transport import shm
    from hvdray.collective.transport.shm import slot_bytes_for

    slot_bytes = slot_bytes_for(int(buffer_mb * (1 << 20)), n)
    data_bytes = 2 * n * slot_bytes
    segment = shm.Segment.create(shm.job_tag(secrets.token_bytes(32)), n, data_bytes)
    store = os.path.join(tempfile.mkdtemp(), "store")
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, n, segment.name, data_bytes, slot_bytes, store, rounds, queue))
             for r in range(n)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
    segment.close()
    names = results[0][1].keys()
    return {k: statistics.median(max(r[1][k][i] for r in results) for i in range(rounds)) for k in names}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--local-ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    for n in args.local_ranks:
        seconds = measure(n, args.rounds)
        base = seconds["raw gloo"]
        for name, t in seconds.items():
            busbw = 2 * (n - 1) / n * SIZE / t / 1e9
            print(f"{n} local ranks  {name:38s} {t * 1e3:8.2f} ms  {busbw:5.2f} GB/s  {base / t:5.2f}x vs raw gloo",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
