"""``hvdrayrun`` as a user runs it (``python -m hvdray.runner``, the console script's module): a
subprocess that starts its own local Ray (or joins the one ``$RAY_ADDRESS`` names) and runs unmodified
scripts on real worker actors."""

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


HOROVOD_SCRIPT = """
    import torch
    import horovod.torch as hvd
    from hvdray.collective import session

    hvd.init()
    torch.manual_seed(hvd.rank())            # different weights on each rank until the broadcast
    model = torch.nn.Linear(2, 1, bias=False)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    before = model.weight.detach().clone()
    opt.zero_grad()
    model(torch.full((1, 2), float(hvd.rank() + 1))).sum().backward()   # gradient: x, i.e. 1s and 2s
    opt.step()
    s = session.settings()
    print(f"rank {hvd.rank()} module={hvd.__name__} gloo={hvd.gloo_built()} mpi={hvd.mpi_built()} "
          f"step={(before - model.weight).flatten().tolist()} fusion_mb={s.fusion_threshold_mb} "
          f"cycle_ms={s.cycle_time_ms} cache={s.cache_capacity}")
"""


def _hvdrayrun(*args: str, cwd: Path = ROOT, timeout: int = 180, env: dict | None = None,
               command: list[str] | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", PYTHONUNBUFFERED="1", **(env or {}))
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return subprocess.run([*(command or [sys.executable, "-m", "hvdray.runner"]), *args], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=cwd)


@pytest.fixture
def ray_address(ray_local) -> dict[str, str]:
    """``RAY_ADDRESS`` of the module's local Ray, for the runs that join it (a Ray of its own costs a run
    ~10 s of the 2 cores here; the first test starts one, as a bare ``hvdrayrun`` on a laptop does)."""
    return {"RAY_ADDRESS": ray_local.get_runtime_context().gcs_address}


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


def test_console_script_runs_an_unmodified_horovod_torch_script_with_horovods_flags_and_knobs(tmp_path, ray_address):
    """`hvdrayrun -np 2 python train.py` where train.py says `import horovod.torch as hvd`: the alias is on in
    every rank, one DistributedOptimizer step averages the gradients, and horovodrun's flags and HOROVOD_*
    knobs reach the workers' settings (a flag beats the environment)."""
    script = _script(tmp_path, "train.py", HOROVOD_SCRIPT)
    console = Path(sys.executable).with_name("hvdrayrun")
    command = [str(console)] if console.exists() else None  # installed with pip install -e . (as `make test` does)
    result = _hvdrayrun(
        "-np", "2", "-H", "localhost:2", "--fusion-threshold-mb", "8", "--verbose", "python", str(script),
        env={"HOROVOD_FUSION_THRESHOLD": str(1 << 20), "HOROVOD_CYCLE_TIME": "2.5", "HOROVOD_CACHE_CAPACITY": "77",
             **ray_address},
        command=command,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    for rank in (0, 1):
        # SGD step = lr * mean gradient = 0.1 * (1 + 2) / 2 = 0.15 on both weights
        assert (f"[{rank}]<stdout>:rank {rank} module=hvdray.torch gloo=True mpi=False step=[0.15000000596046448, "
                "0.15000000596046448] fusion_mb=8.0 cycle_ms=2.5 cache=77") in result.stdout, result.stdout


def test_a_failing_rank_fails_the_run_with_its_error_shown(tmp_path, ray_address):
    script = _script(tmp_path, "fail.py", FAILING_SCRIPT)
    result = _hvdrayrun("-np", "2", "--timeout", "20", "python", str(script), timeout=120, env=ray_address)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "[1]<stderr>:ValueError: bad batch on rank one" in result.stdout
    assert f'[1]<stderr>:  File "{script}", line 7, in <module>' in result.stdout
    assert "hvdrayrun: rank 1 failed with exit code 1: ValueError: bad batch on rank one" in result.stderr


BUSY_SCRIPT = """
    import torch
    import hvdray.torch as hvd

    hvd.init()
    print(f"rank {hvd.rank()} busy", flush=True)
    while True:
        hvd.allreduce(torch.ones(4))
"""


def test_ctrl_c_stops_the_workers_and_exits_130_without_a_traceback(tmp_path, ray_address, actors_left_behind):
    """SIGINT to the launcher (a terminal's Ctrl-C; started in a session of its own so that SIGINT is not
    ignored, as it is for a background job of a shell): it ends within seconds, with the shell's 130 and
    one line (it printed a KeyboardInterrupt traceback and exited 1 before), and leaves no worker behind."""
    import signal
    import time

    script = _script(tmp_path, "busy.py", BUSY_SCRIPT)
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", PYTHONUNBUFFERED="1", **ray_address)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    launcher = subprocess.Popen([sys.executable, "-m", "hvdray.runner", "-np", "2", "python", str(script)],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                cwd=tmp_path, start_new_session=True)
    try:
        busy = 0
        for line in launcher.stdout:
            busy += "busy" in line
            if busy == 2:
                break
        assert busy == 2, "the ranks never started"
        interrupted = time.monotonic()
        launcher.send_signal(signal.SIGINT)
        rest, _ = launcher.communicate(timeout=60)
        took = time.monotonic() - interrupted
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 130, rest
    assert "hvdrayrun: interrupted; the workers were stopped" in rest and "Traceback" not in rest, rest
    assert took < 20, took
    deadline = time.monotonic() + 10
    while actors_left_behind() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert actors_left_behind() == []


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
        (["-np", "2", "--mpi", "python", "train.py"], "--mpi is not supported by hvdrayrun: hvdray does not use MPI"),
        (["-np", "2", "--mpi-args=-x FOO", "python", "train.py"], "--mpi-args is not supported by hvdrayrun"),
        (["-np", "2", "--num-nccl-streams", "2", "python", "train.py"], "(no NCCL)"),
        (["-np", "2", "--jsrun", "python", "train.py"], "not LSF's jsrun"),
        (["-np", "2", "--hierarchical-allgather", "python", "train.py"], "no hierarchical form"),
        (["-H", "a:2,b:1", "python", "examples/pytorch_digits.py"], "hosts with different numbers of slots ([2, 1])"),
        (["-np", "5", "-H", "a:2,b:2", "python", "examples/pytorch_digits.py"], "-np 5 is more than the 4 slots"),
        (["-H", "a:x", "python", "examples/pytorch_digits.py"], "-H/--hosts: slots must be an integer >= 1"),
        (["-np", "2", "--reset-limit", "2", "python", "examples/pytorch_digits.py"], "--reset-limit needs --min-np"),
        (["-np", "2", "--log-level", "LOUD", "python", "examples/pytorch_digits.py"], "--log-level: invalid choice"),
    ],
)
def test_argument_errors_exit_2_with_a_message(args, message, capsys, monkeypatch):
    """Checked in-process: bad arguments are refused before any Ray starts."""
    import ray

    from hvdray.runner import main

    # another module's Ray may be up in this process: watch for an attempt to start or join one instead
    started = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda *a, **kw: started.append((a, kw)))
    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not started


@pytest.mark.parametrize(
    "args, executor",
    [
        (["-np", "3"], {"num_workers": 3}),
        (["-H", "localhost:2"], {"num_hosts": 1, "num_workers_per_host": 2}),
        (["-H", "a:2,b:2"], {"num_hosts": 2, "num_workers_per_host": 2}),
        (["-np", "4", "-H", "a,b,c,d"], {"num_hosts": 4, "num_workers_per_host": 1}),
        (["-np", "3", "-H", "a:2,b:2"], {"num_workers": 3}),   # fewer than the slots: packed like -np
        (["--min-np", "2", "--max-np", "4", "--reset-limit", "3", "--blacklist-cooldown-range", "5", "60"],
         {"min_workers": 2, "max_workers": 4, "reset_limit": 3, "cooldown_range": (5, 60)}),
    ],
)
def test_hosts_and_elastic_options_shape_the_executor(args, executor):
    from hvdray.runner.cli import _executor_kwargs, build_parser

    parser = build_parser()
    kwargs = _executor_kwargs(parser, parser.parse_args([*args, "python", "train.py"]))
    assert {k: v for k, v in kwargs.items() if k in executor} == executor


def test_hostfile_is_read_as_hosts(tmp_path):
    from hvdray.runner.cli import _executor_kwargs, build_parser

    hostfile = tmp_path / "hosts"
    hostfile.write_text("# the cluster\nnode-a slots=4\nnode-b slots=4\n\n")
    parser = build_parser()
    kwargs = _executor_kwargs(parser, parser.parse_args(["--hostfile", str(hostfile), "python", "train.py"]))
    assert (kwargs["num_hosts"], kwargs["num_workers_per_host"]) == (2, 4)


def test_tunable_options_become_explicit_settings(monkeypatch):
    """Flags are explicit arguments: they win over HVDRAY_* and HOROVOD_*; options not given stay unset."""
    from hvdray.runner.cli import build_parser, settings_kwargs
    from hvdray.settings import make_settings

    monkeypatch.setenv("HVDRAY_CYCLE_TIME_MS", "9")
    args = build_parser().parse_args([
        "-np", "2", "--fusion-threshold-mb", "16", "--cycle-time-ms", "4", "--disable-cache", "--no-hierarchical-allreduce",
        "--autotune", "--timeline-filename", "/tmp/tl.json", "--no-stall-check", "--log-level", "DEBUG",
        "--start-timeout", "50", "--network-interface", "eth0,eth1", "--gloo-timeout-seconds", "40", "python", "t.py",
    ])
    given = settings_kwargs(args)
    assert given == {
        "fusion_threshold_mb": 16, "cycle_time_ms": 4, "cache_capacity": 0, "hierarchical_allreduce": False,
        "autotune": True, "timeline_filename": "/tmp/tl.json", "stall_check": False, "verbose": 2,
        "placement_group_timeout_s": 50, "nics": ["eth0", "eth1"], "timeout_s": 40,
    }
    assert make_settings(**given).cycle_time_ms == 4
    assert settings_kwargs(build_parser().parse_args(["-np", "2", "python", "t.py"])) == {}


def test_ssh_options_are_accepted_with_a_note_and_check_build_lists_what_hvdray_has(capsys):
    from hvdray.runner.cli import build_parser

    build_parser().parse_args(["-np", "2", "-p", "2222", "-i", "~/.ssh/id", "python", "t.py"])
    assert "hvdrayrun: note: -p is ignored: Ray starts the workers" in capsys.readouterr().err
    with pytest.raises(SystemExit) as done:
        build_parser().parse_args(["--check-build"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "[X] PyTorch" in out and "[X] Gloo (torch.distributed)" in out and "[ ] MPI" in out and "[ ] NCCL" in out


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


def test_min_np_max_np_run_the_script_elastically(tmp_path, ray_address):
    """--min-np/--max-np become RayExecutor(min_workers, max_workers): the script's hvd.elastic.run works."""
    script = _script(tmp_path, "elastic_train.py", ELASTIC_SCRIPT)
    result = _hvdrayrun("--min-np", "2", "--max-np", "2", "--timeout", "30", "python", str(script), env=ray_address)
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
