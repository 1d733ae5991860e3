"""Start-up time: from ``RayExecutor(...)`` to the first allreduce result, against doing it by hand.

Two ways to get N workers to their first allreduce, timed in the same Ray instance in alternating
rounds (A B A B ...), so that the machine's noise hits both alike:

* ``hvdray``: ``RayExecutor(settings, num_workers=N)``, ``start()``, then ``run(fn)`` where ``fn``
  calls ``hvd.init()`` and allreduces one tensor; the clock stops when ``run`` returns.
* ``raw``: what a user would write without hvdray: a placement group of N one-CPU bundles, N Ray
  actors in it, rank 0's address handed to all, ``torch.distributed.init_process_group("gloo")`` and
  one ``all_reduce`` in every actor; the clock stops when every actor has returned its result.
* ``ray-train`` (with ``--ray-train``): Ray Train's ``TorchTrainer(fn, scaling_config=ScalingConfig(
  num_workers=N))`` and ``fit()``, where ``fn`` allreduces one tensor over the Gloo group Ray Train set up
  and returns the time its result was there (Ray Train v2 hands rank 0's return value to the driver);
  the clock stops at that time (``fit()`` returns only after Ray Train has shut its workers down: its
  median is printed too). Its runs write to a temporary directory, removed at the end.

All include the placement group, the actors' processes, importing torch in them and the shutdown is
not timed. The first hvdray executor of the driver pays for the driver's first export of hvdray's actor
classes (and, for jobs of more than 16 workers, starts the driver's coordinator host, which its later
executors share; smaller jobs keep their coordinator in their first worker): it runs before the timed
rounds and is reported on its own. Prints the
median of each, their ratio (hvdray / raw, at most 1 is the goal), and with ``--phases`` where hvdray's
time goes (driver-side time stamps of each start step).

``--fresh-drivers K`` adds K alternating rounds in which each kind runs in a driver process of its
own (``python benchmarks/startup.py --alone hvdray|raw``, connected to the same Ray instance; its
imports and ``ray.init`` are not timed): the first start of a script that runs one job, where both pay
their first actor class export, against raw's first start. ``--with-host`` adds a third kind to those
rounds, ``hvdray-host``: hvdray with the job's coordinator in the driver's coordinator host, which the
job starts (what jobs of more than 16 workers do, and every fixed job did before 2026-11-26).

``--load K`` keeps K processes spinning on the CPUs during the rounds, at ``--load-niceness`` (0 by
default, like programs outside Ray; Ray runs its workers at niceness 15, so those starve them, and
``--load-niceness 15`` is load at the workers' own priority, like their data loaders).

    python benchmarks/startup.py --workers 2 4 --rounds 5
    python benchmarks/startup.py --workers 2 4 --rounds 5 --ray-train
    python benchmarks/startup.py --workers 2 --rounds 3 --load 2
    python benchmarks/startup.py --workers 2 4 --rounds 5 --fresh-drivers 5
    python benchmarks/startup.py --workers 2 4 --rounds 1 --fresh-drivers 9 --with-host
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import ray
import ray.cloudpickle
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from hvdray import RayExecutor

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def first_allreduce() -> float:
    """hvdray's worker function: join the job and allreduce one small tensor."""
    import torch

    import hvdray.torch as hvd

    hvd.init()
    return float(hvd.allreduce(torch.ones(4), op=hvd.Sum)[0])


def time_hvdray(workers: int, phases: dict[str, list[float]] | None = None) -> float:
    """Seconds from ``RayExecutor(...)`` to the first allreduce's result on every rank."""
    started = time.perf_counter()
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=60, placement_group_timeout_s=60),
                           num_workers=workers)
    try:
        executor.start()
        if phases is not None:
            phases.setdefault("start()", []).append(time.perf_counter() - started)
        results = executor.run(first_allreduce)
        elapsed = time.perf_counter() - started
    finally:
        executor.shutdown()
    if results != [float(workers)] * workers:
        raise RuntimeError(f"hvdray's allreduce returned {results}, expected {workers} on every rank")
    return elapsed


class RawWorker:
    """The hand-written baseline's actor: a torch Gloo process group and one allreduce."""

    def address(self) -> str:
        import socket

        ip = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind((ip, 0))
            return f"tcp://{ip}:{s.getsockname()[1]}"

    def allreduce(self, init_method: str, rank: int, size: int) -> float:
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=size)
        tensor = torch.ones(4)
        dist.all_reduce(tensor)
        dist.destroy_process_group()
        return float(tensor[0])


def time_raw(workers: int) -> float:
    """Seconds from nothing to the first allreduce of a torch Gloo group in N actors of a placement group."""
    started = time.perf_counter()
    group = placement_group([{"CPU": 1}] * workers, strategy="PACK")
    actors: list[Any] = []
    try:
        ray.get(group.ready())
        actors = [
            ray.remote(RawWorker).options(
                num_cpus=1,
                scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=i),
            ).remote()
            for i in range(workers)
        ]
        address = ray.get(actors[0].address.remote())
        results = ray.get([a.allreduce.remote(address, rank, workers) for rank, a in enumerate(actors)])
        elapsed = time.perf_counter() - started
    finally:
        for actor in actors:
            ray.kill(actor, no_restart=True)
        remove_placement_group(group)
    if results != [float(workers)] * workers:
        raise RuntimeError(f"the raw Gloo allreduce returned {results}")
    return elapsed


def ray_train_first_allreduce() -> tuple[float, float]:
    """Ray Train's worker function: Ray Train has set up the torch Gloo process group; allreduce one small
    tensor and return when its result was there (``time.time()``: the driver is on the same machine)."""
    import torch
    import torch.distributed as dist

    tensor = torch.ones(4)
    dist.all_reduce(tensor)
    return time.time(), float(tensor[0])


def time_ray_train(workers: int, storage: str, fits: list[float] | None = None) -> float:
    """Seconds from ``TorchTrainer(...)`` to the first allreduce's result (the time rank 0 returns);
    ``fits`` gets the seconds until ``fit()`` returned (Ray Train shuts its workers down before it does)."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    started_at, started = time.time(), time.perf_counter()
    trainer = TorchTrainer(ray_train_first_allreduce,
                           scaling_config=ScalingConfig(num_workers=workers, resources_per_worker={"CPU": 1}),
                           run_config=RunConfig(storage_path=storage, name=f"startup-{time.time_ns()}"))
    result = trainer.fit()
    if fits is not None:
        fits.append(time.perf_counter() - started)
    if result.error is not None or result.return_value is None or result.return_value[1] != float(workers):
        raise RuntimeError(f"Ray Train's allreduce failed: {result.error!r}, returned {result.return_value}")
    return result.return_value[0] - started_at  # rank 0's function returned it


def alternate(runs: dict[str, Callable[[], float]], rounds: int) -> dict[str, Any]:
    """``rounds`` rounds of each kind's run (the order rotates each round: with two kinds it flips);
    samples, medians, and each kind's ratio to raw (``ratio`` is hvdray's)."""
    kinds = list(runs)
    samples: dict[str, list[float]] = {kind: [] for kind in kinds}
    for round_ in range(rounds):
        for name in kinds[round_ % len(kinds):] + kinds[:round_ % len(kinds)]:
            samples[name].append(runs[name]())
            time.sleep(0.5)  # let the killed actors' processes exit before the next round
    medians = {kind: statistics.median(samples[kind]) for kind in kinds}
    row: dict[str, Any] = {"samples": samples, **{f"{kind}_median_s": medians[kind] for kind in kinds}}
    row["ratio"] = medians["hvdray"] / medians["raw"]
    if "ray-train" in medians:
        row["train_ratio"] = medians["hvdray"] / medians["ray-train"]
    if "hvdray-host" in medians:
        row["host_ratio"] = medians["hvdray-host"] / medians["raw"]
    return row


def compare(workers: int, rounds: int, phases: dict[str, list[float]] | None,
            ray_train_storage: str | None = None) -> dict[str, Any]:
    """Alternate hvdray and raw rounds (and Ray Train's, given a storage path for its runs) in this driver;
    medians and their ratios."""
    time_raw(workers)  # warm-up, untimed: the first actors of a fresh Ray instance pay for its start
    # hvdray's first executor in this driver also exports hvdray's actor classes: reported apart, as the
    # start a script that runs one job pays
    first = time_hvdray(workers, None)
    time.sleep(0.5)
    runs = {"hvdray": lambda: time_hvdray(workers, phases), "raw": lambda: time_raw(workers)}
    fits: list[float] = []
    if ray_train_storage is not None:  # its first run in this driver imports and exports Ray Train's classes
        train_first = time_ray_train(workers, ray_train_storage)
        time.sleep(0.5)
        runs["ray-train"] = lambda: time_ray_train(workers, ray_train_storage, fits)
    row = alternate(runs, rounds)
    row.update(workers=workers, hvdray_first_s=first, first_ratio=first / row["raw_median_s"])
    if ray_train_storage is not None:
        row.update(ray_train_first_s=train_first, ray_train_fit_median_s=statistics.median(fits))
    return row


def time_in_fresh_driver(kind: str, workers: int, address: str) -> float:
    """One start of ``kind`` timed by a driver process of its own, connected to the Ray at ``address``."""
    out = subprocess.run([sys.executable, __file__, "--alone", kind, "--workers", str(workers), "--address", address],
                         check=True, capture_output=True, text=True, timeout=600).stdout
    return float(out.strip().splitlines()[-1])


def compare_fresh(workers: int, rounds: int, address: str, with_host: bool = False) -> dict[str, Any]:
    """Alternate first starts of each kind, each in a driver process of its own."""
    kinds = ("hvdray", "hvdray-host", "raw") if with_host else ("hvdray", "raw")
    return alternate({kind: (lambda kind=kind: time_in_fresh_driver(kind, workers, address)) for kind in kinds},
                     rounds)


def alone(kind: str, workers: int, address: str) -> int:
    """``--alone``: connect, time one start of ``kind``, print its seconds (the driver's first start).
    ``hvdray-host`` keeps the job's coordinator in the driver's coordinator host, started by this job
    (as jobs of more than ``HOSTED_BY_WORKER_UP_TO`` workers do, and every fixed job did before)."""
    if kind == "hvdray-host":
        import hvdray.driver.executor

        hvdray.driver.executor.HOSTED_BY_WORKER_UP_TO = 0
    ray.init(address=address)
    try:
        print(time_raw(workers) if kind == "raw" else time_hvdray(workers), flush=True)
    finally:
        ray.shutdown()
    return 0


@contextlib.contextmanager
def spinning(processes: int, niceness: int):
    """``processes`` busy loops at ``niceness`` for the duration (killed by pid afterwards)."""
    code = f"import os\nos.nice({niceness})\nwhile True: pass"
    spinners = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(processes)]
    try:
        yield
    finally:
        for proc in spinners:
            proc.kill()
            proc.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds of each (medians are reported)")
    parser.add_argument("--phases", action="store_true", help="also print where hvdray's start-up time goes")
    parser.add_argument("--json", default=None, help="write the measurements here")
    parser.add_argument("--load", type=int, default=0, help="processes spinning on the CPUs during the rounds")
    parser.add_argument("--load-niceness", type=int, default=0, help="their niceness (Ray's workers run at 15)")
    parser.add_argument("--fresh-drivers", type=int, default=0,
                        help="also this many alternating rounds of each kind in a driver process of its own")
    parser.add_argument("--with-host", action="store_true",
                        help="the fresh-driver rounds also start hvdray with its coordinator in the driver's host")
    parser.add_argument("--ray-train", action="store_true",
                        help="also time Ray Train's TorchTrainer to its first allreduce, in the same rounds")
    parser.add_argument("--alone", choices=("hvdray", "hvdray-host", "raw"), default=None, help=argparse.SUPPRESS)
    parser.add_argument("--address", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.alone:
        return alone(args.alone, args.workers[0], args.address)
    if any(n < 1 for n in args.workers):
        parser.error("--workers must be at least 1")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.load < 0 or not 0 <= args.load_niceness <= 19:
        parser.error("--load must be at least 0 and --load-niceness within 0..19")
    if args.fresh_drivers < 0:
        parser.error("--fresh-drivers must be at least 0")
    if args.with_host and not args.fresh_drivers:
        parser.error("--with-host needs --fresh-drivers")

    # Ray Train's runs need Ray's state API (its placement-group cleaner asks it about the run's
    # controller), which the dashboard serves: with --ray-train, Ray keeps its default dashboard
    ray.init(address="local", num_cpus=max(args.workers), include_dashboard=None if args.ray_train else False)
    rows = []
    ray_train_storage = tempfile.TemporaryDirectory(prefix="hvdray-startup-ray-train-") if args.ray_train else None
    try:
        with spinning(args.load, args.load_niceness):
            for workers in args.workers:
                phases: dict[str, list[float]] | None = {} if args.phases else None
                row = compare(workers, args.rounds, phases, ray_train_storage and ray_train_storage.name)
                if phases is not None:
                    row["phases"] = {k: statistics.median(v) for k, v in phases.items()}
                rows.append(row)
                print(f"{workers} workers: hvdray {row['hvdray_median_s']:.2f} s, raw Ray + Gloo "
                      f"{row['raw_median_s']:.2f} s, ratio {row['ratio']:.2f}; the driver's first hvdray "
                      f"executor {row['hvdray_first_s']:.2f} s ({row['first_ratio']:.2f}x raw)", flush=True)
                if args.ray_train:
                    print(f"{workers} workers: Ray Train {row['ray-train_median_s']:.2f} s to its first allreduce "
                          f"(fit() returned after {row['ray_train_fit_median_s']:.2f} s), hvdray / Ray Train "
                          f"{row['train_ratio']:.2f}; the driver's first Ray Train run {row['ray_train_first_s']:.2f} s",
                          flush=True)
                if args.fresh_drivers:
                    fresh = compare_fresh(workers, args.fresh_drivers, ray.get_runtime_context().gcs_address,
                                          args.with_host)
                    row["fresh_drivers"] = fresh
                    host = (f"; coordinator in the driver's host {fresh['hvdray-host_median_s']:.2f} s, ratio "
                            f"{fresh['host_ratio']:.2f}" if args.with_host else "")
                    print(f"{workers} workers, each start in a fresh driver: hvdray {fresh['hvdray_median_s']:.2f} s, "
                          f"raw {fresh['raw_median_s']:.2f} s, ratio {fresh['ratio']:.2f}{host}", flush=True)
    finally:
        ray.shutdown()
        if ray_train_storage is not None:
            ray_train_storage.cleanup()
    print("\n| workers | hvdray (s, median) | raw Ray actors + Gloo (s, median) | hvdray / raw "
          "| the driver's first hvdray executor (s) | first / raw |\n|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['workers']} | {row['hvdray_median_s']:.2f} | {row['raw_median_s']:.2f} | {row['ratio']:.2f} "
              f"| {row['hvdray_first_s']:.2f} | {row['first_ratio']:.2f} |")
    if args.ray_train:
        print("\n| workers | hvdray (s, median) | Ray Train to its first allreduce (s, median) | hvdray / Ray Train "
              "| Ray Train's fit() returned (s, median) | the driver's first Ray Train run (s) |\n"
              "|---|---|---|---|---|---|")
        for row in rows:
            print(f"| {row['workers']} | {row['hvdray_median_s']:.2f} | {row['ray-train_median_s']:.2f} "
                  f"| {row['train_ratio']:.2f} | {row['ray_train_fit_median_s']:.2f} | {row['ray_train_first_s']:.2f} |")
    if args.fresh_drivers:
        host_columns = " coordinator in the host (s) | host / raw |" if args.with_host else ""
        print("\n| workers | hvdray, fresh driver (s, median) | raw, fresh driver (s, median) | hvdray / raw |"
              f"{host_columns}\n|---|---|---|---|{'---|---|' if args.with_host else ''}")
        for row in rows:
            fresh = row["fresh_drivers"]
            host = f" {fresh['hvdray-host_median_s']:.2f} | {fresh['host_ratio']:.2f} |" if args.with_host else ""
            print(f"| {row['workers']} | {fresh['hvdray_median_s']:.2f} | {fresh['raw_median_s']:.2f} "
                  f"| {fresh['ratio']:.2f} |{host}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
