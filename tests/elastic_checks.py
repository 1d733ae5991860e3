"""Shared by the elastic multi-node tests: the cluster fixture, a small elastic training job, a recorder
of worker records and driver transitions, and the invariants every elastic run must keep."""

from __future__ import annotations

import time
from typing import Any, Optional

import pytest
import ray
from ray.cluster_utils import Cluster
from ray._private.state import actors as gcs_actors

from hvdray import RayExecutor
from hvdray.testing import faults

EPOCHS = 6


@pytest.fixture(scope="module")
def cluster():
    """A head with no CPUs (driver and coordinator only) and worker nodes added per test."""
    if ray.is_initialized():
        ray.shutdown()
    # fast health checks: a removed raylet is reported dead in about a second, not fifteen
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 0,
            "_system_config": {"health_check_period_ms": 300, "health_check_failure_threshold": 3,
                               "health_check_initial_delay_ms": 0},
        },
    )
    ray.init(address=cluster.address)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def worker_nodes(cluster: Cluster) -> list[Any]:
    return [n for n in cluster.list_all_nodes() if n is not cluster.head_node]


def use_nodes(cluster: Cluster, count: int) -> None:
    """Exactly ``count`` alive 1-CPU worker nodes, and Ray's view agrees (dead ones reported dead)."""
    nodes = worker_nodes(cluster)
    for node in nodes[count:]:
        cluster.remove_node(node, allow_graceful=False)
    for _ in range(count - len(nodes)):
        cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    wanted = {n.node_id for n in worker_nodes(cluster)}
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        alive = {n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU")}
        # the GCS actor table: the state API (list_actors) needs the dashboard, which a loaded machine starts late
        leftovers = [a["ActorID"] for a in gcs_actors().values()
                     if a["State"] == "ALIVE" and a["ActorClassName"].endswith("Worker")]
        if alive == wanted and not leftovers:
            return
        time.sleep(0.2)
    raise AssertionError(f"Ray reports nodes {alive} alive (expected {wanted}) and worker actors {leftovers} alive")


def remove_node_of(cluster: Cluster, node_id: str) -> None:
    node = next(n for n in worker_nodes(cluster) if n.node_id == node_id)
    cluster.remove_node(node, allow_graceful=False)


def cluster_responder(cluster: Cluster, directory: str) -> faults.Responder:
    """The test's side of the fault planned in ``directory``: it removes the blocked worker's node from
    ``cluster``, or adds a 1-CPU node there."""
    return faults.Responder(directory, lambda node_id: remove_node_of(cluster, node_id),
                            lambda: cluster.add_node(num_cpus=1))


def train_job(epochs: int, die: Optional[tuple[int, int, str]] = None,
              hold: Optional[tuple] = None, until: Optional[tuple[str, int, float]] = None) -> dict[str, Any]:
    """A small elastic job. ``die=(epoch, rank, marker)``: that rank exits mid-epoch once.
    ``hold=(epoch, size, seconds[, stop_file])``: before that epoch, commit (without training) until the
    job has ``size`` workers (or ``stop_file`` exists), so a joining node is waited for instead of raced.
    ``until=(path, size, seconds)``: train until the ranks agree (at a commit) that ``path`` exists in an
    epoch of ``size`` workers or more, or that a rank has trained ``seconds``, then ``epochs`` epochs more:
    a chain of faults sets the job's length (and one that stalls ends it, for the test to say which)."""
    import os
    import time

    import ray
    import torch

    import hvdray.torch as hvd
    from hvdray import ray_logger
    from hvdray.testing import faults

    torch.set_num_threads(1)
    hvd.init()
    torch.manual_seed(7)
    model = torch.nn.Linear(8, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                   named_parameters=model.named_parameters())
    # the epoch to stop at (set once ``until`` holds, and committed with the rest of the state)
    state = hvd.elastic.TorchState(model, opt, epoch=0, completed=[], sizes=[], last=None if until else epochs)
    node = ray.get_runtime_context().get_node_id()
    pid = os.getpid()
    started = time.monotonic()

    @hvd.elastic.run
    def train(state):
        ray_logger.log({"kind": "start", "epoch": state.epoch, "pid": pid, "node": node, "size": hvd.size()})
        while state.last is None or state.epoch < state.last:
            if hold is not None and state.epoch == hold[0]:
                deadline = time.monotonic() + hold[2]
                stop_file = hold[3] if len(hold) > 3 else None
                while hvd.size() < hold[1] and time.monotonic() < deadline \
                        and not (stop_file and os.path.exists(stop_file)):
                    time.sleep(0.2)
                    state.commit()  # raises HostsUpdatedInterrupt once the new worker is ready
            for batch in range(4):
                gen = torch.Generator().manual_seed(state.epoch * 100 + batch * 10 + hvd.rank())
                x = torch.randn(16, 8, generator=gen)
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True)).backward()
                opt.step()
                faults.reached("step")
                if die is not None and (state.epoch, batch, hvd.rank()) == (die[0], 2, die[1]) \
                        and not os.path.exists(die[2]):
                    open(die[2], "w").close()
                    os._exit(1)
            time.sleep(0.3)
            state.completed.append(state.epoch)
            state.sizes.append(hvd.size())
            state.epoch += 1
            if state.last is None:
                seen = float((os.path.exists(until[0]) and hvd.size() >= until[1])
                             or time.monotonic() - started > until[2])
                if hvd.allreduce(torch.tensor([seen]), op=hvd.Max, name="until").item():
                    state.last = state.epoch + epochs
            state.commit()
            ray_logger.log({"kind": "commit", "epoch": state.epoch - 1, "pid": pid, "node": node,
                            "size": hvd.size()})
        params = torch.cat([p.detach().flatten() for p in model.parameters()])
        return {"rank": hvd.rank(), "completed": list(state.completed), "sizes": list(state.sizes),
                "params": params.tolist()}

    return train(state)


class Recorder:
    """Collects worker records and driver transitions; ``on`` runs an action once a record matches."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []
        self._actions: list[tuple[Any, Any]] = []

    def on(self, match, action) -> None:
        self._actions.append((match, action))

    def at_commit(self, epoch: int, action) -> None:
        """Run ``action()`` once rank 0 has committed ``epoch``."""
        self.on(lambda r: r.get("kind") == "commit" and r["rank"] == 0 and r["epoch"] == epoch, lambda r: action())

    def __call__(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        for entry in list(self._actions):
            if entry[0](record):
                self._actions.remove(entry)
                entry[1](record)

    def node_of_rank(self, rank: int) -> str:
        """The node where ``rank`` (re)started training last."""
        return [r["node"] for r in self.records if r.get("kind") == "start" and r["rank"] == rank][-1]

    def transitions(self) -> list[dict[str, Any]]:
        return [r for r in self.records if r.get("event") == "elastic"]


def check_invariants(results: list[dict[str, Any]], recorder: Recorder, epochs: int = EPOCHS) -> None:
    ranks = [r["rank"] for r in results]
    # the results of the members of the last epoch that returned, in rank order: a member lost after the
    # last commit (its node removed there) leaves a gap, with training complete and nothing lost
    assert ranks == sorted(set(ranks)) and ranks[0] == 0 and len(ranks) >= 1, ranks
    assert len(ranks) == results[0]["sizes"][-1] or len(ranks) == results[0]["sizes"][-1] - 1, (ranks, results[0])
    assert results[0]["completed"] == list(range(epochs)), results[0]["completed"]
    assert all(r["completed"] == results[0]["completed"] for r in results)
    assert all(r["params"] == results[0]["params"] for r in results), "ranks ended with different parameters"
    # no committed epoch lost: a process (re)starts training only after every epoch it had committed
    committed: dict[int, int] = {}
    for record in recorder.records:
        if record.get("kind") == "commit":
            committed[record["pid"]] = max(committed.get(record["pid"], -1), record["epoch"])
        elif record.get("kind") == "start" and record["pid"] in committed:
            assert record["epoch"] > committed[record["pid"]], (record, committed[record["pid"]])


def elastic_executor(**kwargs: Any) -> RayExecutor:
    settings = RayExecutor.create_settings(timeout_s=10, placement_group_timeout_s=60, discovery_interval_s=0.5)
    return RayExecutor(settings, cpus_per_worker=1, **kwargs)


