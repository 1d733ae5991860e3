"""Autotune: Bayesian optimization of the engine's fusion threshold, cycle time and response cache.

Only rank 0's engine holds a tuner. It scores the running parameters by bytes reduced per second
over ``steps_per_sample`` engine ticks that reduced something, discards the first
``warmup_samples`` samples, and asks a Gaussian-process optimizer (the ``bayesian-optimization``
package, 1.x API) for the next parameters. The optimizer runs on a helper thread, so the engine never
waits for it; the engine sends the new parameters to every rank in its next full negotiation round
and every rank applies them in the same round. After ``max_samples`` scored samples the tuner applies
the best parameters it saw and stops. Every sample is a row of ``log_file`` (CSV).
"""

from __future__ import annotations

import csv
import logging
import threading
import time
from dataclasses import astuple, dataclass, fields
from typing import Optional

log = logging.getLogger(__name__)

FUSION_MB_BOUNDS = (0.0, 64.0)
CYCLE_MS_BOUNDS = (0.1, 10.0)


@dataclass(frozen=True)
class TunedParams:
    """What autotune changes: the same on every rank once applied."""

    fusion_threshold_mb: float
    cycle_time_ms: float
    cache_enabled: bool


class Autotuner:
    """Rank 0's search; :meth:`record` is called by the engine thread once per tick that reduced bytes."""

    def __init__(
        self,
        initial: TunedParams,
        warmup_samples: int,
        steps_per_sample: int,
        max_samples: int,
        gaussian_process_noise: float,
        log_file: Optional[str] = None,
        tune_cache: bool = True,
        seed: int = 0,
    ) -> None:
        try:
            from bayes_opt import BayesianOptimization, UtilityFunction
        except ImportError as exc:  # pragma: no cover - the package is an optional dependency
            raise ImportError(
                "autotune=True needs the bayesian-optimization package (pip install 'bayesian-optimization<2')"
            ) from exc
        bounds = {"fusion_threshold_mb": FUSION_MB_BOUNDS, "cycle_time_ms": CYCLE_MS_BOUNDS}
        if tune_cache:
            bounds["cache"] = (0.0, 1.0)
        self._optimizer = BayesianOptimization(
            f=None, pbounds=bounds, random_state=seed, verbose=0, allow_duplicate_points=True
        )
        self._optimizer.set_gp_params(alpha=max(gaussian_process_noise, 1e-6))
        self._utility = UtilityFunction(kind="ei", xi=0.01)
        self._tune_cache = tune_cache
        self._warmup_left = warmup_samples
        self._steps_per_sample = steps_per_sample
        self._max_samples = max_samples
        self.current = initial
        self.pending: Optional[TunedParams] = None  # decided, not yet sent to the ranks
        self.done = False
        self.best: Optional[tuple[float, TunedParams]] = None
        self._baseline: Optional[float] = None  # the first score; targets are relative to it
        self._scored = 0
        self._sample_index = 0
        self._thinking = False
        self._bytes = 0
        self._steps = 0
        self._started = time.perf_counter()
        self._lock = threading.Lock()
        self._log = None
        if log_file:
            self._log_handle = open(log_file, "w", newline="", encoding="utf-8")  # noqa: SIM115 - closed at the end
            self._log = csv.writer(self._log_handle)
            self._log.writerow(["sample", "kind", *[f.name for f in fields(TunedParams)], "bytes", "seconds",
                                "bytes_per_second"])
            self._log_handle.flush()

    def record(self, nbytes: int, now: float) -> None:
        """Count one tick's reduced bytes; a completed sample is scored (the next parameters follow)."""
        if self.done or self._thinking or self.pending is not None:
            return
        self._bytes += nbytes
        self._steps += 1
        if self._steps < self._steps_per_sample:
            return
        seconds = max(now - self._started, 1e-9)
        score = self._bytes / seconds
        self._sample_index += 1
        if self._warmup_left > 0:
            self._warmup_left -= 1
            self._write("warmup", self.current, self._bytes, seconds, score)
            self._restart(now)
            return
        self._write("sample", self.current, self._bytes, seconds, score)
        self._scored += 1
        if self.best is None or score > self.best[0]:
            self.best = (score, self.current)
        if self._baseline is None:
            self._baseline = score
        target = score / self._baseline
        if self._scored >= self._max_samples:
            self._settle()
            return
        self._thinking = True
        params = self.current
        threading.Thread(target=self._suggest, args=(params, target), name="hvdray-autotune", daemon=True).start()

    def _suggest(self, params: TunedParams, target: float) -> None:
        try:
            point = {"fusion_threshold_mb": params.fusion_threshold_mb, "cycle_time_ms": params.cycle_time_ms}
            if self._tune_cache:
                point["cache"] = 1.0 if params.cache_enabled else 0.0
            self._optimizer.register(params=point, target=target)
            nxt = self._optimizer.suggest(self._utility)
            chosen = TunedParams(
                fusion_threshold_mb=round(float(nxt["fusion_threshold_mb"]), 3),
                cycle_time_ms=round(float(nxt["cycle_time_ms"]), 3),
                cache_enabled=bool(nxt["cache"] >= 0.5) if self._tune_cache else params.cache_enabled,
            )
        except Exception:  # noqa: BLE001 - a failing optimizer must not break the job: keep the best so far
            log.warning("autotune: the optimizer failed; keeping the best parameters so far", exc_info=True)
            self._settle()
            return
        with self._lock:
            self.pending = chosen
            self._thinking = False

    def _settle(self) -> None:
        assert self.best is not None
        score, params = self.best
        self._write("best", params, 0, 0.0, score)
        log.info("autotune settled on %s (%.3g bytes/s)", params, score)
        self.done = True
        self._thinking = False
        if params != self.current:
            self.pending = params
        if self._log is not None:
            self._log_handle.close()
            self._log = None

    def take_pending(self, now: float) -> Optional[TunedParams]:
        """The parameters to send to every rank now (the engine applies them this round), if any."""
        with self._lock:
            params, self.pending = self.pending, None
        if params is not None:
            self.current = params
            self._restart(now)
        return params

    def _restart(self, now: float) -> None:
        self._bytes = 0
        self._steps = 0
        self._started = now

    def _write(self, kind: str, params: TunedParams, nbytes: int, seconds: float, score: float) -> None:
        if self._log is None:
            return
        self._log.writerow([self._sample_index if kind != "best" else "", kind, *astuple(params), nbytes,
                            round(seconds, 6), round(score, 1)])
        self._log_handle.flush()
