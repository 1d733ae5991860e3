"""``python benchmarks/bench.py --quick`` end to end: it runs every section in real Ray workers and writes sane
JSON, markdown and PNG results."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.mark.slow
def test_quick_benchmark_writes_sane_results(tmp_path):
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "bench.py"), "--quick", "--no-shm-rows", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=280,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert time.monotonic() - started < 240
    report = json.loads((tmp_path / "bench.json").read_text())
    rows = report["rows"]
    sections = {r["section"] for r in rows}
    training = {f"training throughput ({m} on digits, batch 64/worker), {w}" for m in ("CNN", "MLP")
                for w in ("1 worker", "2 workers")}
    assert sections == {
        "one core's memory speed, 4 MB", "allreduce 4 MB bus bandwidth, 2 ranks", "allgather 4 MB bus bandwidth, 2 ranks",
        "broadcast 4 MB bus bandwidth, 2 ranks", "reducescatter 4 MB bus bandwidth, 2 ranks",
        "step of 160 x 16 KB gradients", "step of ResNet-50's 161 gradients",
        *training, "scaling efficiency 1 -> 2 workers (CNN)", "scaling efficiency 1 -> 2 workers (MLP)",
        "idle CPU (no ops submitted)", "start to first allreduce", "allreduce of 4 bytes, 2 ranks (4 MB round)",
    }
    impls = {(r["section"], r["impl"]) for r in rows}
    assert {impl for section, impl in impls if section.startswith("allreduce ") and "bus bandwidth" in section} == {
        "memory ideal", "raw gloo", "hvdray in place", "hvdray in place, transport alone", "hvdray out of place",
        "hvdray out of place, transport alone", "one core, passes in place",
        "one core, passes out of place",
        "raw gloo, average", "hvdray in place, average", "hvdray out of place, average",
        "hvdray out of place, average, unnamed"}
    assert {impl for section, impl in impls if section.startswith("allreduce of 4 bytes")} == {
        "raw gloo", "hvdray", "hvdray, hvd.allreduce(tensor)"}
    assert {impl for section, impl in impls if section.startswith(("allgather", "broadcast", "reducescatter"))} == {
        "memory ideal", "raw gloo", "hvdray"}
    for section in training | {"scaling efficiency 1 -> 2 workers (CNN)"}:
        assert {impl for s, impl in impls if s == section} == {
            "DDP (gloo)", "hvdray DistributedOptimizer", "no gradient exchange (ceiling)"}
    assert ("step of 160 x 16 KB gradients", "DDP (gloo) backward") in impls
    assert ("step of 160 x 16 KB gradients", "hvdray") in impls
    assert ("step of 160 x 16 KB gradients", "hvdray grouped") in impls
    assert ("step of 160 x 16 KB gradients", "hvdray DistributedOptimizer backward") in impls
    for r in rows:
        if r["section"] == "idle CPU (no ops submitted)":  # a measure without a baseline
            assert 0 <= r["median"] < 100 and r["vs"] is None and r["speed ratio"] is None, r
            continue
        assert r["median"] > 0 and r["speed ratio"] > 0 and len(r["samples"]) >= 1, r
        if r["impl"] == r["vs"]:
            assert r["speed ratio"] == pytest.approx(1.0)
    idle = {r["impl"]: r["median"] for r in rows if r["section"] == "idle CPU (no ops submitted)"}
    assert set(idle) == {"hvdray engine thread", "whole worker process"}
    assert report["meta"]["workers"] == 2 and report["meta"]["horovod"]
    table = (tmp_path / "bench.md").read_text()
    assert table.count("\n| ") == len(rows) + 2 and "benchmarks/bench.py --quick" in table  # header, rule, rows
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_shared_memory_rows_switch_the_transport_in_the_same_workers():
    """``bench_shm.py`` (the rows ``bench.py`` adds unless ``--no-shm-rows``) restarts hvdray in its workers
    with the shared-memory transport on, then off (and over Gloo with ``peer_sockets`` off), and
    measures each beside raw Gloo."""
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "bench_shm.py"), "--quick", "--local-ranks", "2", "--rows", "latency"],
        capture_output=True, text=True, timeout=200,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = re.findall(r"^allreduce (4 B|64 KB) latency, 2 local ranks +(\S.*?) +([\d.e+]+) us ", done.stdout, re.M)
    for size in ("4 B", "64 KB"):
        assert {impl for size_, impl, _ in rows if size_ == size} == {
            "raw gloo", "hvdray shm", "hvdray shm, tensor in shared memory", "hvdray shm, unnamed",
            "hvdray gloo", "hvdray gloo, peer_sockets off"}, done.stdout
    assert all(float(us) > 0 for _, _, us in rows), rows
    small = re.findall(r"^(allgather|broadcast|grouped allreduce of 2 x|allreduce max of|8 allreduces in flight of)"
                       r" 4 B latency, 2 local ranks +(\S.*?) +([\d.e+]+) us ", done.stdout, re.M)
    for op in ("allgather", "broadcast", "grouped allreduce of 2 x", "allreduce max of", "8 allreduces in flight of"):
        assert {impl for op_, impl, _ in small if op_ == op} == {"raw gloo", "hvdray shm", "hvdray shm, unnamed"}
    assert all(float(us) > 0 for _, _, us in small), small


def test_transport_trees_times_every_way_of_an_in_place_allreduce():
    """``transport_trees.py --ways`` times, in one pair of bare processes, each way an in-place allreduce of
    a private tensor can take beside the default ways, and says nothing of a refusal where the kernel
    allows cross-memory attach (processes of one user here)."""
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "transport_trees.py"), "--ways", "--sizes-mb", "0.25", "--rounds", "1"],
        capture_output=True, text=True, timeout=200,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = re.findall(r"^0.25 MB allreduce, 2 ranks  (\S.*?) +([\d.]+)x memory ideal", done.stdout, re.M)
    assert [way for way, _ in rows] == [
        "in place", "in place, average", "out of place", "out of place, average",
        "in place, its pages in shared memory", "in place, its pages, no plans kept", "in place, through the kernel",
        "in place, scratch block", "in place, slots", "in place, tensor in shared memory"], done.stdout
    assert all(float(ratio) > 0 for _, ratio in rows) and "refused" not in done.stdout


def test_resnet50_has_161_gradient_shapes_and_25_6_million_parameters(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from bench import resnet50_gradient_shapes

    shapes = resnet50_gradient_shapes()
    assert len(shapes) == 161
    total = sum(math.prod(s) for s in shapes)
    assert total == 25_557_032  # torchvision's resnet50: 25,557,032 parameters


def test_the_rounds_range_pairs_each_round_with_its_own_baseline(monkeypatch):
    """Beside a median ratio the benchmarks print the lowest and highest ratio of the rounds, each round's sample
    against the same round's baseline (not against the baseline's median)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from harness import rounds_range

    # higher is better (GB/s): round ratios 2/4, 3/3, 8/4
    assert rounds_range([2.0, 3.0, 8.0], [4.0, 3.0, 4.0], True) == " (rounds 0.50-2.00)"
    # lower is better (us): the baseline over the sample, 100/50 and 100/400
    assert rounds_range([50.0, 400.0], [100.0, 100.0], False) == " (rounds 0.25-2.00)"
    assert rounds_range([1.0], [1.0], True) == ""  # one round: no range
    assert rounds_range([1.0, 2.0], [1.0], True) == ""  # rows that are not paired round by round


def test_memory_ideal_is_the_least_a_rank_must_copy_and_add(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from bandwidth import bus_bytes, ideal_seconds

    copy_s, add_s = 0.010, 0.0125  # one core: S copied in 10 ms, S added in 12.5 ms
    # two ranks: half of S added, half copied; bus bandwidth counts S
    assert ideal_seconds("allreduce", 64e6, 2, copy_s, add_s) == pytest.approx(0.5 * add_s + 0.5 * copy_s)
    assert bus_bytes("allreduce", 64e6, 2) == pytest.approx(64e6)
    assert ideal_seconds("allreduce", 64e6, 4, copy_s, add_s) == pytest.approx(0.75 * (add_s + copy_s))
    assert ideal_seconds("allgather", 64e6, 2, copy_s, add_s) == pytest.approx(2 * copy_s)
    assert bus_bytes("allgather", 64e6, 4) == pytest.approx(3 * 64e6)
    assert ideal_seconds("broadcast", 64e6, 3, copy_s, add_s) == pytest.approx(copy_s)
    # reducescatter: each peer's copy of the rank's chunk added once
    assert ideal_seconds("reducescatter", 64e6, 4, copy_s, add_s) == pytest.approx(0.75 * add_s)
    assert bus_bytes("reducescatter", 64e6, 4) == pytest.approx(0.75 * 64e6)
    with pytest.raises(ValueError, match="collective must be one of"):
        ideal_seconds("alltoall", 64e6, 2, copy_s, add_s)
    with pytest.raises(ValueError, match="collective must be one of"):
        bus_bytes("reduce", 64e6, 2)
