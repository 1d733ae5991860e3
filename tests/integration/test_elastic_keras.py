"""An elastic Keras job on a local Ray instance: KerasState syncs differently initialised workers, and
``model.fit`` survives a worker dying mid-epoch (the peer failure surfaces inside Keras' compiled
train step)."""

from __future__ import annotations

import time

import pytest

from hvdray import RayExecutor

pytest.importorskip("tensorflow")


def _fit(epochs: int, marker: str) -> dict:
    import os

    import keras
    import numpy as np
    import tensorflow as tf
    import torch

    import hvdray.keras as hvd

    tf.config.threading.set_inter_op_parallelism_threads(1)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    torch.set_num_threads(1)
    hvd.init()
    keras.utils.set_random_seed(hvd.rank())  # different starting weights: sync must make them equal
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.9)), loss="mse",
                  jit_compile=False)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    state = hvd.elastic.KerasState(model, epoch=0, sizes=[])
    first_weights = []

    class Die(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if state.epoch == 1 and batch == 2 and hvd.rank() == 1 and not os.path.exists(marker):
                open(marker, "w").close()
                os._exit(1)

    class Sizes(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            state.sizes.append(hvd.size())

    @hvd.elastic.run
    def train(state):
        if not first_weights:  # after the first sync: every rank holds rank 0's weights
            mine = np.concatenate([w.ravel() for w in model.get_weights()]).tolist()
            first_weights.extend(hvd.allgather_object(mine))
        model.fit(x, y, batch_size=8, epochs=epochs, initial_epoch=state.epoch, verbose=0, callbacks=[
            Die(), Sizes(), hvd.elastic.UpdateEpochStateCallback(state), hvd.elastic.CommitStateCallback(state, 4),
        ])
        return state.epoch

    final_epoch = train(state)
    return {"rank": hvd.rank(), "epoch": final_epoch, "sizes": state.sizes, "first_synced": first_weights}


def test_keras_fit_survives_a_worker_death(ray_local, tmp_path):
    started = time.monotonic()
    records = []
    settings = RayExecutor.create_settings(timeout_s=20, placement_group_timeout_s=60, discovery_interval_s=0.5)
    with RayExecutor(settings, min_workers=1, max_workers=2) as ex:
        ex.start(extra_env_vars={"TF_CPP_MIN_LOG_LEVEL": "2"})
        results = ex.run(_fit, args=[3, str(tmp_path / "died")], callbacks=[records.append])
    assert (tmp_path / "died").exists()
    [survivor] = results  # one node: the dead worker's node stays blacklisted, the job goes on with one
    assert survivor["epoch"] == 3
    assert survivor["sizes"] == [2, 1, 1]  # epoch 0 on two workers; epoch 1 re-run after the rollback
    first = survivor["first_synced"]
    assert len(first) == 2 and first[0] == first[1]  # seeded differently, equal after KerasState's sync
    states = [r["state"] for r in records if r.get("event") == "elastic"]
    assert "recovering" in states and states[-1] == "finished"
    assert time.monotonic() - started < 120
