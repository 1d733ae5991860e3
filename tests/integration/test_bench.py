"""``python benchmarks/bench.py --quick`` end to end: it runs every section in real Ray workers and writes sane
JSON, markdown and PNG results."""

from __future__ import annotations

import json
import math
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
    assert sections == {
        "allreduce 4 MB bus bandwidth", "step of 160 x 16 KB gradients", "step of ResNet-50's 161 gradients",
        "training throughput (CNN on digits, batch 64/worker)", "idle CPU (no ops submitted)",
        "start to first allreduce",
    }
    impls = {(r["section"], r["impl"]) for r in rows}
    assert ("step of 160 x 16 KB gradients", "DDP (gloo) backward") in impls
    assert ("step of 160 x 16 KB gradients", "hvdray") in impls
    assert ("step of 160 x 16 KB gradients", "hvdray grouped") in impls
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


def test_resnet50_has_161_gradient_shapes_and_25_6_million_parameters(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from bench import resnet50_gradient_shapes

    shapes = resnet50_gradient_shapes()
    assert len(shapes) == 161
    total = sum(math.prod(s) for s in shapes)
    assert total == 25_557_032  # torchvision's resnet50: 25,557,032 parameters
