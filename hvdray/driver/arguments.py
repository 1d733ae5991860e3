"""Argument checks of the executor's public methods: each error names the argument and what it got."""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

from hvdray.driver.records import Callback
from hvdray.settings import Settings
from hvdray.storage import normalize_storage_path


def check_executor_arguments(
    settings: Any,
    num_workers: Optional[int],
    num_hosts: Optional[int],
    num_workers_per_host: int,
    cpus_per_worker: float,
    use_gpu: bool,
    gpus_per_worker: Optional[float],
    min_workers: Optional[int],
    max_workers: Optional[int],
    reset_limit: Optional[int],
    cooldown_range: Optional[tuple[float, float]],
    elastic_timeout: float,
    override_discovery: bool,
) -> bool:
    """Check ``RayExecutor(...)``'s arguments together; returns whether the job is elastic."""
    if not isinstance(settings, Settings):
        raise TypeError(
            f"settings must come from RayExecutor.create_settings(), got {type(settings).__name__}"
        )
    elastic = min_workers is not None or max_workers is not None
    check_int("num_workers", num_workers, minimum=1)
    check_int("num_hosts", num_hosts, minimum=1)
    check_int("num_workers_per_host", num_workers_per_host, minimum=1, optional=False)
    check_int("min_workers", min_workers, minimum=1)
    check_int("max_workers", max_workers, minimum=1)
    check_int("reset_limit", reset_limit, minimum=0)
    check_number("cpus_per_worker", cpus_per_worker, positive=True)
    check_number("elastic_timeout", elastic_timeout, positive=True)
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
        check_number("gpus_per_worker", gpus_per_worker, positive=True)
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
    return elastic


def check_storage_arguments(settings: Settings, storage_path: Any, checkpoint_config: Any) -> Optional[str]:
    """``storage_path`` (the argument or the setting: one path serves reported checkpoints and elastic
    commits) checked and made absolute, and ``checkpoint_config`` checked; returns the path or None."""
    given = normalize_storage_path(storage_path) if storage_path is not None else None
    configured = normalize_storage_path(settings.storage_path) if settings.storage_path is not None else None
    if given is not None and configured is not None and given != configured:
        raise ValueError(
            f"storage_path={storage_path!r} differs from settings.storage_path={settings.storage_path!r}; "
            "one storage_path serves both checkpoints and elastic commits: pass one of them"
        )
    if checkpoint_config is not None:
        from ray.train import CheckpointConfig

        if not isinstance(checkpoint_config, CheckpointConfig):
            raise TypeError(f"checkpoint_config must be a ray.train.CheckpointConfig, got {type(checkpoint_config).__name__}")
        if given is None and configured is None:
            raise ValueError("checkpoint_config needs a storage_path to keep the checkpoints in")
    return given if given is not None else configured


def check_start_arguments(executable_cls: Optional[type], extra_env_vars: Optional[dict[str, str]]) -> None:
    """Check ``start(...)``'s arguments."""
    if executable_cls is not None and not callable(executable_cls):
        raise TypeError(f"executable_cls must be a class, got {executable_cls!r}")
    if extra_env_vars is not None and (
        not isinstance(extra_env_vars, dict)
        or not all(isinstance(k, str) and isinstance(v, str) for k, v in extra_env_vars.items())
    ):
        raise TypeError("extra_env_vars must be a dict of str to str")


def check_call_arguments(fn: Any, args: Any, kwargs: Any) -> None:
    """Check ``run_remote(fn, args, kwargs)``'s arguments."""
    check_callable(fn)
    if args is not None and not isinstance(args, (list, tuple)):
        raise TypeError(f"args must be a list or tuple, got {type(args).__name__}")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise TypeError(f"kwargs must be a dict, got {type(kwargs).__name__}")


def check_callable(fn: Any, argument: str = "fn") -> None:
    if not callable(fn):
        raise TypeError(f"{argument} must be callable, got {type(fn).__name__}")


def check_callbacks(callbacks: Optional[Sequence[Callback]]) -> None:
    if callbacks is None:
        return
    if not isinstance(callbacks, (list, tuple)):
        raise TypeError(f"callbacks must be a list of callables, got {type(callbacks).__name__}")
    for cb in callbacks:
        check_callable(cb, "callbacks")


def check_int(argument: str, value: Any, minimum: int, optional: bool = True) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{argument} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{argument} must be >= {minimum}, got {value}")


def check_number(argument: str, value: Any, positive: bool) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{argument} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{argument} must be finite, got {value}")
    if positive and value <= 0:
        raise ValueError(f"{argument} must be > 0, got {value}")
