"""Elastic recovery time: a node is lost, how long until the survivors train again? And a node joins:
how long do the members stand still while the job grows?

Runs an elastic job on a ``ray.cluster_utils.Cluster`` (several raylets on this machine, one worker
each) that trains a small model (``DistributedOptimizer``, ``TorchState``) in a loop and commits every
few steps. Each trial removes the node of the highest rank, and measures, from that moment:

* ``detected``: the driver leaves RUNNING (it saw the death or a survivor's check-in),
* ``re-formed``: the driver forms the new membership epoch,
* ``first step``: the first training step (its gradients allreduced) completed in the new epoch,
* ``committed``: the first ``state.commit()`` completed in the new epoch: the job makes progress again
  (the number that matters; goal: under 5 s).

Then a fresh node is added and the job grows back before the next trial, which measures, from the
moment the node is added:

* ``joined``: the new worker has started (its node came up, its process imported what it needs) and
  the driver tells the members (RESIZING),
* ``grown``: the first commit of the grown job;

and ``grow pause``: from the members' last commit before the grown job's first one to that one, the
time the members stood still while the new worker joined (they train on until it has started).

With ``--ray-train`` the same trials then run against Ray Train v2's elastic training on a fresh cluster
of the same shape: a ``TorchTrainer`` with ``ScalingConfig(num_workers=(workers - 1, workers))`` and
``FailureConfig(max_failures=-1)`` trains the same model (DDP through ``prepare_model``), and every
``--commit-every`` steps reports a checkpoint of the model, the optimizer and the step (how Ray Train keeps
progress across a failure; the restarted workers resume from it). Ray Train restarts its whole worker
group on a loss and on a resize, so ``first step`` and ``committed`` are the restarted group's, and
``grown`` is the first checkpoint of the group restarted at full size; the driver's transitions
(``detected``, ``re-formed``, ``joined``) are not observable from outside its controller and are left
out. Its resize monitor looks every ``--discovery-interval`` s, as hvdray's discovery does (Ray Train's
default is 60 s), and it waits ``--timeout`` s for a worker group to start, hvdray's ``timeout_s`` here
(``RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S``; its default is 60 s, and it matters: right after a loss
Ray Train still counts the lost node's CPU and first tries to restart at full size, which waits out
this timeout); its health checks keep their default (2 s). The last lines compare the medians.

Prints markdown tables and writes JSON with ``--json``.

    python benchmarks/elastic_recovery.py --trials 3 [--ray-train]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import ray
from ray.cluster_utils import Cluster

from hvdray import RayExecutor

GOAL_S = 5.0  # issue #23: a node's removal to the next committed step


def small_model() -> Any:
    """The model both kinds train (64-256-10), built after ``torch.manual_seed(0)`` on every rank."""
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))


def training_loop(stop_file: str, commit_every: int) -> int:
    """Runs on every worker: train forever (committing now and then) until the stop file appears."""
    import os
    import time

    import torch

    import hvdray.torch as hvd
    from hvdray import ray_logger

    torch.set_num_threads(1)
    hvd.init()
    model = small_model()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                         named_parameters=model.named_parameters())
    state = hvd.elastic.TorchState(model, optimizer, step=0)
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))

    @hvd.elastic.run
    def loop(state) -> int:
        first, last_tick = True, time.monotonic()
        while True:
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()  # the gradients allreduced
            if hvd.rank() == 0 and first:
                ray_logger.log({"kind": "first_step", "t": time.time(), "size": hvd.size()})
                first = False
            elif hvd.rank() == 0 and time.monotonic() - last_tick > 0.5:
                ray_logger.log({"kind": "tick"})  # keeps the driver's callbacks (which add nodes) running
                last_tick = time.monotonic()
            state.step += 1
            if state.step % commit_every == 0:
                stop = hvd.allreduce(torch.tensor([float(os.path.exists(stop_file))]), op=hvd.Max, name="stop")
                if stop.item():
                    return state.step
                state.commit()
                if hvd.rank() == 0:
                    ray_logger.log({"kind": "commit", "t": time.time(), "size": hvd.size()})
            time.sleep(0.01)

    return loop(state)


def ray_train_loop(config: dict[str, Any]) -> None:
    """Ray Train's worker function: the same model and loop, DDP for the gradients, and a checkpoint
    reported every ``commit_every`` steps (resumed from after a restart); rank 0 appends its first step
    and its commits to ``config["events"]`` (one JSON line each; the driver is on the same machine)."""
    import json
    import os
    import tempfile
    import time

    import torch
    import torch.distributed as dist

    import ray.train
    from ray.train.torch import prepare_model

    torch.set_num_threads(1)
    context = ray.train.get_context()
    rank, size = context.get_world_rank(), context.get_world_size()
    model = prepare_model(small_model())
    plain = getattr(model, "module", model)  # prepare_model wraps it in DDP only with more than one worker
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    step = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as directory:
            saved = torch.load(os.path.join(directory, "state.pt"))
        plain.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        step = saved["step"]
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))

    def log(record: dict[str, Any]) -> None:
        if rank == 0:
            with open(config["events"], "a") as events:
                events.write(json.dumps({**record, "t": time.time(), "size": size}) + "\n")

    first = True
    while True:
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()  # DDP allreduces the gradients
        optimizer.step()
        if first:
            log({"kind": "first_step"})
            first = False
        step += 1
        if step % config["commit_every"] == 0:
            stop = torch.tensor([float(os.path.exists(config["stop_file"]))])
            dist.all_reduce(stop, op=dist.ReduceOp.MAX)
            if stop.item():
                return
            with tempfile.TemporaryDirectory() as directory:
                saved = None
                if rank == 0:
                    torch.save({"model": plain.state_dict(), "optimizer": optimizer.state_dict(),
                                "step": step}, os.path.join(directory, "state.pt"))
                    saved = ray.train.Checkpoint.from_directory(directory)
                ray.train.report({"step": step}, checkpoint=saved)
            log({"kind": "commit"})
        time.sleep(0.01)


class Trials:
    """Callback: records driver transitions, first steps and commits. Node removals run in a thread; node
    additions in the callback itself, since Ray starts raylets only from the main thread.
    ``driver_events``: the records include hvdray's driver transitions (not Ray Train's)."""

    def __init__(self, cluster: Cluster, trials: int, workers: int, stop_file: str,
                 driver_events: bool = True) -> None:
        self.cluster, self.trials, self.workers, self.stop_file = cluster, trials, workers, stop_file
        self.driver_events = driver_events
        self.records: list[dict[str, Any]] = []
        self.results: list[dict[str, float]] = []
        self.growths: list[dict[str, float]] = []
        self.added_at = 0.0
        self._lock = threading.Condition()
        self._add_node = False
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __call__(self, record: dict[str, Any]) -> None:
        with self._lock:
            self.records.append(record)
            self._lock.notify_all()
            add, self._add_node = self._add_node, False
        if add:
            self.added_at = time.time()
            self.cluster.add_node(num_cpus=1)

    def _wait_for(self, match, since: int, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        with self._lock:
            while True:
                for record in self.records[since:]:
                    if match(record):
                        return record
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError("the elastic job did not reach the expected state in time")
                self._lock.wait(remaining)

    def _grow(self) -> dict[str, float]:
        """After a node is added (by the callback): when the new worker joined and the job trained again."""
        growth = {}
        if self.driver_events:
            joined = self._wait_for(lambda r: r.get("event") == "elastic" and r["state"] == "resizing", 0, 180)
            growth["joined_s"] = joined["time"] - self.added_at
        grown = self._wait_for(lambda r: r.get("kind") == "commit" and r["size"] == self.workers, 0, 180)
        with self._lock:
            before = [r["t"] for r in self.records if r.get("kind") == "commit" and r["size"] < self.workers]
        return {**growth, "grown_s": grown["t"] - self.added_at,
                "grow_pause_s": grown["t"] - max(before, default=self.added_at)}

    def _run(self) -> None:
        try:
            for _ in range(self.trials):
                self._wait_for(lambda r: r.get("kind") == "first_step" and r["size"] == self.workers, 0, 180)
                time.sleep(1.0)  # steady state
                with self._lock:
                    mark = len(self.records)
                victim = [n for n in self.cluster.list_all_nodes() if n is not self.cluster.head_node][-1]
                lost_at = time.time()
                self.cluster.remove_node(victim, allow_graceful=False)
                result = {}
                if self.driver_events:
                    detected = self._wait_for(lambda r: r.get("event") == "elastic" and r["state"] == "recovering",
                                              mark, 60)
                    formed = self._wait_for(lambda r: r.get("event") == "elastic" and r["state"] == "running",
                                            mark, 60)
                    result = {"detected_s": detected["time"] - lost_at, "re-formed_s": formed["time"] - lost_at}
                first = self._wait_for(lambda r: r.get("kind") == "first_step" and r["t"] > lost_at, mark, 120)
                committed = self._wait_for(lambda r: r.get("kind") == "commit" and r["t"] > lost_at
                                           and r["size"] < self.workers, mark, 120)
                self.results.append({**result, "first_step_s": first["t"] - lost_at,
                                     "committed_s": committed["t"] - lost_at})
                print(f"trial {len(self.results)}: " + ", ".join(f"{k} {v:.2f}" for k, v in self.results[-1].items()),
                      flush=True)
                with self._lock:
                    self.records.clear()
                    self._add_node = True
                self.growths.append(self._grow())
                print(f"growth {len(self.growths)}: " + ", ".join(f"{k} {v:.2f}" for k, v in self.growths[-1].items()),
                      flush=True)
        finally:
            Path(self.stop_file).touch()


@contextlib.contextmanager
def fresh_cluster(workers: int) -> Iterator[Cluster]:
    """A head without CPUs and one 1-CPU raylet per worker (Ray's default health checks), connected;
    disconnected and shut down afterwards."""
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    try:
        for _ in range(workers):
            cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def run_hvdray(args: argparse.Namespace, scratch: Path) -> Trials:
    """The trials against an hvdray elastic job on a fresh cluster."""
    stop_file = str(scratch / "stop-hvdray")
    settings = RayExecutor.create_settings(timeout_s=args.timeout, discovery_interval_s=args.discovery_interval)
    with fresh_cluster(args.workers) as cluster:
        trials = Trials(cluster, args.trials, args.workers, stop_file)
        trials.thread.start()
        with RayExecutor(settings, min_workers=args.workers - 1, max_workers=args.workers) as executor:
            executor.run(training_loop, args=[stop_file, args.commit_every], callbacks=[trials])
        trials.thread.join(timeout=10)
    return trials


def run_ray_train(args: argparse.Namespace, scratch: Path) -> Trials:
    """The same trials against Ray Train's elastic training on a fresh cluster: ``fit()`` runs on a thread
    while this (main) thread hands rank 0's events to the trials, which add nodes from it."""
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    stop_file, events = scratch / "stop-ray-train", scratch / "ray-train-events.jsonl"
    events.touch()
    trainer = TorchTrainer(
        ray_train_loop,
        train_loop_config={"events": str(events), "stop_file": str(stop_file), "commit_every": args.commit_every},
        scaling_config=ScalingConfig(num_workers=(args.workers - 1, args.workers), resources_per_worker={"CPU": 1},
                                     elastic_resize_monitor_interval_s=args.discovery_interval),
        run_config=RunConfig(storage_path=str(scratch / "ray-train-storage"), name="elastic-recovery",
                             failure_config=FailureConfig(max_failures=-1),
                             checkpoint_config=CheckpointConfig(num_to_keep=2)))
    # the controller reads it in its own process: Ray Train hands this variable on to it
    os.environ["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"] = str(args.timeout)
    outcome: list[Any] = []
    fit = threading.Thread(target=lambda: outcome.append(trainer.fit()), daemon=True)
    with fresh_cluster(args.workers) as cluster:
        trials = Trials(cluster, args.trials, args.workers, str(stop_file), driver_events=False)
        trials.thread.start()
        fit.start()
        try:
            with events.open() as lines:
                pending = ""
                while fit.is_alive():
                    pending += lines.read()
                    *complete, pending = pending.split("\n")
                    for line in complete:
                        trials(json.loads(line))
                    time.sleep(0.05)
            trials.thread.join(timeout=10)
            if outcome and outcome[0].error is not None:
                print(f"Ray Train's run failed: {outcome[0].error!r}", file=sys.stderr)
        finally:
            stop_file.touch()
            fit.join(timeout=60)
    return trials


def report(name: str, trials: Trials) -> float | None:
    """Prints one kind's tables; returns its median seconds to the next commit, if a trial completed."""
    print(f"\n## {name}")
    if not trials.results:
        print("no trial completed")
        return None
    _table("s after node loss", trials.results)
    _table("s after node added", trials.growths)
    recovery = statistics.median(r["committed_s"] for r in trials.results)
    print(f"\nnode removal -> next committed step: median {recovery:.2f} s, worst "
          f"{max(r['committed_s'] for r in trials.results):.2f} s (goal < {GOAL_S:.0f} s): "
          f"{'met' if recovery < GOAL_S else 'NOT met'}")
    return recovery


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--workers", type=int, default=3, help="nodes (one worker each) at full size")
    parser.add_argument("--commit-every", type=int, default=10)
    parser.add_argument("--discovery-interval", type=float, default=0.5,
                        help="seconds between looks for new resources (hvdray's discovery, Ray Train's resize monitor)")
    parser.add_argument("--timeout", type=float, default=10.0,
                        help="hvdray's timeout_s; Ray Train's wait for a worker group to start")
    parser.add_argument("--ray-train", action="store_true",
                        help="then run the same trials against Ray Train's elastic training and compare")
    parser.add_argument("--json", default=None, help="write the measurements here")
    args = parser.parse_args(argv)

    runs = {"hvdray": run_hvdray}
    if args.ray_train:
        runs["Ray Train"] = run_ray_train
    measured: dict[str, Trials] = {}
    with tempfile.TemporaryDirectory(prefix="hvdray-bench-") as scratch:
        for name, run in runs.items():
            measured[name] = run(args, Path(scratch))
    medians = {name: report(name, trials) for name, trials in measured.items()}
    for name in list(medians)[1:]:
        if medians[name] and medians["hvdray"]:
            print(f"{name}: next committed step after a node loss {medians[name]:.2f} s; "
                  f"hvdray / {name} = {medians['hvdray'] / medians[name]:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {name: {"trials": t.results, "growths": t.growths} for name, t in measured.items()}
            | {"workers": args.workers}, indent=2))
    return 0 if all(len(t.results) == args.trials for t in measured.values()) else 1


def _table(unit: str, rows: list[dict[str, float]]) -> None:
    if not rows:
        return
    print(f"\n| measure ({unit}) | median | max |\n|---|---|---|")
    for column in rows[0]:
        values = [r[column] for r in rows]
        print(f"| {column.removesuffix('_s').replace('_', ' ')} | {statistics.median(values):.2f} | {max(values):.2f} |")


if __name__ == "__main__":
    sys.exit(main())
