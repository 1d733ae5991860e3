"""``RayExecutor``: the driver-side facade with horovod.ray's signatures.

It owns one placement group, one coordinator actor and one worker actor per rank. ``run`` sends a
function to every worker and returns the results in rank order; a failing rank makes ``run`` raise
that rank's exception at once, and the worker group is stopped and rebuilt before the next call.
"""

from __future__ import annotations

import logging
import secrets
import uuid
from typing import Any, Callable, Optional, Sequence

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from hvdray.actors.coordinator import Coordinator
from hvdray.actors.placement import Placement, plan_placement
from hvdray.actors.worker import Worker, worker_actor_name
from hvdray.settings import Settings, make_settings

log = logging.getLogger(__name__)

Callback = Callable[[dict[str, Any]], None]
_LOG_POLL_S = 0.1


class WorkerLostError(RuntimeError):
    """A worker actor died (its process exited, was killed, or its node went away)."""


class RayExecutor:
    """Run Horovod-style distributed functions on Ray actors (see the README for a walk-through)."""

    @classmethod
    def create_settings(
        cls,
        timeout_s: float = 30,
        ssh_identity_file: Optional[str] = None,
        ssh_str: Optional[str] = None,
        placement_group_timeout_s: float = 100,
        nics: Optional[Sequence[str]] = None,
        **kwargs: Any,
    ) -> Settings:
        """Validated settings; any other field of :class:`hvdray.settings.Settings` may be passed too."""
        return make_settings(
            timeout_s=timeout_s,
            ssh_identity_file=ssh_identity_file,
            ssh_str=ssh_str,
            placement_group_timeout_s=placement_group_timeout_s,
            nics=list(nics) if nics is not None else None,
            **kwargs,
        )

    def __init__(
        self,
        settings: Optional[Settings] = None,
        num_workers: Optional[int] = None,
        num_hosts: Optional[int] = None,
        num_workers_per_host: int = 1,
        cpus_per_worker: float = 1,
        use_gpu: bool = False,
        gpus_per_worker: Optional[float] = None,
        use_current_placement_group: bool = True,
        min_workers: Optional[int] = None,
        max_workers: Optional[int] = None,
        reset_limit: Optional[int] = None,
        cooldown_range: Optional[tuple[float, float]] = None,
        elastic_timeout: float = 600,
        override_discovery: bool = True,
    ) -> None:
        if settings is None:
            settings = make_settings()
        if not isinstance(settings, Settings):
            raise TypeError(
                f"settings must come from RayExecutor.create_settings(), got {type(settings).__name__}"
            )
        elastic = min_workers is not None or max_workers is not None
        _check_int("num_workers", num_workers, minimum=1)
        _check_int("num_hosts", num_hosts, minimum=1)
        _check_int("num_workers_per_host", num_workers_per_host, minimum=1, optional=False)
        _check_int("min_workers", min_workers, minimum=1)
        _check_int("max_workers", max_workers, minimum=1)
        _check_int("reset_limit", reset_limit, minimum=0)
        _check_number("cpus_per_worker", cpus_per_worker, positive=True)
        _check_number("elastic_timeout", elastic_timeout, positive=True)
        if num_workers is not None and num_hosts is not None:
            raise ValueError("pass num_workers or num_hosts (with num_workers_per_host), not both")
        if elastic and (num_workers is not None or num_hosts is not None):
            raise ValueError(
                "num_workers/num_hosts fix the job size; min_workers/max_workers make it elastic: pass one or the other"
            )
        if not elastic and num_workers is None and num_hosts is None:
            raise ValueError("num_workers (or num_hosts, or min_workers/max_workers for elastic training) is required")
        if min_workers is not None and max_workers is not None and min_workers > max_workers:
            raise ValueError(f"min_workers ({min_workers}) must not exceed max_workers ({max_workers})")
        if gpus_per_worker is not None and not use_gpu:
            raise ValueError("gpus_per_worker needs use_gpu=True")
        if gpus_per_worker is not None:
            _check_number("gpus_per_worker", gpus_per_worker, positive=True)
        if cooldown_range is not None:
            if (
                not isinstance(cooldown_range, (tuple, list))
                or len(cooldown_range) != 2
                or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in cooldown_range)
                or not 0 <= cooldown_range[0] <= cooldown_range[1]
            ):
                raise ValueError(f"cooldown_range must be (low, high) seconds with 0 <= low <= high, got {cooldown_range!r}")
        if elastic:
            raise NotImplementedError(
                "elastic training (min_workers/max_workers) is not available in this version of hvdray; "
                "pass num_workers or num_hosts for a fixed-size job"
            )

        self.settings = settings
        self.num_workers = num_workers if num_workers is not None else num_hosts * num_workers_per_host
        self.use_gpu = bool(use_gpu)
        self._plan = plan_placement(
            num_workers, num_hosts, num_workers_per_host, cpus_per_worker,
            (gpus_per_worker if gpus_per_worker is not None else 1) if use_gpu else 0,
        )
        self._use_current_pg = use_current_placement_group
        self._placement: Optional[Placement] = None
        self._coordinator: Any = None
        self._workers: list[Any] = []
        self._executable: tuple[Optional[type], Sequence[Any], dict[str, Any]] = (None, (), {})
        self._extra_env: dict[str, str] = {}
        self._state = "new"  # new -> started -> (broken -> started)* -> shut down
        self._id = uuid.uuid4().hex[:8]
        if settings.verbose >= 2:
            logging.getLogger("hvdray").setLevel(logging.DEBUG)

    # -- lifecycle -----------------------------------------------------------------------------
    def start(
        self,
        executable_cls: Optional[type] = None,
        executable_args: Optional[Sequence[Any]] = None,
        executable_kwargs: Optional[dict[str, Any]] = None,
        extra_env_vars: Optional[dict[str, str]] = None,
    ) -> None:
        """Reserve the placement group and start one worker per rank (building ``executable_cls`` on each)."""
        if self._state == "shut down":
            raise RuntimeError("this executor was shut down; create a new RayExecutor")
        if self._state != "new":
            raise RuntimeError("start() was already called on this executor")
        if executable_cls is not None and not callable(executable_cls):
            raise TypeError(f"executable_cls must be a class, got {executable_cls!r}")
        if extra_env_vars is not None and (
            not isinstance(extra_env_vars, dict)
            or not all(isinstance(k, str) and isinstance(v, str) for k, v in extra_env_vars.items())
        ):
            raise TypeError("extra_env_vars must be a dict of str to str")
        self._executable = (executable_cls, list(executable_args or ()), dict(executable_kwargs or {}))
        self._extra_env = dict(extra_env_vars or {})
        if not ray.is_initialized():
            ray.init()
        self._placement = Placement(self._plan, self.settings.placement_group_timeout_s, self._use_current_pg)
        try:
            self._start_workers()
        except BaseException:
            self.shutdown()
            raise
        self._state = "started"

    def _start_workers(self) -> None:
        secret = secrets.token_bytes(32)
        self._coordinator = ray.remote(Coordinator).options(
            num_cpus=0,
            name=f"hvdray-{self._id}-coordinator",
            scheduling_strategy=NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=True),
        ).remote()
        options: dict[str, Any] = {}
        if self._extra_env:
            options["runtime_env"] = {"env_vars": self._extra_env}
        workers = [
            ray.remote(Worker)
            .options(name=worker_actor_name(self._id, i), **self._placement.actor_options(i), **options)
            .remote()
            for i in range(self.num_workers)
        ]
        self._workers = workers
        timeout = self.settings.placement_group_timeout_s
        slots = ray.get([w.slot.remote() for w in workers], timeout=timeout)
        epoch, infos, gpus = ray.get(self._coordinator.assign.remote(slots), timeout=timeout)
        ray.get(
            [
                w.configure.remote(info, epoch, self.settings, secret, self._coordinator, node_gpus)
                for w, info, node_gpus in zip(workers, infos, gpus)
            ],
            timeout=timeout,
        )
        cls, args, kwargs = self._executable
        ray.get([w.start_executable.remote(cls, args, kwargs) for w in workers], timeout=timeout)
        self._workers = [w for _, w in sorted(zip((i.rank for i in infos), workers), key=lambda p: p[0])]
        log.info("hvdray executor %s started %d worker(s)", self._id, len(workers))

    def shutdown(self) -> None:
        """Kill the workers and the coordinator and release the placement group; safe to call twice."""
        self._stop_workers()
        if self._placement is not None:
            self._placement.release()
            self._placement = None
        self._state = "shut down"

    def _stop_workers(self) -> None:
        for actor in [*self._workers, self._coordinator]:
            if actor is not None:
                ray.kill(actor, no_restart=True)
        self._workers, self._coordinator = [], None

    def __enter__(self) -> "RayExecutor":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def _ready_workers(self) -> list[Any]:
        if self._state == "new":
            self.start()
        elif self._state == "shut down":
            raise RuntimeError("this executor was shut down; create a new RayExecutor")
        elif self._state == "broken":
            self._start_workers()
            self._state = "started"
        return self._workers

    # -- running functions ---------------------------------------------------------------------
    def run(
        self,
        fn: Callable[..., Any],
        args: Optional[Sequence[Any]] = None,
        kwargs: Optional[dict[str, Any]] = None,
        callbacks: Optional[Sequence[Callback]] = None,
    ) -> list[Any]:
        """Call ``fn(*args, **kwargs)`` on every worker; results in rank order."""
        _check_callbacks(callbacks)
        return self._gather(self.run_remote(fn, args, kwargs), callbacks)

    def run_remote(
        self,
        fn: Callable[..., Any],
        args: Optional[Sequence[Any]] = None,
        kwargs: Optional[dict[str, Any]] = None,
    ) -> list[ray.ObjectRef]:
        """Like ``run`` but returns the ObjectRefs (rank order) without waiting."""
        _check_callable(fn)
        if args is not None and not isinstance(args, (list, tuple)):
            raise TypeError(f"args must be a list or tuple, got {type(args).__name__}")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise TypeError(f"kwargs must be a dict, got {type(kwargs).__name__}")
        return [w.run.remote(fn, list(args or ()), dict(kwargs or {})) for w in self._ready_workers()]

    def execute(self, fn: Callable[[Any], Any], callbacks: Optional[Sequence[Callback]] = None) -> list[Any]:
        """Call ``fn(executable)`` on every worker's executable instance; results in rank order."""
        _check_callable(fn)
        _check_callbacks(callbacks)
        return self._gather([w.execute.remote(fn) for w in self._ready_workers()], callbacks)

    def execute_single(self, fn: Callable[[Any], Any]) -> Any:
        """Call ``fn(executable)`` on rank 0 only and return its result."""
        _check_callable(fn)
        return self._gather([self._ready_workers()[0].execute.remote(fn)], None)[0]

    def _gather(self, refs: list[ray.ObjectRef], callbacks: Optional[Sequence[Callback]]) -> list[Any]:
        callbacks = list(callbacks or ())
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=len(pending), timeout=_LOG_POLL_S)
            self._deliver_logs(callbacks)
            for ref in done:
                try:
                    ray.get(ref)
                except BaseException as exc:  # noqa: BLE001 - re-raised below with the rank attached
                    self._fail(rank_of[ref], len(refs), exc)
        self._deliver_logs(callbacks)
        return ray.get(refs)

    def _deliver_logs(self, callbacks: list[Callback]) -> None:
        if not callbacks or self._coordinator is None:
            return
        for record in ray.get(self._coordinator.drain_logs.remote()):
            for cb in callbacks:
                cb(record)

    def _fail(self, rank: int, size: int, exc: BaseException) -> None:
        """Stop every worker (they may wait on the failed one) and raise that rank's error."""
        self._stop_workers()
        self._state = "broken"
        if isinstance(exc, ray.exceptions.RayActorError):
            raise WorkerLostError(f"the worker of rank {rank} (of {size}) died: {exc}") from exc
        if isinstance(exc, ray.exceptions.RayTaskError):
            exc = exc.as_instanceof_cause()
        if hasattr(exc, "add_note"):
            exc.add_note(f"hvdray: raised on rank {rank} of {size}; the other workers were stopped")
        raise exc


def _check_callable(fn: Any, argument: str = "fn") -> None:
    if not callable(fn):
        raise TypeError(f"{argument} must be callable, got {type(fn).__name__}")


def _check_callbacks(callbacks: Optional[Sequence[Callback]]) -> None:
    if callbacks is None:
        return
    if not isinstance(callbacks, (list, tuple)):
        raise TypeError(f"callbacks must be a list of callables, got {type(callbacks).__name__}")
    for cb in callbacks:
        _check_callable(cb, "callbacks")


def _check_int(argument: str, value: Any, minimum: int, optional: bool = True) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{argument} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{argument} must be >= {minimum}, got {value}")


def _check_number(argument: str, value: Any, positive: bool) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{argument} must be a number, got {value!r}")
    if positive and value <= 0:
        raise ValueError(f"{argument} must be > 0, got {value}")
