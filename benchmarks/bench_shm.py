"""Benchmark rows for the shared-memory transport: hvdray over shared memory vs hvdray over Gloo vs raw
torch Gloo, in the same worker processes of one node, alternating rounds.

For 2 and 4 local ranks: 64 MB allreduce bus bandwidth, small-message allreduce latency (and 4-byte
allgather, broadcast, grouped allreduce of two tensors and float max latency, named and unnamed), and training
throughput of the harness's model with ``DistributedOptimizer`` (vs DDP). "hvdray gloo" is the network
path (``shm_transport`` off: what ranks on different nodes use between them), whose allreduces run over
the ranks' own connections (``peer_sockets``); every row also runs it with ``peer_sockets`` off, where
Gloo carries them. ``benchmarks/bench.py`` adds
these rows to its report; run alone it prints them:

    python benchmarks/bench_shm.py --local-ranks 2 4 --repeats 5      # --quick for a smoke run
    python benchmarks/bench_shm.py --rows bandwidth latency           # only some rows
"""

from __future__ import annotations

import argparse
import statistics
import sys
from typing import Callable

import ray
import ray.cloudpickle

from harness import alternate, rounds_range, setup_raw_gloo, timed, training_round

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

Record = Callable[[str, dict[str, list[float]], str, str, bool], None]
TRANSPORTS = {"hvdray shm": True, "hvdray gloo": False}
#: every row's extra column: the network path without the ranks' own connections (Gloo carries everything)
NO_SOCKETS = "hvdray gloo, peer_sockets off"
SHARED_TENSOR = "hvdray shm, tensor in shared memory"
#: an op without a name, as metric allreduces in a training loop are: each call gets a new generated name,
#: and from the second call on it goes by its family's cached slot (the engine's response cache)
UNNAMED = "hvdray shm, unnamed"
#: (column, shm_transport, peer_sockets) of each hvdray column
CONFIGURATIONS = [*((impl, shm, True) for impl, shm in TRANSPORTS.items()), (NO_SOCKETS, False, False)]


def _use_transport(shm: bool, sockets: bool = True) -> str:
    """Restart this worker's hvdray with ``shm_transport`` on or off (every rank does it in one call), and
    ``peer_sockets`` as given."""
    import hvdray.torch as hvd
    from hvdray.collective import session

    job = session.current().current_job()  # a worker's settings are read-only: the job gets a changed copy
    job.settings = job.settings.replace(shm_transport=shm, peer_sockets=sockets)
    hvd.shutdown()
    hvd.init()
    return session.engine().comm.transport


def _allreduce_round(size_mb: float, iterations: int) -> dict[str, float]:
    """Seconds per allreduce of ``size_mb`` float32: raw Gloo and hvdray over each transport; over shared
    memory also of a tensor that lives in torch shared memory (``share_memory_()``: reduced in place) and
    without a name (a full negotiation round per op);
    and over the network path with ``peer_sockets`` off."""
    import torch
    import torch.distributed as dist

    import hvdray.torch as hvd

    tensor = torch.ones(max(1, int(size_mb * 1024 * 1024 // 4)))
    times = {"raw gloo": timed(lambda: dist.all_reduce(tensor), iterations)}
    for impl, shm, sockets in CONFIGURATIONS:
        _use_transport(shm, sockets)
        times[impl] = timed(lambda: hvd.allreduce_(tensor, op=hvd.Sum, name="shm_bench"), iterations)
        if shm:
            shared = tensor.clone().share_memory_()
            times[SHARED_TENSOR] = timed(
                lambda: hvd.allreduce_(shared, op=hvd.Sum, name="shm_bench"), iterations
            )
            times[UNNAMED] = timed(lambda: hvd.allreduce_(tensor, op=hvd.Sum), iterations)
    return times


#: the small ops' rows (:func:`_small_ops_round`): raw Gloo's is its own op, or a grouped op's tensors one after
#: the other; its max does not reduce a NaN mask beside the tensor, as hvdray's of a float tensor does; the
#: allreduces in flight are submitted asynchronously (raw Gloo's with ``async_op=True``), then each waited on
SMALL_OPS = ("allgather", "broadcast", "grouped allreduce of 2 x", "allreduce max of")
#: how many allreduces the "in flight" row submits before it waits on them (hvdray's unnamed ones go by their
#: families' slots up to FAMILY_VARIANTS in flight)
IN_FLIGHT = 8
IN_FLIGHT_ROW = f"{IN_FLIGHT} allreduces in flight of"
SMALL_OPS += (IN_FLIGHT_ROW,)


def _small_ops_round(iterations: int) -> dict[str, float]:
    """Seconds per 4-byte allgather, broadcast (from rank 0), grouped allreduce of two tensors, float max, and
    :data:`IN_FLIGHT` asynchronous allreduces waited on together, over shared memory: raw Gloo, hvdray with a
    name and without one (from the second call on by its families' cached slots, like the unnamed allreduce)."""
    import torch
    import torch.distributed as dist

    import hvdray.torch as hvd

    _use_transport(True)
    tensor, other = torch.ones(1), torch.ones(1)
    gathered = torch.empty(hvd.size())

    def gloo_pair() -> None:
        dist.all_reduce(tensor)
        dist.all_reduce(other)

    several = [torch.ones(1) for _ in range(IN_FLIGHT)]

    def gloo_in_flight() -> None:
        for work in [dist.all_reduce(t, async_op=True) for t in several]:
            work.wait()

    def in_flight(named: bool) -> Callable[[], None]:
        def run() -> None:
            handles = [hvd.allreduce_async_(t, op=hvd.Sum, name=f"shm_bench.f{i}" if named else None)
                       for i, t in enumerate(several)]
            for handle in handles:
                hvd.synchronize(handle)
        return run

    return {
        "grouped allreduce of 2 x raw gloo": timed(gloo_pair, iterations),
        "grouped allreduce of 2 x hvdray shm": timed(
            lambda: hvd.grouped_allreduce_([tensor, other], op=hvd.Sum, name="shm_bench.gar"), iterations),
        f"grouped allreduce of 2 x {UNNAMED}": timed(
            lambda: hvd.grouped_allreduce_([tensor, other], op=hvd.Sum), iterations),
        "allreduce max of raw gloo": timed(lambda: dist.all_reduce(tensor, dist.ReduceOp.MAX), iterations),
        "allreduce max of hvdray shm": timed(lambda: hvd.allreduce_(tensor, op=hvd.Max, name="shm_bench.max"),
                                             iterations),
        f"allreduce max of {UNNAMED}": timed(lambda: hvd.allreduce_(tensor, op=hvd.Max), iterations),
        "allgather raw gloo": timed(lambda: dist.all_gather_into_tensor(gathered, tensor), iterations),
        "allgather hvdray shm": timed(lambda: hvd.allgather(tensor, name="shm_bench.ag"), iterations),
        f"allgather {UNNAMED}": timed(lambda: hvd.allgather(tensor), iterations),
        "broadcast raw gloo": timed(lambda: dist.broadcast(tensor, 0), iterations),
        "broadcast hvdray shm": timed(lambda: hvd.broadcast_(tensor, root_rank=0, name="shm_bench.bc"), iterations),
        f"broadcast {UNNAMED}": timed(lambda: hvd.broadcast_(tensor, root_rank=0), iterations),
        f"{IN_FLIGHT_ROW} raw gloo": timed(gloo_in_flight, iterations),
        f"{IN_FLIGHT_ROW} hvdray shm": timed(in_flight(True), iterations),
        f"{IN_FLIGHT_ROW} {UNNAMED}": timed(in_flight(False), iterations),
    }


def _training_round(steps: int, batch: int) -> dict[str, float]:
    """Samples per second: DDP, and hvdray's DistributedOptimizer over each transport (and over the network
    path with ``peer_sockets`` off)."""
    rates: dict[str, float] = {}
    for impl, shm, sockets in CONFIGURATIONS:
        _use_transport(shm, sockets)
        measured = training_round(steps, batch)
        rates.setdefault("DDP (gloo)", measured["DDP (gloo)"])
        rates[f"{impl} DistributedOptimizer"] = measured["hvdray DistributedOptimizer"]
    return rates


ROWS = ("bandwidth", "latency", "training")


def shared_memory_rows(
    record: Record, local_ranks: list[int], repeats: int, quick: bool, rows: tuple[str, ...] = ROWS
) -> None:
    """Measure the ``rows`` (all by default) for each number of local ranks and hand them to ``record``."""
    from hvdray import RayExecutor

    for n in local_ranks:
        settings = RayExecutor.create_settings(timeout_s=120)
        with RayExecutor(settings, num_workers=n, cpus_per_worker=min(1.0, 4 / n)) as ex:
            ex.run(setup_raw_gloo)
            assert ex.run(_use_transport, args=[True]) == ["shm"] * n, "the shared-memory transport is not in use"
            if "bandwidth" in rows:
                size = 64
                samples = alternate(ex, _allreduce_round, [size, 2 if quick else 5], repeats)
                busbw = {k: [2 * (n - 1) / n * size * 1024 * 1024 / t / 1e9 for t in v] for k, v in samples.items()}
                record(f"allreduce 64 MB bus bandwidth, {n} local ranks", busbw, "GB/s", "raw gloo", True)
            if "latency" in rows:
                for label, size_mb in (("4 B", 4 / 2**20), ("64 KB", 1 / 16)):
                    samples = alternate(ex, _allreduce_round, [size_mb, 20 if quick else 300], repeats)
                    micros = {k: [t * 1e6 for t in v] for k, v in samples.items()}
                    record(f"allreduce {label} latency, {n} local ranks", micros, "us", "raw gloo", False)
                samples = alternate(ex, _small_ops_round, [20 if quick else 300], repeats)
                for op in SMALL_OPS:
                    micros = {k[len(op) + 1:]: [t * 1e6 for t in v]
                              for k, v in samples.items() if k.startswith(op + " ")}
                    record(f"{op} 4 B latency, {n} local ranks", micros, "us", "raw gloo", False)
            if "training" in rows:
                record(f"training throughput (CNN on digits, batch 64/worker), {n} local ranks", alternate(
                    ex, _training_round, [5 if quick else 40, 64], repeats), "samples/s", "DDP (gloo)", True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--local-ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="few iterations (smoke run)")
    parser.add_argument("--rows", nargs="+", choices=ROWS, default=list(ROWS), help="which rows to measure (all)")
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats = 2
    ray.init(address="local", num_cpus=max(4, *args.local_ranks), include_dashboard=False)

    def record(section: str, samples: dict[str, list[float]], unit: str, baseline: str, higher: bool) -> None:
        base = statistics.median(samples[baseline])
        for impl, values in samples.items():
            median = statistics.median(values)
            ratio = median / base if higher else base / median
            print(f"{section:58s} {impl:36s} {median:12.4g} {unit:9s} {ratio:6.2f}x vs {baseline}"
                  f"{rounds_range(values, samples[baseline], higher) if impl != baseline else ''}", flush=True)

    try:
        shared_memory_rows(record, args.local_ranks, args.repeats, args.quick, tuple(args.rows))
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
