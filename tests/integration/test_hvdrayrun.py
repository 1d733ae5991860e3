"""``hvdrayrun`` as a user runs it (``python -m hvdray.runner``, the console script's module): a
subprocess that starts its own local Ray and runs unmodified scripts on real worker actors."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

ALLREDUCE_SCRIPT = """
    import sys
    import torch
    import hvdray.torch as hvd

    hvd.init()
    total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum)
    print(f"rank {hvd.rank()} of {hvd.size()} argv={sys.argv[1:]} name={__name__} total={total.item():.0f}")
    print(f"warning from rank {hvd.rank()}", file=sys.stderr)
"""

FAILING_SCRIPT = """
    import hvdray.torch as hvd

    hvd.init()
    print(f"rank {hvd.rank()} starting")
    if hvd.rank() == 1:
        raise ValueError("bad batch on rank one")
    hvd.barrier()   # rank 0 waits for rank 1, which never comes: the launcher must not hang
"""


def _hvdrayrun(*args: str, cwd: Path = ROOT, timeout: int = 180) -> subprocess.CompletedProcess:
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "hvdray.runner", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=cwd)


def _script(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def test_runs_an_unmodified_script_on_every_rank_with_prefixed_output(tmp_path):
    script = _script(tmp_path, "train.py", ALLREDUCE_SCRIPT)
    result = _hvdrayrun("-np", "2", "--timeout", "30", "python", str(script), "--epochs", "3")
    assert result.returncode == 0, result.stdout + result.stderr
    for rank in (0, 1):
        assert f"[{rank}]<stdout>:rank {rank} of 2 argv=['--epochs', '3'] name=__main__ total=3" in result.stdout
        assert f"[{rank}]<stderr>:warning from rank {rank}" in result.stdout


def test_a_failing_rank_fails_the_run_with_its_error_shown(tmp_path):
    script = _script(tmp_path, "fail.py", FAILING_SCRIPT)
    result = _hvdrayrun("-np", "2", "--timeout", "20", "python", str(script), timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "[1]<stderr>:ValueError: bad batch on rank one" in result.stdout
    assert f'[1]<stderr>:  File "{script}", line 7, in <module>' in result.stdout
    assert "hvdrayrun: rank 1 failed with exit code 1: ValueError: bad batch on rank one" in result.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["-np", "0", "python", "examples/pytorch_digits.py"], "-np must be >= 1, got 0"),
        (["-np", "2"], "no command"),
        (["python", "examples/pytorch_digits.py"], "-np is required"),
        (["-np", "2", "python", "missing_script.py"], "script not found: missing_script.py"),
        (["-np", "2", "--gpus-per-worker", "1", "python", "examples/pytorch_digits.py"], "--gpus-per-worker needs --use-gpu"),
        (["-np", "2", "--cpus-per-worker", "0", "python", "examples/pytorch_digits.py"], "--cpus-per-worker must be > 0"),
        (["-np", "2", "python", "-c", "print(1)"], "unsupported python option '-c'"),
    ],
)
def test_argument_errors_exit_2_with_a_message(args, message, capsys, monkeypatch):
    """Checked in-process: bad arguments are refused before any Ray starts."""
    import ray

    from hvdray.runner import main

    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not ray.is_initialized()


ELASTIC_SCRIPT = """
    import torch
    import hvdray.torch as hvd

    hvd.init()
    state = hvd.elastic.ObjectState(epoch=0, total=0.0)

    @hvd.elastic.run
    def train(state):
        while state.epoch < 3:
            state.total += hvd.allreduce(torch.ones(1), op=hvd.Sum).item()
            state.epoch += 1
            state.commit()
        return state.total

    print(f"rank {hvd.rank()} of {hvd.size()} elastic total={train(state):.0f}")
"""


def test_min_np_max_np_run_the_script_elastically(tmp_path):
    """--min-np/--max-np become RayExecutor(min_workers, max_workers): the script's hvd.elastic.run works."""
    script = _script(tmp_path, "elastic_train.py", ELASTIC_SCRIPT)
    result = _hvdrayrun("--min-np", "2", "--max-np", "2", "--timeout", "30", "python", str(script))
    assert result.returncode == 0, result.stdout + result.stderr
    for rank in (0, 1):
        assert f"[{rank}]<stdout>:rank {rank} of 2 elastic total=6" in result.stdout


def test_console_script_points_at_the_launcher():
    """pyproject's ``hvdrayrun`` entry resolves to ``main``; where the package is installed, the command runs."""
    import importlib
    import tomllib

    target = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]["hvdrayrun"]
    module, function = target.split(":")
    from hvdray.runner import main

    assert getattr(importlib.import_module(module), function) is main
    command = Path(sys.executable).with_name("hvdrayrun")
    if command.exists():  # installed with pip install -e . (as `make test` does)
        result = subprocess.run([str(command), "--help"], capture_output=True, text=True, timeout=60)
        assert result.returncode == 0 and "-np" in result.stdout
