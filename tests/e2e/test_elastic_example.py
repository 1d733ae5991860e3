"""examples/elastic_digits.py as a user runs it: a subprocess on a local Ray instance, one worker killed."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _scratch_dirs() -> set[Path]:
    return set(Path(tempfile.gettempdir()).glob("hvdray-elastic-*"))


@pytest.mark.slow
def test_elastic_digits_survives_a_killed_worker_and_prints_every_epoch():
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", PYTHONUNBUFFERED="1")
    scratch_before = _scratch_dirs()
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "elastic_digits.py"), "--address", "local",
         "--min-workers", "1", "--max-workers", "2", "--epochs", "6", "--kill-worker-at-epoch", "2",
         "--cooldown", "1", "2", "--min-accuracy", "0.85"],
        capture_output=True, text=True, timeout=300, env=env, cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    epochs = [line for line in result.stdout.splitlines() if line.startswith("epoch")]
    assert [int(line.split()[1]) for line in epochs] == [1, 2, 3, 4, 5, 6]
    assert "recovering" in result.stdout and "test accuracy" in result.stdout
    assert _scratch_dirs() - scratch_before == set(), "the kill marker's directory was left behind"
