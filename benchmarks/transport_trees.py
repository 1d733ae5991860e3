"""The shared-memory transport's allreduce of two source trees, side by side, without Ray or the engine.

Run to run, this machine's memory speed moves by more than most changes to the transport gain, so two
runs of ``bandwidth.py``, one per tree, rarely tell them apart. Here every round starts a fresh pair of
processes for each tree in turn (``PYTHONPATH`` set to the tree), and each pair measures, alternating op
by op: one core's copy and add (the memory ideal: S/2 at add speed plus S/2 at copy speed per rank, as
in ``bandwidth.py``), raw ``torch.distributed`` Gloo's allreduce (a FileStore group), and the tree's
``NodeCollectives.allreduce`` of a private tensor in place and out of place into an output of the
output pool (in shared memory, as the workers' are), each a sum and an average (finished as the tree's
engine finishes it), with the settings' defaults (cross-memory attach
and moving a reduced tensor's pages into shared memory on, where the tree has them). Prints, per tree and size, the median over rounds of each allreduce's
fraction of the memory ideal and its speed against raw Gloo.

    python benchmarks/transport_trees.py --trees /path/to/other/tree . --sizes-mb 4 16 64 --rounds 4

``--ways`` also times, in the same processes, each way an in-place allreduce of a private tensor can take
in the tree (forced by the ``NodeCollectives`` attributes that choose it, so only for trees that have
them, as this one does): with the tensor's pages moved into shared memory where they lie
(``share_reduced_pages``), the same with its operands made afresh at every op instead of kept in a plan
(``PagesPlans`` keeping none), through the kernel's cross-memory attach, through a scratch block of shared
memory, through the segment's slots, and, for comparison, the same allreduce of a tensor that lives in
torch shared memory (the shared tensors' way, ``share_reduced_tensors``):

    python benchmarks/transport_trees.py --ways --sizes-mb 2 4 8 16 --rounds 3
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

_REPEATS = 5  # ops per timing: a time is the mean of these


#: ``--ways``: each way of an in-place allreduce of a private tensor, and the NodeCollectives attributes
#: that force it (moving its pages on or off, cross-memory attach usable or not, the scratch blocks' minimum
#: size, the shared cache, and optionally how many plans of the moved pages' ops are kept)
_WAYS = {
    "in place, its pages in shared memory": {"pages": True, "usable": False, "scratch_min_bytes": 1 << 62,
                                             "cache_bytes": 0},
    "in place, its pages, no plans kept": {"pages": True, "usable": False, "scratch_min_bytes": 1 << 62,
                                           "cache_bytes": 0, "plans": 0},
    "in place, through the kernel": {"pages": False, "usable": True, "scratch_min_bytes": 1 << 62, "cache_bytes": 0},
    "in place, scratch block": {"pages": False, "usable": False, "scratch_min_bytes": 0, "cache_bytes": 0},
    "in place, slots": {"pages": False, "usable": False, "scratch_min_bytes": 1 << 62, "cache_bytes": 0},
}
_SHARED_WAY = "in place, tensor in shared memory"


def _forced(node: object, way: dict[str, int], op: Callable[[], None]) -> Callable[[], None]:
    """``op`` with ``node`` set to take ``way`` (its attributes restored afterwards; every rank alike)."""
    memory, pages, plans = node.cross_memory, node.shared_pages, node.pages_plans  # type: ignore[attr-defined]

    def run() -> None:
        saved = (pages.enabled, memory.usable, node.scratch_min_bytes, node.cache_bytes,  # type: ignore[attr-defined]
                 plans.capacity)
        pages.enabled, memory.usable, node.scratch_min_bytes, node.cache_bytes = (  # type: ignore[attr-defined]
            way["pages"] and saved[0], way["usable"] and saved[1], way["scratch_min_bytes"], way["cache_bytes"])
        plans.capacity = way.get("plans", saved[4])
        try:
            op()
        finally:
            pages.enabled, memory.usable, node.scratch_min_bytes, node.cache_bytes = saved[:4]  # type: ignore[attr-defined]
            plans.capacity = saved[4]

    return run


def _average_of(size: int) -> Callable[[list[Any]], None]:
    """The tree's finish of an average over ``size`` ranks, as its engine hands it to the transport: its
    ``Scale`` where it has one, else (the trees before it) torch's multiplication by 1/size in place."""
    import torch

    try:
        from hvdray.collective.transport.reductions import Scale
    except ImportError:
        return lambda bufs: torch._foreach_mul_(bufs, 1.0 / size)
    return Scale(size, average=True)


def _pair_main(
    rank: int, segment: str, data_bytes: int, slot_bytes: int, store: str, sizes_mb: list[float], ways: bool,
) -> None:
    """One rank of a pair (run as ``python transport_trees.py --rank R ...`` with the tree on PYTHONPATH)."""
    import time

    import torch
    import torch.distributed as dist
    from torch.distributed import ReduceOp

    from hvdray.collective.output_pool import OutputPool
    from hvdray.collective.transport import shm
    from hvdray.collective.transport.shm import NodeCollectives

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
    parameters = inspect.signature(NodeCollectives).parameters
    options = {name: True for name in ("cross_memory", "share_pages") if name in parameters}
    node = NodeCollectives(shm.Segment.attach(segment, 2, data_bytes), rank, 60.0, slot_bytes, **options)
    pool = OutputPool(1 << 30, shared=True)
    average = _average_of(2)
    results = {}
    for size_mb in sizes_mb:
        numel = int(size_mb * (1 << 20)) // 4
        tensor, other, averaged = torch.ones(numel), torch.ones(numel), torch.ones(numel)
        ops = {
            "copy": lambda: other.copy_(tensor),
            "add": lambda: torch.add(tensor, other, out=other),
            "raw gloo": lambda: dist.all_reduce(tensor),
            "in place": lambda: node.allreduce(tensor, ReduceOp.SUM),
            "in place, average": lambda: node.allreduce(averaged, ReduceOp.SUM, finish=average),
            "out of place": lambda: node.allreduce(pool.empty((numel,), torch.float32), ReduceOp.SUM, source=tensor),
            "out of place, average": lambda: node.allreduce(pool.empty((numel,), torch.float32), ReduceOp.SUM,
                                                            source=tensor, finish=average),
        }
        if ways:
            for name, way in _WAYS.items():  # a tensor of each way's own: pages once moved stay in shared memory
                private = torch.ones(numel)
                ops[name] = _forced(node, way, lambda t=private: node.allreduce(t, ReduceOp.SUM))
            shared = torch.ones(numel).share_memory_()
            ops[_SHARED_WAY] = lambda: node.allreduce(shared, ReduceOp.SUM)
        for op in ops.values():
            op()
        times: dict[str, list[float]] = {name: [] for name in ops}
        for _ in range(3):
            for name, op in ops.items():
                node.barrier.wait()
                started = time.perf_counter()
                for _ in range(_REPEATS):
                    op()
                node.barrier.wait()
                times[name].append((time.perf_counter() - started) / _REPEATS)
        results[str(size_mb)] = {name: statistics.median(values) for name, values in times.items()}
    if ways:  # whether the kernel's way was taken at all (where the kernel refuses, its row is the slots')
        results["kernel usable"] = bool(node.cross_memory.usable)
    node.barrier.wait()
    node.close()
    dist.destroy_process_group()
    print(json.dumps(results))


def _run_pair(tree: Path, sizes_mb: list[float], ways: bool) -> dict[str, Any]:
    """Start one pair of processes on ``tree``; rank 0's times per size and op."""
    from hvdray.collective.transport import shm
    from hvdray.collective.transport.shm import slot_bytes_for

    slot_bytes = slot_bytes_for(32 << 20, 2)
    data_bytes = shm.data_bytes_for(slot_bytes, 2)
    segment = shm.Segment.create(shm.job_tag(os.urandom(32)), 2, data_bytes)
    env = {**os.environ, "PYTHONPATH": str(tree)}
    with tempfile.TemporaryDirectory() as scratch:
        store = os.path.join(scratch, "store")
        command = [sys.executable, __file__, "--segment", segment.name, "--data-bytes", str(data_bytes),
                   "--slot-bytes", str(slot_bytes), "--store", store, "--sizes-mb", *map(str, sizes_mb),
                   *(["--ways"] if ways else [])]
        procs = [subprocess.Popen([*command, "--rank", str(rank)], env=env, stdout=subprocess.PIPE, text=True)
                 for rank in range(2)]
        outputs = [proc.communicate(timeout=900)[0] for proc in procs]
    segment.close()
    if any(proc.returncode for proc in procs):
        raise RuntimeError(f"a rank on {tree} failed (exit codes {[proc.returncode for proc in procs]})")
    return json.loads(outputs[0].strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trees", nargs="+", type=Path, default=[Path(".")])
    parser.add_argument("--sizes-mb", nargs="+", type=float, default=[4, 16, 64])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--ways", action="store_true", help="also time each way an in-place allreduce can take")
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--segment", help=argparse.SUPPRESS)
    parser.add_argument("--data-bytes", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--slot-bytes", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--store", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank is not None:
        _pair_main(args.rank, args.segment, args.data_bytes, args.slot_bytes, args.store, args.sizes_mb, args.ways)
        return 0
    trees = [tree.resolve() for tree in args.trees]
    rounds: dict[Path, list[dict[str, Any]]] = {tree: [] for tree in trees}
    for _ in range(args.rounds):
        for tree in trees:
            rounds[tree].append(_run_pair(tree, args.sizes_mb, args.ways))
    for size_mb in args.sizes_mb:
        key = str(size_mb)
        for tree in trees:
            runs = [run[key] for run in rounds[tree]]
            ideal = [(run["copy"] + run["add"]) / 2 for run in runs]  # n=2: S/2 at each speed, a whole S each
            for way in ("in place", "in place, average", "out of place", "out of place, average",
                        *([*_WAYS, _SHARED_WAY] if args.ways else [])):
                of_ideal = statistics.median(i / run[way] for i, run in zip(ideal, runs))
                vs_gloo = statistics.median(run["raw gloo"] / run[way] for run in runs)
                print(f"{size_mb:g} MB allreduce, 2 ranks  {way:33s} {of_ideal:5.2f}x memory ideal  "
                      f"{vs_gloo:5.2f}x raw gloo  {tree}", flush=True)
    if args.ways and not all(run["kernel usable"] for runs in rounds.values() for run in runs):
        print("the kernel refused cross-memory attach: the rows 'through the kernel' went through the slots")
    return 0


if __name__ == "__main__":
    sys.exit(main())
