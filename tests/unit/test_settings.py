"""Settings: defaults, validation errors that name the field, HVDRAY_* environment overrides."""

import pytest

from hvdray import RayExecutor, Settings
from hvdray.settings import make_settings


def test_defaults_match_horovod_ray():
    s = RayExecutor.create_settings()
    assert isinstance(s, Settings)
    assert s.timeout_s == 30 and s.placement_group_timeout_s == 100 and s.nics is None


def test_explicit_values_and_extra_fields():
    s = RayExecutor.create_settings(timeout_s=5, nics=["lo"], cycle_time_ms=2.5, verbose=0)
    assert (s.timeout_s, s.nics, s.cycle_time_ms, s.verbose) == (5, ["lo"], 2.5, 0)


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"timeout_s": -1}, "timeout_s"),
        ({"timeout_s": 0}, "timeout_s"),
        ({"placement_group_timeout_s": -5}, "placement_group_timeout_s"),
        ({"cycle_time_ms": "fast"}, "cycle_time_ms"),
        ({"verbose": 7}, "verbose"),
        ({"fusion_threshold_mb": -1}, "fusion_threshold_mb"),
        ({"output_pool_mb": -1}, "output_pool_mb"),
        ({"share_reduced_tensors": "sometimes"}, "share_reduced_tensors"),
    ],
)
def test_bad_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        RayExecutor.create_settings(**kwargs)


def test_unknown_setting_is_named():
    with pytest.raises(ValueError, match="'no_such_knob'"):
        RayExecutor.create_settings(no_such_knob=1)


def test_stall_shutdown_must_not_undercut_warning():
    with pytest.raises(ValueError, match="stall_shutdown_s"):
        make_settings(stall_warning_s=10, stall_shutdown_s=5)


def test_a_stall_has_a_default_shutdown_bound_that_never_undercuts_the_warning_and_0_turns_it_off():
    assert make_settings().stall_shutdown_s == 1800  # torch.distributed's default collective timeout
    assert make_settings(stall_warning_s=4000).stall_shutdown_s == 4000  # default: not before the warning
    assert make_settings(stall_shutdown_s=0).stall_shutdown_s == 0  # only when asked


def test_a_rule_across_fields_names_the_environment_variable_that_broke_it(monkeypatch):
    # found by the Hypothesis test of every override: HVDRAY_STALL_SHUTDOWN_S=1 under the default
    # stall_warning_s=60 raised an error that did not say where the 1 came from
    monkeypatch.setenv("HVDRAY_STALL_SHUTDOWN_S", "1")
    with pytest.raises(ValueError, match=r"stall_shutdown_s .*HVDRAY_STALL_SHUTDOWN_S from the environment"):
        make_settings()
    with pytest.raises(ValueError, match="stall_warning_s") as explicit:
        make_settings(stall_shutdown_s=1)  # set here, not from the environment: nothing to name
    assert "HVDRAY_" not in str(explicit.value)


def test_environment_overrides_defaults_not_explicit(monkeypatch):
    monkeypatch.setenv("HVDRAY_CYCLE_TIME_MS", "7")
    monkeypatch.setenv("HVDRAY_NICS", "eth0,eth1")
    assert make_settings().cycle_time_ms == 7
    assert make_settings().nics == ["eth0", "eth1"]
    assert make_settings(cycle_time_ms=3).cycle_time_ms == 3


def test_bad_environment_value_names_the_field(monkeypatch):
    monkeypatch.setenv("HVDRAY_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="timeout_s"):
        make_settings()
