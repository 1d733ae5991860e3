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


def _checkpoint_on_every_rank(config):
    import os
    import tempfile

    import ray.train

    import hvdray
    import hvdray.torch as hvd

    hvd.init()
    node = ray.get_runtime_context().get_node_id()
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "node.txt"), "w") as f:
            f.write(node)
        hvdray.report({"node": node, "rank": hvd.rank()}, checkpoint=ray.train.Checkpoint.from_directory(tmp))


def test_rank_zero_on_another_node_persists_the_trials_checkpoint_into_tunes_storage(ray_two_nodes, tmp_path):
    """The Trainable sits on the head (its empty bundle, STRICT_SPREAD), rank 0 on a worker node: rank 0
    copies its checkpoint to the storage_path itself (reachable from every node here: one machine)."""
    tuner = tune.Tuner(
        DistributedTrainableCreator(_checkpoint_on_every_rank, num_hosts=2, num_slots=1),
        run_config=tune.RunConfig(storage_path=str(tmp_path), name="ckpt", verbose=0),
    )
    result = tuner.fit()[0]
    assert result.error is None and result.metrics["rank"] == 0
    assert result.checkpoint.path.startswith(str(tmp_path / "ckpt")) and result.checkpoint.path.endswith("checkpoint_000000")
    with open(f"{result.checkpoint.path}/node.txt") as f:
        written_on = f.read()
    assert written_on == result.metrics["node"] != ray_two_nodes.head_node.node_id
