"""Collective bandwidth against this machine's memory ideal: allreduce (in place and out of place),
reducescatter, allgather and broadcast of hvdray and raw ``torch.distributed`` Gloo, beside one core's copy and add
speed measured in the same round, in the same worker processes.

The ideal is what a rank must at the least do with memory, at the speed its core copies and adds
(every rank measuring at once, as in a collective), and nothing else:

- allreduce of S bytes on n ranks: add its 1/n of every peer's data once and copy every peer's reduced
  1/n once, ``(n-1)/n * S`` at add speed plus ``(n-1)/n * S`` at copy speed (n=2: S/2 + S/2);
- reducescatter of S bytes per rank (n chunks of S/n): add every peer's copy of its chunk once,
  ``(n-1)/n * S`` at add speed;
- allgather of S bytes per rank: write its n*S-byte result once (its own S and every peer's),
  ``n * S`` at copy speed;
- broadcast of S bytes: copy the root's S once, ``S`` at copy speed.

Bus bandwidth is the usual one (allreduce ``2(n-1)/n * S / t``, reducescatter ``(n-1)/n * S / t``, allgather ``(n-1) * S / t``, broadcast
``S / t``), so the ratio to the ideal's bus bandwidth is the fraction of the ideal reached. Copy and add
speeds are operand bytes per second (an add of two S-byte tensors in S / t). The allreduce rows also
time an average (``hvd.Average``, the default op; raw Gloo has none, so its row is the sum and then one
division), in place and out of place (``hvd.allreduce(tensor)`` with no op, the commonest call, named and, as
most scripts call it, unnamed), measured against the same ideal, which has no division in it.

    python benchmarks/bandwidth.py --workers 2 --sizes-mb 4 16 64 256 --repeats 5 [--huge-pages]

"copy, fresh output" is a copy into a tensor allocated for it, as a collective's output is: its
first touch of the memory costs more than the copy, less with huge pages (the ``huge_pages`` setting);
hvdray's outputs come from a pool that avoids it (``output_pool_mb``). "allreduce of 4 bytes" is the
fixed cost of one op (the engine's hand-off and agreement, the transport's barrier), which bounds the
smallest sizes: a named in-place sum, and ``hvd.allreduce(tensor)`` (unnamed, an average, out of place).
"one core, passes in place" and "one core, passes out of place" are the ideal's own passes
(an add of (n-1)/n of the message, then a copy of the sum) done by each core alone, with no peer and no
barrier between them, in the layout of each kind of allreduce: in place the sum lands in the lines just read;
out of place in two results the inputs do not share, and a core reads a line it writes but does not hold
first. They are what the passes cost where the data lies, beside the ideal (a copy and an add of tensors
that stay in the cache at small sizes). Each ratio is the median's; beside it, the lowest and highest of the
rounds' own ratios (each round's time against the same round's ideal), the spread that a busy host gives a
median of few rounds.
"hvdray in place, transport alone" and "hvdray out of place, transport alone" are the same
allreduces through the shared-memory transport called directly (no negotiation, submission or handle;
out of place into an output of the engine's pool): the gap to the engine's rows is the engine's work
around an op, paid with the cache just emptied by the previous op. They need every rank on one node
(else they are left out), and they go through a segment of the benchmark's own, with the transport's
defaults, not the engine's: the engine thread runs idle ticks through its segment, which would pair with
direct calls there in another order on each rank. Settings come from the ``HVDRAY_*`` environment, so the same run without the pool, and
with reduced tensors moved into shared memory, are::

    HVDRAY_OUTPUT_POOL_MB=0 python benchmarks/bandwidth.py
    HVDRAY_SHARE_REDUCED_TENSORS=true python benchmarks/bandwidth.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
from typing import Callable

import ray
import ray.cloudpickle

from harness import alternate, rounds_range, setup_raw_gloo, timed

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

Record = Callable[[str, dict[str, list[float]], str, str, bool], None]
IDEAL = "memory ideal"
#: the allreduce rows of one core doing the ideal's passes alone (no peer, no barrier) in each layout
PASSES_IN_PLACE = "one core, passes in place"
PASSES_OUT_OF_PLACE = "one core, passes out of place"
COLLECTIVES = ("allreduce", "reducescatter", "allgather", "broadcast")


def _gloo_average(tensor, size: int) -> None:
    """An average on raw torch.distributed Gloo, which has no average op: the sum, then one division."""
    import torch.distributed as dist

    dist.all_reduce(tensor)
    tensor.div_(size)


def _passes(mine, peers, result, part: int, peer_result=None) -> None:
    """The memory ideal's passes over ``part`` elements by one core: ``mine`` and ``peers`` added into ``result``,
    then the sum copied into ``peer_result`` (in place, ``peers`` itself)."""
    import torch

    torch.add(mine[:part], peers[:part], out=result[:part])
    (peers if peer_result is None else peer_result)[:part].copy_(result[:part])


def _round(size_mb: float, iterations: int) -> dict[str, float]:
    """Seconds per call of every implementation, and of one core's copy and add of ``size_mb``."""
    import torch
    import torch.distributed as dist
    from torch.distributed import ReduceOp

    import hvdray.torch as hvd
    from hvdray.collective.session import engine

    numel = max(16, int(size_mb * (1 << 20)) // 4)
    tensor, other = torch.ones(numel), torch.ones(numel)
    # the ideal's passes in an allreduce's two layouts, by one core alone (every rank at once): its part of the
    # peers' data added into its own and copied back out, over (n-1)/n of the message
    part = numel * (hvd.size() - 1) // hvd.size()
    own_result, peer_result = torch.ones(numel), torch.ones(numel)
    times = {
        "copy": timed(lambda: other.copy_(tensor), iterations),
        "copy into a fresh tensor": timed(lambda: torch.empty(numel).copy_(tensor), iterations),
        "add": timed(lambda: torch.add(tensor, other, out=other), iterations),
        # in place: the sum lands in the lines just read (its own tensor's and the peer's)
        f"allreduce {PASSES_IN_PLACE}": timed(lambda: _passes(other, peer_result, other, part), iterations),
        # out of place: the sum goes to two results the inputs do not share, the least an out-of-place
        # allreduce writes; a core writing a line it does not hold reads it first
        f"allreduce {PASSES_OUT_OF_PLACE}": timed(lambda: _passes(tensor, other, own_result, part, peer_result),
                                                    iterations),
        "allreduce raw gloo": timed(lambda: dist.all_reduce(tensor), iterations),
        "allreduce hvdray in place": timed(lambda: hvd.allreduce_(tensor, op=hvd.Sum, name="bw.ar"), iterations),
        "allreduce hvdray out of place": timed(lambda: hvd.allreduce(tensor, op=hvd.Sum, name="bw.aro"), iterations),
        # an average: Gloo has no such op (all_reduce, then divide); hvdray divides each rank's part as it
        # reduces it
        "allreduce raw gloo, average": timed(lambda: _gloo_average(tensor, hvd.size()), iterations),
        "allreduce hvdray in place, average": timed(lambda: hvd.allreduce_(tensor, op=hvd.Average, name="bw.avg"),
                                                    iterations),
        # Horovod's default: hvd.allreduce(tensor) averages into a new tensor
        "allreduce hvdray out of place, average": timed(lambda: hvd.allreduce(tensor, name="bw.avgo"), iterations),
        # the same call as most scripts write it, with no name: its calls go by their family's slots
        "allreduce hvdray out of place, average, unnamed": timed(lambda: hvd.allreduce(tensor), iterations),
        "broadcast raw gloo": timed(lambda: dist.broadcast(tensor, 0), iterations),
        "broadcast hvdray": timed(lambda: hvd.broadcast_(tensor, root_rank=0, name="bw.bc"), iterations),
    }
    scattered = torch.empty(numel // hvd.size())
    times["reducescatter raw gloo"] = timed(lambda: dist.reduce_scatter_tensor(scattered, tensor), iterations)
    times["reducescatter hvdray"] = timed(lambda: hvd.reducescatter(tensor, op=hvd.Sum, name="bw.rs"), iterations)
    gathered = torch.empty(hvd.size() * numel)
    times["allgather raw gloo"] = timed(lambda: dist.all_gather_single(gathered, tensor), iterations)
    times["allgather hvdray"] = timed(lambda: hvd.allgather(tensor, name="bw.ag"), iterations)
    tiny = torch.ones(1)
    times["4 bytes raw gloo"] = timed(lambda: dist.all_reduce(tiny), 20)
    times["4 bytes hvdray"] = timed(lambda: hvd.allreduce_(tiny, op=hvd.Sum, name="bw.tiny"), 20)
    times["4 bytes hvdray, hvd.allreduce(tensor)"] = timed(lambda: hvd.allreduce(tiny), 20)
    node = _transport_of_our_own()
    if node is not None:
        # the transport called directly: the same ops without the negotiation, the submission and the handle
        # (what the engine's work around an op costs, not a way for users)
        outputs = engine().outputs
        try:
            times["allreduce hvdray in place, transport alone"] = timed(
                lambda: node.allreduce(tensor, ReduceOp.SUM), iterations)
            times["allreduce hvdray out of place, transport alone"] = timed(
                lambda: node.allreduce(outputs.empty_like(tensor), ReduceOp.SUM, source=tensor), iterations)
        finally:
            node.close()
    return times


def _transport_of_our_own():
    """The shared-memory transport of the node's ranks over a segment of the benchmark's own, with the
    settings' defaults (cross-memory attach on, a reduced tensor's pages moved into shared memory, no tensor
    moved into torch's); None unless every
    rank is on this node and the transport runs here. Not the engine's: its thread runs idle ticks through
    its segment, which would meet direct calls there in another order on each rank."""
    import os

    import hvdray.torch as hvd
    from hvdray.collective.transport import shm
    from hvdray.settings import Settings

    size = hvd.size()
    if hvd.local_size() != size or shm.unsupported_reason() is not None:
        return None
    defaults = Settings()
    slot_bytes = shm.slot_bytes_for(int(defaults.shm_buffer_mb * (1 << 20)), size)
    data_bytes = shm.data_bytes_for(slot_bytes, size)
    segment = shm.Segment.create(shm.job_tag(os.urandom(32)), size, data_bytes) if hvd.local_rank() == 0 else None
    name = hvd.broadcast_object(segment.name if segment is not None else None, root_rank=0, name="bw.segment")
    if segment is None:
        segment = shm.Segment.attach(name, size, data_bytes)
    hvd.barrier()  # every rank has mapped it: the name can go
    segment.unlink()
    return shm.NodeCollectives(segment, hvd.local_rank(), 120.0, slot_bytes, cross_memory=defaults.cross_memory_attach,
                               share_pages=defaults.share_reduced_pages)


def ideal_seconds(collective: str, size_bytes: float, ranks: int, copy_s: float, add_s: float) -> float:
    """Per-rank seconds of the ideal (module docstring), from one core's copy and add of ``size_bytes``."""
    if collective == "allreduce":
        return (ranks - 1) / ranks * (add_s + copy_s)
    if collective == "reducescatter":
        return (ranks - 1) / ranks * add_s
    if collective == "allgather":
        return ranks * copy_s
    if collective == "broadcast":
        return copy_s
    raise ValueError(f"collective must be one of {COLLECTIVES}, got {collective!r}")


def bus_bytes(collective: str, size_bytes: float, ranks: int) -> float:
    """The bytes a collective's bus bandwidth counts (module docstring)."""
    if collective == "allreduce":
        return 2 * (ranks - 1) / ranks * size_bytes
    if collective == "reducescatter":
        return (ranks - 1) / ranks * size_bytes
    if collective == "allgather":
        return (ranks - 1) * size_bytes
    if collective == "broadcast":
        return size_bytes
    raise ValueError(f"collective must be one of {COLLECTIVES}, got {collective!r}")


def bandwidth_rows(
    record: Record, executor, ranks: int, sizes_mb: list[float], repeats: int, quick: bool
) -> None:
    """For each size: one core's copy and add speed, then every collective's bus bandwidth with its
    ideal as the baseline (the ratio is the fraction of the ideal reached), all from the same rounds."""
    for size in sizes_mb:
        size_bytes = max(16, int(size * (1 << 20)) // 4) * 4
        iterations = 2 if quick else max(3, int(128 / size))
        samples = alternate(executor, _round, [size, iterations], repeats)
        fixed = {impl: [t * 1e6 for t in samples.pop(f"4 bytes {impl}")]
                 for impl in ("raw gloo", "hvdray", "hvdray, hvd.allreduce(tensor)")}
        record(f"allreduce of 4 bytes, {ranks} ranks ({size:g} MB round)", fixed, "us", "raw gloo", False)
        copies, adds = samples["copy"], samples["add"]
        record(f"one core's memory speed, {size:g} MB", {
            "copy": [size_bytes / t / 1e9 for t in copies], "add (operand bytes)": [size_bytes / t / 1e9 for t in adds],
            "copy, fresh output": [size_bytes / t / 1e9 for t in samples.pop("copy into a fresh tensor")],
        }, "GB/s", "copy", True)
        for collective in COLLECTIVES:
            moved = bus_bytes(collective, size_bytes, ranks)
            busbw = {IDEAL: [moved / ideal_seconds(collective, size_bytes, ranks, c, a) / 1e9
                             for c, a in zip(copies, adds)]}
            for impl, values in samples.items():
                if impl.startswith(collective + " "):
                    busbw[impl[len(collective) + 1:]] = [moved / t / 1e9 for t in values]
            record(f"{collective} {size:g} MB bus bandwidth, {ranks} ranks", busbw, "GB/s", IDEAL, True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[4, 16, 64, 256])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="few iterations (smoke run)")
    parser.add_argument("--huge-pages", action="store_true",
                        help="the workers with transparent huge pages for large tensors (huge_pages=True)")
    args = parser.parse_args(argv)
    if args.workers < 2:
        parser.error("--workers must be at least 2")
    if args.quick:
        args.repeats = 2
    ray.init(address="local", num_cpus=max(4, args.workers), include_dashboard=False)

    def record(section: str, samples: dict[str, list[float]], unit: str, baseline: str, higher: bool) -> None:
        base = statistics.median(samples[baseline])
        for impl, values in samples.items():
            median = statistics.median(values)
            ratio = median / base if higher else base / median
            print(f"{section:40s} {impl:38s} {median:9.3f} {unit:5s} {ratio:6.2f}x vs {baseline}"
                  f"{rounds_range(values, samples[baseline], higher) if impl != baseline else ''}", flush=True)

    from hvdray import RayExecutor

    try:
        settings = RayExecutor.create_settings(timeout_s=120, huge_pages=args.huge_pages)
        with RayExecutor(settings, num_workers=args.workers) as ex:
            ex.run(setup_raw_gloo)
            bandwidth_rows(record, ex, args.workers, args.sizes_mb, args.repeats, args.quick)
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
