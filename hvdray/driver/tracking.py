"""Experiment tracking callbacks for ``executor.run(fn, callbacks=[...])``: TensorBoard, MLflow, W&B.

Each takes the records the workers send (``hvdray.report(metrics)`` from rank 0, and
``hvdray.ray_logger.log(record)`` from any rank) and writes the numeric values of the chosen rank's
records (rank 0 by default; nested dicts flattened with ``/``) with a step: the record's ``step_key``
value when one is given (records without it are skipped), else a count of the records written. The
elastic driver's own records (``{"event": "elastic", ...}``) are not metrics and are skipped. The same
callbacks serve fixed and elastic runs; call ``close()`` (or use ``with``) when the run is over.

For Ray Tune (``DistributedTrainableCreator``) use Ray's own integrations in ``RunConfig(callbacks=[...])``:
``ray.tune.logger.TBXLoggerCallback`` (Tune's default), ``ray.air.integrations.mlflow.MLflowLoggerCallback``
and ``ray.air.integrations.wandb.WandbLoggerCallback``: a trial's reports reach them as any Tune result.
The libraries are optional: ``pip install "hvdray[tracking]"``.
"""

from __future__ import annotations

import abc
import importlib
import numbers
import time
from typing import Any, Optional



def _import(module: str, extra_hint: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(f"{extra_hint} needs {module.split('.')[0]}: pip install \"hvdray[tracking]\"") from exc


def _numbers(record: dict[str, Any], skip: set[str], prefix: str = "") -> dict[str, float]:
    """The record's real numbers (not bools), nested dicts flattened to ``outer/inner`` keys."""
    found: dict[str, float] = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            found.update(_numbers(value, skip, f"{name}/"))
        elif name not in skip and isinstance(value, numbers.Real) and not isinstance(value, bool):
            found[name] = float(value)
    return found


class _TrackingCallback(abc.ABC):
    """Picks the metrics and the step out of each record; subclasses write them (``_write``) and close."""

    def __init__(self, step_key: Optional[str], rank: Optional[int]) -> None:
        if step_key is not None and (not isinstance(step_key, str) or not step_key):
            raise ValueError(f"step_key must be None or a non-empty str, got {step_key!r}")
        if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 0):
            raise ValueError(f"rank must be None (all ranks) or an int >= 0, got {rank!r}")
        self.step_key = step_key
        self.rank = rank
        self.written = 0  # records written so far (the step when there is no step_key)

    def __call__(self, record: dict[str, Any]) -> None:
        """The executor callback: write one record's metrics, if it is one of the chosen rank's."""
        if record.get("event") == "elastic":
            return
        if self.rank is not None and record.get("rank", 0) != self.rank:
            return
        if self.step_key is None:
            step = self.written
        elif isinstance(record.get(self.step_key), numbers.Real):
            step = int(record[self.step_key])
        else:
            return
        metrics = _numbers(record, {"rank"} | ({self.step_key} if self.step_key else set()))
        if metrics:
            self._write(metrics, step)
            self.written += 1

    @abc.abstractmethod
    def _write(self, metrics: dict[str, float], step: int) -> None:
        """Write one record's metrics at ``step``."""

    @abc.abstractmethod
    def close(self) -> None:
        """Finish writing (flush files, end the run)."""

    def __enter__(self) -> "_TrackingCallback":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class TensorBoardCallback(_TrackingCallback):
    """Writes TensorBoard event files into ``logdir`` (``tensorboard --logdir <logdir>``), one scalar per metric."""

    def __init__(self, logdir: str, step_key: Optional[str] = None, rank: Optional[int] = 0, **writer_kwargs: Any) -> None:
        super().__init__(step_key, rank)
        if not isinstance(logdir, str) or not logdir:
            raise ValueError(f"logdir must be a non-empty str, got {logdir!r}")
        writer = _import("tensorboardX", "TensorBoardCallback").SummaryWriter
        self.logdir = logdir
        self._writer = writer(logdir=logdir, **writer_kwargs)

    def _write(self, metrics: dict[str, float], step: int) -> None:
        for name, value in metrics.items():
            self._writer.add_scalar(name, value, global_step=step)
        self._writer.flush()  # readable while the run goes on

    def close(self) -> None:
        self._writer.close()


class MLflowCallback(_TrackingCallback):
    """Logs into one MLflow run; the experiment is created if it does not exist. ``tracking_uri`` needs no
    server: a local file store (``file:///path/mlruns``; MLflow 3 asks for ``MLFLOW_ALLOW_FILE_STORE=true``
    in the driver's environment) or a SQLite file (``sqlite:///path/mlflow.db``, with full ``mlflow``);
    a tracking server's URL works too. ``close()`` ends the run as ``FINISHED`` (or the status given)."""

    def __init__(
        self,
        tracking_uri: Optional[str] = None,
        experiment_name: str = "hvdray",
        run_name: Optional[str] = None,
        tags: Optional[dict[str, str]] = None,
        step_key: Optional[str] = None,
        rank: Optional[int] = 0,
    ) -> None:
        super().__init__(step_key, rank)
        mlflow = _import("mlflow", "MLflowCallback")
        self._client = mlflow.MlflowClient(tracking_uri=tracking_uri)
        experiment = self._client.get_experiment_by_name(experiment_name)
        experiment_id = experiment.experiment_id if experiment is not None else self._client.create_experiment(experiment_name)
        self.run_id: str = self._client.create_run(experiment_id, run_name=run_name, tags=tags).info.run_id
        self._metric = mlflow.entities.Metric

    def _write(self, metrics: dict[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        self._client.log_batch(self.run_id, metrics=[self._metric(k, v, now, step) for k, v in metrics.items()])

    def close(self, status: str = "FINISHED") -> None:
        """End the MLflow run with ``status`` (``FINISHED``, ``FAILED`` or ``KILLED``)."""
        self._client.set_terminated(self.run_id, status=status)


class WandbCallback(_TrackingCallback):
    """Logs into one Weights & Biases run (``wandb.init(project=..., **init_kwargs)``); with
    ``mode="offline"`` (or ``WANDB_MODE=offline``) it writes only local files, for ``wandb sync`` later."""

    def __init__(
        self, project: str = "hvdray", step_key: Optional[str] = None, rank: Optional[int] = 0, **init_kwargs: Any
    ) -> None:
        super().__init__(step_key, rank)
        wandb = _import("wandb", "WandbCallback")
        self.run = wandb.init(project=project, **init_kwargs)

    def _write(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()
