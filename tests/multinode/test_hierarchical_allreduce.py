"""Hierarchical allreduce on a real two-node Ray cluster (several raylets on this machine).

Each node's ranks reduce through their own shared-memory segment, the ranks that hold the same local
rank on every node allreduce their part over Gloo, and the nodes' segments give every rank the
result: checked for every dtype and op against numpy, beside the settings and layouts that fall back
to plain Gloo.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import ray
import ray.cloudpickle

from hvdray import RayExecutor
from hvdray.collective.transport import shm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import collective_checks as checks  # noqa: E402 - shared with the single-node test

ray.cloudpickle.register_pickle_by_value(checks)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shm.unsupported_reason() is not None, reason=str(shm.unsupported_reason())),
]


def _settings(**kwargs):
    return RayExecutor.create_settings(timeout_s=30, placement_group_timeout_s=60, shm_buffer_mb=1, **kwargs)


def _where():
    import ray

    checks.init()
    return ray.get_runtime_context().get_node_id(), checks.transport(), checks.mapped_segments()


def test_two_nodes_of_two_ranks_reduce_hierarchically(ray_two_nodes):
    with RayExecutor(_settings(), num_hosts=2, num_workers_per_host=2) as ex:
        where = ex.run(_where)
        assert where[0][0] == where[1][0] != where[2][0] == where[3][0]
        assert [transport for _, transport, _ in where] == ["hierarchical"] * 4
        assert all(len(mapped) == 1 and mapped[0].endswith("(deleted)") for _, _, mapped in where)
        assert where[0][2] != where[2][2]  # one segment per node
        results = ex.run(checks.every_dtype_op_and_size)
        assert [failures for _, failures in results] == [[]] * 4
        assert ex.run(checks.gather_and_broadcast) == [[]] * 4  # these take Gloo across nodes
        tag = ex.run(checks.job_files)[0][0]
    assert [f for f in checks.os.listdir(shm.SHM_DIR) if tag in f] == []


@pytest.mark.parametrize(
    "layout,settings,expected",
    [
        ({"num_workers": 3}, {}, "gloo"),  # 2 + 1 ranks: nodes differ, so plain Gloo
        ({"num_hosts": 2, "num_workers_per_host": 2}, {"hierarchical_allreduce": False}, "gloo"),
        ({"num_hosts": 2, "num_workers_per_host": 2}, {"shm_transport": False}, "gloo"),
    ],
    ids=["uneven-nodes", "hierarchical-off", "shm-off"],
)
def test_layouts_and_settings_that_use_plain_gloo(ray_two_nodes, layout, settings, expected):
    with RayExecutor(_settings(**settings), **layout) as ex:
        where = ex.run(_where)
        assert [transport for _, transport, _ in where] == [expected] * ex.num_workers
        results = ex.run(checks.every_dtype_op_and_size)
        assert [failures for _, failures in results] == [[]] * ex.num_workers
