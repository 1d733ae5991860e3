"""The engine's knobs (timeline, autotune): documented defaults, HVDRAY_* overrides, errors naming the field."""

from __future__ import annotations

import pytest

from hvdray.settings import Settings, make_settings

ENGINE_FIELDS = [
    "timeline_filename", "timeline_mark_cycles", "autotune", "autotune_log_file", "autotune_warmup_samples",
    "autotune_steps_per_sample", "autotune_bayes_opt_max_samples", "autotune_gaussian_process_noise",
    "steps_on_waiting_thread",
]


def test_defaults_are_documented_and_off():
    s = make_settings()
    assert s.timeline_filename is None and s.timeline_mark_cycles is False and s.autotune is False
    assert (s.autotune_warmup_samples, s.autotune_steps_per_sample, s.autotune_bayes_opt_max_samples) == (3, 10, 20)
    for name in ENGINE_FIELDS:
        assert Settings.model_fields[name].description


def test_environment_overrides(monkeypatch):
    monkeypatch.setenv("HVDRAY_AUTOTUNE", "1")
    monkeypatch.setenv("HVDRAY_AUTOTUNE_STEPS_PER_SAMPLE", "7")
    monkeypatch.setenv("HVDRAY_TIMELINE", "/tmp/trace.json")  # Horovod's HOROVOD_TIMELINE, hvdray's prefix
    s = make_settings()
    assert s.autotune is True and s.autotune_steps_per_sample == 7 and s.timeline_filename == "/tmp/trace.json"
    monkeypatch.setenv("HVDRAY_TIMELINE_FILENAME", "/tmp/other.json")  # the field's own name wins
    assert make_settings().timeline_filename == "/tmp/other.json"
    assert make_settings(timeline_filename="/x.json").timeline_filename == "/x.json"  # arguments win


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"autotune_steps_per_sample": 0}, "autotune_steps_per_sample"),
        ({"autotune_warmup_samples": -1}, "autotune_warmup_samples"),
        ({"autotune_bayes_opt_max_samples": 1}, "autotune_bayes_opt_max_samples"),
        ({"autotune_gaussian_process_noise": 2}, "autotune_gaussian_process_noise"),
        ({"autotune": "maybe"}, "autotune"),
        ({"timeline_mark_cycles": "often"}, "timeline_mark_cycles"),
        ({"steps_on_waiting_thread": "sometimes"}, "steps_on_waiting_thread"),
    ],
)
def test_bad_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        make_settings(**kwargs)


def test_steps_on_the_waiting_thread_auto_true_false(monkeypatch):
    assert make_settings().steps_on_waiting_thread is None  # auto
    monkeypatch.setenv("HVDRAY_STEPS_ON_WAITING_THREAD", "auto")
    assert make_settings().steps_on_waiting_thread is None
    monkeypatch.setenv("HVDRAY_STEPS_ON_WAITING_THREAD", "false")
    assert make_settings().steps_on_waiting_thread is False
    assert make_settings(steps_on_waiting_thread=True).steps_on_waiting_thread is True


@pytest.mark.parametrize("cores,local_ranks,spare", [(2, 1, True), (2, 2, False), (4, 2, True), (8, 5, False),
                                                     (96, 8, True), (1, 1, False)])
def test_auto_takes_the_waiting_thread_where_engine_threads_have_no_core_to_spare(monkeypatch, cores, local_ranks,
                                                                                   spare):
    import os

    from hvdray.collective import topology

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    assert topology.usable_cores() == cores
    assert topology.engine_threads_have_cores(local_ranks) is spare
