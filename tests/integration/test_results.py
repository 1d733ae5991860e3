"""``hvdray.report`` outside Tune: ``executor.result`` is a ``ray.train.Result`` built from rank 0's
reports, with its checkpoints copied to ``<storage_path>/checkpoint_<n>``.

* a fixed run: per-rank return values as before, rank 0's last metrics, every report in a DataFrame
  (nested keys flattened), the latest and every kept checkpoint readable from storage; rank 1's reports
  and checkpoints are dropped; a second run on the same path goes on numbering;
* ``CheckpointConfig(num_to_keep=1, checkpoint_score_attribute=...)``: only the best is a best
  checkpoint, the others are deleted from storage except the latest (Ray Train's rule);
* a run that fails after two checkpoints: ``result.error`` is what ``run`` raised, and both checkpoints
  are still in the result;
* an elastic run reports the same way;
* bad arguments: a storage_path that is a file or an unknown URI, a storage_path that disagrees with the
  setting, a checkpoint_config of the wrong type or without storage, a checkpoint reported without
  storage: each a clear error naming the argument.
"""

from __future__ import annotations

import os
import sys
import time

import pytest
import ray.cloudpickle
from ray.train import Checkpoint, CheckpointConfig, Result

import hvdray
from hvdray import MetricsHistory, RayExecutor

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _report_epochs(epochs: int, scores=None, fail_after=None) -> int:
    """Every rank reports each epoch; rank 0's checkpoint holds the epoch, rank 1's says "rank 1"."""
    import tempfile

    import torch

    import hvdray.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    for epoch in range(epochs):
        loss = float(hvd.allreduce(torch.tensor(float(epoch + hvd.rank()))).item())
        with tempfile.TemporaryDirectory() as tmp:
            with open(os.path.join(tmp, "state.txt"), "w") as f:
                f.write(f"epoch {epoch}" if hvd.rank() == 0 else f"rank {hvd.rank()}")
            metrics = {"epoch": epoch, "loss": loss, "reporter": hvd.rank(), "val": {"acc": epoch / 10}}
            if scores is not None:
                metrics["score"] = scores[epoch]
            hvdray.report(metrics, checkpoint=Checkpoint.from_directory(tmp))
        if fail_after is not None and epoch + 1 == fail_after:
            hvd.barrier()  # rank 0's reports were made before rank 1 fails
            if hvd.rank() == 1:
                raise ValueError("bad batch on rank 1")
    return hvd.rank()


def _read(checkpoint: Checkpoint) -> str:
    with checkpoint.as_directory() as path:
        with open(os.path.join(path, "state.txt")) as f:
            return f.read()


def test_a_run_gives_rank_0s_metrics_history_and_checkpoints(make_executor, tmp_path):
    storage = tmp_path / "run"
    executor = make_executor(num_workers=2, storage_path=str(storage))
    assert executor.result is None
    history = MetricsHistory()
    assert executor.run(_report_epochs, args=[3], callbacks=[history]) == [0, 1]  # per-rank values, as before

    result = executor.result
    assert isinstance(result, Result)
    assert result.error is None and result.path == str(storage)
    assert result.metrics == {"epoch": 2, "loss": 2.5, "reporter": 0, "val": {"acc": 0.2}}
    frame = result.metrics_dataframe
    assert list(frame["epoch"]) == [0, 1, 2] and list(frame["reporter"]) == [0, 0, 0]  # rank 1's dropped
    assert list(frame["val/acc"]) == [0.0, 0.1, 0.2]
    assert result.checkpoint.path == str(storage / "checkpoint_000002")
    assert _read(result.checkpoint) == "epoch 2"
    assert [_read(c) for c, _ in result.best_checkpoints] == ["epoch 0", "epoch 1", "epoch 2"]
    assert [m["epoch"] for _, m in result.best_checkpoints] == [0, 1, 2]
    assert sorted(os.listdir(storage)) == ["checkpoint_000000", "checkpoint_000001", "checkpoint_000002"]
    if hasattr(result, "return_value"):  # Ray Train v2's Result
        assert result.return_value == 0
    # the callbacks see the same reports as records
    assert [(row["epoch"], row["rank"]) for row in history.rows] == [(0, 0), (1, 0), (2, 0)]

    executor.run(_report_epochs, args=[1])  # a second run: a new result, numbering goes on
    assert executor.result.checkpoint.path == str(storage / "checkpoint_000003")
    assert list(executor.result.metrics_dataframe["epoch"]) == [0]


def test_num_to_keep_keeps_the_best_and_the_latest(make_executor, tmp_path):
    storage = tmp_path / "best"
    config = CheckpointConfig(num_to_keep=1, checkpoint_score_attribute="score", checkpoint_score_order="max")
    executor = make_executor(num_workers=2, storage_path=str(storage), checkpoint_config=config)
    executor.run(_report_epochs, args=[4], kwargs={"scores": [0.1, 0.9, 0.5, 0.3]})
    result = executor.result
    assert [(_read(c), m["score"]) for c, m in result.best_checkpoints] == [("epoch 1", 0.9)]
    assert _read(result.checkpoint) == "epoch 3"  # the latest stays until a newer one comes (Ray Train's rule)
    assert sorted(os.listdir(storage)) == ["checkpoint_000001", "checkpoint_000003"]


def test_a_failed_run_keeps_its_error_and_the_checkpoints_reported_before(make_executor, tmp_path):
    storage = tmp_path / "failing"
    executor = make_executor(num_workers=2, storage_path=str(storage))
    with pytest.raises(ValueError, match="bad batch on rank 1") as raised:
        executor.run(_report_epochs, args=[5], kwargs={"fail_after": 2})
    result = executor.result
    assert result.error is raised.value
    assert result.metrics["epoch"] == 1
    assert [_read(c) for c, _ in result.best_checkpoints] == ["epoch 0", "epoch 1"]
    assert _read(result.checkpoint) == "epoch 1"
    assert executor.run(_report_epochs, args=[1]) == [0, 1]  # the executor goes on with new workers
    assert executor.result.error is None and executor.result.checkpoint.path.endswith("checkpoint_000002")


def _elastic_report(epochs: int) -> int:
    import tempfile

    import torch

    import hvdray.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    state = hvd.elastic.ObjectState(epoch=0)

    @hvd.elastic.run
    def train(state):
        while state.epoch < epochs:
            total = hvd.allreduce(torch.tensor(1.0), op=hvd.Sum).item()
            with tempfile.TemporaryDirectory() as tmp:
                with open(os.path.join(tmp, "state.txt"), "w") as f:
                    f.write(f"epoch {state.epoch}")
                hvdray.report({"epoch": state.epoch, "workers": total}, checkpoint=Checkpoint.from_directory(tmp))
            state.epoch += 1
            state.commit()
        return hvd.rank()

    return train(state)


def test_an_elastic_run_reports_the_same_way(ray_local, tmp_path):
    storage = tmp_path / "elastic"
    settings = RayExecutor.create_settings(timeout_s=20, placement_group_timeout_s=60, discovery_interval_s=0.5)
    with RayExecutor(settings, min_workers=2, max_workers=2, storage_path=str(storage)) as executor:
        assert sorted(executor.run(_elastic_report, args=[3])) == [0, 1]
        result = executor.result
    assert result.error is None
    assert list(result.metrics_dataframe["epoch"]) == [0, 1, 2]
    assert result.metrics == {"epoch": 2, "workers": 2.0}
    assert _read(result.checkpoint) == "epoch 2"
    assert "elastic_state" in os.listdir(storage)  # one storage_path: elastic commits beside the checkpoints
    assert sorted(n for n in os.listdir(storage) if n.startswith("checkpoint_")) == [
        "checkpoint_000000", "checkpoint_000001", "checkpoint_000002"]


def _checkpoint_without_storage() -> None:
    import tempfile

    import hvdray.torch as hvd

    hvd.init()
    with tempfile.TemporaryDirectory() as tmp:
        hvdray.report({"x": 1}, checkpoint=Checkpoint.from_directory(tmp))


def test_a_checkpoint_without_storage_path_is_a_clear_error(make_executor):
    executor = make_executor(num_workers=2)
    with pytest.raises(ValueError, match="needs a storage_path"):
        executor.run(_checkpoint_without_storage)
    assert executor.result.error is not None and executor.result.checkpoint is None


# -- argument checks: no workers needed ------------------------------------------------------------------
def test_bad_storage_arguments_are_refused_by_name(tmp_path):
    settings = RayExecutor.create_settings()
    a_file = tmp_path / "a_file"
    a_file.write_text("not a directory")
    with pytest.raises(ValueError, match="storage_path .*a_file.* not a directory"):
        RayExecutor(settings, num_workers=1, storage_path=str(a_file))
    with pytest.raises(ValueError, match="storage_path .*nosuchscheme"):
        RayExecutor(settings, num_workers=1, storage_path="nosuchscheme://bucket/run")
    with pytest.raises(ValueError, match="storage_path"):
        RayExecutor(settings, num_workers=1, storage_path="")
    other = RayExecutor.create_settings(storage_path=str(tmp_path / "one"))
    with pytest.raises(ValueError, match="differs from settings.storage_path"):
        RayExecutor(other, num_workers=1, storage_path=str(tmp_path / "two"))
    with pytest.raises(ValueError, match="checkpoint_config needs a storage_path"):
        RayExecutor(settings, num_workers=1, checkpoint_config=CheckpointConfig(num_to_keep=1))
    with pytest.raises(TypeError, match="checkpoint_config must be a ray.train.CheckpointConfig"):
        RayExecutor(settings, num_workers=1, storage_path=str(tmp_path), checkpoint_config={"num_to_keep": 1})


def test_one_storage_path_for_the_argument_and_the_setting(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    executor = RayExecutor(RayExecutor.create_settings(), num_workers=1, storage_path="relative/run")
    assert executor.settings.storage_path == str(tmp_path / "relative" / "run")  # absolute: workers see the same
    same = RayExecutor(RayExecutor.create_settings(storage_path="relative/run"), num_workers=1,
                       storage_path=str(tmp_path / "relative" / "run"))
    assert same.settings.storage_path == executor.settings.storage_path


def test_report_is_one_function_and_logs_outside_an_executor(caplog):
    import hvdray.tune

    assert hvdray.report is hvdray.tune.report
    with caplog.at_level("INFO", logger="hvdray"):
        hvdray.report({"loss": 0.5})
    assert "loss=0.5" in caplog.text
    with pytest.raises(TypeError, match="dict of metrics"):
        hvdray.report([0.5])
    with pytest.raises(TypeError, match="ray.train.Checkpoint"):
        hvdray.report({"loss": 0.5}, checkpoint="/tmp/dir")


class _Trainer:
    """horovod.ray's pattern: a stateful executable whose method trains and reports."""

    def __init__(self, scale: float) -> None:
        self.scale = scale

    def train(self) -> float:
        import hvdray.torch as hvd

        hvd.init()
        for step in range(2):
            hvdray.report({"step": step, "value": self.scale * step})
        return self.scale


def test_execute_collects_a_result_too_and_run_remote_leaves_its_reports_to_the_next_call(make_executor):
    executor = make_executor(num_workers=2, start=False)
    executor.start(executable_cls=_Trainer, executable_args=[2.0])
    assert executor.execute(lambda trainer: trainer.train()) == [2.0, 2.0]
    assert list(executor.result.metrics_dataframe["value"]) == [0.0, 2.0]
    assert executor.result.checkpoint is None and executor.result.path is None  # no storage_path
    ray.get(executor.run_remote(lambda: hvdray.report({"from": "run_remote"})))
    assert list(executor.result.metrics_dataframe["value"]) == [0.0, 2.0]  # still execute's result
    executor.run(lambda: hvdray.report({"from": "run"}))
    assert [row["from"] for _, row in executor.result.metrics_dataframe.iterrows()] == ["run_remote", "run"]


def test_a_workers_reports_of_metrics_import_no_ray_train(make_executor):
    """``ray.train`` (pyarrow, pandas: ~0.55 s of CPU) comes into a worker only with a checkpoint, which
    brought it already; reports of metrics alone, the only kind most jobs send, leave it out."""
    executor = make_executor(num_workers=2)

    def report_then_look() -> bool:
        import sys

        hvdray.report({"x": 1})
        return "ray.train" in sys.modules

    assert executor.run(report_then_look) == [False, False]
    assert list(executor.result.metrics_dataframe["x"]) == [1]


def _rank1_raises_then_rank0_reports():
    import time

    import hvdray.torch as hvd

    hvd.init()
    if hvd.rank() == 1:
        raise ValueError("rank 1 fails first")
    time.sleep(1.0)  # the run has raised by now; rank 0's call goes on with the workers kept
    hvdray.report({"late": 1})
    return hvd.rank()


def _report_fresh():
    import hvdray.torch as hvd

    hvd.init()
    hvdray.report({"fresh": hvd.rank()})
    return hvd.rank()


def test_a_report_sent_after_the_run_failed_is_in_neither_result(make_executor):
    """A rank raised, so the run's result is final; rank 0's report after that (its worker kept for the
    next call) goes to neither the failed run's result nor the next one's."""
    executor = make_executor(num_workers=2)
    with pytest.raises(ValueError, match="rank 1 fails first"):
        executor.run(_rank1_raises_then_rank0_reports)
    failed = executor.result
    assert failed.metrics is None and failed.error is not None
    time.sleep(2.0)  # rank 0's report has reached the coordinator
    assert executor.run(_report_fresh) == [0, 1]
    assert executor.result.metrics == {"fresh": 0}
    assert list(executor.result.metrics_dataframe.columns) == ["fresh"], executor.result.metrics_dataframe
    assert failed.metrics is None
