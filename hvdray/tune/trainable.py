"""``DistributedTrainableCreator``: a Ray Tune Trainable whose every trial is a distributed hvdray job.

Tune reserves one placement group per trial (``default_resource_request``): an empty head bundle for
the Trainable actor, which only waits, and the workers' bundles as ``hvdray/driver/placement.py`` plans them
(one bundle per host). The trial's ``RayExecutor`` finds that group as its current one and starts the
workers inside it. The user's function runs on every worker; its reports come back through a
``ReportChannel``, one per ``train()`` call. Rank 0 persists its checkpoints into the trial's directory
of Tune's storage itself (see ``hvdray/tune/session.py``); the Trainable hands Tune those
``Checkpoint``s as they are, as Ray's function trainables do, and gives the workers the one to restore.
On several nodes Tune's ``storage_path`` must therefore be reachable from every node (shared storage
or a pyarrow URI such as ``s3://``), as Ray Train requires.
"""

from __future__ import annotations

import inspect
import tempfile
from typing import Any, Callable, Optional

import ray
from ray.train import Checkpoint
from ray.train._internal.storage import StorageContext
from ray.tune import PlacementGroupFactory, Trainable
from ray.tune.result import DONE, RESULT_DUPLICATE, SHOULD_CHECKPOINT

try:  # what Trainable.save returns; Tune records no checkpoint for one whose checkpoint is None
    from ray.train._internal.checkpoint_manager import _TrainingResult
except ImportError:  # Ray < 2.10
    from ray.train._internal.session import _TrainingResult

from hvdray.driver.placement import PlacementPlan, plan_placement
from hvdray.driver.executor import RayExecutor
from hvdray.driver.failures import failure_error
from hvdray.settings import Settings
from hvdray.tune.channel import report_channel_class
from hvdray.tune.session import run_trial

# how long the ranks of a stopped function may take to unwind before their workers are killed instead
_STOP_GRACE_S = 5.0


class DistributedTrainable(Trainable):
    """Base class of the classes ``DistributedTrainableCreator`` returns; configured by class attributes."""

    _function: Callable[..., Any]
    _pass_checkpoint_dir: bool = False
    _settings: Settings
    _executor_kwargs: dict[str, Any]
    _plan: PlacementPlan

    @classmethod
    def default_resource_request(cls, config: dict[str, Any]) -> PlacementGroupFactory:
        """The whole trial: an empty head bundle for this actor plus the workers' bundles."""
        return PlacementGroupFactory([{}] + cls._plan.bundles, strategy=cls._plan.strategy)

    # -- lifecycle -------------------------------------------------------------------------------
    def setup(self, config: dict[str, Any]) -> None:
        self._executor: Optional[RayExecutor] = None
        self._channel: Any = ray.remote(report_channel_class()).options(num_cpus=0).remote()  # starts meanwhile
        self._generation = 0
        self._runs: Optional[list[ray.ObjectRef]] = None  # the running function, one ref per rank
        self._running: list[ray.ObjectRef] = []  # those not finished yet
        self._new_trial(config)
        self._start_workers()  # now, so that a trial that cannot start fails in setup

    def _new_trial(self, config: dict[str, Any]) -> None:
        self._config = config
        # Tune's storage for this trial; a Trainable made by hand (no Tune) gets a local one, as for debugging
        self._trial_storage: StorageContext = self._storage or StorageContext(
            tempfile.mkdtemp(prefix="hvdray-trial-"), experiment_dir_name=type(self).__name__, trial_dir_name="trial"
        )
        self._checkpoint: Optional[Checkpoint] = None  # latest checkpoint in storage (reported or restored)
        self._saved: Optional[Checkpoint] = None  # the one Tune saved last
        self._taken = 0  # reports of the running function consumed so far
        self._last_metrics: dict[str, Any] = {}
        self._done: Optional[str] = None  # why train() may not be called again

    def cleanup(self) -> None:
        """Stop the running function on every rank (so each removes its local copy of the restored checkpoint
        and any checkpoint directory not reported yet), then kill the workers and the channel; Tune then
        removes the trial's placement group. A rank that does not unwind within the grace is killed as it is."""
        self._end_function()
        self._kill_workers()
        ray.kill(self._channel, no_restart=True)

    def reset_config(self, new_config: dict[str, Any]) -> bool:
        """Reuse this actor, and its idle workers, for another trial (Tune's ``reuse_actors=True``)."""
        self._end_function()
        self._new_trial(new_config)
        self._start_workers()
        return True

    def _start_workers(self) -> None:
        if self._executor is None:
            self._executor = RayExecutor(self._settings, **self._executor_kwargs)
            self._executor.start()  # inside Tune: in the trial's placement group, none is created

    def _launch(self) -> None:
        self._start_workers()
        self._generation += 1
        ray.get(self._channel.begin.remote(self._generation))
        args = [
            type(self)._function, self._config, self._channel, self._generation,
            ray.cloudpickle.dumps(self._trial_storage),  # unpickled where used (see session.py)
            self._checkpoint, self._pass_checkpoint_dir,
        ]
        self._runs = self._executor.run_remote(run_trial, args=args)
        self._running = list(self._runs)
        self._taken = 0

    def _end_function(self) -> None:
        """Stop the running function but keep the workers if every rank unwinds cleanly (else kill them)."""
        if self._running:
            ray.get(self._channel.stop.remote())  # every rank waiting in report() raises TrialStopped
            ready, late = ray.wait(self._running, num_returns=len(self._running), timeout=_STOP_GRACE_S)
            try:
                ray.get(ready)
            except Exception:  # noqa: BLE001 - a failing or dead rank: the workers are not reusable
                late = True
            if late:
                self._kill_workers()
        self._runs, self._running = None, []

    def _kill_workers(self) -> None:
        """Kill the workers and their coordinator; a later ``_launch`` starts new ones."""
        if self._executor is not None:
            self._executor.shutdown()
            self._executor = None
        self._runs, self._running = None, []

    # -- training --------------------------------------------------------------------------------
    def step(self) -> dict[str, Any]:
        """The function's next report from rank 0 (waits for it); the function's end marks the trial done."""
        if self._done is not None:
            raise RuntimeError(f"train() called after {self._done}; the trial has no more results")
        if self._runs is None:
            self._launch()
        next_ref = self._channel.next.remote(self._taken)
        rank0 = self._runs[0]
        while True:
            ready, _ = ray.wait([next_ref, *self._running], num_returns=1)
            if next_ref in ready:
                break
            for ref in ready:
                self._running.remove(ref)
                self._raise_if_failed(ref)
            if rank0 not in self._running:
                return self._finish()
        metrics, checkpoint = ray.get(next_ref)
        self._taken += 1
        result = dict(metrics)
        if checkpoint is not None:
            self._checkpoint = ray.get(checkpoint[0])  # already in storage: rank 0 persisted it
            self._trial_storage._update_checkpoint_index(metrics)  # the next run of the function numbers on
            result[SHOULD_CHECKPOINT] = True  # Tune saves it now
        self._last_metrics = dict(metrics)
        return result

    def _finish(self) -> dict[str, Any]:
        """Rank 0's function returned: collect the other ranks (bounded by timeout_s), mark the trial done."""
        ray.get(self._channel.release_all.remote())
        timeout = self._settings.timeout_s
        ready, late = ray.wait(self._running, num_returns=len(self._running), timeout=timeout)
        for ref in ready:
            self._raise_if_failed(ref)
        if late:
            ranks = sorted(self._runs.index(ref) for ref in late)
            self._abort("the trial failed")
            raise RuntimeError(
                f"rank 0's training function returned but rank(s) {ranks} did not finish within "
                f"timeout_s={timeout} s; every rank must run the same sequence of reports"
            )
        self._done = "the training function finished"
        self._end_function()  # the workers stay, idle, for a reused actor's next trial
        # Tune marks the last real result done and does not log this one again (function-trainable protocol)
        return {**self._last_metrics, DONE: True, RESULT_DUPLICATE: True}

    def _raise_if_failed(self, ref: ray.ObjectRef) -> None:
        try:
            ray.get(ref)
        except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as exc:
            error = failure_error(exc, self._runs.index(ref), len(self._runs))
            self._abort("the trial failed")
            # a lost worker's error keeps Ray's as its cause; a user's exception is raised as itself
            raise error from (exc if isinstance(exc, ray.exceptions.RayActorError) else None)

    def _abort(self, why: str) -> None:
        self._done = why
        self._end_function()  # the ranks that can still unwind do (removing their local files); the rest are killed
        self._kill_workers()

    # -- checkpoints -----------------------------------------------------------------------------
    def save(self, checkpoint_dir: Optional[str] = None) -> Any:
        """Tune's save: the latest checkpoint the function reported, already in the trial's storage (no copy).
        As for a function trainable, with none yet, or after the function finished with its last one already
        saved (Tuner's checkpoint at end), Tune gets an empty result and records no (duplicate) checkpoint."""
        nothing_new = self._done is not None and self._checkpoint is self._saved
        if self._checkpoint is None or nothing_new:
            return _TrainingResult(checkpoint=None, metrics=dict(self._last_result or {}))
        self._saved = self._checkpoint
        return _TrainingResult(checkpoint=self._checkpoint, metrics=dict(self._last_result or {}))

    def restore(self, checkpoint_path: Any) -> None:
        """Tune's restore (of what ``save`` returned, a ``Checkpoint`` or a directory): the next ``train()``
        starts the function again, and every rank copies this checkpoint from storage (``get_checkpoint()``)."""
        found = getattr(checkpoint_path, "checkpoint", checkpoint_path)  # a _TrainingResult holds one
        self._checkpoint = found if isinstance(found, Checkpoint) else Checkpoint.from_directory(str(found))
        super().restore(checkpoint_path)

    def load_checkpoint(self, checkpoint_dir: Any) -> None:
        """Called by ``restore``; the workers read the checkpoint from storage, so only the function is stopped."""
        self._end_function()  # restored mid-run: the function starts again from this checkpoint
        self._done = None


def DistributedTrainableCreator(  # noqa: N802 - horovod / Ray 1.x name
    func: Callable[..., Any],
    use_gpu: bool = False,
    num_hosts: int = 1,
    num_slots: int = 1,
    num_cpus_per_slot: float = 1,
    timeout_s: float = 30,
    replicate_pem: bool = False,
    *,
    num_workers: Optional[int] = None,
    num_cpus_per_worker: Optional[float] = None,
) -> type[DistributedTrainable]:
    """A Tune Trainable class running ``func(config)`` (or ``func(config, checkpoint_dir=...)``) on
    ``num_hosts * num_slots`` workers per trial, ``num_slots`` on each of ``num_hosts`` nodes.

    ``num_workers`` and ``num_cpus_per_worker`` are the later Ray 1.x names of ``num_slots`` (workers
    per host) and ``num_cpus_per_slot``. ``replicate_pem`` is accepted for compatibility: Ray starts
    the workers, no ssh is used. Bad arguments raise ``ValueError`` here, not in the trials.
    """
    pass_checkpoint_dir = _check_signature(func)
    slots = _alias("num_slots", num_slots, 1, "num_workers", num_workers)
    cpus = _alias("num_cpus_per_slot", num_cpus_per_slot, 1, "num_cpus_per_worker", num_cpus_per_worker)
    _check_positive("num_hosts", num_hosts, integer=True)
    _check_positive("num_slots", slots, integer=True)
    _check_positive("num_cpus_per_slot", cpus, integer=False)
    if not isinstance(replicate_pem, bool):
        raise ValueError(f"replicate_pem must be a bool, got {replicate_pem!r}")
    settings = RayExecutor.create_settings(timeout_s=timeout_s)
    executor_kwargs = dict(num_hosts=num_hosts, num_workers_per_host=slots, cpus_per_worker=cpus, use_gpu=use_gpu)
    RayExecutor(settings, **executor_kwargs)  # the executor's own checks, before any trial starts
    plan = plan_placement(None, num_hosts, slots, cpus, 1 if use_gpu else 0)

    name = getattr(func, "__name__", "func")
    return type(
        f"DistributedTrainable_{name}",
        (DistributedTrainable,),
        {
            "_function": staticmethod(func),
            "_pass_checkpoint_dir": pass_checkpoint_dir,
            "_settings": settings,
            "_executor_kwargs": executor_kwargs,
            "_plan": plan,
            "__module__": __name__,
            "__doc__": f"Distributed trials of {name} on {plan.num_workers} hvdray worker(s).",
        },
    )


def _check_signature(func: Any) -> bool:
    """``func(config)`` -> False, ``func(config, checkpoint_dir=None)`` -> True, anything else raises."""
    if not callable(func):
        raise ValueError(f"func must be a function taking (config), got {type(func).__name__}")
    try:
        params = list(inspect.signature(func).parameters.values())
    except (TypeError, ValueError) as exc:
        raise ValueError(f"cannot read the signature of {func!r}: {exc}") from exc
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    if len(params) == 1 and params[0].kind in positional:
        return False
    if len(params) == 2 and params[0].kind in positional and params[1].name == "checkpoint_dir" and params[1].kind in named:
        return True
    shown = getattr(func, "__name__", repr(func))
    raise ValueError(
        f"the training function must take (config) or (config, checkpoint_dir=None); "
        f"{shown}{inspect.signature(func)} does not"
    )


def _alias(name: str, value: Any, default: Any, alias: str, alias_value: Any) -> Any:
    """``value``, or the newer spelling ``alias_value`` when given; both, disagreeing, is an error."""
    if alias_value is None:
        return value
    if value != default and value != alias_value:
        raise ValueError(f"{name}={value!r} and {alias}={alias_value!r} name the same thing; pass one of them")
    return alias_value


def _check_positive(argument: str, value: Any, integer: bool) -> None:
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or value <= 0:
        raise ValueError(f"{argument} must be a positive {'int' if integer else 'number'}, got {value!r}")
