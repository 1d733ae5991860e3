"""Elastic executors on a local Ray instance: custom discovery, the ElasticRayExecutor alias, reset
callbacks after a worker death, user errors, and argument checks. Multi-node faults are in
tests/multinode/test_elastic.py."""

from __future__ import annotations

import os
import re
import threading
import time

import pytest
import ray

from hvdray import ElasticJobError, ElasticRayExecutor, NetworkDeviceError, RayExecutor
from hvdray.collective.errors import HvdrayError


class _OneNodeDiscovery:
    """A user discovery object: this Ray node, with a fixed number of slots."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.calls = 0

    def find_available_hosts_and_slots(self) -> dict[str, int]:
        self.calls += 1
        return {ray.get_runtime_context().get_node_id(): self.slots}


def _sum_ranks(marker: str = "") -> dict:
    import os

    import torch

    import hvdray.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    state = hvd.elastic.ObjectState(epoch=0, resets=0)
    state.register_reset_callbacks([lambda: setattr(state, "resets", state.resets + 1)])

    @hvd.elastic.run
    def train(state):
        while state.epoch < 4:
            total = hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum).item()
            if marker and state.epoch == 2 and hvd.rank() == 1 and not os.path.exists(marker):
                open(marker, "w").close()
                os._exit(1)
            state.epoch += 1
            state.commit()
        return {"rank": hvd.rank(), "size": hvd.size(), "total": total, "resets": state.resets}

    return train(state)


def _settings(**kwargs):
    return RayExecutor.create_settings(timeout_s=10, placement_group_timeout_s=60, discovery_interval_s=0.5, **kwargs)


def test_custom_discovery_decides_the_slots(ray_local):
    discovery = _OneNodeDiscovery(2)
    with RayExecutor(_settings(discovery=discovery), min_workers=1, max_workers=4, override_discovery=False) as ex:
        results = ex.run(_sum_ranks)
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["size"] == 2 and r["total"] == 2.0 for r in results)


def _grows_to_two() -> dict:
    import sys
    import time

    loaded = "torch._dynamo" in sys.modules  # before anything of the user's runs
    import hvdray.torch as hvd

    hvd.init()
    state = hvd.elastic.ObjectState(first_size=hvd.size())

    @hvd.elastic.run
    def train(state):
        deadline = time.monotonic() + 60
        while hvd.size() < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
            state.commit()  # raises HostsUpdatedInterrupt once the new worker has started
        return {"loaded": loaded, "first_size": state.first_size, "size": hvd.size()}

    return train(state)


def test_a_worker_joining_a_running_job_loads_what_optimizers_import_before_it_counts_as_started(ray_local):
    """The joining worker would otherwise import torch._dynamo (1.3 s of CPU here) when the user's
    function builds its first torch.optim optimizer, while the members wait for it in the state sync.
    A function that returns without hvd.init() ends an elastic job at once, naming the worker (the
    driver used to wait for it to join an epoch for ever)."""
    discovery = _OneNodeDiscovery(1)

    def grow(record: dict) -> None:
        if record.get("event") == "elastic" and record["state"] == "running":
            discovery.slots = 2  # after the first epoch formed: the second worker joins a running job

    with RayExecutor(_settings(discovery=discovery), min_workers=1, max_workers=2, override_discovery=False) as ex:
        results = ex.run(_grows_to_two, callbacks=[grow])
        assert [r["size"] for r in results] == [2, 2] and {r["first_size"] for r in results} == {1}
        assert sorted(r["loaded"] for r in results) == [False, True]  # the first worker's function imports it
        discovery.slots = 1
        started = time.monotonic()
        with pytest.raises(ElasticJobError, match=r"returned from the training function without joining the job: "
                                                  r"an elastic job's function must call hvd.init\(\)"):
            ex.run(lambda: 1)
        assert time.monotonic() - started < 30


def test_elastic_ray_executor_alias_with_horovod_signature(ray_local):
    settings = ElasticRayExecutor.create_settings(min_num_proc=2, max_num_proc=2, elastic_timeout=30, timeout_s=10)
    assert (settings.elastic_min_workers, settings.elastic_max_workers, settings.elastic_timeout) == (2, 2, 30)
    executor = ElasticRayExecutor(settings, use_gpu=False, cpus_per_slot=1, env_vars={"HVDRAY_TEST_VAR": "x"})
    executor.start()
    try:
        results = executor.run(lambda: _sum_ranks() | {"env": os.environ.get("HVDRAY_TEST_VAR")})
    finally:
        executor.shutdown()
    assert [r["size"] for r in results] == [2, 2] and [r["env"] for r in results] == ["x", "x"]


def test_worker_death_shrinks_the_job_and_runs_reset_callbacks(ray_local, tmp_path):
    """One node: it is the last usable one, so it is not blacklisted; the survivor goes on alone at once
    (min_workers=1), and a replacement may join it later."""
    records = []
    started = time.monotonic()
    with RayExecutor(_settings(), min_workers=1, max_workers=2) as ex:
        results = ex.run(_sum_ranks, args=[str(tmp_path / "died")], callbacks=[records.append])
    assert results[0]["resets"] >= 1 and [r["rank"] for r in results] == list(range(len(results)))
    states = [r["state"] for r in records if r.get("event") == "elastic"]
    assert states[:4] == ["starting", "running", "recovering", "running"], states
    assert states[-2:] == ["finishing", "finished"]
    epoch_2 = [r for r in records if r.get("event") == "elastic" and r["epoch"] == 2][0]
    assert epoch_2["workers"] == 1  # the survivor was not made to wait for a replacement
    assert time.monotonic() - started < 90


def test_an_abandoned_epoch_ends_its_rendezvous_waits_at_once(ray_local):
    """A member died while epoch 1 formed: the driver abandons it, and a survivor waiting in its
    rendezvous gets HorovodInternalError at once (not after timeout_s); nobody is handed that epoch
    any more, and the next epoch is joined as usual."""
    from concurrent.futures import ThreadPoolExecutor

    from hvdray.collective.errors import HorovodInternalError
    from hvdray.collective.topology import WorkerSlot
    from hvdray.driver.coordinator_host import start_job_coordinator
    from hvdray.worker.rendezvous import CoordinatorStore

    job = start_job_coordinator()
    client = job.client
    try:
        slots = [WorkerSlot(node_id="n", hostname="h", ip="127.0.0.1", gpu_ids=()) for _ in range(2)]
        epoch, _, _ = ray.get(client.assign.remote(slots, ["survivor", "dead"]))
        store = CoordinatorStore(client, f"e{epoch}/gen1/", timeout_s=60)
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(store.get, "rank_1")  # the dead member's key never comes
            time.sleep(1.0)
            assert not waiting.done()
            asked = time.monotonic()
            ray.get(client.abandon.remote(epoch))
            with pytest.raises(HorovodInternalError, match="is over"):
                waiting.result(timeout=30)
            assert time.monotonic() - asked < 5
        with pytest.raises(HorovodInternalError):  # new waits on the abandoned epoch end at once too
            store.wait(["rank_1"])
        assert ray.get(client.await_membership.remote("survivor", 0, 0.5)) == ("wait", None)
        epoch_2, infos, _ = ray.get(client.assign.remote(slots[:1], ["survivor"]))
        status, member = ray.get(client.await_membership.remote("survivor", epoch, 5.0))
        assert (status, member[0], member[1].size) == ("member", epoch_2, 1)
    finally:
        job.close()


def _fails_on_rank_1(how: str = "raise", peer_waits: bool = False):
    import sys

    import torch

    import hvdray.torch as hvd

    hvd.init()
    if hvd.rank() == 1:
        if how == "sys.exit":
            sys.exit(4)
        raise KeyError("bad batch")
    if peer_waits:
        hvd.allreduce(torch.ones(2), name="never_submitted_by_rank_1")  # fails: rank 1 left
    return hvd.rank()


@pytest.mark.parametrize("how, error, message", [("raise", KeyError, "bad batch"),
                                                  ("sys.exit", RuntimeError, r"called sys\.exit\(4\) on rank 1")])
def test_user_exception_ends_the_job_with_the_rank(ray_local, how, error, message):
    """The raising rank's own error, also where the peer's allreduce failed because of it in the same
    moment (the driver reported whichever it polled first, often the peer's PeerFinishedError)."""
    with RayExecutor(_settings(), min_workers=2, max_workers=2) as ex:
        for peer_waits in (False, True):
            with pytest.raises(error, match=message) as info:
                ex.run(_fails_on_rank_1, args=[how, peer_waits])
            notes = "".join(getattr(info.value, "__notes__", []))
            assert "rank 1" in notes and "hvd.elastic.run" not in notes  # the user's own error, not a broken ring


def _dies_while_its_peer_broadcasts_outside_run(marker: str):
    """Rank 1 dies (once) while rank 0 waits in a broadcast of its own, before any ``hvd.elastic.run``."""
    import os

    import torch

    import hvdray.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    if hvd.rank() == 1 and not os.path.exists(marker):
        open(marker, "w").close()
        os._exit(1)
    model = torch.nn.Linear(4, 1)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)  # rank 0 waits here for rank 1
    return hvd.rank()


def test_a_loss_during_collectives_outside_elastic_run_ends_the_job_saying_so(ray_local, tmp_path):
    """A ring broken under collectives outside hvd.elastic.run cannot roll back (there is no commit to
    return to, as in Horovod): the job ends within seconds with the survivor's HorovodInternalError, whose note
    names the lost worker and says where the collectives belong; the executor's next run works."""
    from hvdray.collective.errors import HorovodInternalError

    marker = tmp_path / "died"
    with RayExecutor(_settings(), min_workers=1, max_workers=2) as ex:
        with pytest.raises(HorovodInternalError, match="rank 0") as info:
            ex.run(_dies_while_its_peer_broadcasts_outside_run, args=[str(marker)])
        # from the death (the marker is written just before it) to the error: the loss's grace and a
        # loaded machine's slack, not timeout_s after timeout_s
        assert time.time() - marker.stat().st_mtime < 20
        notes = "".join(getattr(info.value, "__notes__", []))
        assert "outside hvd.elastic.run" in notes, notes
        assert re.search(r"the ring broke after the loss of worker \w+ \(rank 1\)", notes), notes
        results = ex.run(_sum_ranks)
    assert sorted(r["rank"] for r in results) == list(range(len(results))) and results[0]["resets"] == 0


def _init_rank():
    import hvdray.torch as hvd

    hvd.init()
    return hvd.rank()


@pytest.mark.parametrize("shape", [{"min_workers": 2, "max_workers": 2}, {"num_workers": 2}], ids=["elastic", "fixed"])
def test_a_missing_network_interface_ends_the_job_at_once_naming_it(ray_local, shape):
    """Every epoch would fail the same way: the job ends with the cause instead of forming epoch after epoch."""
    started = time.monotonic()
    with pytest.raises(NetworkDeviceError, match=r"network interface 'nope0' \(nics\) on node .* whose interfaces are .*lo"):
        with RayExecutor(_settings(nics=["nope0"]), **shape) as ex:
            ex.run(_init_rank)
    assert time.monotonic() - started < 60


def _init_behind_a_firewall():
    """Every Gloo connect fails as if the ports between the workers were blocked (a firewall cannot be
    set up on this machine, so the connect is replaced: the one stand-in of this test)."""
    from hvdray.collective.transport import gloo

    def refused(*args, **kwargs):
        raise RuntimeError("Connection refused (this test's firewall)")

    gloo.GlooGroup.connect = refused  # every Gloo group's connect (a one-node job's setup runs over Gloo)
    return _init_rank()


def test_an_elastic_job_whose_epochs_never_connect_ends_after_elastic_timeout(ray_local):
    started = time.monotonic()
    with pytest.raises(HvdrayError, match=r"no membership epoch could connect for elastic_timeout=8 s.*this test's firewall"):
        with RayExecutor(_settings(), min_workers=2, max_workers=2, elastic_timeout=8) as ex:
            ex.run(_init_behind_a_firewall)
    assert time.monotonic() - started < 8 + 40


def test_a_coordinator_host_still_starting_gets_the_start_budget_not_timeout_s(ray_local, fresh_coordinator_host):
    """A host started for the job may take long to answer its first call (its process imports at a few
    per cent of a core on a busy node, which the starved fault cases meet): here it is frozen (SIGSTOP)
    from the moment its process is up until 15 s later, past timeout_s=10, and the job still runs."""
    import signal

    from ray._private.state import actors as gcs_actors

    ex = RayExecutor(_settings(), min_workers=2, max_workers=2)
    pid = None
    try:
        ex.start()
        host = ex._coordinator.client.handle._actor_id.hex()
        deadline = time.monotonic() + 60
        while pid is None and time.monotonic() < deadline:
            pid = next((a["Pid"] for a in gcs_actors().values() if a["ActorID"] == host and a["State"] == "ALIVE"), None)
            time.sleep(0 if pid else 0.05)
        assert pid, "the coordinator host did not start"
        os.kill(pid, signal.SIGSTOP)
        threading.Timer(15.0, os.kill, (pid, signal.SIGCONT)).start()
        started = time.monotonic()
        assert sorted(ex.run(_init_rank)) == [0, 1]
        assert time.monotonic() - started > 10, "the host answered while frozen"
    finally:
        if pid:
            os.kill(pid, signal.SIGCONT)
        ex.shutdown()


def test_elastic_argument_checks(ray_local):
    with pytest.raises(ValueError, match="override_discovery"):
        RayExecutor(_settings(), min_workers=1, override_discovery=False)
    with pytest.raises(ValueError, match="find_available_hosts_and_slots"):
        _settings(discovery=object())
    ex = RayExecutor(_settings(), min_workers=1, max_workers=2)
    with pytest.raises(ValueError, match="executable_cls"):
        ex.start(executable_cls=dict)
    with pytest.raises(RuntimeError, match="use run"):
        ex.run_remote(_sum_ranks)
    ex.shutdown()


def _commits_until_stopped() -> int:
    import time

    import hvdray.torch as hvd
    from hvdray import ray_logger

    hvd.init()
    state = hvd.elastic.ObjectState(step=0)

    @hvd.elastic.run
    def train(state):
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            state.step += 1
            state.commit()
            ray_logger.log({"kind": "commit", "step": state.step})
            time.sleep(0.2)
        return state.step

    return train(state)


def test_a_coordinator_that_stops_answering_fails_the_job_instead_of_hanging_it(ray_local):
    """The coordinator's process is frozen (SIGSTOP: a starved or wedged process, not a dead one, so Ray
    reports nothing): the driver's next call to it gives up after timeout_s and the job fails naming it."""
    import signal

    from ray._private.state import actors as gcs_actors

    from hvdray.driver.controller import ElasticJobError

    frozen = []

    def freeze(record):
        if record.get("kind") == "commit" and not frozen:
            host = ex._coordinator.client.handle._actor_id.hex()
            pid = next(a["Pid"] for a in gcs_actors().values() if a["ActorID"] == host and a["State"] == "ALIVE")
            os.kill(pid, signal.SIGSTOP)
            frozen.append((pid, time.monotonic()))

    ex = RayExecutor(_settings(), min_workers=2, max_workers=2)
    try:
        with pytest.raises(ElasticJobError, match="coordinator did not answer .* within timeout_s=10"):
            ex.run(_commits_until_stopped, callbacks=[freeze])
        assert frozen and time.monotonic() - frozen[0][1] < 10 + 20
    finally:
        for pid, _ in frozen:
            os.kill(pid, signal.SIGCONT)
        ex.shutdown()
