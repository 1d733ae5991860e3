"""Local and cross ranks on a real multi-node Ray cluster (several raylets on this machine).

The nodes share one IP address, so this also proves ranks are keyed by Ray node id, not by address.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from hvdray import RayExecutor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from local_processes import refused  # noqa: E402 - shared with the end-to-end tests

pytestmark = pytest.mark.slow


def _where_and_reduce():
    import ray
    import torch

    import hvdray.torch as hvd

    hvd.init()
    torch.set_num_threads(1)
    total = hvd.allreduce(torch.tensor([float(hvd.rank())]), op=hvd.Sum).item()
    gathered = hvd.allgather(torch.tensor([hvd.cross_rank()]))
    return {
        "node": ray.get_runtime_context().get_node_id(),
        "rank": hvd.rank(),
        "local": (hvd.local_rank(), hvd.local_size()),
        "cross": (hvd.cross_rank(), hvd.cross_size()),
        "sum": total,
        "cross_of_all": gathered.tolist(),
    }


def test_num_hosts_spreads_and_assigns_local_and_cross_ranks(ray_two_nodes):
    started = time.monotonic()
    settings = RayExecutor.create_settings(timeout_s=30, placement_group_timeout_s=30)
    with RayExecutor(settings, num_hosts=2, num_workers_per_host=2) as ex:
        results = ex.run(_where_and_reduce)
    assert [r["rank"] for r in results] == [0, 1, 2, 3]
    nodes = [r["node"] for r in results]
    assert nodes[0] == nodes[1] and nodes[2] == nodes[3] and nodes[0] != nodes[2]
    assert [r["local"] for r in results] == [(0, 2), (1, 2), (0, 2), (1, 2)]
    assert [r["cross"] for r in results] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    assert all(r["sum"] == 6.0 for r in results)
    assert all(r["cross_of_all"] == [0, 0, 1, 1] for r in results)
    assert time.monotonic() - started < 120


def test_num_workers_packs_onto_one_node_when_it_fits(ray_two_nodes):
    settings = RayExecutor.create_settings(timeout_s=30, placement_group_timeout_s=30)
    with RayExecutor(settings, num_workers=2) as ex:
        results = ex.run(_where_and_reduce)
    assert results[0]["node"] == results[1]["node"]
    assert [r["local"] for r in results] == [(0, 2), (1, 2)]
    assert [r["cross"] for r in results] == [(0, 1), (0, 1)]


def test_num_workers_spills_across_nodes_when_needed(ray_two_nodes):
    settings = RayExecutor.create_settings(timeout_s=30, placement_group_timeout_s=30)
    with RayExecutor(settings, num_workers=3) as ex:
        results = ex.run(_where_and_reduce)
    assert len({r["node"] for r in results}) == 2
    assert sorted(r["local"][1] for r in results) == [1, 2, 2]
    assert all(r["sum"] == 3.0 for r in results)
    # ranks are contiguous per node
    assert results[0]["node"] == results[1]["node"] != results[2]["node"]


def test_the_multi_node_cluster_refuses_a_driver_without_its_token(ray_two_nodes):
    """The raylets of these tests run with Ray's token authentication, as a new local cluster does by
    default: a driver presenting another token is refused."""
    env = dict(os.environ, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN="0" * 32)
    code = f"import ray; ray.init(address={ray_two_nodes.address!r}, log_to_driver=False); print('JOINED')"
    refused([sys.executable, "-c", code], env, refusal="Authentication token is missing or incorrect",
            joined="JOINED")
    assert os.environ.get("RAY_AUTH_MODE") == "token"
