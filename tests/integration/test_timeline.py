"""The timeline on real workers: the Chrome-trace file parses, holds Horovod's events per tensor under
Horovod's tensor names, nested on each tensor's row, shows fusion (several tensors in one REDUCE), and
starts and stops at run time."""

from __future__ import annotations

import json
import time
from collections import defaultdict

from hvdray import RayExecutor


def _workload(start: str = "", mark_cycles: bool = False):
    import torch

    import hvdray.torch as hvd

    hvd.init()
    if start:
        hvd.start_timeline(start, mark_cycles=mark_cycles)
    for _ in range(3):
        grads = [torch.ones(64) for _ in range(8)]
        handles = [hvd.allreduce_async_(g, name=f"grad.{i}", op=hvd.Sum) for i, g in enumerate(grads)]
        for h in handles:
            hvd.synchronize(h)
    hvd.broadcast(torch.ones(3), root_rank=0, name="weights")
    hvd.stop_timeline()
    hvd.allreduce(torch.ones(1), name="after.stop")  # not recorded
    return hvd.rank()


def _load(path):
    with open(path) as f:
        events = json.load(f)  # a complete JSON array once the timeline is stopped
    rows = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    phases = defaultdict(list)
    for e in events:
        if e.get("ph") == "X":
            phases[rows[(e["pid"], e["tid"])]].append(e)
    return events, phases


def test_timeline_from_settings_has_every_phase_and_shows_fusion(make_executor, tmp_path):
    path = tmp_path / "timeline.json"
    settings = RayExecutor.create_settings(timeout_s=20, timeline_filename=str(path))
    ex = make_executor(settings=settings, num_workers=2)
    before_us = time.time_ns() // 1000
    ex.run(_workload)
    assert [p.name for p in tmp_path.iterdir()] == ["timeline.json"]  # rank 0 writes it, alone
    events, phases = _load(path)
    # as in Horovod's: the wall clock at time stamp 0 in the first event, rows named <op>.<tensor name>
    assert before_us <= events[0]["args"]["start_time_since_epoch_in_micros"] <= time.time_ns() // 1000
    assert {row for row in phases} == {f"allreduce.grad.{i}" for i in range(8)} | {"broadcast.weights"}
    for i in range(8):
        row = phases[f"allreduce.grad.{i}"]
        names = [e["name"] for e in row]
        for phase in ("NEGOTIATE_ALLREDUCE", "ALLREDUCE", "QUEUE", "MEMCPY_IN_FUSION_BUFFER", "REDUCE",
                      "MEMCPY_OUT_FUSION_BUFFER"):
            assert names.count(phase) == 3, (i, names)
        for e in row:
            assert e["dur"] >= 0 and e["ts"] >= 0
        # each activity lies inside its op's event, which follows the negotiation
        ops = [e for e in row if e["name"] == "ALLREDUCE"]
        for e in row:
            if e["name"] not in ("ALLREDUCE", "NEGOTIATE_ALLREDUCE"):
                assert any(op["ts"] <= e["ts"] and e["ts"] + e["dur"] <= op["ts"] + op["dur"] + 0.2 for op in ops), e
    assert [e["name"] for e in phases["broadcast.weights"]] == ["NEGOTIATE_BROADCAST", "BROADCAST", "QUEUE"]
    assert "allreduce.after.stop" not in phases
    # fusion is visible: REDUCE events shared by several tensors, starting at the same instant
    reduces = [e for row, es in phases.items() if row.startswith("allreduce.") for e in es if e["name"] == "REDUCE"]
    fused = [e for e in reduces if e["args"]["tensors"] > 1]
    assert fused, "no REDUCE event carried more than one tensor"
    by_start = defaultdict(set)
    for e in reduces:
        by_start[e["ts"]].add(e["tid"])
    assert max(len(tids) for tids in by_start.values()) > 1


def test_start_and_stop_at_run_time_per_rank_with_cycle_marks(make_executor, tmp_path):
    ex = make_executor(num_workers=2)
    pattern = str(tmp_path / "tl.{rank}.json")
    ex.run(_workload, args=[pattern, True])
    for rank in (0, 1):
        events, phases = _load(tmp_path / f"tl.{rank}.json")
        assert any(e["name"] == "CYCLE_START" for e in events)
        assert {e["name"] for e in phases["allreduce.grad.0"]} >= {"NEGOTIATE_ALLREDUCE", "ALLREDUCE", "REDUCE"}
