"""A driver outside the cluster, as from a laptop or a notebook: ``ray.init("ray://head:port")`` (Ray
Client), then fixed and elastic executor runs, a Ray Dataset and a Tune sweep, unchanged; and a driver
sent with ``ray job submit`` whose progress bar reaches ``ray job logs`` one line per step.

The head is a real ``ray start --head --ray-client-server-port=...`` with Ray's token authentication on,
in a temp dir with free ports and a HOME of its own; the client holds the token only through
``RAY_AUTH_TOKEN``. Clean-up kills, by pid, exactly the processes the head started.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
RAY = str(BIN / "ray")

sys.path.insert(0, str(ROOT / "tests"))
from local_processes import SAY_SOURCE, free_ports, kill, processes_using, refused  # noqa: E402 - shared

pytestmark = pytest.mark.slow


def _env(tmp: Path, home: str, **extra: str) -> dict[str, str]:
    """An environment of its own: HOME (so ~/.ray/auth_token is its own), RAY_TMPDIR, hvdray importable."""
    (tmp / home).mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items()
           if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")}
    env.update(HOME=str(tmp / home), RAY_TMPDIR=str(tmp), RAY_USAGE_STATS_ENABLED="0", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(p for p in [str(ROOT), os.environ.get("PYTHONPATH", "")] if p),
               PATH=os.pathsep.join([str(BIN), os.environ.get("PATH", "")]), **extra)
    return env


def _run(cmd: list[str], env: dict[str, str], timeout: float, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, **kw)


@pytest.fixture(scope="module")
def head():
    """A one-node cluster with 4 CPUs, the dashboard and a Ray Client server, token authentication on.
    Yields (the client's environment, the ray:// address, the dashboard URL)."""
    tmp = Path(tempfile.mkdtemp(prefix="hvr-c-"))  # short: Ray's unix socket paths must stay < 108 chars
    gcs, dashboard, client, agent = free_ports(4)
    try:
        # GRPC_ENABLE_FORK_SUPPORT=false: the head's Ray Client proxy forks a server per client while its
        # gRPC threads run, and gRPC's fork handlers then crash the child (empty ray_client_server_<port>.err,
        # a segfault in cygrpc's event_engine thread in dmesg; ray-project/ray#63202). The child execs at
        # once, so the handlers are not needed; see docs/ray_client.md.
        head_env = _env(tmp, "head", RAY_AUTH_MODE="token", GRPC_ENABLE_FORK_SUPPORT="false")
        made = _run([RAY, "get-auth-token", "--generate"], head_env, timeout=120)
        assert made.returncode == 0, made.stdout + made.stderr
        token = made.stdout.strip().splitlines()[-1]
        started = _run([RAY, "start", "--head", "--node-ip-address=127.0.0.1", f"--port={gcs}", "--num-cpus=4",
                        f"--temp-dir={tmp / 'ray'}", "--include-dashboard=true", "--dashboard-host=127.0.0.1",
                        f"--dashboard-port={dashboard}", f"--ray-client-server-port={client}",
                        f"--dashboard-agent-listen-port={agent}", "--disable-usage-stats"], head_env, timeout=180)
        assert started.returncode == 0, started.stdout + started.stderr
        laptop = _env(tmp, "laptop", RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)
        yield laptop, f"ray://127.0.0.1:{client}", f"http://127.0.0.1:{dashboard}"
    finally:
        kill(processes_using(str(tmp)))
        shutil.rmtree(tmp, ignore_errors=True)


_CLIENT_DRIVER = SAY_SOURCE + """
import ray
import torch
from hvdray import RayExecutor, get_dataset_shard
import hvdray.torch as hvd

ray.init(sys.argv[1])                     # Ray Client: this process is outside the cluster
assert ray.util.client.ray.is_connected()

def total(value):
    hvd.init()
    return hvd.allreduce(torch.tensor([value]), op=hvd.Sum).item()

settings = RayExecutor.create_settings(timeout_s=60, placement_group_timeout_s=120)
with RayExecutor(settings, num_workers=2) as executor:
    say("FIXED", executor.run(total, args=[1.5]))

def rows():
    hvd.init()
    return sum(len(batch["id"]) for batch in get_dataset_shard("train").iter_batches(batch_size=10))

with RayExecutor(settings, num_workers=2) as executor:
    say("DATA", executor.run(rows, datasets={"train": ray.data.range(40)}))

def elastic_fn():
    hvd.init()
    state = hvd.elastic.ObjectState(epoch=0)

    @hvd.elastic.run
    def train(state):
        while state.epoch < 2:
            hvd.allreduce(torch.ones(1))
            state.epoch += 1
            state.commit()
        return hvd.size()

    return train(state)

from hvdray.driver.node_liveness import down_nodes   # liveness asks the cluster about nodes it cannot reach

live = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
say("DOWN", sorted(down_nodes(live + ["f" * 56])) == ["f" * 56])

with RayExecutor(settings.model_copy(update={"discovery_interval_s": 0.5}), min_workers=2, max_workers=2,
                 elastic_timeout=120) as executor:
    say("ELASTIC", executor.run(elastic_fn))

from ray import tune
from hvdray.tune import DistributedTrainableCreator, report

def trial(config):
    hvd.init()
    for step in range(2):
        report({"score": hvd.allreduce(torch.tensor([config["x"] * hvd.size()]), op=hvd.Sum).item(), "step": step})

trainable = DistributedTrainableCreator(trial, num_hosts=1, num_slots=2, num_cpus_per_slot=1, timeout_s=60)
analysis = tune.run(trainable, config={"x": tune.grid_search([1.0, 2.0])}, metric="score", mode="max",
                    verbose=0, storage_path=sys.argv[2])
say("TUNE", sorted(t.last_result["score"] for t in analysis.trials))
"""


def test_a_ray_client_driver_runs_fixed_elastic_data_and_tune_jobs(head, tmp_path):
    env, address, _ = head
    script = tmp_path / "laptop.py"
    script.write_text(_CLIENT_DRIVER)
    done = _run([sys.executable, str(script), address, str(tmp_path / "tune")], env, timeout=600, cwd=tmp_path)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "FIXED [3.0, 3.0]" in output, output
    assert "DATA [20, 20]" in output, output
    assert "DOWN True" in output, output
    assert "ELASTIC [2, 2]" in output, output
    assert "TUNE [4.0, 8.0]" in output, output


def test_the_client_needs_the_token(head, tmp_path):
    """Authentication is really on for the client server: without the token, ray:// is refused."""
    env, address, _ = head
    stranger = {k: v for k, v in env.items() if k not in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN")}
    stranger["HOME"] = str(tmp_path)
    # Ray Client says why it is turned away only in its debug log (and retries for 30 s before it gives up)
    code = ("import logging, sys; logging.basicConfig(stream=sys.stderr); "
            "logging.getLogger('ray.util.client.worker').setLevel(logging.DEBUG); "
            f"import ray; ray.init({address!r}); print('CONNECTED')")
    refused([sys.executable, "-c", code], stranger, refusal="Invalid or missing authentication token",
            joined="CONNECTED")


_JOB_DRIVER = SAY_SOURCE + """
from hvdray import ProgressBar, RayExecutor, init_ray, ray_logger

def train(epochs):
    import hvdray.torch as hvd
    hvd.init()
    for epoch in range(1, epochs + 1):
        ray_logger.log({"epoch": epoch, "loss": 1.0 / epoch})
    return hvd.rank()

init_ray()  # $RAY_ADDRESS, set by ray job submit
with RayExecutor(RayExecutor.create_settings(timeout_s=60), num_workers=2) as executor, \\
        ProgressBar(total=3, desc="digits") as bar:
    say("RANKS", executor.run(train, args=[3], callbacks=[bar]))
"""


def test_ray_job_logs_hold_one_progress_line_per_step(head, tmp_path):
    """A driver sent with ``ray job submit``: its output is a log, not a terminal, so the progress bar
    writes each step once (``ray job logs`` shows three lines, no carriage-return redraws)."""
    env, _, dashboard = head
    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "train.py").write_text(_JOB_DRIVER)
    job_id = f"hvdray-progress-{os.getpid()}"
    submit = _run([RAY, "job", "submit", f"--address={dashboard}", f"--submission-id={job_id}",
                   f"--working-dir={tmp_path / 'job'}", "--", sys.executable, "train.py"], env, timeout=400)
    assert submit.returncode == 0 and "succeeded" in submit.stdout + submit.stderr, submit.stdout + submit.stderr
    logs = _run([RAY, "job", "logs", f"--address={dashboard}", job_id], env, timeout=120)
    assert logs.returncode == 0, logs.stdout + logs.stderr
    assert "RANKS [0, 1]" in logs.stdout, logs.stdout
    steps = re.findall(r"^digits: .*\| (\d)/3 \[", logs.stdout, flags=re.MULTILINE)
    assert steps == ["1", "2", "3"], logs.stdout
    assert "\r" not in logs.stdout
