"""Ray Tune integration on a real local Ray: distributed trials under tune.run, Tuner, BayesOpt, ASHA, PBT.

Every trial here is a 2-worker hvdray job (one bundle of 2 CPUs), so the module's 4-CPU Ray runs two
trials at a time. Nothing in Ray, Tune or Gloo is mocked.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import tempfile
import time

import pytest
import ray
from ray import tune
from ray.tune.result import RESULT_DUPLICATE
from ray.util.placement_group import placement_group_table

from hvdray.tune import DistributedTrainableCreator, distributed_checkpoint_dir, get_checkpoint, report


# -- training functions (run on every worker of a trial) ---------------------------------------------
def _train_ranks(config):
    import torch

    import hvdray.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    for epoch in range(config["epochs"]):
        total = hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum).item()
        report({
            "rank": hvd.rank(), "size": hvd.size(), "epoch": epoch, "total": total,
            "pg": ray.get_runtime_context().get_placement_group_id(),
        })


def _allreduced_objective(config):
    """f(x) = -mean_i (x - p_i)^2 over points split between the ranks; its maximum is at mean(p) = 0.3."""
    import torch

    import hvdray.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    points = torch.tensor([0.1, 0.2, 0.4, 0.5], dtype=torch.float64)[hvd.rank() :: hvd.size()]
    partial = ((config["x"] - points) ** 2).sum()
    score = -hvd.allreduce(partial, op=hvd.Sum).item() / 4
    report({"score": score, "size": hvd.size()})


def _train_with_state(config, checkpoint_dir=None):
    """Counts epochs; checkpoints (rank 0 keeps its copy) if asked; resumes from a checkpoint."""
    import torch

    import hvdray.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    state = {"epoch": 0, "value": 0.0}
    if checkpoint_dir is not None:
        with open(os.path.join(checkpoint_dir, "state.json")) as f:
            state = json.load(f)
    seen = hvd.allreduce(torch.tensor([float(get_checkpoint() is not None)]), op=hvd.Sum).item()
    resumed_at = state["epoch"]
    for epoch in range(state["epoch"], config["epochs"]):
        state["value"] += hvd.allreduce(torch.tensor([config["lr"]]), op=hvd.Average).item()
        state["epoch"] = epoch + 1
        if config.get("checkpoint", True):
            with distributed_checkpoint_dir(step=epoch) as path:
                with open(os.path.join(path, "state.json"), "w") as f:
                    json.dump({**state, "written_by": hvd.rank()}, f)
        report({
            "value": state["value"], "epoch": state["epoch"], "resumed_at": resumed_at, "ranks_restored": seen,
        })


# -- helpers ------------------------------------------------------------------------------------------
def _live_placement_groups() -> int:
    return sum(1 for pg in placement_group_table().values() if pg["state"] != "REMOVED")


def _wait_until_released(groups_before: int, timeout_s: float = 15) -> tuple[float, int]:
    """Wait until every CPU is free and only ``groups_before`` placement groups live; return both."""
    total = ray.cluster_resources()["CPU"]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ray.available_resources().get("CPU", 0) == total and _live_placement_groups() == groups_before:
            break
        time.sleep(0.2)
    return ray.available_resources().get("CPU", 0), _live_placement_groups()


def _run_config(tmp_path, name):
    return tune.RunConfig(name=name, storage_path=str(tmp_path), verbose=0)


def _temporary(prefix: str) -> set[str]:
    """The paths in the temporary directory whose names start with ``prefix`` (the workers run on this
    machine, as this process)."""
    return set(glob.glob(os.path.join(tempfile.gettempdir(), prefix + "*")))


def _own_trial_storages() -> set[str]:
    """The local storages that trials made by hand (no Tune) create for themselves in this process."""
    return _temporary("hvdray-trial-")


@pytest.fixture(autouse=True)
def _remove_own_trial_storages():
    """A trial made by hand keeps its storage after it stops, as Ray's own ``Trainable`` keeps its
    logdir; the tests remove theirs so that the suite leaves nothing in the temporary directory."""
    before = _own_trial_storages()
    yield
    for path in _own_trial_storages() - before:
        shutil.rmtree(path, ignore_errors=True)


# -- the Trainable on its own -------------------------------------------------------------------------
def test_a_trial_trained_directly_reports_rank_zero_and_size_then_refuses_more(ray_local):
    groups = _live_placement_groups()
    trainable_cls = DistributedTrainableCreator(_train_ranks, num_hosts=1, num_slots=2)
    trial = trainable_cls(config={"epochs": 2})
    try:
        results = [trial.train() for _ in range(2)]
        assert [(r["rank"], r["size"], r["total"], r["epoch"]) for r in results] == [(0, 2, 2.0, 0), (0, 2, 2.0, 1)]
        assert [r["training_iteration"] for r in results] == [1, 2]
        last = trial.train()  # the function returned: Tune's "done" marker, no new iteration
        assert last["done"] is True and last[RESULT_DUPLICATE] is True
        with pytest.raises(RuntimeError, match="finished"):
            trial.train()
    finally:
        started = time.monotonic()
        trial.stop()
    assert _wait_until_released(groups, timeout_s=5) == (ray.cluster_resources()["CPU"], groups)
    assert time.monotonic() - started < 5


def test_a_trials_reports_of_metrics_import_no_ray_train_in_the_workers(ray_local):
    """Every worker of every trial (without ``reuse_actors``) would pay ``ray.train``'s import (pyarrow,
    pandas: ~0.55 s of CPU) on its first report: only a checkpoint brings it."""

    def report_twice(config):
        import sys

        report({"before": "ray.train" in sys.modules})
        report({"after": "ray.train" in sys.modules})

    trial = DistributedTrainableCreator(report_twice, num_hosts=1, num_slots=2)(config={})
    try:
        first, second = trial.train(), trial.train()
    finally:
        trial.stop()
    assert (first["before"], second["after"]) == (False, False)


def test_a_worker_error_fails_the_trial_with_its_rank(ray_local):
    def fail_on_rank_one(config):
        import torch

        import hvdray.torch as hvd

        hvd.init()
        report({"ok": 1})
        if hvd.rank() == 1:
            raise KeyError("bad batch 17")
        hvd.allreduce(torch.ones(1), name="never-completed")  # rank 0 waits here: it must be stopped
        report({"ok": 2})

    trial = DistributedTrainableCreator(fail_on_rank_one, num_slots=2)(config={})
    try:
        assert trial.train()["ok"] == 1
        started = time.monotonic()
        with pytest.raises(KeyError, match="bad batch 17") as info:
            trial.train()
        assert time.monotonic() - started < 10
        assert any("rank 1 of 2" in note for note in getattr(info.value, "__notes__", []))
        assert str(info.value).startswith("rank 1 of 2: 'bad batch 17'"), str(info.value)
        with pytest.raises(RuntimeError, match="failed"):
            trial.train()
    finally:
        trial.stop()


@pytest.mark.parametrize(
    "func",
    [
        lambda: None,
        lambda config, extra: None,
        lambda config, checkpoint=None: None,
        lambda *args: None,
        lambda config, checkpoint_dir=None, more=None: None,
        "not a function",
    ],
    ids=["no-args", "two-positional", "wrong-keyword", "varargs", "three", "not-callable"],
)
def test_a_bad_function_signature_raises_when_the_trainable_is_created(func):
    with pytest.raises(ValueError, match="config"):
        DistributedTrainableCreator(func)


@pytest.mark.parametrize(
    "kwargs,argument",
    [
        ({"num_slots": 0}, "num_slots"),
        ({"num_hosts": 0}, "num_hosts"),
        ({"num_cpus_per_slot": -1}, "num_cpus_per_slot"),
        ({"num_slots": 2, "num_workers": 3}, "num_workers"),
        ({"num_cpus_per_slot": 3, "num_cpus_per_worker": 2}, "num_cpus_per_worker"),
        ({"num_workers": 0}, "num_slots"),
        ({"timeout_s": 0}, "timeout_s"),
    ],
)
def test_bad_resource_arguments_name_the_argument(kwargs, argument):
    with pytest.raises(ValueError, match=argument):
        DistributedTrainableCreator(_train_ranks, **kwargs)


def test_the_resource_request_covers_the_whole_trial():
    request = DistributedTrainableCreator(
        lambda config, checkpoint_dir=None: None, num_hosts=2, num_slots=3, num_cpus_per_slot=2, use_gpu=True
    ).default_resource_request({})
    assert request.head_bundle_is_empty  # the Trainable actor only waits; it runs in bundle 0 with no resources
    assert request.bundles == [{"CPU": 6.0, "GPU": 3.0}, {"CPU": 6.0, "GPU": 3.0}]  # one bundle per host
    assert request.strategy == "STRICT_SPREAD"
    newer = DistributedTrainableCreator(_train_ranks, num_workers=2, num_cpus_per_worker=0.5)
    assert newer.default_resource_request({}).required_resources == {"CPU": 1.0}


def test_outside_a_trial_the_session_functions_still_work(caplog, tmp_path):
    """The same training function runs in a plain process: report logs, there is no checkpoint."""
    with caplog.at_level("INFO", logger="hvdray"):
        report({"loss": 0.5})
    assert "loss=0.5" in caplog.text
    assert get_checkpoint() is None
    with distributed_checkpoint_dir(step=3) as path:
        assert os.path.isdir(path)
        open(os.path.join(path, "w.txt"), "w").close()
    assert not os.path.exists(path)
    with pytest.raises(TypeError, match="dict"):
        report([0.5])
    with pytest.raises(TypeError, match="Checkpoint"):
        report({"loss": 0.5}, checkpoint=str(tmp_path))


# -- under Tune -------------------------------------------------------------------------------------
def test_tune_run_two_samples_stop_by_iteration_inside_the_trials_placement_groups(ray_local, tmp_path):
    groups = _live_placement_groups()
    known = set(placement_group_table())
    trainable_cls = DistributedTrainableCreator(_train_ranks, num_hosts=1, num_slots=2, num_cpus_per_slot=1)
    analysis = tune.run(
        trainable_cls, config={"epochs": 10}, num_samples=2, stop={"training_iteration": 3},
        storage_path=str(tmp_path), name="run", verbose=0,
    )
    assert len(analysis.trials) == 2
    for trial in analysis.trials:
        assert trial.status == "TERMINATED"
        result = trial.last_result
        assert (result["training_iteration"], result["epoch"], result["rank"], result["size"]) == (3, 2, 0, 2)
    # each trial's workers ran in the placement group Tune reserved for it; hvdray created none of its own
    created = set(placement_group_table()) - known
    assert {trial.last_result["pg"] for trial in analysis.trials} == created and len(created) == 2
    assert _wait_until_released(groups) == (ray.cluster_resources()["CPU"], groups)


def _fail_on_rank_one(config):
    import hvdray.torch as hvd

    hvd.init()
    report({"ok": 1})
    if hvd.rank() == 1:
        raise ValueError("bad batch 17")
    report({"ok": 2})


def test_tuner_reports_a_failed_trial_with_the_rank_and_the_users_exception_type(ray_local, tmp_path):
    tuner = tune.Tuner(DistributedTrainableCreator(_fail_on_rank_one, num_slots=2),
                       run_config=_run_config(tmp_path, "failing"))
    results = tuner.fit()
    assert len(results.errors) == 1
    error = results[0].error
    assert isinstance(error, ValueError), type(error)
    assert "rank 1 of 2: bad batch 17" in str(error), str(error)


def test_tuner_with_bayesopt_finds_the_optimum_of_an_allreduced_objective(ray_local, tmp_path):
    from ray.tune.search import ConcurrencyLimiter
    from ray.tune.search.bayesopt import BayesOptSearch

    groups = _live_placement_groups()
    # one trial at a time: the Gaussian process should see every result before it suggests the next point
    search = ConcurrencyLimiter(BayesOptSearch(random_state=7, random_search_steps=4), max_concurrent=1)
    tuner = tune.Tuner(
        DistributedTrainableCreator(_allreduced_objective, num_slots=2),
        param_space={"x": tune.uniform(-1.0, 1.0)},
        tune_config=tune.TuneConfig(
            metric="score", mode="max", search_alg=search, num_samples=10, reuse_actors=True  # one set of workers serves every trial
        ),
        run_config=_run_config(tmp_path, "bayesopt"),
    )
    results = tuner.fit()
    assert not results.errors
    assert {r.metrics["size"] for r in results} == {2}
    best = results.get_best_result()
    assert abs(best.config["x"] - 0.3) < 0.05, [(r.config["x"], r.metrics["score"]) for r in results]
    assert best.metrics["score"] == pytest.approx(-((best.config["x"] - 0.3) ** 2) - 0.025)
    assert _wait_until_released(groups) == (ray.cluster_resources()["CPU"], groups)


def test_checkpoints_are_present_or_absent_as_asked_and_hold_rank_zeros_copy(ray_local, tmp_path):
    tuner = tune.Tuner(
        DistributedTrainableCreator(_train_with_state, num_slots=2),
        param_space={"epochs": 3, "lr": 0.5, "checkpoint": tune.grid_search([True, False])},
        tune_config=tune.TuneConfig(max_concurrent_trials=1, reuse_actors=True),
        run_config=_run_config(tmp_path, "checkpoints"),
    )
    results = {r.config["checkpoint"]: r for r in tuner.fit()}
    assert results[False].checkpoint is None
    assert results[False].metrics["epoch"] == 3
    checkpoint = results[True].checkpoint
    with checkpoint.as_directory() as path:
        with open(os.path.join(path, "state.json")) as f:
            assert json.load(f) == {"epoch": 3, "value": 1.5, "written_by": 0}
    # rank 0 persisted each one into the trial's directory of Tune's storage, numbered as Tune numbers them
    trial_dir = os.path.dirname(checkpoint.path)
    assert os.path.dirname(trial_dir) == str(tmp_path / "checkpoints")
    assert sorted(d for d in os.listdir(trial_dir) if d.startswith("checkpoint_")) == [
        "checkpoint_000000", "checkpoint_000001", "checkpoint_000002"
    ]
    assert [os.path.basename(c.path) for c, _ in results[True].best_checkpoints] == [
        "checkpoint_000000", "checkpoint_000001", "checkpoint_000002"
    ]


def _restored_copies() -> set[str]:
    """The ranks' local copies of restored checkpoints."""
    return _temporary("hvdray-restored-")


def test_a_restored_trial_resumes_from_its_checkpoint_on_every_rank(ray_local):
    trainable_cls = DistributedTrainableCreator(_train_with_state, num_slots=2)
    trial = trainable_cls(config={"epochs": 4, "lr": 1.0})
    copies_before = _restored_copies()
    try:
        assert [trial.train()["epoch"] for _ in range(2)] == [1, 2]
        saved = trial.save()  # the second checkpoint, where rank 0 put it (no Tune: a local storage of its own)
        assert os.path.basename(saved.checkpoint.path) == "checkpoint_000001"
        with open(os.path.join(saved.checkpoint.path, "state.json")) as f:
            assert json.load(f)["epoch"] == 2
        assert trial.train()["epoch"] == 3
        trial.restore(saved)  # mid-run: the function stops on every rank and starts again from epoch 2
        result = trial.train()
        assert (result["epoch"], result["resumed_at"], result["ranks_restored"], result["value"]) == (3, 2, 2.0, 3.0)
        assert result["training_iteration"] == 3
        assert len(_restored_copies() - copies_before) == 2  # one local copy per rank while it runs
    finally:
        trial.stop()  # while the function runs (waiting in report): every rank unwinds and removes its copy
    assert _restored_copies() - copies_before == set()


def _rank_one_fails_while_rank_zero_reports(config):
    """Both ranks take their copy of the restored checkpoint; rank 1 fails, and rank 0 then waits in
    ``report`` (no collective in between: only the trial can end its wait)."""
    import hvdray.torch as hvd

    hvd.init()
    assert get_checkpoint() is not None
    if hvd.rank() == 1:
        raise ValueError("rank one fails after its restore")
    time.sleep(1.0)  # rank 1's failure reaches the trial first
    report({"rank": hvd.rank()})


def test_a_restored_trial_that_fails_leaves_no_copy(ray_local, tmp_path):
    (tmp_path / "state.json").write_text("{}")
    trial = DistributedTrainableCreator(_rank_one_fails_while_rank_zero_reports, num_slots=2)(config={})
    copies_before = _restored_copies()
    try:
        trial.restore(str(tmp_path))
        with pytest.raises(ValueError, match="rank one fails after its restore"):
            trial.train()  # the failed trial lets rank 0 unwind from report before its workers go
    finally:
        trial.stop()
    assert _restored_copies() - copies_before == set()


def test_asha_stops_weak_trials_early_and_their_workers_serve_the_next_trial(ray_local, tmp_path):
    from ray.tune.schedulers import ASHAScheduler

    groups = _live_placement_groups()
    tuner = tune.Tuner(
        DistributedTrainableCreator(_train_with_state, num_slots=2),
        # one trial at a time, best first: every later trial falls below the first rung's cutoff
        param_space={"epochs": 6, "lr": tune.grid_search([1.0, 0.9, 0.2, 0.1]), "checkpoint": False},
        tune_config=tune.TuneConfig(
            metric="value", mode="max",
            scheduler=ASHAScheduler(time_attr="training_iteration", max_t=6, grace_period=1, reduction_factor=2),
            max_concurrent_trials=1, reuse_actors=True,  # a stopped trial's workers unwind and serve the next
        ),
        run_config=_run_config(tmp_path, "asha"),
    )
    results = tuner.fit()
    assert not results.errors
    assert {r.config["lr"]: r.metrics["epoch"] for r in results} == {1.0: 6, 0.9: 1, 0.2: 1, 0.1: 1}
    assert _wait_until_released(groups) == (ray.cluster_resources()["CPU"], groups)


def test_pbt_restores_trials_from_checkpoints_on_every_rank(ray_local, tmp_path):
    from ray.tune.schedulers import PopulationBasedTraining

    groups = _live_placement_groups()
    pbt = PopulationBasedTraining(
        time_attr="training_iteration", perturbation_interval=2, quantile_fraction=0.5,
        hyperparam_mutations={"lr": [0.1, 1.0]}, resample_probability=0.0,
        # Each trial waits for all to catch up. Whether a restored trial gets new actors (paused: its
        # placement group released) or is restored in its running ones depends on which trial Tune hears
        # from last, so the test checks the restore itself, not where it ran.
        synch=True,
    )
    tuner = tune.Tuner(
        DistributedTrainableCreator(_train_with_state, num_slots=2),
        param_space={"epochs": 3, "lr": tune.grid_search([0.1, 1.0])},
        tune_config=tune.TuneConfig(metric="value", mode="max", scheduler=pbt),  # new actors for restored trials
        run_config=_run_config(tmp_path, "pbt"),
    )
    results = tuner.fit()
    assert not results.errors
    histories = [r.metrics_dataframe for r in results]
    resumed = [h for h in histories if (h["resumed_at"] > 0).any()]
    assert resumed, "PBT never restored a trial from a checkpoint"
    for history in resumed:
        row = history[history["resumed_at"] > 0].iloc[0]
        assert row["ranks_restored"] == 2  # every rank got the checkpoint
        assert row["epoch"] == row["resumed_at"] + 1  # it went on from the restored epoch
    assert all(r.metrics["epoch"] == 3 for r in results)
    assert _wait_until_released(groups) == (ray.cluster_resources()["CPU"], groups)
