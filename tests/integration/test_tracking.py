"""Tracking callbacks, read back with each library's own reader: TensorBoard event files (tensorboard's
``EventAccumulator``), an MLflow file store (``MlflowClient``) and a W&B offline run (its transaction log).

* on their own: rank 0's numbers at the record's step (nested keys flattened), other ranks' records,
  elastic events, booleans and records without the step key left out;
* in a fixed run and in an elastic run: ``hvdray.report`` from every rank, written once per rank-0 report;
* bad arguments and a missing library: clear errors.
"""

from __future__ import annotations

import glob
import json
import struct
import sys
import time

import pytest
import ray.cloudpickle

import hvdray
from hvdray import MLflowCallback, RayExecutor, TensorBoardCallback, WandbCallback

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

KINDS = ["tensorboard", "mlflow", "wandb"]


@pytest.fixture
def tracking_env(tmp_path, monkeypatch):
    """Offline W&B with its files under tmp_path; MLflow's file store allowed (MLflow 3 asks for the opt-in)."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for name in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home"))
    (tmp_path / "wandb-home").mkdir()
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    return tmp_path


def _make(kind: str, where, **kwargs):
    if kind == "tensorboard":
        pytest.importorskip("tensorboardX")
        return TensorBoardCallback(str(where / "tb"), **kwargs)
    if kind == "mlflow":
        pytest.importorskip("mlflow")
        return MLflowCallback(tracking_uri=f"file://{where}/mlruns", experiment_name="hvdray-test", **kwargs)
    pytest.importorskip("wandb")
    return WandbCallback(project="hvdray-test", dir=str(where / "wb"), **kwargs)


def _read_back(kind: str, callback, where) -> dict[str, list[tuple[int, float]]]:
    """{metric: [(step, value), ...]} as the library stored them."""
    if kind == "tensorboard":
        event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
        accumulator = event_accumulator.EventAccumulator(str(where / "tb"))
        accumulator.Reload()
        return {tag: [(s.step, pytest.approx(s.value)) for s in accumulator.Scalars(tag)]
                for tag in accumulator.Tags()["scalars"]}
    if kind == "mlflow":
        import mlflow

        client = mlflow.MlflowClient(f"file://{where}/mlruns")
        run = client.get_run(callback.run_id)
        assert run.info.status == "FINISHED"
        return {name: [(m.step, m.value) for m in client.get_metric_history(callback.run_id, name)]
                for name in run.data.metrics}
    return _wandb_history(where)


def _wandb_history(where) -> dict[str, list[tuple[int, float]]]:
    """The history records of the one offline run under ``where/wb``, from its transaction log. wandb's
    service process writes the log on its own after ``finish()`` returns: wait for the run's exit record."""
    (path,) = glob.glob(str(where / "wb" / "wandb" / "offline-run-*" / "run-*.wandb"))
    deadline = time.monotonic() + 60
    while True:
        records = _wandb_records(path)
        if any(record.WhichOneof("record_type") == "exit" for record in records) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    history: dict[str, list[tuple[int, float]]] = {}
    for record in records:
        if record.WhichOneof("record_type") == "history":
            items = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in record.history.item}
            step = items.pop("_step")
            for name, value in items.items():
                if not name.startswith("_"):
                    history.setdefault(name, []).append((step, value))
    return history


def _wandb_records(path: str) -> list:
    """The protobuf records of a W&B transaction log: a LevelDB-style log (a 7-byte file header, 32 KiB
    blocks, each record piece behind a 7-byte header: checksum, length, type FULL/FIRST/MIDDLE/LAST)."""
    from wandb.proto import wandb_internal_pb2

    data = open(path, "rb").read()
    if len(data) < 7:
        return []
    assert struct.unpack("<4sHB", data[:7])[:2] == (b":W&B", 0xBEE1)
    records, pos, pending = [], 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # too little room for a header: the block is padded
            pos += 32768 - pos % 32768
            continue
        _checksum, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if (kind == 0 and length == 0) or pos + 7 + length > len(data):  # the end, or a record being written
            break
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


@pytest.mark.parametrize("kind", KINDS)
def test_a_callback_writes_rank_0s_numbers_at_their_step(kind, tracking_env):
    callback = _make(kind, tracking_env, step_key="epoch")
    with callback:
        for epoch in (1, 2, 3):
            callback({"rank": 0, "epoch": epoch, "loss": 1 / epoch, "val": {"acc": epoch / 10}, "best": True,
                      "note": "text"})
        callback({"rank": 1, "epoch": 4, "loss": 99.0})  # another rank
        callback({"event": "elastic", "state": "running", "epoch": 5, "workers": 2})  # the driver's own record
        callback({"rank": 0, "loss": 42.0})  # no step
    assert callback.written == 3
    assert _read_back(kind, callback, tracking_env) == {
        "loss": [(1, 1.0), (2, 0.5), (3, pytest.approx(1 / 3))],
        "val/acc": [(1, pytest.approx(0.1)), (2, pytest.approx(0.2)), (3, pytest.approx(0.3))],
    }


def _train_and_report(epochs: int) -> int:
    import torch

    import hvdray.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    for epoch in range(epochs):
        loss = hvd.allreduce(torch.tensor(float(epoch * (hvd.rank() + 1)))).item()  # rank 0: 1.5 * epoch
        hvdray.report({"epoch": epoch, "loss": loss if hvd.rank() == 0 else -1.0})
    return hvd.rank()


def _elastic_train_and_report(epochs: int) -> int:
    import hvdray.torch as hvd

    hvd.init()
    state = hvd.elastic.ObjectState(epoch=0)

    @hvd.elastic.run
    def train(state):
        while state.epoch < epochs:
            hvdray.report({"epoch": state.epoch, "loss": 1.5 * state.epoch if hvd.rank() == 0 else -1.0})
            state.epoch += 1
            state.commit()
        return hvd.rank()

    return train(state)


@pytest.mark.parametrize("elastic", [False, True], ids=["fixed", "elastic"])
def test_runs_write_rank_0s_reports_to_every_tracker(ray_local, tracking_env, elastic):
    callbacks = {kind: _make(kind, tracking_env) for kind in KINDS}  # no step_key: one step per report
    settings = RayExecutor.create_settings(timeout_s=20, placement_group_timeout_s=60, discovery_interval_s=0.5)
    size = dict(min_workers=2, max_workers=2) if elastic else dict(num_workers=2)
    fn = _elastic_train_and_report if elastic else _train_and_report
    with RayExecutor(settings, **size) as executor:
        assert sorted(executor.run(fn, args=[3], callbacks=list(callbacks.values()))) == [0, 1]
    for kind, callback in callbacks.items():
        callback.close()
        found = _read_back(kind, callback, tracking_env)
        assert found.get("loss") == [(0, 0.0), (1, 1.5), (2, 3.0)], (kind, found)
        assert found["epoch"] == [(0, 0.0), (1, 1.0), (2, 2.0)], kind


def test_bad_arguments_and_a_missing_library_are_clear(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="step_key"):
        TensorBoardCallback(str(tmp_path), step_key="")
    with pytest.raises(ValueError, match="rank"):
        TensorBoardCallback(str(tmp_path), rank=-1)
    with pytest.raises(ValueError, match="logdir"):
        TensorBoardCallback("")
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if it were not installed
    with pytest.raises(ImportError, match=r"WandbCallback needs wandb: pip install \"hvdray\[tracking\]\""):
        WandbCallback()


def _trial(config):
    import hvdray.torch as hvd

    hvd.init()
    for epoch in range(config["epochs"]):
        hvdray.report({"epoch": epoch, "loss": 1.5 * epoch if hvd.rank() == 0 else -1.0})


def test_in_tune_ray_s_own_tracking_callbacks_get_the_reports(ray_local, tracking_env):
    """Inside a trial ``hvdray.report`` feeds Tune, so Ray's own tracking callbacks (TensorBoard, MLflow,
    W&B offline, passed explicitly) write rank 0's reports: read back with each library."""
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    pytest.importorskip("mlflow")
    pytest.importorskip("wandb")
    import mlflow
    from ray import tune
    from ray.air.integrations.mlflow import MLflowLoggerCallback
    from ray.air.integrations.wandb import WandbLoggerCallback
    from ray.tune.logger import TBXLoggerCallback

    from hvdray.tune import DistributedTrainableCreator

    tmp_path = tracking_env
    trainable = DistributedTrainableCreator(_trial, num_hosts=1, num_slots=2)
    callbacks = [
        TBXLoggerCallback(),
        MLflowLoggerCallback(tracking_uri=f"file://{tmp_path}/mlruns", experiment_name="hvdray-tune"),
        WandbLoggerCallback(project="hvdray-tune", mode="offline", dir=str(tmp_path / "wb")),
    ]
    analysis = tune.run(trainable, config={"epochs": 3}, storage_path=str(tmp_path), name="tracked", verbose=0,
                        callbacks=callbacks)
    (trial,) = analysis.trials
    accumulator = event_accumulator.EventAccumulator(trial.local_path)
    accumulator.Reload()
    assert [(s.step, s.value) for s in accumulator.Scalars("ray/tune/loss")] == [(1, 0.0), (2, 1.5), (3, 3.0)]
    client = mlflow.MlflowClient(f"file://{tmp_path}/mlruns")
    (run,) = client.search_runs([client.get_experiment_by_name("hvdray-tune").experiment_id])
    assert [m.value for m in sorted(client.get_metric_history(run.info.run_id, "loss"), key=lambda m: m.step)] \
        == [0.0, 1.5, 3.0]
    assert [value for _, value in _wandb_history(tmp_path)["loss"]] == [0.0, 1.5, 3.0]
