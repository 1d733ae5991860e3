"""One validated settings model for every hvdray knob.

Values come, in order of precedence, from explicit arguments, then ``HVDRAY_<FIELD>`` environment
variables, then Horovod's ``HOROVOD_*`` knobs that mean the same (see :mod:`hvdray.environment`), then
the documented defaults. The environment is read where the settings are created: on the driver.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from hvdray import environment

if TYPE_CHECKING:
    from hvdray.collective.job import JobSettings

ENV_PREFIX = environment.HVDRAY_PREFIX
#: Fields that hold Python objects: they have no environment variable.
OBJECT_FIELDS = frozenset({"discovery"})


class Settings(BaseModel):
    """Every knob of an hvdray job; build it with ``RayExecutor.create_settings``."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False, allow_inf_nan=False)

    timeout_s: float = Field(
        30.0, gt=0, description="Seconds a collective, a rendezvous or a dead peer may take before it becomes an error."
    )
    placement_group_timeout_s: float = Field(
        100.0, gt=0, description="Seconds to wait for the cluster to grant the workers' placement group."
    )
    nics: Optional[list[str]] = Field(
        None, description="Network interfaces Gloo may use (first one wins); default: the Ray node's address."
    )
    verbose: int = Field(1, ge=0, le=2, description="2 turns on hvdray's debug logging on the driver and the workers.")
    ssh_identity_file: Optional[str] = Field(
        None, description="Accepted for horovod.ray compatibility; Ray launches the workers, so no ssh is used."
    )
    ssh_str: Optional[str] = Field(
        None, description="Accepted for horovod.ray compatibility; Ray launches the workers, so no ssh is used."
    )
    cycle_time_ms: float = Field(
        1.0, gt=0, le=1000, description="Engine tick while work is in flight: tensors ready within one tick are fused."
    )
    idle_cycle_time_ms: float = Field(
        100.0, gt=0, le=10000, description="Longest engine tick while no rank has work (a local submission wakes it)."
    )
    fusion_threshold_mb: float = Field(
        64.0, ge=0, description="Largest fused allreduce buffer in MiB; 0 turns fusion off."
    )
    cache_capacity: int = Field(
        1024, ge=0, le=1 << 16,
        description="Tensor names the response cache remembers (their steady state costs one tiny allreduce per "
        "tick); 0 turns the cache off.",
    )
    stall_warning_s: float = Field(
        60.0, gt=0, description="A tensor submitted on some ranks but not all for this long logs a warning."
    )
    stall_shutdown_s: float = Field(
        1800.0, ge=0,
        description="Such a stall turns into an error naming the missing ranks on the waiting ranks after this "
        "many seconds (the default is torch.distributed's default collective timeout); 0 never.",
    )
    storage_path: Optional[str] = Field(
        None,
        description="Where the job keeps what outlives its workers (a local directory or a pyarrow filesystem URI "
        "such as s3://bucket/run; also RayExecutor(storage_path=...)): checkpoints passed to hvdray.report, as "
        "checkpoint_<n>, and in elastic jobs each commit() of the elastic state, under elastic_state/ (a job "
        "whose workers all died, or a new job started on the same path, resumes from the newest commit).",
    )
    stall_check: bool = Field(
        True, description="False turns the stall inspector off: no stall warnings, no stall shutdown and no "
        "deadlock detection (Horovod's HOROVOD_STALL_CHECK_DISABLE=1).",
    )
    timeline_filename: Optional[str] = Field(
        None,
        description="Write a Chrome-trace timeline (open it in Perfetto) to this path from hvd.init() on: rank 0 "
        "writes it, or every rank its own when the path contains '{rank}'. Also HVDRAY_TIMELINE.",
    )
    timeline_mark_cycles: bool = Field(False, description="Mark every engine tick that had work in the timeline.")
    autotune: bool = Field(
        False,
        description="Search fusion_threshold_mb, cycle_time_ms and the response cache on/off with Bayesian "
        "optimization while the job runs, scoring bytes reduced per second; needs bayesian-optimization.",
    )
    autotune_log_file: Optional[str] = Field(
        None, description="CSV file (written by rank 0) with every autotune sample: parameters and score."
    )
    autotune_warmup_samples: int = Field(
        3, ge=0, le=1000, description="Samples discarded at the start of autotuning, before any is scored."
    )
    autotune_steps_per_sample: int = Field(
        10, ge=1, le=100000, description="Engine ticks with reductions that make up one autotune sample."
    )
    autotune_bayes_opt_max_samples: int = Field(
        20, ge=2, le=1000, description="Scored samples before autotune settles on the best parameters seen."
    )
    autotune_gaussian_process_noise: float = Field(
        0.8, ge=0, le=1, description="Noise (alpha) of autotune's Gaussian process, as scores are noisy."
    )

    discovery: Optional[Any] = Field(
        None,
        description="Elastic jobs: an object with find_available_hosts_and_slots() -> {host or node id: slots}; "
        "used instead of Ray's own cluster state when the executor has override_discovery=False.",
    )
    discovery_interval_s: float = Field(
        1.0, gt=0, le=60, description="Elastic jobs: seconds between two looks at the cluster for new or lost slots."
    )
    elastic_min_workers: Optional[int] = Field(
        None, ge=1, description="ElasticRayExecutor.create_settings(min_num_proc): the fewest workers the job runs on."
    )
    elastic_max_workers: Optional[int] = Field(
        None, ge=1, description="ElasticRayExecutor.create_settings(max_num_proc): the most workers the job grows to."
    )
    elastic_reset_limit: Optional[int] = Field(
        None, ge=0, description="ElasticRayExecutor.create_settings(reset_limit): membership changes allowed."
    )
    elastic_timeout: float = Field(
        600.0, gt=0, description="ElasticRayExecutor.create_settings(elastic_timeout): seconds below min workers."
    )
    shm_transport: bool = Field(
        True, description="Ranks on the same node exchange data through a shared-memory segment instead of "
        "loopback TCP (Linux x86-64; falls back to Gloo where /dev/shm cannot be used).",
    )
    peer_sockets: bool = Field(
        True, description="Collectives that cross the network run over direct TCP connections between partner "
        "ranks, sent and received by the engine thread itself, instead of through Gloo's threads: every allreduce "
        "(the engine's flags every tick, tensors of any size, the cross-node step of hierarchical allreduce), "
        "every allgather (its negotiation rounds, tensors) and every broadcast. Off: Gloo carries them.",
    )
    hierarchical_allreduce: Optional[bool] = Field(
        None, description="Allreduce across nodes in three steps: shared memory inside each node, Gloo between "
        "nodes, shared memory again. None (\"auto\"): on when the job spans several nodes with the same number "
        "(> 1) of ranks each and shm_transport is on.",
    )
    steps_on_waiting_thread: Optional[bool] = Field(
        None, description="Which thread runs the collectives of a step that repeats (a DistributedOptimizer's "
        "gradients, once the engine has learned the step): True, the thread that waits for them, once it waits "
        "(no wake-up of the engine thread and no hand-off back, and no second busy thread per rank while the "
        "backward pass ends); False, the engine thread, woken when the step's last tensor is submitted (the "
        "reduction overlaps whatever the caller does before it waits). None (\"auto\"): True in a job (or process "
        "set) of one rank, and where the node's ranks cannot each have a core for their engine thread beside their "
        "own (twice the local ranks exceed the cores this process may run on); else False.",
    )
    payload_warning_mb: float = Field(
        100.0, ge=0, description="Warn (once per executor and argument) when a function, argument or "
        "executable argument sent to every worker pickles to more than this many MiB; 0 turns it off.",
    )
    shm_buffer_mb: float = Field(
        32.0, ge=1, le=4096, description="Shared memory per node and job in MiB; larger messages go through it in "
        "several rounds.",
    )
    share_reduced_tensors: bool = Field(
        False, description="A private tensor of 4 MiB or more that an allreduce reduces a second time (in place, "
        "or as an out-of-place input), or a reducescatter's input reduced a second time, moves into shared memory "
        "(torch's share_memory_(), one copy): from then on the ranks of a node reduce straight between each "
        "other's tensors instead of copying through the shared buffer. Only while /dev/shm has room for it and 256 MiB more. Off by default: torch crashes when a "
        "tensor in shared memory is grown (resize_ to a larger size), and an alias taken before the move "
        "(tensor.numpy()) keeps the old memory.",
    )
    share_reduced_pages: bool = Field(
        True, description="A private tensor of 4 MiB or more that an allreduce among the ranks of one node reduces a "
        "second time (the same storage; in place, or as an out-of-place input), or a reducescatter's input read a "
        "second time, has its whole memory pages moved into shared memory where they "
        "lie (one copy; the same addresses, so every view and raw alias stays valid): from then on the node's ranks "
        "reduce straight between each other's tensors; the bytes before its first and after its last page boundary "
        "go through the shared buffer. Such a tensor can no longer be grown (resize_ raises, as for a tensor numpy "
        "sees); hvdray holds its storage until the tensor is gone, gives it private memory back and then lets torch "
        "free it (within about a second); a process forked meanwhile shares those pages with its parent instead of "
        "copying them. False: such tensors stay private.",
    )
    cross_memory_attach: bool = Field(
        True, description="In flat allreduces of more than 32 KiB among the ranks of one node, each rank reads its "
        "part of its peers' tensors and writes the sums back into them through the kernel (process_vm_readv and "
        "process_vm_writev), instead of copying both ways through shared memory: one pass over memory fewer "
        "each way. The kernel allows it between processes of one user where Yama's ptrace_scope is 0 (or with "
        "CAP_SYS_PTRACE); the ranks check at their first such allreduce and keep to shared memory where it "
        "refuses. In-place allreduces of 4 MiB and more whose every local rank's tensor and scratch block fit "
        "together in the cache the ranks' cores share go through shared memory all the same: copies within the "
        "cache outrun the kernel's. False: shared memory only.",
    )
    output_pool_mb: float = Field(
        512.0, ge=0, description="MiB of freed collective outputs (out-of-place allreduce, allgather and broadcast "
        "results of 1 MiB and more) a worker keeps to hand out again warm: a fresh output's first touch of its "
        "memory costs more than the collective itself. 0 turns it off. Such outputs cannot be resized.",
    )
    huge_pages: bool = Field(
        False, description="Workers ask the kernel for transparent huge pages for tensors of 2 MiB and more "
        "(torch's THP_MEM_ALLOC_ENABLE, unless the worker's environment sets it): a fresh tensor above 32 MiB "
        "(a large collective's output) is ready in about a third of the time, but fresh tensors of 32 MiB and "
        "less, which glibc otherwise hands out again warm, get slower; up to 2 MiB of memory more per tensor.",
    )

    @field_validator("hierarchical_allreduce", "steps_on_waiting_thread", mode="before")
    @classmethod
    def _auto_is_none(cls, value: Any) -> Any:
        return None if isinstance(value, str) and value.strip().lower() in ("auto", "") else value

    @model_validator(mode="before")
    @classmethod
    def _fill_from_environment(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        fields = [name for name in cls.model_fields if name not in OBJECT_FIELDS]
        environment.report_unknown(fields)
        try:
            for name, variable in environment.sources(fields, given=data).items():
                data[name] = environment.read(variable, name)
        except environment.EnvironmentValueError as exc:
            raise ValueError(str(exc)) from None
        return data

    @model_validator(mode="after")
    def _check_consistency(self) -> "Settings":
        if "stall_shutdown_s" not in self.model_fields_set and self.stall_shutdown_s < self.stall_warning_s:
            self.stall_shutdown_s = self.stall_warning_s  # the default bound never comes before the warning
        if self.stall_shutdown_s and self.stall_shutdown_s < self.stall_warning_s:
            raise ValueError(
                f"stall_shutdown_s ({self.stall_shutdown_s}) must be 0 (off) or >= stall_warning_s "
                f"({self.stall_warning_s})"
            )
        if self.discovery is not None and not callable(getattr(self.discovery, "find_available_hosts_and_slots", None)):
            raise ValueError(
                f"discovery must have a find_available_hosts_and_slots() method, got {type(self.discovery).__name__}"
            )
        return self

    def for_workers(self) -> "JobSettings":
        """These values as the job's workers get them: a read-only view that needs no pydantic there."""
        from hvdray.collective.job import JobSettings

        return JobSettings({name: getattr(self, name) for name in type(self).model_fields})


def make_settings(**kwargs: Any) -> Settings:
    """Build Settings, turning pydantic's errors into a ``ValueError`` that names each bad argument."""
    unknown = sorted(set(kwargs) - set(Settings.model_fields))
    if unknown:
        raise ValueError(
            f"unknown setting(s) {', '.join(map(repr, unknown))}; known settings: {', '.join(Settings.model_fields)}"
        )
    try:
        return Settings(**kwargs)
    except ValidationError as exc:
        from_env = environment.sources([n for n in Settings.model_fields if n not in OBJECT_FIELDS], given=kwargs)
        raise ValueError(_describe(exc, from_env)) from None


def _describe(exc: ValidationError, from_env: dict[str, str]) -> str:
    parts = []
    for err in exc.errors():
        if not err["loc"]:  # a rule across fields: name the environment variables of the fields it names
            env = [from_env[f] for f in sorted(from_env) if re.search(rf"\b{f}\b", err["msg"])]
            source = f" ({', '.join(env)} from the environment)" if env else ""
            parts.append(f"settings: {err['msg'].removeprefix('Value error, ')}{source}")
            continue
        where = ".".join(str(p) for p in err["loc"])
        field = str(err["loc"][0])
        source = f" (from the environment variable {from_env[field]})" if field in from_env else ""
        parts.append(f"{where}{source}: {err['msg']} (got {err.get('input')!r})")
    return "invalid settings: " + "; ".join(parts)
