"""Property-based checks of the driver-side API with careless values (no Ray needed).

Every knob of the settings model and every argument of ``RayExecutor`` is fed values of the wrong
type, out of range, or of odd shape. Whatever is generated, the outcome is one of two: the value is
accepted (and then it is what was asked for), or a ``ValueError``/``TypeError`` is raised at once
whose message names the argument. Nothing else (no AttributeError, no silent coercion of garbage,
no hang).
"""

from __future__ import annotations

import contextlib
import math
import os
import time

import pytest
from hypothesis import HealthCheck, given, settings as hsettings, strategies as st

from hvdray import RayExecutor
from hvdray.settings import ENV_PREFIX, Settings

#: Anything a careless user might pass for a value.
ANY_VALUE = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.lists(st.integers(-3, 3), max_size=3),
    st.tuples(st.floats(-5, 5), st.floats(-5, 5)),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)

FIELDS = sorted(Settings.model_fields)


@contextlib.contextmanager
def _environment(name: str, value: str):
    """Set one environment variable for the duration of the block."""
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old
QUICK_S = 1.0


def _accepts_or_names(call, argument: str):
    """Run ``call``; on failure it must be a ValueError/TypeError naming ``argument``, raised quickly."""
    started = time.monotonic()
    try:
        return call()
    except (ValueError, TypeError) as exc:
        assert argument in str(exc), f"error does not name {argument!r}: {exc}"
        return exc
    finally:
        assert time.monotonic() - started < QUICK_S


@hsettings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(field=st.sampled_from(FIELDS), value=ANY_VALUE)
def test_every_setting_accepts_or_names_itself(field, value):
    result = _accepts_or_names(lambda: RayExecutor.create_settings(**{field: value}), field)
    if isinstance(result, Settings):
        stored = getattr(result, field)
        if isinstance(value, float) and not math.isfinite(value):
            pytest.fail(f"{field} accepted the non-finite {value}")
        if value is not None and isinstance(stored, (int, float)) and not isinstance(value, str):
            expected = float(value) if isinstance(stored, float) else value  # a float field rounds an int
            assert stored == expected, f"{field}={value!r} was stored as {stored!r}"


@hsettings(max_examples=150, deadline=None)
@given(field=st.sampled_from(FIELDS), raw=st.text(st.characters(exclude_characters="\x00", exclude_categories=("Cs",)), max_size=12))
def test_every_environment_override_accepts_or_names_its_variable(field, raw):
    env_name = ENV_PREFIX + field.upper()
    with _environment(env_name, raw):
        result = _accepts_or_names(lambda: RayExecutor.create_settings(), field)
    if isinstance(result, Exception):
        assert env_name in str(result), f"error does not name the variable {env_name}: {result}"


@hsettings(max_examples=50, deadline=None)
@given(name=st.text(min_size=1, max_size=12).filter(lambda n: n not in Settings.model_fields))
def test_unknown_setting_is_named(name):
    with pytest.raises(ValueError, match="unknown setting"):
        RayExecutor.create_settings(**{name: 1})


EXECUTOR_ARGUMENTS = [
    "num_workers", "num_hosts", "num_workers_per_host", "cpus_per_worker", "gpus_per_worker",
    "min_workers", "max_workers", "reset_limit", "elastic_timeout", "cooldown_range",
]


@hsettings(max_examples=400, deadline=None)
@given(argument=st.sampled_from(EXECUTOR_ARGUMENTS), value=ANY_VALUE)
def test_executor_arguments_accept_or_name_themselves(argument, value):
    """Only ``argument`` is careless; the rest is a valid fixed-size (or elastic) job."""
    base: dict = {"num_workers": 2}
    if argument in ("num_hosts", "num_workers_per_host"):
        base = {"num_hosts": 1, "num_workers_per_host": 1}
    elif argument in ("min_workers", "max_workers", "reset_limit", "elastic_timeout", "cooldown_range"):
        base = {"min_workers": 1, "max_workers": 4}
    elif argument == "gpus_per_worker":
        base = {"num_workers": 2, "use_gpu": True}
    kwargs = {**base, argument: value}
    if argument == "num_workers":
        kwargs.pop("num_hosts", None)
    if argument == "min_workers" and isinstance(value, int) and not isinstance(value, bool) and value > 4:
        kwargs["max_workers"] = value
    _accepts_or_names(lambda: RayExecutor(RayExecutor.create_settings(), **kwargs), argument)


def test_settings_must_come_from_create_settings():
    with pytest.raises(TypeError, match="settings"):
        RayExecutor({"timeout_s": 3}, num_workers=2)
