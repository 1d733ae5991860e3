"""Worker actor names seen through Ray's state API, and progress/metrics callbacks fed by real workers."""

from __future__ import annotations

import io
import os
import socket
import sys
from pathlib import Path

import pytest

from hvdray import RayExecutor, ray_logger
from hvdray.driver.callbacks import MetricsHistory
from hvdray.driver.callbacks import ProgressBar

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from local_processes import SAY_SOURCE  # noqa: E402 - the drivers' line writer, shared with test_ray_client.py


@pytest.fixture(scope="module")
def ray_with_dashboard():
    """A local Ray whose dashboard (the state API's server) listens on a free port of its own."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = ray.init(address="local", num_cpus=4, include_dashboard=True, dashboard_port=port)
    yield f"http://{context.dashboard_url}"
    ray.shutdown()


def _actor_id_and_rank():
    import ray

    import hvdray.torch as hvd

    hvd.init()
    return ray.get_runtime_context().get_actor_id(), hvd.rank()


def _train(epochs: int) -> int:
    import hvdray.torch as hvd

    hvd.init()
    for epoch in range(1, epochs + 1):
        loss = hvd.allreduce(__import__("torch").tensor([1.0 / epoch])).item()
        ray_logger.log({"epoch": epoch, "loss": loss})
    return hvd.rank()


def test_worker_actors_are_named_by_executor_and_rank(ray_with_dashboard):
    from ray.util.state import list_actors, list_placement_groups

    # names are checked, not start-up time: a loaded machine may take longer than 20 s to start 3 actors
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=20, placement_group_timeout_s=120), num_workers=3)
    try:
        executor.start()
        ranks = dict(executor.run(_actor_id_and_rank))
        alive = {a.actor_id: a.name for a in list_actors(address=ray_with_dashboard, filters=[("state", "=", "ALIVE")])}
        for actor_id, rank in ranks.items():
            assert alive[actor_id] == f"hvdray-{executor._id}-rank-{rank}"
        # a job of 3 keeps its coordinator in its first worker
        assert alive[executor._group.coordinator.handle._actor_id.hex()] == f"hvdray-{executor._id}-rank-0"
        groups = {g.name: g.state for g in list_placement_groups(address=ray_with_dashboard)}
        assert groups.get(f"hvdray-{executor._id}-pg") == "CREATED", groups
    finally:
        executor.shutdown()


def test_progress_bar_and_history_follow_what_workers_log(ray_with_dashboard):
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=20, placement_group_timeout_s=20), num_workers=2)
    history_all, history = MetricsHistory(rank=None), MetricsHistory()
    out = io.StringIO()
    try:
        with ProgressBar(total=4, file=out, mininterval=0) as progress:
            assert executor.run(_train, args=[4], callbacks=[progress, history, history_all]) == [0, 1]
            assert progress.bar.n == 4
    finally:
        executor.shutdown()
    assert history.series("loss") == ([1, 2, 3, 4], [1.0, 0.5, pytest.approx(1 / 3), 0.25])
    assert sorted(row["rank"] for row in history_all.rows) == [0] * 4 + [1] * 4
    assert "4/4" in out.getvalue()


_PRINTING_DRIVER = """
import sys
import ray
from hvdray import RayExecutor

def say(word):
    import hvdray.torch as hvd
    hvd.init()
    print(f"{word} from {hvd.rank()}", flush=True)
    print(f"{word} on stderr from {hvd.rank()}", file=sys.stderr, flush=True)
    return hvd.rank()

ray.init(address=sys.argv[1])  # the module's Ray: a driver that joins a running cluster
settings = RayExecutor.create_settings(timeout_s=30)
# the ranks go to a file: the driver's own output stays Ray's forwarded lines alone (a line the driver
# wrote could fall between a forwarded line and its newline, which Ray's log thread writes apart)
with open(sys.argv[2], "w") as ranks:
    fixed = RayExecutor(settings, num_workers=2)
    ranks.write(f"fixed ranks {fixed.run(say, args=['fixed'])}\\n")
    fixed.shutdown()
    elastic = RayExecutor(settings, min_workers=2, max_workers=2)
    ranks.write(f"elastic ranks {elastic.run(say, args=['elastic'])}\\n")
    elastic.shutdown()
import time; time.sleep(3)  # Ray forwards the workers' last lines
ray.shutdown()
"""


def test_worker_log_lines_reach_the_driver_prefixed_by_rank(ray_with_dashboard, tmp_path):
    """What a worker prints comes out on the driver as ``(rank 1 pid=...) ...``, not ``(Worker pid=...)``;
    an elastic worker's prefix also carries its worker id. The driver is a process of its own that joins
    the module's Ray (Ray sends a job's worker lines to that job's driver only)."""
    import ray
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in [str(root), os.environ.get("PYTHONPATH")] if p))
    env.pop("RAY_ADDRESS", None)
    script = tmp_path / "driver.py"
    script.write_text(_PRINTING_DRIVER)
    address = ray.get_runtime_context().gcs_address
    ranks = tmp_path / "ranks.txt"
    done = subprocess.run([sys.executable, str(script), address, str(ranks)], env=env, capture_output=True, text=True,
                          timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert ranks.read_text() == "fixed ranks [0, 1]\nelastic ranks [0, 1]\n", output
    for rank in (0, 1):
        assert re.search(rf"\(rank {rank} pid=\d+\)\S* fixed from {rank}\n", output), output
        assert re.search(rf"\(rank {rank} pid=\d+\)\S* fixed on stderr from {rank}\n", output), output
        assert re.search(rf"\(rank {rank}, worker \w+ pid=\d+\)\S* elastic from {rank}\n", output), output
    assert not re.search(r"\(Worker pid=\d+\)", output), output


_PROGRESS_DRIVER = SAY_SOURCE + """
import json
import ray
from hvdray import ProgressBar, RayExecutor, init_ray, ray_logger
from ray.util.state import list_actors, list_placement_groups

def train(epochs):
    import hvdray.torch as hvd
    hvd.init()
    for epoch in range(1, epochs + 1):
        ray_logger.log({"epoch": epoch, "loss": 1.0 / epoch})
    return hvd.rank()

init_ray(num_cpus=4)  # a new local Ray with its dashboard on: the state API needs it
executor = RayExecutor(RayExecutor.create_settings(timeout_s=30, placement_group_timeout_s=120), num_workers=2)
executor.start()
ours = ray.get_runtime_context().gcs_address  # other Ray instances may run on this machine
alive = [a.name for a in list_actors(address=ours, filters=[("state", "=", "ALIVE")])]
groups = [g.name for g in list_placement_groups(address=ours, filters=[("state", "=", "CREATED")])]
say("NAMES", json.dumps({"id": executor._id, "actors": alive, "groups": groups}))
with ProgressBar(total=3, desc="digits") as bar:  # on stderr, a pipe here
    say("RANKS", executor.run(train, args=[3], callbacks=[bar]))
executor.shutdown()
"""


def test_init_ray_keeps_the_dashboard_and_a_piped_progress_bar_writes_one_line_per_step(tmp_path):
    """A script started with its output piped (as ``ray job submit`` runs a driver): ``init_ray`` leaves
    the dashboard on, so the state API lists the job's actors and placement group by name, and the
    progress bar writes each step once as a line of its own, never redrawn with carriage returns."""
    import json
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in [str(root), os.environ.get("PYTHONPATH")] if p))
    env.pop("RAY_ADDRESS", None)
    script = tmp_path / "driver.py"
    script.write_text(_PROGRESS_DRIVER)
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    names = json.loads(done.stdout.split("NAMES ", 1)[1].splitlines()[0])
    job = f"hvdray-{names['id']}"
    assert {f"{job}-rank-0", f"{job}-rank-1"} <= set(names["actors"]), names
    assert not any(name.startswith("hvdray-coordinator-") for name in names["actors"]), names  # in rank 0
    assert f"{job}-pg" in names["groups"], names
    assert "RANKS [0, 1]" in done.stdout
    steps = re.findall(r"^digits: .*\| (\d)/3 \[.*loss=([\d.]+)\]$", done.stderr, flags=re.MULTILINE)
    assert steps == [("1", "1"), ("2", "0.5"), ("3", "0.3333")], done.stderr
    assert "\r" not in done.stderr
