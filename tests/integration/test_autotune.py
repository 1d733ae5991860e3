"""Autotune on real workers: from a deliberately bad configuration (no fusion, a 10 ms cycle) it finds
better parameters on a synthetic many-small-gradients workload, logs every sample, and leaves every
rank with the same parameters."""

from __future__ import annotations

import csv

import pytest

from hvdray import RayExecutor

pytest.importorskip("bayes_opt")


def _synthetic_training(max_steps: int):
    import torch

    import hvdray.torch as hvd
    from hvdray.collective import session

    hvd.init()
    engine = session.engine()
    grads = [torch.ones(4096) for _ in range(48)]  # 48 x 16 KB per step
    step = 0
    while step < max_steps:
        handles = [hvd.allreduce_async_(g, name=f"grad.{i}", op=hvd.Sum) for i, g in enumerate(grads)]
        for h in handles:
            hvd.synchronize(h)
        step += 1
        if step % 10 == 0:  # rank 0 knows when its tuner is done; tell everybody
            done = float(engine._agreement.tuner.done if engine._agreement.tuner is not None else 0.0)
            if hvd.allreduce(torch.tensor([done]), op=hvd.Max, name="tuner.done").item() == 1.0:
                break
    tuned = engine.tuned
    return step, (round(tuned.fusion_threshold_mb, 3), round(tuned.cycle_time_ms, 3), tuned.cache_enabled)


def test_autotune_improves_a_bad_configuration_and_logs_every_sample(make_executor, tmp_path):
    log_file = tmp_path / "autotune.csv"
    settings = RayExecutor.create_settings(
        # over Gloo, unfused small tensors cost one TCP round trip each: a configuration that is really bad
        timeout_s=30, fusion_threshold_mb=0, cycle_time_ms=10, shm_transport=False,
        autotune=True, autotune_log_file=str(log_file),
        autotune_warmup_samples=1, autotune_steps_per_sample=16, autotune_bayes_opt_max_samples=8,
    )
    ex = make_executor(settings=settings, num_workers=2)
    results = ex.run(_synthetic_training, args=[3000])
    (steps0, tuned0), (steps1, tuned1) = results
    assert steps0 == steps1 < 3000, "autotune did not finish"
    assert tuned0 == tuned1  # every rank applied the same parameters
    with open(log_file) as f:
        rows = list(csv.DictReader(f))
    kinds = [r["kind"] for r in rows]
    assert kinds == ["warmup"] + ["sample"] * 8 + ["best"]
    samples = [r for r in rows if r["kind"] == "sample"]
    first, best = samples[0], rows[-1]
    assert (float(first["fusion_threshold_mb"]), float(first["cycle_time_ms"])) == (0.0, 10.0)
    assert float(best["bytes_per_second"]) == max(float(r["bytes_per_second"]) for r in samples)
    assert float(best["bytes_per_second"]) > 1.2 * float(first["bytes_per_second"])
    assert tuned0 == (float(best["fusion_threshold_mb"]), float(best["cycle_time_ms"]), best["cache_enabled"] == "True")
