"""The README's quick starts run as printed: each snippet alone in a fresh interpreter (its own local Ray,
from ``init_ray()``), its output checked against what the README says it prints."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
sys.path.insert(0, str(ROOT / "tests"))
from markdown_snippets import python_snippets  # noqa: E402 - shared with unit/test_readme.py

pytestmark = pytest.mark.slow


def _run_snippet(heading: str, tmp_path: Path) -> str:
    code = python_snippets(README.read_text())[heading]
    env = {
        **os.environ, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1", "TF_CPP_MIN_LOG_LEVEL": "3",
        "HOME": str(tmp_path),  # whatever the snippet writes by default (Tune's ~/ray_results) stays here
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    env.pop("RAY_ADDRESS", None)  # init_ray() then starts the snippet's own local Ray
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=280)
    assert run.returncode == 0, f"README {heading!r} failed:\n{run.stdout}\n{run.stderr}"
    return run.stdout.strip().splitlines()[-1]


def test_pytorch_quick_start(tmp_path):
    assert ast.literal_eval(_run_snippet("Quick start: PyTorch", tmp_path)) == [0, 1]


def test_keras_quick_start(tmp_path):
    assert ast.literal_eval(_run_snippet("Quick start: TensorFlow and Keras", tmp_path)) == [0, 1]


def test_elastic_quick_start(tmp_path):
    results = ast.literal_eval(_run_snippet("Quick start: elastic training", tmp_path))
    assert results in ([5], [5, 5])  # one entry per worker of the last epoch, each at epoch 5


def test_tune_quick_start(tmp_path):
    assert ast.literal_eval(_run_snippet("Quick start: Ray Tune, every trial a distributed job", tmp_path)) == {
        "lr": 0.01, "epochs": 3}
