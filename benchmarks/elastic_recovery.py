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

Prints markdown tables and writes JSON with ``--json``.

    python benchmarks/elastic_recovery.py --trials 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import ray
from ray.cluster_utils import Cluster

from hvdray import RayExecutor

GOAL_S = 5.0  # issue #23: a node's removal to the next committed step


def training_loop(stop_file: str, commit_every: int) -> int:
    """Runs on every worker: train forever (committing now and then) until the stop file appears."""
    import os
    import time

    import torch

    import hvdray.torch as hvd
    from hvdray import ray_logger

    torch.set_num_threads(1)
    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
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


class Trials:
    """Callback: records driver transitions, first steps and commits. Node removals run in a thread; node
    additions in the callback itself, since Ray starts raylets only from the main thread."""

    def __init__(self, cluster: Cluster, trials: int, workers: int, stop_file: str) -> None:
        self.cluster, self.trials, self.workers, self.stop_file = cluster, trials, workers, stop_file
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
        joined = self._wait_for(lambda r: r.get("event") == "elastic" and r["state"] == "resizing", 0, 180)
        grown = self._wait_for(lambda r: r.get("kind") == "commit" and r["size"] == self.workers, 0, 120)
        with self._lock:
            before = [r["t"] for r in self.records if r.get("kind") == "commit" and r["size"] < self.workers]
        return {
            "joined_s": joined["time"] - self.added_at,
            "grown_s": grown["t"] - self.added_at,
            "grow_pause_s": grown["t"] - max(before, default=self.added_at),
        }

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
                detected = self._wait_for(lambda r: r.get("event") == "elastic" and r["state"] == "recovering",
                                          mark, 60)
                formed = self._wait_for(lambda r: r.get("event") == "elastic" and r["state"] == "running",
                                        mark, 60)
                first = self._wait_for(lambda r: r.get("kind") == "first_step" and r["t"] > lost_at, mark, 60)
                committed = self._wait_for(lambda r: r.get("kind") == "commit" and r["t"] > lost_at
                                           and r["size"] < self.workers, mark, 60)
                self.results.append({
                    "detected_s": detected["time"] - lost_at,
                    "re-formed_s": formed["time"] - lost_at,
                    "first_step_s": first["t"] - lost_at,
                    "committed_s": committed["t"] - lost_at,
                })
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--workers", type=int, default=3, help="nodes (one worker each) at full size")
    parser.add_argument("--commit-every", type=int, default=10)
    parser.add_argument("--json", default=None, help="write the measurements here")
    args = parser.parse_args(argv)

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})  # Ray's default health checks
    for _ in range(args.workers):
        cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address)
    scratch = tempfile.TemporaryDirectory(prefix="hvdray-bench-")
    stop_file = str(Path(scratch.name) / "stop")
    trials = Trials(cluster, args.trials, args.workers, stop_file)
    trials.thread.start()
    settings = RayExecutor.create_settings(timeout_s=10, discovery_interval_s=0.5)
    try:
        with RayExecutor(settings, min_workers=args.workers - 1, max_workers=args.workers) as executor:
            executor.run(training_loop, args=[stop_file, args.commit_every], callbacks=[trials])
        trials.thread.join(timeout=10)
    finally:
        scratch.cleanup()
        ray.shutdown()
        cluster.shutdown()
    if not trials.results:
        print("no trial completed", file=sys.stderr)
        return 1
    _table("s after node loss", trials.results)
    _table("s after node added", trials.growths)
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"trials": trials.results, "growths": trials.growths, "workers": args.workers}, indent=2))
    recovery = statistics.median(r["committed_s"] for r in trials.results)
    print(f"\nnode removal -> next committed step: median {recovery:.2f} s, worst "
          f"{max(r['committed_s'] for r in trials.results):.2f} s (goal < {GOAL_S:.0f} s): "
          f"{'met' if recovery < GOAL_S else 'NOT met'}")
    return 0 if len(trials.results) == args.trials else 1


def _table(unit: str, rows: list[dict[str, float]]) -> None:
    if not rows:
        return
    print(f"\n| measure ({unit}) | median | max |\n|---|---|---|")
    for column in rows[0]:
        values = [r[column] for r in rows]
        print(f"| {column.removesuffix('_s').replace('_', ' ')} | {statistics.median(values):.2f} | {max(values):.2f} |")


if __name__ == "__main__":
    sys.exit(main())
