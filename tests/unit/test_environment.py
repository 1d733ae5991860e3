"""Settings from the environment: one precedence (argument > HVDRAY_* > HOROVOD_* > default), Horovod's
knobs in Horovod's units, and unknown names reported once (hvdray/environment.py)."""

from __future__ import annotations

import warnings

import pytest
import torch

from hvdray import environment
from hvdray.settings import Settings, make_settings


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    for name in list(__import__("os").environ):
        if name.startswith(("HVDRAY_", "HOROVOD_")):
            monkeypatch.delenv(name)
    monkeypatch.setattr(environment, "_reported", set())


@pytest.mark.parametrize(
    "variable, raw, field, value",
    [
        ("HOROVOD_FUSION_THRESHOLD", "33554432", "fusion_threshold_mb", 32.0),   # bytes -> MiB
        ("HOROVOD_CYCLE_TIME", "3.5", "cycle_time_ms", 3.5),
        ("HOROVOD_CACHE_CAPACITY", "0", "cache_capacity", 0),
        ("HOROVOD_TIMELINE", "/tmp/t.json", "timeline_filename", "/tmp/t.json"),
        ("HOROVOD_TIMELINE_MARK_CYCLES", "1", "timeline_mark_cycles", True),
        ("HOROVOD_STALL_CHECK_TIME_SECONDS", "5", "stall_warning_s", 5.0),
        ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "120", "stall_shutdown_s", 120.0),
        ("HOROVOD_STALL_CHECK_DISABLE", "1", "stall_check", False),
        ("HOROVOD_HIERARCHICAL_ALLREDUCE", "1", "hierarchical_allreduce", True),
        ("HOROVOD_HIERARCHICAL_ALLREDUCE", "0", "hierarchical_allreduce", False),
        ("HOROVOD_AUTOTUNE", "1", "autotune", True),
        ("HOROVOD_AUTOTUNE_LOG", "/tmp/a.csv", "autotune_log_file", "/tmp/a.csv"),
        ("HOROVOD_AUTOTUNE_WARMUP_SAMPLES", "7", "autotune_warmup_samples", 7),
        ("HOROVOD_LOG_LEVEL", "debug", "verbose", 2),
        ("HOROVOD_GLOO_TIMEOUT_SECONDS", "45", "timeout_s", 45.0),
        ("HOROVOD_GLOO_IFACE", "eth1", "nics", ["eth1"]),
        ("HOROVOD_START_TIMEOUT", "12", "placement_group_timeout_s", 12.0),
        ("HOROVOD_ELASTIC_TIMEOUT", "30", "elastic_timeout", 30.0),
    ],
)
def test_horovod_knobs_set_their_settings(monkeypatch, variable, raw, field, value):
    assert getattr(make_settings(), field) != value
    monkeypatch.setenv(variable, raw)
    assert getattr(make_settings(), field) == value


def test_a_dynamic_horovod_timeline_records_nothing_until_started(monkeypatch, tmp_path):
    """Horovod's ``HOROVOD_TIMELINE=DYNAMIC``: no file at init (not one named DYNAMIC), and
    ``hvd.start_timeline`` records from then on."""
    import hvdray.torch as hvd

    monkeypatch.setenv("HOROVOD_TIMELINE", "DYNAMIC")
    assert make_settings().timeline_filename is None
    monkeypatch.chdir(tmp_path)
    hvd.init()
    try:
        hvd.allreduce(torch.ones(3), name="before")
        assert list(tmp_path.iterdir()) == []
        hvd.start_timeline(str(tmp_path / "timeline.json"))
        hvd.allreduce(torch.ones(3), name="recorded")
        hvd.stop_timeline()
    finally:
        hvd.shutdown()
    assert [p.name for p in tmp_path.iterdir()] == ["timeline.json"]
    text = (tmp_path / "timeline.json").read_text()
    assert "recorded" in text and "before" not in text


def test_precedence_argument_then_hvdray_then_horovod_then_default(monkeypatch):
    default = Settings.model_fields["cycle_time_ms"].default
    assert make_settings().cycle_time_ms == default
    monkeypatch.setenv("HOROVOD_CYCLE_TIME", "3")
    assert make_settings().cycle_time_ms == 3
    monkeypatch.setenv("HVDRAY_CYCLE_TIME_MS", "2")
    assert make_settings().cycle_time_ms == 2
    assert make_settings(cycle_time_ms=5).cycle_time_ms == 5
    # the same for hvdray's second spelling of the timeline (HVDRAY_TIMELINE beats HOROVOD_TIMELINE)
    monkeypatch.setenv("HOROVOD_TIMELINE", "/tmp/horovod.json")
    monkeypatch.setenv("HVDRAY_TIMELINE", "/tmp/hvdray.json")
    assert make_settings().timeline_filename == "/tmp/hvdray.json"
    assert make_settings(timeline_filename="/tmp/arg.json").timeline_filename == "/tmp/arg.json"


@pytest.mark.parametrize(
    "variable, raw, message",
    [
        ("HOROVOD_FUSION_THRESHOLD", "64MB", "HOROVOD_FUSION_THRESHOLD must be a number of bytes, got '64MB'"),
        ("HOROVOD_LOG_LEVEL", "loud", "HOROVOD_LOG_LEVEL must be one of TRACE, DEBUG"),
        ("HOROVOD_STALL_CHECK_DISABLE", "sometimes", "HOROVOD_STALL_CHECK_DISABLE must be 0 or 1"),
        ("HOROVOD_CACHE_CAPACITY", "-3", "cache_capacity (from the environment variable HOROVOD_CACHE_CAPACITY)"),
    ],
)
def test_a_bad_horovod_value_names_the_variable(monkeypatch, variable, raw, message):
    monkeypatch.setenv(variable, raw)
    with pytest.raises(ValueError, match="invalid settings") as error:
        make_settings()
    assert message in str(error.value)


def test_unknown_names_are_reported_once_with_the_closest_name_or_the_reason(monkeypatch):
    monkeypatch.setenv("HVDRAY_CYCLE_TIME", "2")                 # a typo of HVDRAY_CYCLE_TIME_MS
    monkeypatch.setenv("HOROVOD_MPI_THREADS_DISABLE", "1")      # MPI only
    monkeypatch.setenv("HOROVOD_NUM_NCCL_STREAMS", "2")         # GPU only
    monkeypatch.setenv("HOROVOD_RANK", "0")                     # set by hvdray itself: no report
    monkeypatch.setenv("HVDRAY_HOROVOD_ALIAS", "0")             # read by hvdray/__init__: no report
    monkeypatch.setenv("HVDRAY_TEST_FAULTS", "{}")              # read by hvdray.testing.faults: no report
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        settings = make_settings()
        make_settings()
    messages = sorted(str(w.message) for w in caught)
    assert settings.cycle_time_ms == Settings.model_fields["cycle_time_ms"].default
    assert messages == [
        "Horovod knob HOROVOD_MPI_THREADS_DISABLE is ignored by hvdray: hvdray does not use MPI: collectives run "
        "over Gloo from torch.distributed",
        "Horovod knob HOROVOD_NUM_NCCL_STREAMS is ignored by hvdray: a GPU (NCCL/CUDA/ROCm/oneCCL) knob; hvdray's "
        "collectives run on the CPU over Gloo",
        "environment variable HVDRAY_CYCLE_TIME is not an hvdray setting and is ignored; did you mean "
        "HVDRAY_CYCLE_TIME_MS?",
    ]
