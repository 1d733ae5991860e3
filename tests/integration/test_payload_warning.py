"""A function or argument that every worker receives and that pickles large is named in a warning; one
that cannot be pickled is named in an error."""

from __future__ import annotations

import threading
import time
import warnings

import numpy as np
import pytest

from hvdray import RayExecutor
from hvdray.driver.payload import LargePayloadWarning, pickled_size

MIB = 1 << 20


def _settings(**kw):
    return RayExecutor.create_settings(timeout_s=20, placement_group_timeout_s=20, **kw)


def _large_payload_warnings(record) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category, LargePayloadWarning)]


def test_a_large_closure_is_named_with_the_variable_it_captures(make_executor):
    ex = make_executor(num_workers=2, settings=_settings(payload_warning_mb=4))
    table = np.ones(6 * MIB // 8)  # 6 MiB captured by the closure below

    def total():
        return float(table.sum())

    with pytest.warns(LargePayloadWarning) as record:
        assert ex.run(total) == [float(len(table))] * 2
    (message,) = _large_payload_warnings(record)
    assert "run() sends to each of its 2 worker(s)" in message
    assert "'test_a_large_closure_is_named_with_the_variable_it_captures.<locals>.total' pickles to 6.0 MiB" in message
    assert "6.0 MiB of it the variable 'table' it captures" in message
    assert "ray.put" in message and "payload_warning_mb=4" in message
    assert record[0].filename == __file__  # points at the user's line
    with warnings.catch_warnings():
        warnings.simplefilter("error", LargePayloadWarning)
        ex.run(total)  # once per executor


def test_large_arguments_are_named_and_small_ones_are_not(make_executor):
    ex = make_executor(num_workers=2, settings=_settings(payload_warning_mb=4))
    big = np.zeros(5 * MIB, dtype=np.uint8)
    with pytest.warns(LargePayloadWarning) as record:
        ex.run(lambda a, b, scale: len(a) + b * scale, args=[big, 1], kwargs={"scale": 2})
    (message,) = _large_payload_warnings(record)
    assert "args[0] (ndarray) pickles to 5.0 MiB" in message
    assert "args[1]" not in message and "scale" not in message and "the function '" not in message
    with pytest.warns(LargePayloadWarning, match=r"kwargs\['rows'\] \(list\) pickles to"):
        ex.run(lambda rows: len(rows), kwargs={"rows": [bytes(MIB) for _ in range(5)]})
    with warnings.catch_warnings():
        warnings.simplefilter("error", LargePayloadWarning)
        assert ex.run(lambda x: x, args=[3]) == [3, 3]


def test_executable_arguments_and_a_zero_limit(ray_local):
    class Holder:
        def __init__(self, blob):
            self.size = len(blob)

    with pytest.warns(LargePayloadWarning, match=r"start\(\) sends .*executable_args\[0\] \(bytes\) pickles to 5\.0 MiB") as record:
        with RayExecutor(_settings(payload_warning_mb=4), num_workers=1) as ex:
            ex.start(Holder, executable_args=[bytes(5 * MIB)])
            assert ex.execute(lambda h: h.size) == [5 * MIB]
    assert [w.filename for w in record if issubclass(w.category, LargePayloadWarning)] == [__file__]  # the user's line
    with warnings.catch_warnings():
        warnings.simplefilter("error", LargePayloadWarning)
        with RayExecutor(_settings(payload_warning_mb=0), num_workers=1) as ex:  # 0: off
            assert ex.run(lambda blob: len(blob), args=[bytes(5 * MIB)]) == [5 * MIB]


def test_default_limit_and_measuring_a_large_array_without_copying_it():
    assert _settings().payload_warning_mb == 100
    array = np.zeros(150 * MIB, dtype=np.uint8)  # counted through pickle 5's out-of-band buffers
    assert 150 * MIB <= pickled_size(array) < 150 * MIB + 4096
    assert pickled_size(lambda: array) >= 150 * MIB
    assert pickled_size(__import__("threading").Lock()) is None  # unpicklable


@pytest.mark.parametrize("elastic", [False, True], ids=["fixed", "elastic"])
def test_what_cannot_be_pickled_is_named_before_anything_is_sent(make_executor, elastic):
    """Ray's own error names its internal actor method and the function, not the variable at fault, and
    comes after the call has begun on the driver; this one names the variable or argument, at once."""
    ex = make_executor(**({"min_workers": 2, "max_workers": 2} if elastic else {"num_workers": 2}))
    lock = threading.Lock()

    def uses_a_lock():
        return lock.locked()

    started = time.monotonic()
    with pytest.raises(TypeError, match=r"run\(\): the function '.*uses_a_lock' cannot be pickled to be sent to the "
                                        r"workers: the variable 'lock' it captures \(lock\) cannot \(cannot pickle"):
        ex.run(uses_a_lock)
    with pytest.raises(TypeError, match=r"run\(\): kwargs\['gen'\] \(generator\) cannot be pickled"):
        ex.run(lambda gen: 0, kwargs={"gen": (i for i in range(3))})
    assert time.monotonic() - started < 5
    if not elastic:  # and the executor goes on
        assert ex.run(lambda: 7) == [7, 7]
        with pytest.raises(TypeError, match=r"run_remote\(\): args\[1\] \(lock\) cannot be pickled"):
            ex.run_remote(lambda a, b: 0, args=[1, lock])
        with pytest.raises(TypeError, match=r"execute\(\): the function .* the variable 'lock'"):
            ex.execute(lambda executable: lock)


def test_an_unpicklable_executable_argument_is_named(ray_local):
    with RayExecutor(_settings(), num_workers=1) as ex:
        with pytest.raises(TypeError, match=r"start\(\): executable_args\[0\] \(lock\) cannot be pickled"):
            ex.start(dict, executable_args=[threading.Lock()])
        ex.start(dict)  # the failed start left it new
        assert ex.execute(lambda d: len(d)) == [0]
