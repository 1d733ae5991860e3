"""Real Ray clusters driven by Ray's own CLI, as a user drives them:

* ``ray start --head`` plus a second ``ray start --address`` node on this machine, and the digits
  example sent with ``ray job submit``;
* ``ray up`` / ``ray submit`` / ``ray down`` with cluster_configs/local.yaml over ssh to 127.0.0.1.

Both clusters are private to the test: their own RAY_TMPDIR (so ``--address auto`` and the launcher's
state files find only them) and their own ports. Clean-up kills, by pid, exactly the processes they
started (never ``ray stop`` as root, which would stop every Ray on a shared machine).
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
RAY = str(BIN / "ray")
SSH_USER = "hvdray-e2e"  # unprivileged: its `ray stop` (run by `ray down`) can only stop its own processes

sys.path.insert(0, str(ROOT / "tests"))
from local_processes import free_ports, kill, processes_using, refused  # noqa: E402 - shared with test_ray_client.py

pytestmark = pytest.mark.slow


def _ray_env(ray_tmpdir: Path) -> dict[str, str]:
    env = dict(os.environ, RAY_TMPDIR=str(ray_tmpdir), RAY_USAGE_STATS_ENABLED="0", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(ROOT), os.environ.get("PYTHONPATH", "")] if p)
    env["PATH"] = os.pathsep.join([str(BIN), env.get("PATH", "")])
    env.pop("RAY_ADDRESS", None)
    return env


def _run(cmd: list[str], env: dict[str, str], timeout: float, check: bool = True, **kw) -> subprocess.CompletedProcess:
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, **kw)
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {result.returncode}:\n{result.stdout}\n{result.stderr}")
    return result


# -- ray start + ray job submit -------------------------------------------------------------------
def _node_env(base: dict[str, str], home: Path, **extra: str) -> dict[str, str]:
    """One "machine" of the README's recipe: its own HOME (so ~/.ray/auth_token is its own) and no
    authentication variables but those the recipe sets."""
    home.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in base.items() if k not in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")}
    env.update(HOME=str(home), **extra)
    return env


@pytest.fixture(scope="module")
def two_node_cluster():
    """The README's "Nodes you start yourself" recipe, with Ray's token authentication: a head and a
    second node, 1 CPU each, so a 2-worker job must span both nodes (shared by the tests below).

    Each node has its own HOME, so the second node and the submitter hold only the token the recipe
    hands them (``RAY_AUTH_TOKEN``); the recipe's commands get private ports and a private temp dir.
    Yields the submitter's environment, the dashboard URL, the GCS address and the bare environment."""
    tmp = Path(tempfile.mkdtemp(prefix="hvr-"))  # short: Ray's unix socket paths must stay < 108 chars
    base = _ray_env(tmp)
    gcs, dashboard, client, agent1, agent2 = free_ports(5)
    try:
        head = _node_env(base, tmp / "head", RAY_AUTH_MODE="token")
        token = _run([RAY, "get-auth-token", "--generate"], head, timeout=120).stdout.strip().splitlines()[-1]
        assert (tmp / "head" / ".ray" / "auth_token").read_text().strip() == token
        _run([RAY, "start", "--head", "--node-ip-address=127.0.0.1", f"--port={gcs}", "--num-cpus=1",
              f"--temp-dir={tmp / 'ray'}", "--include-dashboard=true", "--dashboard-host=127.0.0.1",
              f"--dashboard-port={dashboard}", f"--ray-client-server-port={client}",
              f"--dashboard-agent-listen-port={agent1}", "--disable-usage-stats"], head, timeout=180)
        other = _node_env(base, tmp / "other", RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)
        _run([RAY, "start", f"--address=127.0.0.1:{gcs}", "--node-ip-address=127.0.0.1", "--num-cpus=1",
              f"--dashboard-agent-listen-port={agent2}", "--disable-usage-stats"], other, timeout=180)
        submitter = _node_env(base, tmp / "submitter", RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)
        yield submitter, f"http://127.0.0.1:{dashboard}", f"127.0.0.1:{gcs}", _node_env(base, tmp / "stranger")
    finally:
        kill(processes_using(str(tmp)))
        shutil.rmtree(tmp, ignore_errors=True)
        assert not processes_using(str(tmp))


def test_the_cluster_refuses_a_client_without_the_token(two_node_cluster):
    """Authentication is really on: without the token (or with a wrong one) the job API and the GCS say no."""
    _, dashboard, gcs, stranger = two_node_cluster
    _assert_refused(stranger, dashboard, "Authentication required")
    _assert_refused(dict(stranger, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN="0" * 32), dashboard,
                    "Authentication failed")
    refused([sys.executable, "-c", f"import ray; ray.init(address={gcs!r}); print('JOINED')"], stranger,
            refusal="Authentication token is missing or incorrect", joined="JOINED")


def _assert_refused(env: dict[str, str], dashboard: str, why: str) -> None:
    """Ray's job API turns the client away (401 without a token, 403 with a wrong one)."""
    listed = _run([RAY, "job", "list", f"--address={dashboard}"], env, timeout=120, check=False)
    assert listed.returncode != 0 and why in listed.stdout + listed.stderr, listed.stdout + listed.stderr


def test_ray_job_submit_runs_the_example_across_two_nodes(two_node_cluster):
    env, dashboard, gcs, _ = two_node_cluster
    nodes = _run([sys.executable, "-c", f"import ray; ray.init(address={gcs!r}); "
                  "print(sum(n['Alive'] for n in ray.nodes()))"], env, timeout=120)
    assert nodes.stdout.strip().splitlines()[-1] == "2"
    submit = _run([RAY, "job", "submit", f"--address={dashboard}", f"--working-dir={ROOT / 'examples'}", "--",
                   sys.executable, "pytorch_digits.py", "--num-workers", "2", "--epochs", "4",
                   "--min-accuracy", "0.85"], env, timeout=400, check=False)
    output = submit.stdout + submit.stderr
    assert submit.returncode == 0, output
    assert "trained on 2 workers on 2 node(s)" in output and "test accuracy" in output, output
    assert "succeeded" in output, output


def test_hvdrayrun_runs_a_script_across_two_nodes_with_address_auto(two_node_cluster, tmp_path):
    env, _, _, _ = two_node_cluster
    script = tmp_path / "where.py"
    script.write_text(
        "import torch\nimport hvdray.torch as hvd\nhvd.init()\n"
        "total = hvd.allreduce(torch.ones(1), op=hvd.Sum).item()\n"
        "print(f'rank {hvd.rank()} of {hvd.size()} on {hvd.cross_size()} nodes, sum {total:.0f}')\n"
    )
    result = _run([sys.executable, "-m", "hvdray.runner", "-np", "2", "--address", "auto", "python", str(script)],
                  env, timeout=300, check=False, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    for rank in (0, 1):
        assert f"[{rank}]<stdout>:rank {rank} of 2 on 2 nodes, sum 2" in result.stdout, result.stdout


# -- examples and an unrelated running cluster --------------------------------------------------------
@pytest.fixture
def unrelated_cluster():
    """A Ray head started with `ray start` that `ray.init(address="auto")` would find (the same RAY_TMPDIR
    and HOME as the example below); yields the example's environment and the head's GCS address."""
    tmp = Path(tempfile.mkdtemp(prefix="hvr-u-"))
    env = _node_env(_ray_env(tmp), tmp / "home")
    gcs, client, agent = free_ports(3)
    try:
        _run([RAY, "get-auth-token", "--generate"], env, timeout=120)
        _run([RAY, "start", "--head", "--node-ip-address=127.0.0.1", f"--port={gcs}", "--num-cpus=2",
              f"--temp-dir={tmp / 'ray'}", "--include-dashboard=false", f"--ray-client-server-port={client}",
              f"--dashboard-agent-listen-port={agent}", "--disable-usage-stats"], env, timeout=180)
        yield env, f"127.0.0.1:{gcs}"
    finally:
        kill(processes_using(str(tmp)))
        shutil.rmtree(tmp, ignore_errors=True)


def test_the_elastic_example_and_a_bare_executor_join_a_running_cluster_only_when_asked(unrelated_cluster):
    env, gcs = unrelated_cluster
    example = [sys.executable, str(ROOT / "examples" / "elastic_digits.py"), "--min-workers", "1",
               "--max-workers", "2", "--epochs", "2", "--min-accuracy", "0"]
    alone = _run(example, env, timeout=300, check=False)
    output = alone.stdout + alone.stderr
    assert alone.returncode == 0, output
    assert "Started a local Ray instance" in output and "Connecting to existing Ray cluster" not in output, output
    asked = _run([*example, "--address", "auto"], env, timeout=300, check=False)  # the check above can fail
    output = asked.stdout + asked.stderr
    assert asked.returncode == 0, output
    port = gcs.rsplit(":", 1)[1]  # Ray names the node by its own IP, not the 127.0.0.1 it was given
    assert re.search(rf"Connecting to existing Ray cluster at address: [\d.]+:{port}\b", output), output
    # an executor started without ray.init() starts its own local Ray too, as horovod.ray users expect
    script = ("from hvdray import RayExecutor\n"
              "with RayExecutor(RayExecutor.create_settings(timeout_s=60), num_workers=1) as ex:\n"
              "    print('ran', ex.run(lambda: 7))\n")
    bare = _run([sys.executable, "-c", script], env, timeout=300, check=False)
    output = bare.stdout + bare.stderr
    assert bare.returncode == 0 and "ran [7]" in output, output
    assert "Started a local Ray instance" in output and "Connecting to existing Ray cluster" not in output, output


# -- ray up / ray submit / ray down over ssh --------------------------------------------------------
def _ensure_packages() -> None:
    missing = [pkg for pkg, tool in (("openssh-server", "/usr/sbin/sshd"), ("rsync", "rsync"),
                                     ("openssh-client", "ssh"), ("acl", "setfacl")) if not shutil.which(tool)]
    if not missing:
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        pytest.skip(f"{', '.join(missing)} not installed and cannot be installed here (needs root and apt-get)")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    install = ["apt-get", "install", "-y", "-qq", *missing]
    if subprocess.run(install, env=env, capture_output=True, timeout=600).returncode != 0:
        subprocess.run(["apt-get", "update", "-qq"], env=env, capture_output=True, timeout=600)
        result = subprocess.run(install, env=env, capture_output=True, text=True, timeout=600)
        if result.returncode != 0:
            pytest.skip(f"apt-get could not install {missing}: {result.stderr[-500:]}")


def _ssh_port_open() -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", 22)) == 0


def _grant_traverse(user: str, paths: list[Path]) -> list[Path]:
    """Let ``user`` reach the interpreter and the checkout (e.g. a Python under /root): an ACL entry
    ``u:USER:x`` on each closed ancestor directory, removed again after the test. Returns those dirs."""
    closed = sorted({d for p in paths for d in p.parents if not d.stat().st_mode & stat.S_IXOTH})
    for directory in closed:
        subprocess.run(["setfacl", "-m", f"u:{user}:x", str(directory)], check=True)
    return closed


@pytest.fixture
def ssh_to_localhost(tmp_path):
    """An unprivileged user reachable with a fresh key over ssh on 127.0.0.1:22; yields (user, key, ray tmpdir)."""
    if os.geteuid() != 0:
        pytest.skip("setting up sshd and a test user needs root")
    _ensure_packages()
    try:
        pwd.getpwnam(SSH_USER)
    except KeyError:
        subprocess.run(["useradd", "--create-home", "--shell", "/bin/bash", SSH_USER], check=True)
    subprocess.run(["usermod", "--password", "*", SSH_USER], check=True)  # no password, but not locked for sshd
    home = Path(pwd.getpwnam(SSH_USER).pw_dir)
    key = tmp_path / "id_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    ray_tmpdir = Path(tempfile.mkdtemp(prefix="hvr-up-"))
    ssh_dir = home / ".ssh"
    ssh_dir.mkdir(mode=0o700, exist_ok=True)
    (ssh_dir / "authorized_keys").write_text(key.with_suffix(".pub").read_text())
    (home / ".bashrc").write_text(  # Ray runs every remote command in a login shell that sources this
        f'export PATH="{BIN}:$PATH" PYTHONPATH="{ROOT}" RAY_TMPDIR="{ray_tmpdir}" RAY_USAGE_STATS_ENABLED=0\n'
    )
    for path in (home, ssh_dir, ssh_dir / "authorized_keys", home / ".bashrc", ray_tmpdir):
        shutil.chown(path, SSH_USER, SSH_USER)
    (ssh_dir / "authorized_keys").chmod(0o600)

    granted = _grant_traverse(SSH_USER, [Path(sys.executable).resolve(), BIN, ROOT])
    sshd = None
    if not _ssh_port_open():  # no sshd on this machine: start a private one, ours to stop
        host_key = tmp_path / "ssh_host_ed25519_key"
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(host_key)], check=True)
        config = tmp_path / "sshd_config"
        config.write_text(f"ListenAddress 127.0.0.1\nPort 22\nHostKey {host_key}\nPasswordAuthentication no\n"
                          "PubkeyAuthentication yes\nUsePAM no\nPidFile none\n")
        Path("/run/sshd").mkdir(exist_ok=True)
        sshd = subprocess.Popen(["/usr/sbin/sshd", "-D", "-e", "-f", str(config)], stderr=subprocess.PIPE)
        deadline = time.monotonic() + 20
        while not _ssh_port_open():
            if sshd.poll() is not None or time.monotonic() > deadline:
                pytest.skip(f"sshd did not start: {sshd.stderr.read().decode()[-500:] if sshd.stderr else ''}")
            time.sleep(0.2)
    try:
        probe = subprocess.run(
            ["ssh", "-i", str(key), "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no", "-o",
             "UserKnownHostsFile=/dev/null", "-o", "ConnectTimeout=10", f"{SSH_USER}@127.0.0.1", "python -V"],
            capture_output=True, text=True, timeout=60,
        )  # fail here, clearly, rather than let `ray up` wait for ssh until its timeout
        assert probe.returncode == 0, f"ssh {SSH_USER}@127.0.0.1 with the test key failed: {probe.stderr}"
        yield SSH_USER, key, ray_tmpdir
    finally:
        kill(processes_using(str(ray_tmpdir), user=SSH_USER))
        if sshd is not None:
            sshd.kill()
            sshd.wait(timeout=10)
        for directory in granted:
            subprocess.run(["setfacl", "-x", f"u:{SSH_USER}", str(directory)], check=False)
        shutil.rmtree(ray_tmpdir, ignore_errors=True)


def _local_test_config(user: str, key: Path, ray_tmpdir: Path, path: Path) -> Path:
    """cluster_configs/local.yaml pointed at 127.0.0.1 with private ports; the set-up only checks the install."""
    config = yaml.safe_load((ROOT / "cluster_configs" / "local.yaml").read_text())
    gcs, dashboard, client, agent = free_ports(4)
    config["cluster_name"] = f"hvdray-e2e-{os.getpid()}"
    config["provider"].update(head_ip="127.0.0.1", worker_ips=[])
    config["auth"] = {"ssh_user": user, "ssh_private_key": str(key)}
    config["min_workers"] = config["max_workers"] = 0
    assert config["file_mounts"].pop("~/hvdray") == "."
    config["file_mounts"]["~/hvdray"] = str(ROOT)  # the token's mount stays as it is
    # This machine's environment already has hvdray (the real set-up would pip install it): check it;
    # the config's token-authentication set-up runs as it is.
    config["setup_commands"] = [c for c in config["setup_commands"] if "RAY_AUTH_MODE" in c] + [
        'python -c "import hvdray, ray, torch; print(\'hvdray\', hvdray.__version__)"']
    config["head_start_ray_commands"] = [
        f"ray start --head --node-ip-address=127.0.0.1 --port={gcs} --num-cpus=2 --temp-dir={ray_tmpdir}/ray "
        f"--include-dashboard=true --dashboard-port={dashboard} --ray-client-server-port={client} "
        f"--dashboard-agent-listen-port={agent} "
        "--autoscaling-config=~/ray_bootstrap_config.yaml --disable-usage-stats"
    ]
    path.write_text(yaml.safe_dump(config))
    return path, f"http://127.0.0.1:{dashboard}"


@pytest.mark.timeout(900)
def test_ray_up_submit_down_with_the_local_provider_config_over_ssh(ssh_to_localhost, tmp_path):
    user, key, ray_tmpdir = ssh_to_localhost
    config, dashboard = _local_test_config(user, key, ray_tmpdir, tmp_path / "cluster.yaml")
    launcher = Path(tempfile.mkdtemp(prefix="hvr-cli-"))  # the launcher's own state files and HOME
    env = _node_env(_ray_env(launcher), launcher / "home")
    try:
        _run([RAY, "get-auth-token", "--generate"], env, timeout=120)  # the configs' first step
        up = _run([RAY, "up", "-y", "--no-config-cache", str(config)], env, timeout=400, check=False, cwd=ROOT)
        assert up.returncode == 0, up.stdout + up.stderr
        assert "hvdray 0.1.0" in up.stdout + up.stderr
        submit = _run([RAY, "submit", "--no-config-cache", str(config), str(ROOT / "examples" / "pytorch_digits.py"),
                       "--", "--address", "auto", "--num-workers", "2", "--epochs", "4", "--min-accuracy", "0.85"],
                      env, timeout=400, check=False, cwd=ROOT)
        output = submit.stdout + submit.stderr
        assert submit.returncode == 0, output
        assert "trained on 2 workers" in output and "test accuracy" in output, output
        _assert_refused(_node_env(env, tmp_path / "stranger"), dashboard, "Authentication required")
    finally:
        down = _run([RAY, "down", "-y", str(config)], env, timeout=300, check=False, cwd=ROOT)
        shutil.rmtree(env["RAY_TMPDIR"], ignore_errors=True)
    assert down.returncode == 0, down.stdout + down.stderr
    deadline = time.monotonic() + 30
    while processes_using(str(ray_tmpdir), user=user) and time.monotonic() < deadline:
        time.sleep(1)
    assert not processes_using(str(ray_tmpdir), user=user), "ray down left processes behind"
