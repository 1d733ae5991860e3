"""``DistributedTrainableCreator``: a Ray Tune Trainable whose every trial is a distributed hvdray job.

Tune reserves one placement group per trial (``default_resource_request``): an empty head bundle for
the Trainable actor, which only waits, and the workers' bundles as ``actors/placement.py`` plans them
(one bundle per host). The trial's ``RayExecutor`` finds that group as its current one and starts the
workers inside it. The user's function runs on every worker; its reports come back through a
``ReportChannel``, one per ``train()`` call, and rank 0's checkpoints become the Trainable's.
"""

from __future__ import annotations

import inspect
import os
from typing import Any, Callable, Optional

import ray
from ray.tune import PlacementGroupFactory, Trainable
from ray.tune.result import DONE, RESULT_DUPLICATE, SHOULD_CHECKPOINT

from hvdray.actors.placement import PlacementPlan, plan_placement
from hvdray.executor import RayExecutor, WorkerLostError
from hvdray.settings import Settings
from hvdray.tune.channel import ReportChannel
from hvdray.tune.packing import pack_directory, unpack_directory
from hvdray.tune.session import run_trial

# written into a saved checkpoint when the function never reported one: restoring it restores nothing
_NO_CHECKPOINT = ".hvdray_no_checkpoint"


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
        self._config = config
        self._checkpoint: Optional[bytes] = None  # latest checkpoint (reported or restored), a tar archive
        self._executor: Optional[RayExecutor] = None
        self._channel: Any = None
        self._runs: Optional[list[ray.ObjectRef]] = None  # one per rank, rank order
        self._running: list[ray.ObjectRef] = []
        self._restore_ref: Optional[ray.ObjectRef] = None
        self._taken = 0  # reports of the running function consumed so far
        self._last_metrics: dict[str, Any] = {}
        self._done: Optional[str] = None  # why train() may not be called again
        self._start_workers()  # now, so that a trial that cannot start fails in setup

    def cleanup(self) -> None:
        """Kill the workers and the channel at once; Tune then removes the trial's placement group."""
        self._stop()

    def reset_config(self, new_config: dict[str, Any]) -> bool:
        """Reuse this actor for another trial (``reuse_actors=True``): fresh workers, fresh function."""
        self._stop()
        self.setup(new_config)
        return True

    def _start_workers(self) -> None:
        if self._executor is None:
            self._executor = RayExecutor(self._settings, **self._executor_kwargs)
            self._executor.start()  # inside Tune: in the trial's placement group, none is created

    def _launch(self) -> None:
        self._start_workers()
        self._channel = ray.remote(ReportChannel).options(num_cpus=0).remote()
        self._restore_ref = ray.put(self._checkpoint) if self._checkpoint is not None else None
        args = [type(self)._function, self._config, self._channel, self._restore_ref, self._pass_checkpoint_dir]
        self._runs = self._executor.run_remote(run_trial, args=args)
        self._running = list(self._runs)
        self._taken = 0

    def _stop(self) -> None:
        """Stop the function (if running), its workers and its channel; ``_launch`` starts afresh."""
        if self._executor is not None:
            self._executor.shutdown()
            self._executor = None
        if self._channel is not None:
            ray.kill(self._channel, no_restart=True)
            self._channel = None
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
            self._checkpoint = ray.get(checkpoint[0])
            result[SHOULD_CHECKPOINT] = True  # Tune saves it now
        self._last_metrics = dict(metrics)
        return result

    def _finish(self) -> dict[str, Any]:
        """Rank 0's function returned: collect the others (bounded), release the workers, mark done."""
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
        self._stop()  # free the workers' CPUs now, before Tune stops the actor
        # Tune marks the last real result done and does not log this one again (function-trainable protocol)
        return {**self._last_metrics, DONE: True, RESULT_DUPLICATE: True}

    def _raise_if_failed(self, ref: ray.ObjectRef) -> None:
        try:
            ray.get(ref)
        except ray.exceptions.RayActorError as exc:
            rank, size = self._runs.index(ref), len(self._runs)
            self._abort("the trial failed")
            raise WorkerLostError(f"the worker of rank {rank} (of {size}) died: {exc}") from exc
        except ray.exceptions.RayTaskError as exc:
            rank, size = self._runs.index(ref), len(self._runs)
            self._abort("the trial failed")
            cause = exc.as_instanceof_cause()
            if hasattr(cause, "add_note"):
                cause.add_note(f"hvdray: raised on rank {rank} of {size}; the other workers were stopped")
            raise cause from None

    def _abort(self, why: str) -> None:
        self._done = why
        self._stop()

    # -- checkpoints -----------------------------------------------------------------------------
    def save_checkpoint(self, checkpoint_dir: str) -> None:
        """The latest checkpoint rank 0 reported (or the one this trial was restored from)."""
        if self._checkpoint is None:
            open(os.path.join(checkpoint_dir, _NO_CHECKPOINT), "w").close()
        else:
            unpack_directory(self._checkpoint, checkpoint_dir)

    def load_checkpoint(self, checkpoint_dir: str) -> None:
        """Restart the function from this checkpoint on the next ``train()`` (``get_checkpoint()`` returns it)."""
        if os.path.exists(os.path.join(checkpoint_dir, _NO_CHECKPOINT)):
            self._checkpoint = None
        else:
            self._checkpoint = pack_directory(checkpoint_dir)
        if self._runs is not None or self._done is not None:  # restored mid-run: start the function again
            self._stop()
        self._done = None


def DistributedTrainableCreator(  # noqa: N802 - horovod / Ray 1.x name
    func: Callable[..., Any],
    use_gpu: bool = False,
    num_hosts: int = 1,
    num_slots: Optional[int] = None,
    num_cpus_per_slot: Optional[float] = None,
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
    slots = _one_of("num_slots", num_slots, "num_workers", num_workers, default=1)
    cpus = _one_of("num_cpus_per_slot", num_cpus_per_slot, "num_cpus_per_worker", num_cpus_per_worker, default=1)
    for argument, value, kind in (("num_hosts", num_hosts, int), ("num_slots", slots, int), ("num_cpus_per_slot", cpus, float)):
        if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int) or value <= 0:
            raise ValueError(f"{argument} must be a positive {kind.__name__}, got {value!r}")
    if not isinstance(replicate_pem, bool):
        raise ValueError(f"replicate_pem must be a bool, got {replicate_pem!r}")
    settings = RayExecutor.create_settings(timeout_s=timeout_s)
    executor_kwargs = dict(num_hosts=num_hosts, num_workers_per_host=slots, cpus_per_worker=cpus, use_gpu=use_gpu)
    RayExecutor(settings, **executor_kwargs)  # validates every argument (names it) without touching Ray
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


def _one_of(name: str, value: Any, alias: str, alias_value: Any, default: Any) -> Any:
    if value is not None and alias_value is not None and value != alias_value:
        raise ValueError(f"{name}={value!r} and {alias}={alias_value!r} name the same thing; pass one of them")
    if value is not None:
        return value
    return alias_value if alias_value is not None else default
