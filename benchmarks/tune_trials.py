"""Tune trials: seconds per trial of a sweep whose every trial is a distributed job, against doing it by hand.

A sweep of ``--trials`` trials, one at a time (``max_concurrent_trials=1``), each a job of ``--workers``
workers that joins, allreduces one tensor and reports it. Three ways, timed in the same Ray instance in
alternating rounds (the order rotates every round, so that the machine's noise hits all alike):

* ``hvdray+reuse``: ``DistributedTrainableCreator(fn, num_slots=N)`` with Tune's ``reuse_actors=True``:
  the next trial gets the same Trainable actor, and its workers unwind and serve it (``reset_config``).
* ``hvdray``: the same with ``reuse_actors=False``: every trial starts its workers.
* ``raw``: what a user would write without hvdray: a function trainable that reserves the same placement
  group (an empty head bundle and one bundle of N CPUs), starts N Ray actors in it, hands rank 0's address
  to all, ``torch.distributed.init_process_group("gloo")`` and one ``all_reduce`` (startup.py's baseline).

The clock runs around ``Tuner.fit()``, Tune's own start and bookkeeping included (the same for all three);
printed are the medians of seconds per trial and their ratios (below 1: faster than raw).

    python benchmarks/tune_trials.py --workers 2 --trials 6 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import ray
import ray.cloudpickle
from ray import tune
from ray.util.placement_group import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

sys.path.insert(0, str(Path(__file__).resolve().parent))
from startup import RawWorker  # noqa: E402 - the same hand-written actor as the start-up benchmark

from hvdray.tune import DistributedTrainableCreator  # noqa: E402

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def hvdray_trial(config: dict[str, Any]) -> None:
    """Every rank of an hvdray trial: join, allreduce one tensor, report it."""
    import torch

    import hvdray.torch as hvd
    from hvdray.tune import report

    hvd.init()
    report({"sum": float(hvd.allreduce(torch.ones(4), op=hvd.Sum)[0])})


def raw_trial(config: dict[str, Any]) -> None:
    """A hand-written trial: N actors in the trial's placement group, a Gloo group, one allreduce.
    (Any bundle: Tune leaves an empty head bundle out of the group.)"""
    from ray import tune as tune_

    workers = config["workers"]
    group = get_current_placement_group()
    actors = [
        ray.remote(RawWorker).options(
            num_cpus=1, scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=-1)
        ).remote()
        for _ in range(workers)
    ]
    try:
        address = ray.get(actors[0].address.remote())
        results = ray.get([a.allreduce.remote(address, rank, workers) for rank, a in enumerate(actors)])
    finally:
        for actor in actors:
            ray.kill(actor, no_restart=True)
    tune_.report({"sum": results[0]})


def sweep(kind: str, workers: int, trials: int, storage: str) -> float:
    """Seconds per trial of ``trials`` one-at-a-time trials of ``kind``; checks every trial's result."""
    if kind == "raw":
        trainable: Any = tune.with_resources(raw_trial, tune.PlacementGroupFactory([{}, {"CPU": workers}]))
    else:
        trainable = DistributedTrainableCreator(hvdray_trial, num_slots=workers, timeout_s=60)
    tuner = tune.Tuner(
        trainable,
        param_space={"workers": workers, "trial": tune.grid_search(list(range(trials)))},
        tune_config=tune.TuneConfig(max_concurrent_trials=1, reuse_actors=kind == "hvdray+reuse"),
        run_config=tune.RunConfig(storage_path=storage, verbose=0, name=f"{kind.replace('+', '_')}-{time.time_ns()}"),
    )
    started = time.perf_counter()
    grid = tuner.fit()
    elapsed = time.perf_counter() - started
    sums = [result.metrics.get("sum") for result in grid]
    if grid.errors or sums != [float(workers)] * trials:
        raise RuntimeError(f"{kind}: trials returned {sums}, errors {grid.errors}")
    return elapsed / trials


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--trials", type=int, default=6, help="trials per sweep")
    parser.add_argument("--rounds", type=int, default=3, help="sweeps of each kind (medians are reported)")
    parser.add_argument("--json", default=None, help="write the measurements here")
    args = parser.parse_args(argv)
    if args.workers < 1 or args.trials < 1 or args.rounds < 1:
        parser.error("--workers, --trials and --rounds must be at least 1")

    kinds = ["hvdray+reuse", "hvdray", "raw"]
    samples: dict[str, list[float]] = {kind: [] for kind in kinds}
    ray.init(address="local", num_cpus=args.workers + 1, include_dashboard=False)
    try:
        with tempfile.TemporaryDirectory(prefix="hvdray-tune-bench-") as storage:
            sweep("raw", args.workers, 1, storage)  # warm-up, untimed: Tune's and Ray's first-use costs
            for round_ in range(args.rounds):
                for kind in kinds[round_ % 3:] + kinds[: round_ % 3]:
                    samples[kind].append(sweep(kind, args.workers, args.trials, storage))
                    print(f"round {round_ + 1} {kind}: {samples[kind][-1]:.2f} s per trial", flush=True)
    finally:
        ray.shutdown()
    medians = {kind: statistics.median(values) for kind, values in samples.items()}
    print(f"\n{args.trials} trials of {args.workers} workers, one at a time; medians of {args.rounds} sweeps")
    print("| | seconds per trial | / raw |\n|---|---|---|")
    for kind in kinds:
        print(f"| {kind} | {medians[kind]:.2f} | {medians[kind] / medians['raw']:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "samples": samples, "medians": medians}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
