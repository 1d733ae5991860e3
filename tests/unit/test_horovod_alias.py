"""The opt-in ``horovod`` -> ``hvdray`` import alias (hvdray/alias.py), each case in a fresh interpreter so
that ``sys.modules`` and ``sys.meta_path`` start clean."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _python(code: str, *args: str, env: dict | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if k != "HVDRAY_HOROVOD_ALIAS"}
    full_env.update(env or {})
    full_env["PYTHONPATH"] = os.pathsep.join([str(ROOT), full_env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, *args, "-c", textwrap.dedent(code)] if code else [sys.executable, *args],
                          capture_output=True, text=True, timeout=120, env=full_env, cwd=cwd)


def test_off_unless_asked_for():
    result = _python("""
        import hvdray.torch
        try:
            import horovod.torch
        except ModuleNotFoundError as exc:
            print("missing", exc.name)
    """)
    assert result.stdout.strip() == "missing horovod", result.stderr


def test_install_maps_every_horovod_module_to_the_same_hvdray_module():
    result = _python("""
        from hvdray import alias
        assert alias.install()
        import horovod, horovod.torch as hvd, horovod.torch.elastic, hvdray.torch
        from horovod.torch import DistributedOptimizer
        assert horovod.torch is hvdray.torch and hvd.DistributedOptimizer is DistributedOptimizer
        assert hvd.__spec__.name == "hvdray.torch", hvd.__spec__   # the module keeps its own spec
        assert horovod.torch.elastic.__name__ == "hvdray.torch.elastic"
        try:
            import horovod.spark
        except ModuleNotFoundError as exc:
            print(exc)
        import sys
        alias.uninstall()
        assert "horovod.torch" not in sys.modules and "hvdray.torch" in sys.modules
    """)
    assert result.returncode == 0, result.stderr
    assert "No module named 'horovod.spark': hvdray's Horovod alias maps it to 'hvdray.spark'" in result.stdout


def test_environment_variable_turns_it_on_when_hvdray_is_imported():
    result = _python("import hvdray, horovod.tensorflow.keras as k; print(k.__name__)",
                     env={"HVDRAY_HOROVOD_ALIAS": "1"})
    assert result.stdout.strip() == "hvdray.tensorflow.keras", result.stderr
    bad = _python("import hvdray", env={"HVDRAY_HOROVOD_ALIAS": "maybe"})
    assert "HVDRAY_HOROVOD_ALIAS must be 1/true/yes/on or 0/false/no/off, got 'maybe'" in bad.stderr


def test_python_m_hvdray_alias_runs_a_horovod_script(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import sys, horovod.torch as hvd\nhvd.init()\nprint(hvd.__name__, hvd.size(), sys.argv[1:])\n")
    result = _python("", "-m", "hvdray.alias", str(script), "--lr", "0.1")
    assert result.stdout.strip() == "hvdray.torch 1 ['--lr', '0.1']", result.stderr


def test_a_real_horovod_is_never_shadowed(tmp_path):
    (tmp_path / "horovod").mkdir()
    (tmp_path / "horovod" / "__init__.py").write_text("REAL = True\n")
    result = _python("""
        import warnings
        from hvdray import alias
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            print(alias.install(), alias.is_installed())
        import horovod
        print(horovod.REAL, str(caught[0].message))
    """, env={"PYTHONPATH": str(tmp_path)})
    lines = result.stdout.splitlines()
    assert lines[0] == "False False", result.stderr
    assert lines[1].startswith("True a real Horovod is installed (") and "alias stays off" in lines[1]
