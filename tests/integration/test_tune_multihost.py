"""num_hosts > 1 under Tune on a real multi-node Ray (several raylets on this machine, ray.cluster_utils).

The trial's placement group has one bundle per host (STRICT_SPREAD); the executor's workers fill those
bundles, so each host gets exactly num_slots workers and ranks are contiguous per node.
"""

from __future__ import annotations

import pytest
import ray
from ray import tune

from hvdray.tune import DistributedTrainableCreator, report

pytestmark = pytest.mark.slow


def _where(config):
    import hvdray.torch as hvd

    hvd.init()
    report({
        "nodes": hvd.allgather_object(ray.get_runtime_context().get_node_id()),
        "local": hvd.allgather_object((hvd.local_rank(), hvd.local_size())),
        "cross": hvd.allgather_object((hvd.cross_rank(), hvd.cross_size())),
    })


def test_a_trial_with_two_hosts_puts_num_slots_workers_on_each_of_two_nodes(ray_two_nodes, tmp_path):
    trainable_cls = DistributedTrainableCreator(_where, num_hosts=2, num_slots=2)
    analysis = tune.run(trainable_cls, storage_path=str(tmp_path), name="hosts", verbose=0)
    result = analysis.trials[0].last_result
    nodes = result["nodes"]
    assert nodes[0] == nodes[1] and nodes[2] == nodes[3] and nodes[0] != nodes[2]
    assert [tuple(x) for x in result["local"]] == [(0, 2), (1, 2), (0, 2), (1, 2)]
    assert [tuple(x) for x in result["cross"]] == [(0, 2), (0, 2), (1, 2), (1, 2)]
