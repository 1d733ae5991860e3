"""Keras/TensorFlow elastic states on one process (a size-1 job, no Ray): commit, restore, sync, callbacks."""

from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

import hvdray.keras as hvd  # noqa: E402
import hvdray.tensorflow as hvd_tf  # noqa: E402


@pytest.fixture(autouse=True)
def size_one_job():
    hvd.init()
    yield
    hvd.shutdown()


def _model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss="mse")
    return model


def _values(variables):
    return [np.array(v.numpy()) for v in variables]


def test_keras_state_rolls_back_weights_optimizer_slots_and_attributes():
    model = _model()
    x, y = np.ones((4, 3), np.float32), np.zeros((4, 1), np.float32)
    state = hvd.elastic.KerasState(model, epoch=0)
    model.fit(x, y, epochs=1, verbose=0)
    state.epoch = 1
    state.commit()
    committed = _values(model.variables) + _values(model.optimizer.variables)
    model.fit(x, y, epochs=2, verbose=0)
    state.epoch = 3
    assert not np.allclose(committed[0], model.variables[0].numpy())
    state.restore()
    assert state.epoch == 1
    now = _values(model.variables) + _values(model.optimizer.variables)
    assert all(np.array_equal(a, b) for a, b in zip(committed, now))


def test_keras_state_sync_builds_the_optimizer_of_a_fresh_worker():
    model = _model()
    state = hvd.elastic.KerasState(model, epoch=0)
    assert not model.optimizer.built
    state.sync()
    assert model.optimizer.built


def test_commit_callbacks_during_fit():
    model = _model()
    state = hvd.elastic.KerasState(model, epoch=0, batch=0)
    x, y = np.ones((8, 3), np.float32), np.zeros((8, 1), np.float32)
    commits = []
    original = state.commit
    state.commit = lambda: (commits.append(state.epoch), original())
    model.fit(x, y, batch_size=2, epochs=2, verbose=0, callbacks=[
        hvd.elastic.UpdateBatchStateCallback(state), hvd.elastic.UpdateEpochStateCallback(state),
        hvd.elastic.CommitStateCallback(state, batches_per_commit=2),
    ])
    assert state.epoch == 2 and state.batch == 0
    assert len(commits) == 2 * (4 // 2) + 2  # every second batch, plus each epoch's end
    with pytest.raises(ValueError, match="batches_per_commit"):
        hvd.elastic.CommitStateCallback(state, batches_per_commit=0)


def test_tensorflow_state_with_plain_variables():
    v = tf.Variable([1.0, 2.0])
    state = hvd_tf.elastic.TensorFlowState([v], step=0)
    v.assign([5.0, 5.0])
    state.step = 4
    state.restore()
    assert v.numpy().tolist() == [1.0, 2.0] and state.step == 0
    state.sync()
    with pytest.raises(ValueError, match="session"):
        hvd_tf.elastic.TensorFlowState([v], session=object())
    with pytest.raises(TypeError, match="Keras model"):
        hvd.elastic.KerasState(object())
