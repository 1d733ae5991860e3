"""``RayExecutor``: the driver-side facade with horovod.ray's signatures.

It owns one placement group, one coordinator actor and one worker actor per rank. ``run`` sends a
function to every worker and returns the results in rank order; a failing rank makes ``run`` raise
that rank's exception at once, and the worker group is stopped and rebuilt before the next call.

With ``min_workers``/``max_workers`` the job is elastic: no placement group, workers follow the
cluster's free slots, and each ``run`` is driven by :class:`hvdray.driver.controller.ElasticDriver`.
``ElasticRayExecutor`` is the same thing under horovod.ray's elastic names.
"""

from __future__ import annotations

import logging
import math
import secrets
import sys
import uuid
from typing import Any, Callable, Optional, Sequence

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from hvdray.driver.coordinator import start_coordinator
from hvdray.driver.placement import Placement, plan_placement
from hvdray.worker.actor import Worker, worker_actor_name
from hvdray.driver.discovery import HostDiscovery, RayNodeDiscovery
from hvdray.driver.controller import Blacklist, ElasticDriver, ElasticLimits
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
        timeout_s: Optional[float] = None,
        ssh_identity_file: Optional[str] = None,
        ssh_str: Optional[str] = None,
        placement_group_timeout_s: Optional[float] = None,
        nics: Optional[Sequence[str]] = None,
        **kwargs: Any,
    ) -> Settings:
        """Validated settings (horovod.ray's signature); any other field of :class:`hvdray.settings.Settings`
        may be passed too. Arguments left at ``None`` take their ``HVDRAY_*`` variable or the default."""
        given = dict(
            timeout_s=timeout_s,
            ssh_identity_file=ssh_identity_file,
            ssh_str=ssh_str,
            placement_group_timeout_s=placement_group_timeout_s,
            nics=nics,
        )
        return make_settings(**{k: v for k, v in given.items() if v is not None}, **kwargs)

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
        if elastic and not override_discovery and settings.discovery is None:
            raise ValueError("override_discovery=False needs settings.discovery (an object with "
                             "find_available_hosts_and_slots())")

        self.settings = settings
        self.use_gpu = bool(use_gpu)
        gpus = (gpus_per_worker if gpus_per_worker is not None else 1) if use_gpu else 0
        self._cpus_per_worker, self._gpus_per_worker = cpus_per_worker, gpus
        self._limits: Optional[ElasticLimits] = None
        self._plan = None
        if elastic:
            self._limits = ElasticLimits(
                min_workers=min_workers or 1,
                max_workers=max_workers if max_workers is not None else sys.maxsize,
                reset_limit=reset_limit,
                cooldown_range=tuple(cooldown_range) if cooldown_range is not None else None,
                elastic_timeout=float(elastic_timeout),
            )
            self._override_discovery = override_discovery
            self._blacklist = Blacklist(self._limits.cooldown_range)
            self.num_workers = self._limits.min_workers
        else:
            self.num_workers = num_workers if num_workers is not None else num_hosts * num_workers_per_host
            self._plan = plan_placement(num_workers, num_hosts, num_workers_per_host, cpus_per_worker, gpus)
        self._use_current_pg = use_current_placement_group
        self._placement: Optional[Placement] = None
        self._coordinator: Any = None
        self._workers: list[Any] = []
        self._executable: tuple[Optional[type], Sequence[Any], dict[str, Any]] = (None, (), {})
        self._extra_env: dict[str, str] = {}
        self._state = "new"  # new -> started -> (broken -> started)* -> shut down
        self._driver: Optional[ElasticDriver] = None
        self._secret = b""
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
        if self._limits is not None and executable_cls is not None:
            raise ValueError("executable_cls is not supported by elastic executors: workers come and go; use run()")
        self._executable = (executable_cls, list(executable_args or ()), dict(executable_kwargs or {}))
        self._extra_env = dict(extra_env_vars or {})
        if not ray.is_initialized():
            ray.init()
        if self._limits is not None:
            self._start_coordinator()  # the elastic driver starts workers inside each run()
            self._state = "started"
            return
        self._placement = Placement(self._plan, self.settings.placement_group_timeout_s, self._use_current_pg)
        try:
            self._start_workers()
        except BaseException:
            self.shutdown()
            raise
        self._state = "started"

    def _start_coordinator(self) -> None:
        self._secret = secrets.token_bytes(32)
        self._coordinator = start_coordinator(
            num_cpus=0,
            name=f"hvdray-{self._id}-coordinator",
            # on the driver's node, never spilled elsewhere: losing another node must not lose the coordinator
            scheduling_strategy=NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False),
        )

    def _start_workers(self) -> None:
        self._start_coordinator()
        secret = self._secret
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
        if self._driver is not None:
            self._driver.stop()
        self._stop_workers()
        if self._placement is not None:
            self._placement.release()
            self._placement = None
        self._state = "shut down"

    def _stop_workers(self) -> None:
        coordinator = [self._coordinator.handle] if self._coordinator is not None else []
        for actor in [*self._workers, *coordinator]:
            ray.kill(actor, no_restart=True)
        self._workers, self._coordinator = [], None

    def __enter__(self) -> "RayExecutor":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def _ready_workers(self) -> list[Any]:
        if self._limits is not None:
            raise RuntimeError("elastic executors have no fixed workers: use run(), not run_remote/execute")
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
        """Call ``fn(*args, **kwargs)`` on every worker; results in rank order.

        Elastic executors run ``fn`` on as many workers as the cluster offers (between min_workers and
        max_workers), re-forming the ring as nodes come and go; callbacks also receive every driver
        transition as ``{"event": "elastic", ...}``."""
        _check_callbacks(callbacks)
        if self._limits is not None:
            return self._run_elastic(fn, args, kwargs, callbacks)
        return self._gather(self.run_remote(fn, args, kwargs), callbacks)

    def _run_elastic(
        self,
        fn: Callable[..., Any],
        args: Optional[Sequence[Any]],
        kwargs: Optional[dict[str, Any]],
        callbacks: Optional[Sequence[Callback]],
    ) -> list[Any]:
        _check_callable(fn)
        if self._state == "new":
            self.start()
        elif self._state == "shut down":
            raise RuntimeError("this executor was shut down; create a new RayExecutor")
        driver = ElasticDriver(
            executor_id=self._id,
            limits=self._limits,
            settings=self.settings,
            discovery=self._discovery(),
            coordinator=self._coordinator,
            secret=self._secret,
            cpus_per_worker=self._cpus_per_worker,
            gpus_per_worker=self._gpus_per_worker,
            runtime_env={"env_vars": self._extra_env} if self._extra_env else None,
            blacklist=self._blacklist,
        )
        self._driver = driver
        try:
            return driver.run(fn, list(args or ()), dict(kwargs or {}), list(callbacks or ()))
        finally:
            self._driver = None

    def _discovery(self) -> HostDiscovery:
        if not self._override_discovery:
            return self.settings.discovery

        def held() -> dict[str, int]:
            return self._driver.held() if self._driver is not None else {}

        return RayNodeDiscovery(self._cpus_per_worker, self._gpus_per_worker, held)

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
        try:
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
        except KeyboardInterrupt:
            # Ctrl-C (or a notebook's interrupt): the workers may be mid-collective, so they are stopped;
            # the executor stays usable and its next call starts fresh workers in the same placement group.
            self._break()
            log.warning("hvdray executor %s interrupted: workers stopped; the next call starts new ones", self._id)
            raise

    def _deliver_logs(self, callbacks: list[Callback]) -> None:
        if not callbacks or self._coordinator is None:
            return
        for record in ray.get(self._coordinator.drain_logs.remote()):
            for cb in callbacks:
                cb(record)

    def _break(self) -> None:
        """Stop the workers and their coordinator; the next call starts fresh ones in the same placement group."""
        self._stop_workers()
        self._state = "broken"

    def _fail(self, rank: int, size: int, exc: BaseException) -> None:
        """Stop every worker (they may wait on the failed one) and raise that rank's error."""
        self._break()
        if isinstance(exc, ray.exceptions.OutOfMemoryError):
            raise WorkerLostError(
                f"the worker of rank {rank} (of {size}) was killed because its node ran out of memory "
                f"(Ray's memory monitor): {_first_lines(exc)}"
            ) from exc
        if isinstance(exc, ray.exceptions.RayActorError):
            raise WorkerLostError(f"the worker of rank {rank} (of {size}) died: {exc}") from exc
        if isinstance(exc, ray.exceptions.RayTaskError):
            exc = exc.as_instanceof_cause()
        if hasattr(exc, "add_note"):
            exc.add_note(f"hvdray: raised on rank {rank} of {size}; the other workers were stopped")
        raise exc


def _first_lines(exc: BaseException, lines: int = 2) -> str:
    return " ".join(str(exc).strip().splitlines()[:lines])


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
        raise TypeError(f"{argument} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{argument} must be finite, got {value}")
    if positive and value <= 0:
        raise ValueError(f"{argument} must be > 0, got {value}")


class ElasticRayExecutor(RayExecutor):
    """horovod.ray's ``ElasticRayExecutor``: an elastic :class:`RayExecutor` under Horovod's names."""

    @classmethod
    def create_settings(  # type: ignore[override]
        cls,
        min_num_proc: int = 1,
        max_num_proc: Optional[int] = None,
        reset_limit: Optional[int] = None,
        elastic_timeout: float = 600,
        timeout_s: float = 30,
        ssh_identity_file: Optional[str] = None,
        nics: Optional[Sequence[str]] = None,
        min_np: Optional[int] = None,
        max_np: Optional[int] = None,
        **kwargs: Any,
    ) -> Settings:
        """Validated settings carrying the elastic limits (``min_np``/``max_np`` are Horovod's older names)."""
        return make_settings(
            elastic_min_workers=min_np if min_np is not None else min_num_proc,
            elastic_max_workers=max_np if max_np is not None else max_num_proc,
            elastic_reset_limit=reset_limit,
            elastic_timeout=elastic_timeout,
            timeout_s=timeout_s,
            ssh_identity_file=ssh_identity_file,
            nics=list(nics) if nics is not None else None,
            **kwargs,
        )

    def __init__(
        self,
        settings: Settings,
        use_gpu: bool = False,
        cpus_per_slot: float = 1,
        gpus_per_slot: Optional[float] = None,
        env_vars: Optional[dict[str, str]] = None,
        override_discovery: bool = True,
        cooldown_range: Optional[tuple[float, float]] = None,
    ) -> None:
        if not isinstance(settings, Settings):
            raise TypeError(
                f"settings must come from ElasticRayExecutor.create_settings(), got {type(settings).__name__}"
            )
        super().__init__(
            settings,
            cpus_per_worker=cpus_per_slot,
            use_gpu=use_gpu,
            gpus_per_worker=gpus_per_slot,
            min_workers=settings.elastic_min_workers or 1,
            max_workers=settings.elastic_max_workers,
            reset_limit=settings.elastic_reset_limit,
            cooldown_range=cooldown_range,
            elastic_timeout=settings.elastic_timeout,
            override_discovery=override_discovery,
        )
        self._env_vars = env_vars

    def start(self) -> None:  # type: ignore[override]
        """Start the job's coordinator; workers start inside ``run``."""
        super().start(extra_env_vars=self._env_vars)

    def run(  # type: ignore[override]
        self, worker_fn: Callable[[], Any], callbacks: Optional[Sequence[Callback]] = None
    ) -> list[Any]:
        """Run ``worker_fn()`` elastically; results of the final workers in rank order."""
        return super().run(worker_fn, callbacks=callbacks)
