"""Elastic recovery time: a node is lost, how long until the survivors complete an allreduce again?

Runs an elastic job on a ``ray.cluster_utils.Cluster`` (several raylets on this machine, one worker
each) that allreduces a small tensor in a loop and commits every few steps. Each trial removes the
node of the highest rank, and measures, from that moment:

* ``detected``: the driver leaves RUNNING (it saw the death or a survivor's check-in),
* ``re-formed``: the driver forms the new membership epoch,
* ``first allreduce``: the first allreduce completed in the new epoch,
* ``committed``: the first ``state.commit()`` completed in the new epoch: the job makes progress again
  (the number that matters; goal: under 5 s).

Then a fresh node is added and the job grows back before the next trial. Prints a markdown table and
writes JSON with ``--json``.

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


def allreduce_loop(stop_file: str, commit_every: int) -> int:
    """Runs on every worker: allreduce forever (committing now and then) until the stop file appears."""
    import os
    import time

    import torch

    import hvdray.torch as hvd
    from hvdray import ray_logger

    torch.set_num_threads(1)
    hvd.init()
    state = hvd.elastic.ObjectState(step=0)
    tensor = torch.ones(1024)

    @hvd.elastic.run
    def loop(state) -> int:
        first, last_tick = True, time.monotonic()
        while True:
            hvd.allreduce(tensor, name="bench")
            if hvd.rank() == 0 and first:
                ray_logger.log({"kind": "first_allreduce", "t": time.time(), "size": hvd.size()})
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
    """Callback: records driver transitions and first allreduces. Node removals run in a thread; node
    additions in the callback itself, since Ray starts raylets only from the main thread."""

    def __init__(self, cluster: Cluster, trials: int, workers: int, stop_file: str) -> None:
        self.cluster, self.trials, self.workers, self.stop_file = cluster, trials, workers, stop_file
        self.records: list[dict[str, Any]] = []
        self.results: list[dict[str, float]] = []
        self._lock = threading.Condition()
        self._add_node = False
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __call__(self, record: dict[str, Any]) -> None:
        with self._lock:
            self.records.append(record)
            self._lock.notify_all()
            add, self._add_node = self._add_node, False
        if add:
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

    def _run(self) -> None:
        try:
            for _ in range(self.trials):
                self._wait_for(lambda r: r.get("kind") == "first_allreduce" and r["size"] == self.workers, 0, 180)
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
                first = self._wait_for(lambda r: r.get("kind") == "first_allreduce" and r["t"] > lost_at, mark, 60)
                committed = self._wait_for(lambda r: r.get("kind") == "commit" and r["t"] > lost_at
                                           and r["size"] < self.workers, mark, 60)
                self.results.append({
                    "detected_s": detected["time"] - lost_at,
                    "re-formed_s": formed["time"] - lost_at,
                    "first_allreduce_s": first["t"] - lost_at,
                    "committed_s": committed["t"] - lost_at,
                })
                print(f"trial {len(self.results)}: " + ", ".join(f"{k} {v:.2f}" for k, v in self.results[-1].items()),
                      flush=True)
                with self._lock:
                    self.records.clear()
                    self._add_node = True
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
    stop_file = str(Path(tempfile.mkdtemp(prefix="hvdray-bench-")) / "stop")
    trials = Trials(cluster, args.trials, args.workers, stop_file)
    trials.thread.start()
    settings = RayExecutor.create_settings(timeout_s=10, discovery_interval_s=0.5)
    try:
        with RayExecutor(settings, min_workers=args.workers - 1, max_workers=args.workers) as executor:
            executor.run(allreduce_loop, args=[stop_file, args.commit_every], callbacks=[trials])
        trials.thread.join(timeout=10)
    finally:
        ray.shutdown()
        cluster.shutdown()
    if not trials.results:
        print("no trial completed", file=sys.stderr)
        return 1
    columns = list(trials.results[0])
    print("\n| measure (s after node loss) | median | max |\n|---|---|---|")
    for column in columns:
        values = [r[column] for r in trials.results]
        print(f"| {column.removesuffix('_s')} | {statistics.median(values):.2f} | {max(values):.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"trials": trials.results, "workers": args.workers}, indent=2))
    recovery = statistics.median(r["committed_s"] for r in trials.results)
    print(f"\nnode removal -> next committed step: median {recovery:.2f} s, worst "
          f"{max(r['committed_s'] for r in trials.results):.2f} s (goal < {GOAL_S:.0f} s): "
          f"{'met' if recovery < GOAL_S else 'NOT met'}")
    return 0 if len(trials.results) == args.trials else 1


if __name__ == "__main__":
    sys.exit(main())
