"""The rendezvous is closed to anyone without the job's token.

A job runs; a second Ray driver (another process connected to the same cluster, as a stranger on a
shared cluster would be) finds the actor that holds the job's coordinator (its first worker, or the
driver's coordinator host) by listing named actors in every namespace, and tries everything the
rendezvous offers: reading, writing, adding to, deleting and waiting on keys, forming a new
membership, reading the workers' logs, closing the job, and building a Gloo group on the job's store.
Every attempt is refused with ``PermissionError``; the job goes on undisturbed.
Gloo's listening sockets bind to the node's address, not to every interface.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import ray.cloudpickle

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

OUTSIDER = textwrap.dedent(
    """
    import json, sys
    import ray

    ray.init(address=sys.argv[1], namespace="outsider", log_to_driver=False)
    name, namespace = next(
        (a["name"], a["namespace"]) for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"] == sys.argv[2]
    )
    coordinator = ray.get_actor(name, namespace=namespace)
    call = coordinator.call.remote
    attempts = {
        "kv_get": lambda: call(b"guess", "kv_get", "e1/gen1/rank_0", 1.0),
        "kv_get_key_as_token": lambda: call("e1/gen1/rank_0", "kv_get", "e1/gen1/rank_0", 1.0),
        "kv_set": lambda: call(b"x" * 32, "kv_set", "e1/gen1/rank_0", b"evil"),
        "kv_add": lambda: call(b"x" * 32, "kv_add", "e1/gen1/counter", 1),
        "kv_wait": lambda: call(b"x" * 32, "kv_wait", ["e1/gen1/rank_0"], 30.0),
        "kv_read": lambda: call(b"x" * 32, "kv_read", ["e1/gen1/rank_0"], 30.0),
        "kv_check": lambda: call(b"", "kv_check", ["e1/gen1/rank_0"]),
        "kv_delete": lambda: call(None, "kv_delete", "e1/gen1/rank_0"),
        "assign": lambda: call(b"x" * 32, "assign", []),
        "abandon": lambda: call(b"x" * 32, "abandon", 1),
        "records": lambda: call(b"x" * 32, "records", None, 0.0),
        "push_log": lambda: call(b"x" * 32, "push_log", 0, {"message": "evil"}),
        "private_method": lambda: call(b"x" * 32, "_clear_kv"),
    }
    outcome = {}
    ray.get(coordinator.close_job.remote(b"x" * 32), timeout=20)  # a token of no job closes nothing
    for label, attempt in attempts.items():
        try:
            ray.get(attempt(), timeout=20)
            outcome[label] = "answered"
        except Exception as exc:  # noqa: BLE001
            outcome[label] = type(exc.cause if hasattr(exc, "cause") and exc.cause else exc).__name__ + ": " + str(exc)[-200:]

    # building a Gloo group on the job's store: the store's first call is refused
    from hvdray.driver.coordinator_host import CoordinatorClient
    from hvdray.worker.rendezvous import CoordinatorStore
    from hvdray.collective.transport import Communicator
    try:
        store = CoordinatorStore(CoordinatorClient(coordinator, b"y" * 32), "e1/gen1/", 5.0)
        Communicator(store, 1, 2, timeout_s=5.0)
        outcome["join_ring"] = "joined"
    except Exception as exc:  # noqa: BLE001
        outcome["join_ring"] = type(exc).__name__ + ": " + str(exc)[-200:]
    print("OUTCOME " + json.dumps(outcome))
    """
)


def _train_steps(steps: int) -> list[float]:
    import torch

    import hvdray.torch as hvd

    hvd.init()
    return [float(hvd.allreduce(torch.ones(2) * step, name="steady", op=hvd.Sum)[0]) for step in range(steps)]


def _gloo_listen_addresses() -> list[str]:
    """The local addresses of the listening TCP sockets this worker opened in ``hvd.init()`` (Gloo's)."""
    import os

    import psutil

    import hvdray.torch as hvd

    def listening() -> set[tuple[str, int]]:
        conns = psutil.Process(os.getpid()).net_connections(kind="tcp")
        return {(c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN}

    before = listening()
    hvd.init()
    return sorted({ip for ip, _ in listening() - before})


def test_outsider_cannot_read_write_block_or_join(make_executor, tmp_path, coordinator_place):
    executor = make_executor(num_workers=2)
    assert executor.run(_train_steps, args=[3]) == [[0.0, 2.0, 4.0]] * 2
    # the actor that holds the job's table: its first worker, or the driver's coordinator host
    from ray._private.state import actors as gcs_actors

    holder = gcs_actors()[executor._group.coordinator.handle._actor_id.hex()]["Name"]
    expected = (f"hvdray-{executor._id}-rank-0" if coordinator_place == "first worker"
                else f"hvdray-coordinator-{os.getpid()}-")
    assert holder.startswith(expected), holder

    script = tmp_path / "outsider.py"
    script.write_text(OUTSIDER)
    address = ray.get_runtime_context().gcs_address
    done = subprocess.run(
        [sys.executable, str(script), address, holder], capture_output=True, text=True, timeout=180
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("OUTCOME ")]
    assert lines, f"the outsider script did not finish:\n{done.stdout}\n{done.stderr}"
    outcome = json.loads(lines[-1][len("OUTCOME "):])
    for label, result in outcome.items():
        assert "PermissionError" in result, f"{label}: {result}"

    # the job is undisturbed: its keys, membership and ring still work
    assert executor.run(_train_steps, args=[3]) == [[0.0, 2.0, 4.0]] * 2


def test_gloo_listens_on_the_node_address_only(make_executor):
    executor = make_executor(num_workers=2)
    node_ip = ray.util.get_node_ip_address()
    for addresses in executor.run(_gloo_listen_addresses):
        assert addresses, "hvd.init() opened no listening socket"
        assert addresses == [node_ip], f"Gloo listens on {addresses}, not only on the node address {node_ip}"
