"""The Keras example runs as a user runs it: a subprocess, real Ray, real TensorFlow, small settings."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_keras_digits_trains_and_reports_each_epoch():
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", PYTHONUNBUFFERED="1")
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "keras_digits.py"), "--num-workers", "2", "--epochs", "5",
         "--min-accuracy", "0.85"],
        capture_output=True, text=True, timeout=300, env=env, cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    epochs = [line for line in result.stdout.splitlines() if line.startswith("epoch")]
    assert len(epochs) == 5
    assert "trained on 2 workers" in result.stdout and "test accuracy" in result.stdout
