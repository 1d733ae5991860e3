"""The examples run as a user runs them: a subprocess, real Ray, small settings."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(script: str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", PYTHONUNBUFFERED="1")
    return subprocess.run(
        [sys.executable, str(ROOT / "examples" / script), *args],
        capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT,
    )


def test_pytorch_digits_trains_and_reports_each_epoch():
    result = _run("pytorch_digits.py", "--num-workers", "2", "--epochs", "6", "--min-accuracy", "0.85")
    assert result.returncode == 0, result.stdout + result.stderr
    epochs = [line for line in result.stdout.splitlines() if line.startswith("epoch")]
    assert len(epochs) == 6
    assert "test accuracy" in result.stdout


def test_pytorch_digits_exits_non_zero_when_accuracy_is_not_reached():
    result = _run("pytorch_digits.py", "--num-workers", "2", "--epochs", "1", "--lr", "0.0001", "--min-accuracy", "0.99")
    assert result.returncode == 1
    assert "FAILED" in result.stderr


def test_stateful_example_trains_step_by_step_and_saves_its_history(tmp_path):
    result = _run("stateful_digits.py", "--num-workers", "2", "--epochs", "4", "--min-accuracy", "0.85",
                  "--plot-dir", str(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    epochs = [line for line in result.stdout.splitlines() if line.startswith("epoch")]
    assert len(epochs) == 4 and epochs[0].endswith("lr 0.02") and epochs[-1].endswith("lr 0.002")
    assert "learning rate lowered to 0.002 on the same workers" in result.stdout
    assert "trained 4 epochs on 2 workers" in result.stdout
    assert "4/4" in result.stderr  # the progress bar reached the end
    assert (tmp_path / "history.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "history.csv").read_text().count("\n") == 5
    assert '"step_key": "epoch"' in (tmp_path / "history.json").read_text()
