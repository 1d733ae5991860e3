"""Shared fixtures: a real local Ray instance per test module, and executors that always shut down."""

from __future__ import annotations

import os
import signal

import pytest

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


@pytest.fixture(scope="session", autouse=True)
def ray_token_authentication():
    """Ray's token authentication on in every test, whatever runs first.

    Ray 2.60's ``ray.init()`` turns it on for a new local cluster unless ``RAY_AUTH_MODE`` says
    otherwise (it sets ``RAY_AUTH_MODE=token`` in the process and makes a token in ``~/.ray``);
    ``ray.cluster_utils.Cluster`` does not, so a multi-node test run on its own would start its raylets
    without it. This applies the same default, through the same Ray functions, before any test."""
    from ray._private.authentication.authentication_token_setup import (
        enable_token_auth_by_default,
        ensure_token_if_auth_enabled,
    )

    enable_token_auth_by_default()  # respects an explicit RAY_AUTH_MODE, as ray.init() does
    ensure_token_if_auth_enabled()
    yield


#: the address of the local Ray that :func:`ray_local` started and shares between modules, if any
_shared_local_ray: dict[str, str] = {}


#: actors that stay in a cluster by design: the driver's coordinator host (its executors share it), and Ray
#: Data's statistics actor (detached: Ray Data starts it once per cluster and keeps it)
_STAYING_ACTOR_CLASSES = {"CoordinatorHost", "_StatsActor"}


def _actors_left_behind() -> list[dict]:
    """The live actors of the connected Ray other than those that stay by design."""
    from ray._private.state import actors  # the GCS actor table; the state API needs the dashboard

    return [a for a in actors().values() if a["State"] == "ALIVE" and a["ActorClassName"] not in _STAYING_ACTOR_CLASSES]


@pytest.fixture(scope="session")
def actors_left_behind():
    """A function listing the live actors other than those that stay by design (for tests that count leaks)."""
    return _actors_left_behind


def _cluster_is_clean(timeout_s: float = 5.0) -> bool:
    """No actor but those that stay by design and no placement group alive (both go away
    asynchronously after an executor's shutdown, so this waits up to ``timeout_s`` for it)."""
    import time

    from ray.util import placement_group_table

    deadline = time.monotonic() + timeout_s
    while True:
        alive = _actors_left_behind()
        groups = [g for g in placement_group_table().values() if g["state"] != "REMOVED"]
        if not alive and not groups:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)


@pytest.fixture(scope="module")
def ray_local():
    """A local Ray instance with 4 logical CPUs (the machine has 2 cores; workers use 1 thread each).

    One instance serves every module that uses this fixture in a row: starting and stopping one costs
    ~6 s of the 2 cores, ~3 min over the suite. A module that needs another Ray (a multi-node cluster, a
    dashboard) shuts it down, and the next module here starts a fresh one. A module that leaves an actor
    (other than the driver's coordinator host, which a driver's executors share by design) or a placement
    group behind gets its instance shut down after it, so the next module starts from a clean one (the
    actors that stay by design, :data:`_STAYING_ACTOR_CLASSES`, do not count)."""
    import ray

    if ray.is_initialized() and ray.get_runtime_context().gcs_address != _shared_local_ray.get("address"):
        ray.shutdown()
    if not ray.is_initialized():
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=True)
        _shared_local_ray["address"] = ray.get_runtime_context().gcs_address
    yield ray
    if ray.is_initialized() and not _cluster_is_clean():
        ray.shutdown()


@pytest.fixture(scope="session", autouse=True)
def _shut_down_the_shared_local_ray():
    yield
    import ray

    if ray.is_initialized() and ray.get_runtime_context().gcs_address == _shared_local_ray.get("address"):
        ray.shutdown()


#: the settings of the executors that tests start (:func:`make_executor`'s and the shared ones), unless told
EXECUTOR_SETTINGS = {"timeout_s": 20, "placement_group_timeout_s": 20}


@pytest.fixture
def make_executor(ray_local):
    """``make_executor(num_workers=2, **kw)`` -> a started RayExecutor, shut down after the test."""
    from hvdray import RayExecutor

    made = []

    def factory(start: bool = True, settings=None, **kwargs):
        settings = settings or RayExecutor.create_settings(**EXECUTOR_SETTINGS)
        executor = RayExecutor(settings, **kwargs)
        made.append(executor)
        if start:
            executor.start()
        return executor

    yield factory
    for executor in made:
        executor.shutdown()


#: executors that the tests of a module share (the ``shared_executor`` fixture), by name: their workers and the
#: settings they have beyond :func:`make_executor`'s; a module adds its own in a dict named ``EXECUTORS``
SHARED_EXECUTORS: dict[str, tuple[int, dict]] = {"pair": (2, {}), "trio": (3, {})}


def pytest_generate_tests(metafunc):
    """A test that takes ``shared_executor`` runs once for each executor that its
    ``@pytest.mark.shared_executor(name, ...)`` names (the pair without the mark). As a module-scoped
    parametrized fixture, pytest runs the tests of one executor together: each starts once per module, and
    only one holds the local Ray's CPUs at a time."""
    if "shared_executor" in metafunc.fixturenames:
        marker = metafunc.definition.get_closest_marker("shared_executor")
        metafunc.parametrize("shared_executor", marker.args if marker else ["pair"], indirect=True, scope="module")


@pytest.fixture(scope="module")
def shared_executor(request, ray_local):
    """A started executor shared by the tests of a module (all of them, see
    :func:`_no_test_beside_a_shared_executor`; which executor: :func:`pytest_generate_tests`).
    Its workers keep their engines from test to test, as they do from call to call, so a check counts
    what it measures from where it starts; a test that leaves a worker broken has the next call restart
    the workers, as any executor does."""
    from hvdray import RayExecutor

    workers, settings = {**SHARED_EXECUTORS, **getattr(request.module, "EXECUTORS", {})}[request.param]
    settings = RayExecutor.create_settings(**{**EXECUTOR_SETTINGS, **settings})
    with RayExecutor(settings, num_workers=workers) as ex:
        _open_shared_executors[request.node.nodeid] = request.param
        try:
            yield ex
        finally:
            del _open_shared_executors[request.node.nodeid]


#: the shared executors alive now, by the module that holds them
_open_shared_executors: dict[str, str] = {}


@pytest.fixture(autouse=True)
def _no_test_beside_a_shared_executor(request):
    """A module's shared executor lives until the module ends, and pytest runs the tests that take none
    after those that do: they would find its workers holding the local Ray's CPUs and its actors alive.
    So a module's tests take the shared executor all or none."""
    if "shared_executor" not in request.fixturenames and _open_shared_executors:
        pytest.fail(f"{request.node.nodeid} takes no shared executor, but {_open_shared_executors} are alive: "
                    "a module's tests take the `shared_executor` fixture all or none")


@pytest.fixture(params=["first worker", "driver's host"])
def coordinator_place(request):
    """Runs a test twice: fixed jobs' coordinators in their first worker (the default up to
    ``HOSTED_BY_WORKER_UP_TO`` workers), and in the driver's coordinator host (larger jobs)."""
    if request.param == "driver's host":
        request.getfixturevalue("coordinator_in_host")
    return request.param


@pytest.fixture
def coordinator_in_host(monkeypatch):
    """Fixed jobs keep their coordinator in the driver's coordinator host, as jobs of more than
    ``HOSTED_BY_WORKER_UP_TO`` workers do."""
    monkeypatch.setattr("hvdray.driver.executor.HOSTED_BY_WORKER_UP_TO", 0)


@pytest.fixture
def fresh_coordinator_host():
    """Kill this driver's coordinator host, so that the test's next elastic (or large) job starts one of
    its own, as the first job of a fresh driver does: on a busy node that start is slow."""
    import ray

    from hvdray.driver import coordinator_host

    with coordinator_host._host_lock:
        _, host = coordinator_host._host_here()  # not one of an earlier module's Ray session: gone with it
        if host is not None:
            ray.kill(host, no_restart=True)
        coordinator_host._host = None
    yield


@pytest.fixture(scope="module")
def ray_two_nodes():
    """A real multi-node Ray on this machine: a head without CPUs and two raylets of 2 CPUs each."""
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    for _ in range(2):
        cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


@pytest.fixture
def python_sigint_handler():
    """Python's own SIGINT handler for a test that sends SIGINT to this process, and the one before it put
    back afterwards: a Ray Tune run earlier in the same pytest process leaves Tune's handler installed, which
    takes the next SIGINT without raising (ray-project/ray#37737; docs/troubleshooting.md)."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)
