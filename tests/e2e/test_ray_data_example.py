"""examples/ray_data_digits.py runs as a user runs it: a subprocess training from Ray Datasets."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_ray_data_digits_trains_from_dataset_shards():
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", PYTHONUNBUFFERED="1")
    env.pop("RAY_ADDRESS", None)
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "ray_data_digits.py"), "--num-workers", "2", "--epochs", "5",
         "--min-accuracy", "0.85"],
        capture_output=True, text=True, timeout=300, env=env, cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    epochs = [line for line in result.stdout.splitlines() if line.startswith("epoch")]
    assert len(epochs) == 5
    # the accuracy is counted over the whole test set: the two ranks' shards together
    assert "trained on 2 workers from Ray Datasets" in result.stdout and "over 450 rows" in result.stdout
