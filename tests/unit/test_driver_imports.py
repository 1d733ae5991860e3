"""What the driver side imports: no torch (1.3 s of CPU) in a script that only starts jobs, in a Tune
Trainable actor (one per trial without ``reuse_actors``) or in a job's coordinator actor, whose processes
never run a collective; and no TensorFlow anywhere hvdray.tensorflow is not asked for."""

from __future__ import annotations

import subprocess
import sys

import pytest

HEAVY = ("torch", "tensorflow", "keras")


@pytest.mark.parametrize(
    "module",
    ["hvdray", "hvdray.driver.executor", "hvdray.driver.coordinator", "hvdray.tune.trainable", "hvdray.runner.cli"],
)
def test_driver_modules_import_no_framework(module):
    code = (
        f"import sys, {module}\n"
        f"from hvdray import RayExecutor\n"
        f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    )
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert loaded.stdout.strip() == "[]", f"{module} imports {loaded.stdout.strip()}"
