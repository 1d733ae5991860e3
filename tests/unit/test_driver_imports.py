"""What the driver side imports: no torch (1.3 s of CPU) in a script that only starts jobs, in a Tune
Trainable actor (one per trial without ``reuse_actors``) or in a job's coordinator actor, whose processes
never run a collective; no TensorFlow anywhere hvdray.tensorflow is not asked for; and no pydantic or
pyarrow in a worker that does not commit to storage."""

from __future__ import annotations

import subprocess
import sys

import pytest

HEAVY = ("torch", "tensorflow", "keras")


@pytest.mark.parametrize(
    "module",
    ["hvdray", "hvdray.driver.executor", "hvdray.driver.coordinator_host", "hvdray.tune.trainable",
     "hvdray.runner.cli"],
)
def test_driver_modules_import_no_framework(module):
    code = (
        f"import sys, {module}\n"
        f"from hvdray import RayExecutor\n"
        f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    )
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert loaded.stdout.strip() == "[]", f"{module} imports {loaded.stdout.strip()}"


def test_workers_get_their_settings_without_pydantic():
    """A worker's modules and the settings it is sent (``Settings.for_workers()``, pickled as Ray sends
    them) import neither pydantic nor pyarrow: ~100 ms of CPU per worker at every start."""
    import pickle

    from hvdray import RayExecutor

    settings = RayExecutor.create_settings(timeout_s=12, fusion_threshold_mb=8).for_workers()
    assert (settings.timeout_s, settings.fusion_threshold_mb, settings.storage_path) == (12, 8, None)
    with pytest.raises(AttributeError, match="read-only"):
        settings.timeout_s = 1
    with pytest.raises(AttributeError, match="no setting 'timeout'"):
        settings.timeout
    changed = settings.replace(shm_transport=False, timeout_s=3)  # a copy: the job's own stays as it was
    assert (changed.shm_transport, changed.timeout_s, changed.fusion_threshold_mb) == (False, 3, 8)
    assert (settings.shm_transport, settings.timeout_s) == (True, 12)
    with pytest.raises(AttributeError, match="no setting 'shm'"):
        settings.replace(shm=False)
    code = (
        "import pickle, sys\n"
        "import hvdray.worker.actor, hvdray.collective.session, hvdray.torch\n"
        f"settings = pickle.loads({pickle.dumps(settings)!r})\n"
        "assert settings.timeout_s == 12\n"
        "print(sorted(m for m in ('pydantic', 'pyarrow', 'hvdray.settings') if m in sys.modules))"
    )
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert loaded.stdout.strip() == "[]", f"a worker imports {loaded.stdout.strip()}"
