"""Settings from the environment: ``HVDRAY_<FIELD>`` variables and Horovod's ``HOROVOD_*`` knobs.

One precedence, for every field: an explicit argument, then ``HVDRAY_<FIELD>``, then the Horovod knob
that means the same thing (``HOROVOD_FUSION_THRESHOLD`` ...), then the default. An ``HVDRAY_*`` variable
that names no setting is warned about once, with the closest valid name; a ``HOROVOD_*`` knob hvdray
does not honour is reported once, saying why (MPI-only, GPU-only, build-time, or not implemented).

Written here rather than with pydantic-settings: what it would take over (``HVDRAY_<FIELD>`` lookup)
is a few lines, while the Horovod knobs' conversions, the unknown-name warnings and the errors that
name the variable would still be ours; and every worker unpickles ``Settings``, where importing
pydantic-settings costs about 30 ms more (11-69 ms after ray and torch, measured on Ray 2.60).
"""

from __future__ import annotations

import difflib
import os
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Optional

HVDRAY_PREFIX = "HVDRAY_"
HOROVOD_PREFIX = "HOROVOD_"


class EnvironmentValueError(ValueError):
    """An environment variable's value that cannot be converted; names the variable."""


@dataclass(frozen=True)
class Knob:
    """A Horovod environment knob and the hvdray setting it sets (``convert`` turns its text into a value)."""

    variable: str
    field: str
    convert: Callable[[str], Any] = str


def _bytes_to_mib(raw: str) -> float:
    try:
        return int(raw) / float(1 << 20)
    except ValueError:
        raise EnvironmentValueError(f"HOROVOD_FUSION_THRESHOLD must be a number of bytes, got {raw!r}") from None


def _not(raw: str) -> str:
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return "false"
    if value in ("0", "false", "no", "off", ""):
        return "true"
    raise EnvironmentValueError(f"HOROVOD_STALL_CHECK_DISABLE must be 0 or 1, got {raw!r}")


#: Horovod's log levels -> hvdray's ``verbose`` (2: debug logging; 1: hvdray's default logging)
LOG_LEVELS = {"trace": 2, "debug": 2, "info": 1, "warning": 1, "error": 1, "fatal": 1}


def _log_level(raw: str) -> int:
    try:
        return LOG_LEVELS[raw.strip().lower()]
    except KeyError:
        raise EnvironmentValueError(
            f"HOROVOD_LOG_LEVEL must be one of {', '.join(level.upper() for level in LOG_LEVELS)}, got {raw!r}"
        ) from None


def _timeline_file(raw: str) -> Optional[str]:
    """``HOROVOD_TIMELINE``: a file to record into from the start, or ``DYNAMIC`` (Horovod's word for no file
    until ``hvd.start_timeline``, which hvdray allows whatever this says)."""
    return None if raw == "DYNAMIC" else raw


def _interfaces(raw: str) -> list[str]:
    return [s.strip() for s in raw.split(",") if s.strip()]


#: Horovod knobs hvdray honours, each mapped onto one settings field.
HOROVOD_KNOBS: dict[str, Knob] = {
    knob.variable: knob
    for knob in (
        Knob("HOROVOD_FUSION_THRESHOLD", "fusion_threshold_mb", _bytes_to_mib),
        Knob("HOROVOD_CYCLE_TIME", "cycle_time_ms"),
        Knob("HOROVOD_CACHE_CAPACITY", "cache_capacity"),
        Knob("HOROVOD_TIMELINE", "timeline_filename", _timeline_file),
        Knob("HOROVOD_TIMELINE_MARK_CYCLES", "timeline_mark_cycles"),
        Knob("HOROVOD_STALL_CHECK_TIME_SECONDS", "stall_warning_s"),
        Knob("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "stall_shutdown_s"),
        Knob("HOROVOD_STALL_CHECK_DISABLE", "stall_check", _not),
        Knob("HOROVOD_HIERARCHICAL_ALLREDUCE", "hierarchical_allreduce"),
        Knob("HOROVOD_AUTOTUNE", "autotune"),
        Knob("HOROVOD_AUTOTUNE_LOG", "autotune_log_file"),
        Knob("HOROVOD_AUTOTUNE_WARMUP_SAMPLES", "autotune_warmup_samples"),
        Knob("HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE", "autotune_steps_per_sample"),
        Knob("HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES", "autotune_bayes_opt_max_samples"),
        Knob("HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE", "autotune_gaussian_process_noise"),
        Knob("HOROVOD_LOG_LEVEL", "verbose", _log_level),
        Knob("HOROVOD_GLOO_TIMEOUT_SECONDS", "timeout_s"),
        Knob("HOROVOD_GLOO_IFACE", "nics", _interfaces),
        Knob("HOROVOD_START_TIMEOUT", "placement_group_timeout_s"),
        Knob("HOROVOD_ELASTIC_TIMEOUT", "elastic_timeout"),
    )
}

#: hvdray's own spellings beside HVDRAY_<FIELD>: variable -> field
HVDRAY_ALIASES = {"HVDRAY_TIMELINE": "timeline_filename"}
#: HVDRAY_* variables that are not settings but are read elsewhere in hvdray
#: the alias; the test-only fault plan and the fault matrix's own knobs (tests/multinode/test_elastic_faults.py)
HVDRAY_OTHER = frozenset({"HVDRAY_HOROVOD_ALIAS", "HVDRAY_TEST_FAULTS", "HVDRAY_FAULT_MATRIX", "HVDRAY_FAULT_REPEATS"})

#: HOROVOD_* variables hvdray sets itself in every worker (rank facts for scripts): never reported
SET_BY_HVDRAY = frozenset({
    "HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE", "HOROVOD_CROSS_RANK",
    "HOROVOD_CROSS_SIZE",
})

_MPI = "hvdray does not use MPI: collectives run over Gloo from torch.distributed"
_GPU = "a GPU (NCCL/CUDA/ROCm/oneCCL) knob; hvdray's collectives run on the CPU over Gloo"
_BUILD = "a build-time option of Horovod's C++ extension; hvdray has none"
_RENDEZVOUS = "set by horovodrun for its own rendezvous; hvdray's rendezvous is the job's coordinator actor"
#: why a HOROVOD_* knob hvdray does not honour is ignored: (prefix or name, reason), first match wins
IGNORED: tuple[tuple[str, str], ...] = (
    ("HOROVOD_WITH_", _BUILD), ("HOROVOD_WITHOUT_", _BUILD), ("HOROVOD_BUILD_", _BUILD),
    ("HOROVOD_CMAKE", _BUILD), ("HOROVOD_GPU", _GPU), ("HOROVOD_NCCL", _GPU), ("HOROVOD_NUM_NCCL_STREAMS", _GPU),
    ("HOROVOD_CUDA", _GPU), ("HOROVOD_ROCM", _GPU), ("HOROVOD_CCL", _GPU), ("HOROVOD_BATCH_D2D_MEMCOPIES", _GPU),
    ("HOROVOD_ENABLE_ASYNC_COMPLETION", _GPU), ("HOROVOD_ENABLE_XLA_OPS", _GPU), ("HOROVOD_DISABLE_NVTX_RANGES", _GPU),
    ("HOROVOD_MPI", _MPI), ("HOROVOD_ADASUM_MPI_CHUNK_SIZE", _MPI), ("HOROVOD_CPU_OPERATIONS", _MPI),
    ("HOROVOD_CONTROLLER", _MPI), ("HOROVOD_GLOO_RENDEZVOUS", _RENDEZVOUS), ("HOROVOD_GLOO_GLOBAL", _RENDEZVOUS),
    ("HOROVOD_GLOO_LOCAL", _RENDEZVOUS), ("HOROVOD_GLOO_CROSS", _RENDEZVOUS), ("HOROVOD_HOSTNAME", _RENDEZVOUS),
    ("HOROVOD_HIERARCHICAL_ALLGATHER", "hvdray's allgather across nodes is one Gloo allgather (no hierarchical form)"),
    ("HOROVOD_TORUS_ALLREDUCE", "hvdray has no torus allreduce (hierarchical_allreduce is its multi-node form)"),
    ("HOROVOD_THREAD_AFFINITY", "hvdray does not pin its engine thread; Ray places the worker processes"),
    ("HOROVOD_DYNAMIC_PROCESS_SETS", "process sets can always be added and removed at run time in hvdray"),
    ("HOROVOD_LOG_HIDE_TIME", "hvdray logs through Python's logging; configure its format there"),
    ("HOROVOD_DISABLE_GROUP_FUSION", "not implemented in hvdray: grouped allreduces are always fused together"),
)

_reported: set[str] = set()


def hvdray_variable(field: str) -> str:
    """The environment variable of a settings field: ``HVDRAY_<FIELD>``."""
    return HVDRAY_PREFIX + field.upper()


def sources(fields: Iterable[str], given: Iterable[str], environ: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """For each of ``fields`` not ``given`` explicitly: the environment variable it comes from, by precedence."""
    environ = os.environ if environ is None else environ
    given = set(given)
    found: dict[str, str] = {}
    candidates: dict[str, list[str]] = {}
    for field in fields:
        candidates[field] = [hvdray_variable(field)]
    for variable, field in HVDRAY_ALIASES.items():
        candidates.setdefault(field, []).append(variable)
    for knob in HOROVOD_KNOBS.values():
        candidates.setdefault(knob.field, []).append(knob.variable)
    for field, variables in candidates.items():
        if field in given or field not in fields:
            continue
        for variable in variables:
            if variable in environ:
                found[field] = variable
                break
    return found


def read(variable: str, field: str, environ: Optional[Mapping[str, str]] = None) -> Any:
    """The value of ``variable`` for ``field``, converted where its text is not the field's own form."""
    raw = (os.environ if environ is None else environ)[variable]
    knob = HOROVOD_KNOBS.get(variable)
    if knob is not None:
        return knob.convert(raw)
    return _interfaces(raw) if field == "nics" else raw


def report_unknown(fields: Iterable[str], environ: Optional[Mapping[str, str]] = None) -> list[str]:
    """Warn, once per variable, about HVDRAY_* names that are no setting and HOROVOD_* knobs not honoured."""
    environ = os.environ if environ is None else environ
    valid = {hvdray_variable(f) for f in fields} | set(HVDRAY_ALIASES) | HVDRAY_OTHER
    messages = []
    for variable in sorted(environ):
        if variable in _reported:
            continue
        message = None
        if variable.startswith(HVDRAY_PREFIX) and variable not in valid:
            close = difflib.get_close_matches(variable, sorted(valid), n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            message = f"environment variable {variable} is not an hvdray setting and is ignored{hint}"
        elif variable.startswith(HOROVOD_PREFIX) and variable not in HOROVOD_KNOBS and variable not in SET_BY_HVDRAY:
            reason = next((why for prefix, why in IGNORED if variable.startswith(prefix)), "hvdray does not implement it")
            message = f"Horovod knob {variable} is ignored by hvdray: {reason}"
        if message is not None:
            _reported.add(variable)
            messages.append(message)
            warnings.warn(message, RuntimeWarning, stacklevel=4)
    return messages
