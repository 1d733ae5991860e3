"""examples/tune_bayesopt.py as a user runs it: a subprocess on its own local Ray, small settings."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str, timeout: int = 300, **env_vars: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", PYTHONUNBUFFERED="1", **env_vars)
    return subprocess.run(
        [sys.executable, str(ROOT / "examples" / "tune_bayesopt.py"), *args],
        capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT,
    )


def test_tune_bayesopt_example_tunes_the_learning_rate_and_keeps_the_best_model(tmp_path):
    result = _run("--num-samples", "5", "--num-workers", "2", "--epochs", "4", "--min-accuracy", "0.85",
                  HOME=str(tmp_path))  # its results go to ~/ray_results: the test's own directory
    assert result.returncode == 0, result.stdout + result.stderr
    trials = [line for line in result.stdout.splitlines() if line.startswith("trial")]
    assert len(trials) == 5
    assert "best of 5 trials on 2 workers" in result.stdout and "checkpoint saved" in result.stdout


def test_tune_bayesopt_example_exits_non_zero_when_accuracy_is_not_reached(tmp_path):
    """Also: with no --storage, every results path it prints (Tune's and its own) still exists after it
    exits, in Ray's default place (~/ray_results; HOME is the test's own directory here)."""
    result = _run("--num-samples", "1", "--epochs", "1", "--min-accuracy", "0.999", HOME=str(tmp_path))
    assert result.returncode == 1, result.stdout + result.stderr
    assert "FAILED" in result.stderr
    output = result.stdout + result.stderr
    printed = re.findall(r"(?:View detailed results here|results \(trials, checkpoints\)): (\S+)", output)
    assert len(printed) >= 2, output
    for path in printed:
        assert Path(path).is_dir(), f"printed results path {path} does not exist after the run"
        assert Path(path).resolve().is_relative_to((tmp_path / "ray_results").resolve())
