"""Soak: many executor lifecycles and many elastic resets, and the machine is back where it started.

Two phases on one embedded local Ray instance:

1. ``--cycles`` (default 200) times: ``RayExecutor(num_workers=2)`` start, ``run`` (an allreduce),
   shutdown;
2. one elastic job (``min_workers=1, max_workers=2``) in which rank 1 of every 2-worker epoch exits after
   20 steps: the survivor resets and goes on alone, a new worker starts once the node's cooldown is
   over, the job resets again to take it in, and so on, until ``--resets`` (default 50) membership
   changes have happened; every rank allreduces and commits in a loop meanwhile.

Before (after one warm-up cycle) and after each phase it records the driver's resident memory, open
file descriptors and threads, the CPU use of the processes it started (Ray's included) over two
seconds, the cluster's live actors (the driver's coordinator host, which the elastic phase starts and
keeps by design, not counted), placement groups and free CPUs, and hvdray's shared-memory segments in
/dev/shm; it prints a markdown table and exits 1 when anything did not come back (with a small slack
for descriptors Ray opens lazily).

    python benchmarks/soak.py                 # ~15 min on 2 cores
    python benchmarks/soak.py --cycles 20 --resets 6 --json soak.json
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import tempfile
import threading
import time
from typing import Any

import psutil
import ray

from hvdray import RayExecutor
from hvdray.driver.coordinator_host import HOST_NAME_PREFIX

FD_SLACK = 8  # descriptors Ray opens lazily (log files, gRPC channels) the first few times
THREAD_SLACK = 2
RSS_SLACK_MB = 64


def _allreduce() -> float:
    import torch

    import hvdray.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    return float(hvd.allreduce(torch.ones(4), name="soak", op=hvd.Sum).sum())


def _elastic_loop(stop_file: str) -> int:
    """Allreduce and commit until the stop file appears; rank 1 of a 2-worker epoch exits after 20 steps."""
    import os

    import torch

    import hvdray.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    state = hvd.elastic.ObjectState(steps=0)
    in_epoch = [0]  # steps since this worker's last reset
    state.register_reset_callbacks([lambda: in_epoch.__setitem__(0, 0)])

    @hvd.elastic.run
    def train(state):
        while not os.path.exists(stop_file):
            hvd.allreduce(torch.ones(8), name="step")
            state.steps += 1
            in_epoch[0] += 1
            if state.steps % 5 == 0:
                state.commit()
            if hvd.size() == 2 and hvd.rank() == 1 and in_epoch[0] >= 20 and not os.path.exists(stop_file):
                os._exit(1)
            time.sleep(0.01)
        return state.steps

    return train(state)


def _session_cpu_percent(interval_s: float = 2.0) -> float:
    """CPU use of this process and every process it started (Ray's own and its workers), in % of one core:
    other work on the machine does not count."""
    procs = [psutil.Process(), *psutil.Process().children(recursive=True)]
    for proc in procs:
        try:
            proc.cpu_percent(None)
        except psutil.Error:
            pass
    time.sleep(interval_s)
    total = 0.0
    for proc in procs:
        try:
            total += proc.cpu_percent(None)
        except psutil.Error:
            pass
    return round(total, 1)


def snapshot() -> dict[str, Any]:
    """What must come back: driver resources, cluster usage, shared memory, CPU use."""
    from ray._private.state import actors  # the GCS actor table; the state API needs the dashboard
    from ray.util import placement_group_table

    process = psutil.Process()
    return {
        "driver_rss_mb": round(process.memory_info().rss / 2**20, 1),
        "driver_fds": process.num_fds(),
        "driver_threads": threading.active_count(),
        "cpu_percent": _session_cpu_percent(),
        # the driver's coordinator host, which the elastic phase starts, stays by design (its next jobs share it)
        "live_actors": sum(a["State"] == "ALIVE" and not a["Name"].startswith(HOST_NAME_PREFIX)
                           for a in actors().values()),
        "placement_groups": sum(g["state"] != "REMOVED" for g in placement_group_table().values()),
        "free_cpus": ray.available_resources().get("CPU", 0.0),
        "shm_segments": len(glob.glob("/dev/shm/hvdray-*")),  # hvdray's (run it when no other job runs)
    }


def settled(baseline: dict[str, Any], timeout_s: float = 60.0) -> dict[str, Any]:
    """A snapshot once the cluster has released what the last job held (it does so asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = snapshot()
        if now["live_actors"] <= baseline["live_actors"] and now["placement_groups"] <= baseline[
            "placement_groups"
        ] and now["free_cpus"] >= baseline["free_cpus"] or time.monotonic() > deadline:
            return now
        time.sleep(1.0)


def problems(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    found = []
    for key, slack in (("driver_fds", FD_SLACK), ("driver_threads", THREAD_SLACK), ("driver_rss_mb", RSS_SLACK_MB),
                       ("live_actors", 0), ("placement_groups", 0), ("shm_segments", 0)):
        if after[key] > before[key] + slack:
            found.append(f"{key} grew from {before[key]} to {after[key]}")
    if after["free_cpus"] < before["free_cpus"]:
        found.append(f"free CPUs fell from {before['free_cpus']} to {after['free_cpus']}")
    if after["cpu_percent"] > before["cpu_percent"] + 20.0:
        found.append(f"CPU use stayed at {after['cpu_percent']}% (was {before['cpu_percent']}%)")
    return found


def run_cycles(cycles: int) -> float:
    settings = RayExecutor.create_settings(timeout_s=60, placement_group_timeout_s=120)
    started = time.monotonic()
    for i in range(cycles):
        with RayExecutor(settings, num_workers=2) as executor:
            assert executor.run(_allreduce) == [8.0, 8.0], f"cycle {i}: wrong sum"
    return time.monotonic() - started


def run_resets(resets: int) -> tuple[float, int]:
    with tempfile.TemporaryDirectory(prefix="hvdray-soak-") as scratch:
        return _run_resets(resets, os.path.join(scratch, "stop"))


def _run_resets(resets: int, stop_file: str) -> tuple[float, int]:
    seen = {"resets": 0}

    def on_event(record: dict[str, Any]) -> None:
        if record.get("event") != "elastic" or record["state"] != "running":
            return
        seen["resets"] = record["resets"]
        if record["resets"] >= resets:
            open(stop_file, "w").close()

    settings = RayExecutor.create_settings(timeout_s=60, discovery_interval_s=0.5, elastic_timeout=300)
    started = time.monotonic()
    # the node comes back from the blacklist after 1-2 s, so that a new worker can join
    with RayExecutor(settings, min_workers=1, max_workers=2, reset_limit=resets + 10,
                     cooldown_range=(1, 2)) as executor:
        executor.run(_elastic_loop, args=[stop_file], callbacks=[on_event])
    return time.monotonic() - started, seen["resets"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cycles", type=int, default=200, help="executor start/run/shutdown cycles")
    parser.add_argument("--resets", type=int, default=50, help="elastic membership changes")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        run_cycles(1)  # warm-up: Ray's channels and worker pool
        before = settled(snapshot())
        cycles_s = run_cycles(args.cycles)
        after_cycles = settled(before)
        resets_s, resets_done = run_resets(args.resets)
        after_resets = settled(before)
    finally:
        ray.shutdown()

    rows = [("before", before), (f"after {args.cycles} cycles", after_cycles),
            (f"after {resets_done} elastic resets", after_resets)]
    keys = list(before)
    print("| | " + " | ".join(keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    for label, snap in rows:
        print(f"| {label} | " + " | ".join(str(snap[k]) for k in keys) + " |")
    print(f"\n{args.cycles} cycles in {cycles_s:.0f} s ({cycles_s / max(1, args.cycles):.2f} s each); "
          f"{resets_done} elastic resets in {resets_s:.0f} s ({resets_s / max(1, resets_done):.1f} s each)")
    failed = problems(before, after_cycles) + problems(before, after_resets)
    if resets_done < args.resets:
        failed.append(f"only {resets_done} of {args.resets} resets happened")
    for line in failed:
        print("NOT BACK:", line)
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"before": before, "after_cycles": after_cycles, "after_resets": after_resets,
                       "cycles": args.cycles, "cycles_s": cycles_s, "resets": resets_done,
                       "resets_s": resets_s, "problems": failed}, out, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
